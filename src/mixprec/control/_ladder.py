"""The controller's rungs and what it keeps per layer: the ladder's names, a layer's recipe
composed per GEMM from its GEMMs' rungs, and the record of one layer (rungs, device windows,
trends, the loss costs' plans); the probe that measures into it is :mod:`._probe`."""

from __future__ import annotations

import dataclasses
import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from mixprec.formats._like import features
from mixprec.formats._quant import STAT_NAMES
from mixprec.formats._recipe import Cast, Float8Recipe
from mixprec.formats._tensor_parallel import probe_operand
from mixprec.formats._state import GRAD_OUTPUT, INPUT, OPERANDS, WEIGHT, LayerState, clear_window, new_window
from mixprec.control._settings import FP4_RUNGS, FP8_RUNGS, LOW_RUNGS, RUNGS, ControllerSettings
from mixprec.control._backward import FAR, far_by_factor
from mixprec.control._fold import StepIndex
from mixprec.control._cost import (Cadence, clear, clear_pooled, cost_steps, far, loss_cost, measure_cost,  # noqa: F401
                                  output_errors, pool, pooled_with, unresolved, _accumulate_cost, variance)
from mixprec.control._measure import measure
from mixprec.control._trend import Trend

__all__ = ["Decision", "FP4_RUNGS", "FP8_RUNGS", "GEMMS", "GEMM_OPERANDS", "GemmCasts", "LOW_RUNGS", "RUNGS",
           "LayerRecord", "compose", "gemm_casts", "loss_cost", "measure", "output_roundoff", "past_costly"]

#: a linear layer's GEMMs (the keys of ``Float8Recipe.gemms()``) and the operands each reads, in
#: the order of its (left, right) casts, as rows of :class:`LayerState`'s windows.
GEMMS = ("output", "grad_input", "grad_weight")
GEMM_OPERANDS = {"output": ("input", "weight"), "grad_input": ("grad_output", "weight"),
                 "grad_weight": ("grad_output", "input")}
_CASTS = tuple(f.name for f in dataclasses.fields(Float8Recipe)[:6])  # the recipe's six casts, two per GEMM
_HP = Cast("none")
#: the recipe settings that touch only e2m1 casts (the others, power-of-2 scales, only fp8 ones)
_FP4_SETTINGS = ("hadamard", "stochastic_rounding", "subnormal_scales", "seed")
_NCOL = len(STAT_NAMES)
_RANGE = ("input", "output")  # the range row: the layer's input and output amax, in its own dtype
#: a record's loss-cost buffer, per row (the forward GEMM's own casts, the rung below's): this
#: step's sums (first-order term, sum of squared per-row terms, rows), the window's (estimates,
#: steps, squared estimates, each estimate times its index among the window's steps: _early's line)
_COST_COLUMNS = ("first", "squares", "rows", "sum", "steps", "sum_sq", "sum_at")
#: the fewest measured steps of a window whose own spread may read its mean clear over
#: ``max_loss_cost`` (a promotion at once, ``_decide.too_costly``; as ``_early.EARLY_STEPS``: the
#: plan's variance, kept from earlier windows, may be stale by then, and 2 steps' spread is a guess)
CLEAR_STEPS = 3


@dataclass(frozen=True)
class Decision:
    """One switch of one layer: at ``step`` (the :meth:`Controller.step` count), ``layer`` went
    from ``from_`` to ``to`` (``action``: ``"promote"`` up the ladder, ``"demote"`` down) because
    ``operand``'s ``statistic`` was ``value`` (against ``threshold``); ``reason`` says it in words.
    ``gemm``: the GEMM that switched (``"output"``, ``"grad_input"``, ``"grad_weight"``) under a
    ``Controller(per_gemm=True)``; None: all three together (the layer).

    Example:
        >>> d = Decision(190, "0", "input", "promote", "fp8-tensorwise", "fp8-rowwise",
        ...              "underflow_forecast", 0.07, 0.05, "input underflow forecast 0.07 > 0.05")
        >>> d.action, d.to
        ('promote', 'fp8-rowwise')
    """

    step: int
    layer: str
    operand: str
    action: str
    from_: str
    to: str
    statistic: str
    value: float
    threshold: float
    reason: str
    gemm: str | None = None


def compose(recipes: tuple[Float8Recipe | None, ...]) -> Float8Recipe | None:
    """The recipe whose GEMMs (:data:`GEMMS`, in order) run the casts of ``recipes`` (one per
    GEMM; None: the compute dtype, no cast), or None where they do not compose: the GEMMs' recipes
    must agree on the settings of their kind (fp8 recipes: power-of-2 scales; fp4 ones: the
    Hadamard transform, stochastic rounding, subnormal scales, seed) and the casts must make a
    valid recipe (without fp4, no block scales beside tensor or row ones; with fp4 each GEMM runs
    on its own, the fp8 GEMMs by the fp8 recipes' settings). A recipe the three GEMMs share is
    returned as it is.

    Example:
        >>> t = Float8Recipe.tensorwise()
        >>> compose((t, t, t)) is t, compose((t, None, None)).input_for_grad_weight.format
        (True, 'none')
        >>> compose((t, Float8Recipe.rowwise(), None)) is None  # power-of-2 scales or not
        True
        >>> r = compose((Float8Recipe.nvfp4(), Float8Recipe.nvfp4(), t))
        >>> r.fp4, r.input_for_grad_weight.format, r.weight.granularity
        (True, 'e4m3fn', '16x16')
    """
    used = [r for r in recipes if r is not None]
    if not used:
        return None
    if all(r is used[0] for r in recipes):
        return used[0]
    fp4, fp8 = [r for r in used if r.fp4], [r for r in used if not r.fp4]
    settings = [f.name for f in dataclasses.fields(Float8Recipe) if f.name not in (*_CASTS, "save_fp8", "name")]
    for group, names in ((fp4, _FP4_SETTINGS), (fp8, [s for s in settings if s not in _FP4_SETTINGS])):
        if any(getattr(r, s) != getattr(group[0], s) for r in group for s in names):
            return None
    base = fp4[0] if fp4 else fp8[0]  # an fp4 GEMM: the fp4 path runs the recipe, fp8 GEMMs by fp8's settings
    extra = {s: getattr(fp8[0], s) for s in settings if s not in _FP4_SETTINGS} if fp4 and fp8 else {}
    casts = {}
    for gemm, recipe, (left, right) in zip(GEMMS, recipes, zip(_CASTS[::2], _CASTS[1::2])):
        pair = recipe.gemms()[gemm] if recipe is not None else (_HP, _HP)
        casts[_field(gemm, 0)], casts[_field(gemm, 1)] = pair
    name = "+".join(r.name if r is not None else "compute" for r in recipes)
    try:
        return dataclasses.replace(base, **casts, **extra, save_fp8=False, name=name)
    except ValueError:
        return None


def output_roundoff(recipe: Float8Recipe | None, compute: torch.dtype | None) -> float:
    """The relative rounding error of a forward GEMM's operands under ``recipe`` (None: the
    compute dtype, no cast): the ``hypot`` of the input's and the weight's format's
    :attr:`~mixprec.fp8.Cast.unit_roundoff` (an operand left in high precision: the compute
    dtype's; float32's while it is unknown).

    Example:
        >>> output_roundoff(Float8Recipe.nvfp4(), None) / output_roundoff(Float8Recipe.tensorwise(), None)
        4.0
        >>> output_roundoff(None, torch.bfloat16) == math.hypot(2 ** -8, 2 ** -8)
        True
    """
    high = torch.finfo(compute if compute is not None and compute.is_floating_point else torch.float32).eps / 2
    casts = (_HP, _HP) if recipe is None else (recipe.input, recipe.weight)
    return math.hypot(*(c.unit_roundoff or high for c in casts))


def past_costly(cost: float, limit: float, here: float, above: list[tuple[int, float]]) -> int:
    """The rung a forward GEMM is promoted to whose own casts cost the loss ``cost`` over
    ``limit`` on a rung of :func:`output_roundoff` ``here``: the first of ``above`` (the rungs
    above it that it may run, in order, each with its roundoff) where the cost scaled by the
    ratio of the roundoffs fits the limit, else the last. An error's first-order cost scales
    with its size, its curvature cost with the square: the rung picked by the smaller fall fits
    either way, and one that rounds no finer (another fp8 rung) is passed by while the cost is
    over; a rung passed by that would fit is the next demotion's to find (its cost is measured
    as the rung below's).

    Example:
        >>> fp4, fp8, bf16 = 0.35, 0.088, 0.0055
        >>> past_costly(6e-3, 1e-3, fp4, [(1, fp8), (2, fp8), (3, bf16)]), past_costly(2e-3, 1e-3, fp4, [(1, fp8), (3, bf16)])
        (3, 1)
    """
    return next((rung for rung, u in above if cost * u <= limit * here), above[-1][0])


@dataclass(frozen=True)
class GemmCasts:
    """What one GEMM's operands go through on a rung, as the probe measures them: the (left,
    right) casts, the recipe's power-of-2 scales and, for a weight-gradient GEMM whose e2m1
    operands pass through the random Hadamard transform first (NVFP4's), its seed (else None)."""

    left: Cast
    right: Cast
    pow2: bool
    hadamard_seed: int | None = None


def gemm_casts(recipe: Float8Recipe | None, gemm: str) -> GemmCasts | None:
    """The :class:`GemmCasts` of ``gemm`` on ``recipe`` (None: the compute dtype, nothing cast);
    the Hadamard seed as :class:`~mixprec.formats._fp4_linear.Fp4Matmul` applies it (a recipe with
    ``hadamard`` whose weight-gradient GEMM is e2m1).

    Example:
        >>> gemm_casts(Float8Recipe.nvfp4(), "grad_weight").hadamard_seed, gemm_casts(Float8Recipe.nvfp4(), "output").hadamard_seed
        (0, None)
    """
    if recipe is None:
        return None
    left, right = recipe.gemms()[gemm]
    rht = gemm == "grad_weight" and recipe.hadamard and right.is_fp4
    return GemmCasts(left, right, recipe.pow2_scales, recipe.seed if rht else None)


def _field(gemm: str, side: int) -> str:
    """The recipe field of ``gemm``'s left (0) or right (1) cast."""
    return {"output": ("input", "weight"), "grad_input": ("grad_output", "weight_for_grad_input"),
            "grad_weight": ("grad_output_for_grad_weight", "input_for_grad_weight")}[gemm][side]


class LayerRecord:
    """The controller's record of one layer: its rung per GEMM (one rung for all three unless the
    controller is ``per_gemm``), its device windows, its trends.

    ``gemm_windows`` (per-GEMM controllers only): ``(2, 3, 2, 5)``, the layer's own casts and the
    shadow's, per GEMM, per operand of that GEMM, in the layout of a LayerState row.
    """

    def __init__(self, module: nn.Module | None, state: LayerState, rung: int, floor: int,
                 allowed: tuple[bool, ...], per_gemm: bool = False, cost: bool = False, order: int = 0) -> None:
        # None: a layer this rank has not run yet (Controller._detached)
        self.module = weakref.ref(module) if module is not None else _no_module
        self.root: Any = _no_module  # the model it was reached in (Controller._track)
        # multiply-adds per row of each of its GEMMs (a peer's, from its metadata: Controller._detached)
        self.size = math.prod(features(module)) if module is not None else 0
        # its place in the order the layers were first reached (the first rank's to reach it: the same on every rank)
        self.order = order
        self.state = state
        self.rungs = [rung] * len(GEMMS)
        self.floor = floor  # the lowest rung it may be demoted to
        self.allowed = allowed  # per rung of the ladder: whether the layer can run it (block multiples)
        # the rung below's casts measured on a sample (promoted layers): a window, as LayerState's
        self.shadow = new_window(state.device)
        self.range = torch.zeros(len(_RANGE), device=state.device)  # worst input/output amax
        self.gemm_windows = torch.zeros(2, len(GEMMS), 2, _NCOL + 1, device=state.device) if per_gemm else None
        # log2 amax per operand and range entry; underflow of the layer's casts and of the shadow's
        keys = (*OPERANDS, *(f"range_{r}" for r in _RANGE), *(f"underflow_{op}" for op in OPERANDS),
                *(f"shadow_{op}" for op in OPERANDS))
        if per_gemm:
            keys = (*(f"range_{r}" for r in _RANGE),
                    *(f"{g}.{kind}{op}" for g in GEMMS for kind in ("", "underflow_", "shadow_")
                      for op in GEMM_OPERANDS[g]))
        self.trends = {key: Trend() for key in keys}
        self.clean = 0  # consecutive windows in which the rung below was safe
        # this step's latest_count() (_scaled) when its measured forward ran and when its gradient came (Probe)
        self.scaled_by: list[int | None] = [None, None]
        self.switches: list[int] = []  # steps of its switches (of the layer as a whole)
        self.gemm_clean = [0] * len(GEMMS)  # per GEMM (per-GEMM records)
        self.gemm_switches: list[list[int]] = [[] for _ in GEMMS]
        # per GEMM, the casts its current rung measures (per-GEMM) and the rung below's (its shadow)
        self.own: list[GemmCasts | None] = [None] * len(GEMMS)
        self.below_gemm: list[GemmCasts | None] = [None] * len(GEMMS)
        # per kind (own casts, the rung below's) and GEMM, whether this window's check reads the
        # GEMM's cast statistics (eager code measures them only then): not where a backward GEMM's
        # measured loss cost decides it (_decide.stats_read)
        self.stats_read = [[True] * len(GEMMS), [True] * len(GEMMS)]
        # per GEMM, the checks in a row whose backward cost read over max_backward_cost (BACKWARD_WINDOWS)
        self.back_over = [0] * len(GEMMS)
        self.below: Float8Recipe | None = None  # the rung below, while it may go there: its shadow's casts
        # the loss cost of the forward GEMM's error (Controller.max_loss_cost): its own casts' and,
        # while its forward may go down, the recipe below's (``forward_below``)
        self.cost = torch.zeros(2, len(_COST_COLUMNS), device=state.device) if cost else None
        self.forward_low = False  # the forward GEMM runs casts (its own cost is measured)
        # its weight is all-gathered in fp8 by FSDP2: no high-precision weight, no loss cost
        self.cost_blind = False
        self.forward_below: Float8Recipe | None = None
        self.reference: torch.dtype | None = torch.float32  # the loss costs' reference GEMMs (_reference: with its probe)
        # per row, on how many of a window's last steps the loss cost is measured (None: every
        # step) and the per-step variance it was planned from (_cost.cost_steps); whether this
        # step measures it (eager code) and its device copy (compiled code); the forward's rung planned for
        self.cost_plan: list[int | None] = [None, None]
        self.cost_var: list[list[float] | None] = [None, None]  # (the windows' sample variances: _cost.cost_steps)
        self.cost_now = [True, True]
        self.cost_cadence = [Cadence(), Cadence()]  # in which windows each is measured (_cost.Cadence)
        self.cost_pool: list[list[list[float]]] = [[], []]  # the last measured windows' [steps, mean, mean square] (_cost.clear)
        self.cost_unresolved = [False, False]  # planned for as no window resolves it: decided on its pool (_cost.unresolved)
        self.cost_over = 0  # the checks in a row that read its own cost over max_loss_cost (_decide.too_costly)
        self.cost_clear = False  # this check's window of its own cost lies clear over max_loss_cost (CLEAR_STEPS)
        self.cost_below = True  # whether the rung below's is measured (below_wanted)
        self.cost_gate = torch.ones(2, dtype=torch.bool, device=state.device)
        self.cost_rung = rung
        # the gap between the forward's own and below loss-cost estimates its last flip showed, per
        # unit of squared roundoff, and the rung and below estimate of its last demotion (_estimate_gap)
        self.cost_gap = 0.0
        self.demoted_below: tuple[int, float] | None = None
        # the step under way, whose index draws the output rows a loss cost measures under
        # Controller(cost_row_share=...) (_cost.sampled_rows): eager code reads the int, compiled code its device copy
        self.cost_step = 0
        self.step_index = StepIndex(state.device)  # (one per device, shared by a controller's layers: _fold.StepWrites)
        self.cost_sign = torch.tensor([-1.0, 1.0], device=state.device)  # loss_cost's at_error, per row
        self.probe: Any = None  # its Probe (also in state.probe)
        # whether this step feeds the shadows (Controller._measuring), on the device: what compiled
        # code reads, so that the shadow phase is no guard (a recompile) but data
        self.measuring = torch.zeros((), dtype=torch.bool, device=state.device)
        self.measuring_now = False  # the same, for eager code
        self.backward: Any = None  # its backward GEMMs' loss cost (max_backward_cost: _backward.BackwardCost)
        self.backward_now = False  # whether this step measures it (eager code: the first shadow step)

    @property
    def cost_step_t(self) -> torch.Tensor:
        """The step index on the device, which compiled code draws a loss cost's rows from."""
        return self.step_index.tensor

    @property
    def rung(self) -> int:
        """The layer's rung (its forward GEMM's, for a per-GEMM record)."""
        return self.rungs[0]

    @rung.setter
    def rung(self, value: int) -> None:
        self.rungs = [value] * len(GEMMS)

    def split(self, row: list[float], settings: ControllerSettings | None = None
              ) -> tuple[list[float], list[float] | None]:
        """A check's row of the layer (:func:`~mixprec.control._windows.stacked_windows`, all-reduced,
        as a list) as ``(statistics, loss costs)``; the costs (own, below, whether each was
        measured) are None without ``max_loss_cost``. With
        ``settings``, plans from the window on how many of the next window's steps each loss cost
        is measured (:func:`~mixprec.control._cost.cost_steps`: at least the shadow steps and
        2, against ``max_loss_cost`` for the own cost, the demotion limit for the one below) and
        in which windows (:class:`~mixprec.control._cost.Cadence`: a window it skipped reads
        the last measured cost; fewer where this window, or the last :data:`~mixprec.control._cost.POOL_WINDOWS`
        measured since the forward GEMM's last switch, lie clear of the limit: :func:`~mixprec.control._cost.clear`).
        A cost planned for as no window resolves it (:func:`~mixprec.control._cost.unresolved`) is
        decided on those windows' pooled mean, this one's included, not on this window's. Whether
        the own cost's window lies clear over ``max_loss_cost`` on its own steps (at least
        :data:`CLEAR_STEPS`) is kept (``cost_clear``: a promotion at once, ``_decide.too_costly``)."""
        if self.cost is None:
            return row, None
        n = 4 * self.cost.shape[0]
        cost, mean_sq, steps = row[-n:-n // 2], row[-n // 2:-n // 4], row[-n // 4:]
        if settings is not None:
            every, limits = settings.every, (settings.max_loss_cost, settings.demote_cost)
            least = min(every, max(2, settings.shadow_steps))
            pooled = (1, settings.demote_windows)  # (a demotion takes that many clean windows in a row)
            for r in range(2):
                measured = cost[2 + r] > 0
                figure = cost[r]
                if measured:
                    self.cost_pool[r] = pooled_with(self.cost_pool[r], [steps[r], cost[r], mean_sq[r]])
                    figure = pool(self.cost_pool[r])[0] if self.cost_unresolved[r] else cost[r]
                if measured or self.cost_cadence[r].due:  # (a window its cadence skipped keeps the plan)
                    self.cost_plan[r], self.cost_var[r] = cost_steps(cost[r], mean_sq[r], steps[r], self.cost_var[r],
                                                                     limits[r], every, least, pooled[r])
                    self.cost_unresolved[r] = unresolved(cost[r], steps[r], self.cost_var[r], limits[r], every, pooled[r])
                settled = measured and clear(cost[r], variance(self.cost_var[r]), steps[r], limits[r], self.cost_pool[r])
                if r == 0:  # (this window alone, on its own steps' spread, clear over the limit: a promotion at once)
                    spread = self.cost_var[0][-1] if measured and steps[0] >= CLEAR_STEPS else None  # (cost_steps': this window's)
                    self.cost_clear = measured and cost[0] > limits[0] and far(cost[0], spread, limits[0], steps[0])
                cost[r], cost[2 + r] = self.cost_cadence[r].checked([figure, cost[2 + r]], measured, settled)
        return row[:-n], cost

    def carry_backward(self, back: list[float] | None, settings: ControllerSettings) -> list[float] | None:
        """The backward GEMMs' costs a check's decisions read (``back``: this window's, from
        ``_backward.peel``): per kind (own casts, the rung below's), the last measured ones in a
        window its cadence skipped (``BackwardCost.cadence``; clear where each measured cost
        lies a factor of :data:`~mixprec.control._backward.FAR` from its limit, or its last
        measured windows since the layer's last switch lie clear of it together
        (:func:`~mixprec.control._cost.clear_pooled`, ``BackwardCost.pool``); the own casts' only
        below it: one over it is measured again, as a promotion waits for
        :data:`~mixprec.control._backward.BACKWARD_WINDOWS` measured windows over it)."""
        if back is None or self.backward is None:
            return back
        out, pools = list(back), self.backward.pool
        for kind, (cadence, limit) in enumerate(zip(self.backward.cadence,
                                                    (settings.max_backward_cost, settings.demote_backward))):
            at = (2 * kind, 2 * kind + 1, 4 + 2 * kind, 5 + 2 * kind)  # its two costs, their two flags
            measured = back[at[2]] > 0 or back[at[3]] > 0
            for c, f in zip(at[:2], at[2:]):
                if back[f] > 0 and math.isfinite(back[c]):
                    pools[c] = pooled_with(pools[c], [1.0, back[c], back[c] * back[c]])
            # (own costs over the limit are measured again: a promotion waits for BACKWARD_WINDOWS measured windows)
            far = far_by_factor if kind else (lambda cost, limit: cost * FAR <= limit)
            settled = measured and all(not back[f] > 0 or far(back[c], limit) or (
                (kind or back[c] <= limit) and clear_pooled(back[c], limit, pools[c])) for c, f in zip(at[:2], at[2:]))
            for i, v in zip(at, cadence.checked([back[i] for i in at], measured, settled)):
                out[i] = v
        return out

    def below_wanted(self, allowed: bool) -> bool:
        """A check's verdict on all that may keep the forward GEMM from coming down but the rung
        below's loss cost (``allowed``), returned: the next window measures that cost only where
        it would decide (a promoted GEMM whose shadow's operands still flush does not pay for it)."""
        self.cost_below = allowed
        return allowed

    def cost_phase(self, step: int, every: int, sampled: bool = False) -> None:
        """Whether the step after ``step`` ``Controller.step()`` calls measures each loss cost:
        one of the last ``cost_plan`` steps of a window its cadence measures (every step on a
        rung not planned for: after the forward GEMM switched), the rung below's only where it
        would decide (:meth:`below_wanted`); and that step's index, ``step`` from 0 (``sampled``:
        also its device copy, which compiled code draws the rows from). No host sync (a device
        write where it changes)."""
        if self.cost is None:
            return
        self.at_step(step, sampled)
        if self.rungs[0] != self.cost_rung:
            self.cost_rung, self.cost_plan, self.cost_var = self.rungs[0], [None, None], [None, None]
            self.cost_pool, self.cost_below, self.cost_unresolved = [[], []], True, [False, False]
            self.cost_over = 0
            for cadence in self.cost_cadence:
                cadence.reset()
        now = [c.due and (n is None or every - 1 - step % every < n) for n, c in zip(self.cost_plan, self.cost_cadence)]
        now[1] = now[1] and self.cost_below
        for r in range(2):
            if now[r] != self.cost_now[r]:
                self.cost_gate[r].fill_(now[r])
        self.cost_now = now

    def cost_rows_now(self) -> tuple[bool, bool]:
        """The loss costs this step measures (eager code): :attr:`cost_now`'s, the rung below's
        only where the forward GEMM has one (its own casts' only where it runs casts:
        ``_cost.measure_cost``)."""
        return self.cost_now[0], self.cost_now[1] and self.forward_below is not None

    def at_step(self, step: int, sampled: bool) -> None:
        """The step under way is ``step`` (from 0): the index its loss costs draw their rows from
        (``sampled``: its device copy too, which compiled code reads)."""
        self.cost_step = step
        if sampled and self.cost is not None:
            self.step_index.set(step)
        if self.backward is not None:
            self.backward.step = step

    def reset(self) -> None:
        self.state.reset()
        clear_window(self.shadow)
        self.range.zero_()
        if self.gemm_windows is not None:
            self.gemm_windows[..., :-1].zero_()
        if self.cost is not None:
            self.cost[:, 3:] = 0
        if self.backward is not None:
            self.backward.reset()


def _no_module() -> None:
    return None
