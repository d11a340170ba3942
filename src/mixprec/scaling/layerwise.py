"""Per-layer gradient scaling: ``mixprec.GradScaler(device, per_layer=True).watch(model)``.

One loss scale cannot serve a network whose gradients span more binades than float16 holds (about
40 with subnormals): the scale that keeps the bottom layers from flushing to zero overflows the
top. Here the gradient is multiplied again, by a power of two ``s_k``, each time it crosses a
*cut point* on its way down: the output of a block, where every path from the loss has already
been summed (the residual stream between transformer blocks). A parameter below the cut points
``K`` carries ``S = loss scale * prod(s_k for k in K)``, and ``unscale_`` divides its gradient by
its own ``S``; all factors are powers of two, so scaling and unscaling are exact.

Pieces, each small:

* :func:`choose_cut_points`: the outputs of the children of the model's largest
  ``nn.Sequential``/``nn.ModuleList`` of blocks, or the modules a user names.
* :func:`walk`: a walk of the autograd graph from the loss that labels every node with the
  region whose scale its gradient carries, and raises where a node would sum gradients carrying
  different scales (a skip connection around a cut point): residual connections inside a block
  are fine, a path around a block is an error; a shared (tied) parameter reached from several
  regions gets its contributions rescaled to the topmost one. The first walk fixes the canonical
  structure; a later step whose forward differs (a block skipped, an early exit) is walked again
  and planned so that every gradient still carries its canonical region's scale.
* :func:`clean_step`, :func:`overflow_step`, :func:`layer_rule`: the rule, pure functions of
  device tensors over the cut points' :func:`topology`; :func:`host_rule`: the same rule on host
  numbers, bit for bit, for a state in host memory (the CPU), where it replaces some fifty tiny
  tensor ops by two reads.
* :class:`Layerwise`: the stateful shell: the hooks (a backward hook on each cut point's output
  tensor multiplies the gradient by ``s_k`` and records its amax on the device), the per-region
  unscale, and :meth:`Layerwise.update`, which applies the rule; no host syncs on an accelerator.

The rule (after each ``update()``; ``e_k = log2 s_k``, ``T_r`` the sum of the ``e_k`` above
region ``r``, region 0 the one above every cut point, which carries the loss scale alone):
region ``r``'s statistic ``a_r`` is the amax of the scaled gradients seen there in the step (its
parameters' gradients and the activation gradient at its cut point). On a clean step every region
moves so that ``floor(log2 a_r) = floor(log2 a_0) - m_r``: ``T_r += floor(log2 a_0) - floor(log2
a_r) - HEADROOM - m_r`` (``ZERO_JUMP`` more per zero-only region), then ``e_k = T_(k) - T_(parent of k)``
clamped into ``layer_bounds``. The global loss scale keeps its own rule (overflow probing, growth)
and so sets the headroom of every region. An overflow skips the step and backs off the loss scale
as always; the topmost cut point whose region overflowed also raises its margin ``m_k`` by one
binade (after ``hysteresis`` overflows), which comes back down after ``growth_interval`` clean
steps.
"""

from __future__ import annotations

import difflib
import math
import warnings
import weakref
from collections import deque
from typing import Any, NamedTuple, Sequence

import torch
import torch.utils.checkpoint
from torch import nn

from mixprec._unscale import inverse_scale
from mixprec.scaling._graph import Walk, walk
from mixprec.scaling._structure import Structure, decode, encode
from mixprec.scaling.rule import ScaleConfig

__all__ = [
    "LayerState", "Layerwise", "Topology", "choose_cut_points", "clean_step", "layer_rule", "overflow_step",
    "host_rule", "pow2", "topology", "walk", "Walk",
]

#: Binades every region sits below the top region: equalising floor(log2 amax) leaves a region's
#: amax up to twice the top's, which the loss scale's probing does not cover.
HEADROOM = 1
#: Binades a region whose gradients were all zero moves up per clean step.
ZERO_JUMP = 4
#: Updates whose factors :meth:`Layerwise.history` keeps (device tensors, read only when asked).
HISTORY_LEN = 16
#: Bound on the total exponent of a region, so that ``loss scale * 2**T`` stays in float32.
TOTAL_BOUND = 100
#: Default bounds of each cut point's factor: float16's smallest normal and largest power of two
#: (the factor is cast to the gradient's dtype when it multiplies).
DEFAULT_BOUNDS = (2.0**-14, 2.0**15)


def pow2(exponent: torch.Tensor) -> torch.Tensor:
    """``2**exponent`` as float32, exact, for integer exponents in [-126, 127] (any shape).

    Built from the bits (no ``exp2`` rounding). Example: ``pow2(torch.tensor([-1, 3]))`` is
    ``tensor([0.5, 8.])``.
    """
    return ((exponent.to(torch.int32) + 127) << 23).view(torch.float32)


def _exponent_of(value: float, name: str) -> int:
    exponent = math.log2(value) if value > 0 else math.nan
    if not (math.isfinite(exponent) and exponent == int(exponent) and -14 <= exponent <= 15):
        raise ValueError(
            f"{name} must be a power of two in [2**-14, 2**15] (a factor float16 holds exactly), "
            f"got {value!r}."
        )
    return int(exponent)


# ----------------------------------------------------------------------------- cut points


def _has_params(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


def choose_cut_points(model: nn.Module, names: Sequence[str] | None = None) -> list[str]:
    """The qualified names of the modules whose outputs are cut points, bottom (input side) first.

    With ``names``, checks and returns them. Otherwise finds the ``nn.Sequential`` or
    ``nn.ModuleList`` (the model itself included) whose children hold the most trainable
    parameters, and cuts after each of its children with parameters; when that
    container is the model itself (or what single-child wrappers such as DDP or
    ``torch.compile`` hold), its last child is left out (its output is the model's output, which
    only the loss consumes).

    Raises:
        ValueError: a name that is not a submodule (with close matches), a repeated name, or no
            container of blocks found (name the cut points then).

    Example:
        >>> choose_cut_points(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Linear(4, 1)))
        ['0', '2']
    """
    modules = dict(model.named_modules())
    if names is not None:
        names = list(names)
        for name in names:
            if name not in modules or name == "":
                close = difflib.get_close_matches(name, [n for n in modules if n], n=3)
                hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
                raise ValueError(
                    f"cut_points: {name!r} is not a submodule of the watched model.{hint} Give the "
                    "qualified names of model.named_modules(), e.g. 'blocks.0'."
                )
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"cut_points must be distinct module names, at least one; got {names!r}.")
        return names
    best: tuple[int, str] | None = None
    cuts: list[str] = []
    for name, module in modules.items():
        if not isinstance(module, (nn.Sequential, nn.ModuleList)):
            continue
        children = [c for c in module.children() if _has_params(c)]
        if not children:
            continue
        count = sum(p.numel() for c in children for p in c.parameters() if p.requires_grad)
        if best is None or count > best[0]:
            best = (count, name)
    if best is not None:
        container = modules[best[1]]
        prefix = f"{best[1]}." if best[1] else ""
        cuts = [f"{prefix}{n}" for n, c in container.named_children() if _has_params(c)]
        root = model
        while len(root._modules) == 1:  # wrappers: DDP's .module, torch.compile's ._orig_mod
            root = next(iter(root._modules.values()))
        if container is root and cuts[-1] == f"{prefix}{list(container._modules)[-1]}":
            cuts = cuts[:-1]
    if not cuts:
        raise ValueError(
            "GradScaler(per_layer=True) found no nn.Sequential or nn.ModuleList of blocks in the "
            "watched model. Name the modules whose outputs are cut points: "
            "GradScaler(..., per_layer=True, cut_points=['blocks.0', 'blocks.1', ...])."
        )
    return cuts


def _reentrant_message(what: str) -> str:
    return (
        f"per_layer: {what} inside reentrant activation checkpointing "
        "(torch.utils.checkpoint.checkpoint(..., use_reentrant=True)), whose graph the walk from "
        "the loss cannot see into, so the scale its gradients carry cannot be known. Pass "
        "use_reentrant=False (torch's recommendation; per-layer scaling sees through it; in "
        "transformers: model.gradient_checkpointing_enable(gradient_checkpointing_kwargs="
        "{'use_reentrant': False})), or keep the cut points and the parameters outside reentrant "
        "checkpoints."
    )


def _first_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None


# ----------------------------------------------------------------------------- the rule


class Topology(NamedTuple):
    """The cut points' tree as device tensors, built by :func:`topology` after the graph walk.

    ``n`` cut points; region ``k + 1`` is the one right below cut point ``k``, region 0 the top.

    Attributes:
        parent: int64 ``(n,)``: the region that region ``k + 1`` hangs from (0: the top).
        membership: float32 ``(n, n)``: ``[k, j] = 1`` when region ``k + 1`` lies below cut point
            ``j`` (its total exponent is ``membership @ exponent``).
        depth: float32 ``(n,)``: how many cut points lie above region ``k + 1`` (``k`` included).
        scored: ``membership * depth``; outside: ``1 - membership``.
        step_down: float32 ``(n, n)``: ``step_down @ totals`` is each cut point's exponent (its
            region's total minus its parent region's).
    """

    parent: torch.Tensor
    membership: torch.Tensor
    depth: torch.Tensor
    scored: torch.Tensor
    outside: torch.Tensor
    step_down: torch.Tensor


def topology(parents: Sequence[int], device: torch.device | str) -> Topology:
    """The :class:`Topology` of cut points whose regions hang from ``parents[k]`` (0 or ``j + 1``).

    Raises:
        RuntimeError: the parents form a cycle.

    Example:
        >>> topology([2, 0], "cpu").membership  # a chain: region 1 lies below cut points 0 and 1
        tensor([[1., 1.],
                [0., 1.]])
    """
    n = len(parents)
    rows: dict[int, list[float]] = {0: [0.0] * n}

    def row(region: int, depth: int = 0) -> list[float]:
        if region not in rows:
            if depth > n:
                raise RuntimeError("per_layer: the cut points' parents form a cycle")
            rows[region] = list(row(parents[region - 1], depth + 1))
            rows[region][region - 1] = 1.0
        return rows[region]

    membership = torch.tensor([row(r) for r in range(1, n + 1)], dtype=torch.float32).reshape(n, n)
    step_down = torch.eye(n)
    for k, p in enumerate(parents):
        if p:
            step_down[k, p - 1] = -1.0
    depth = membership.sum(dim=1)
    host = Topology(torch.tensor(list(parents), dtype=torch.int64), membership, depth,
                    membership * depth, 1.0 - membership, step_down)
    return Topology(*(t.to(device) for t in host))


class LayerState(NamedTuple):
    """Per cut point, int32 ``(n,)`` device tensors: the exponent of its factor, its margin
    (extra binades below the top region), its growth tracker and its hysteresis budget."""

    exponent: torch.Tensor
    margin: torch.Tensor
    growth_tracker: torch.Tensor
    hysteresis_left: torch.Tensor


def _binade_steps(config: ScaleConfig) -> tuple[int, int]:
    """Binades a margin moves by on a back-off and on a growth."""
    return max(1, round(-math.log2(config.backoff_factor))), max(1, round(math.log2(config.growth_factor)))


def clean_step(
    state: LayerState, stats: torch.Tensor, totals: torch.Tensor, topo: Topology, config: ScaleConfig,
    bounds: tuple[int, int],
) -> LayerState:
    """The rule on a step without overflow (pure; no host sync).

    ``stats``: float32 ``(n + 1,)``, each region's amax of the step (-1: nothing seen); ``totals``:
    float32 ``(n,)``, the total exponents of regions 1..n. Trackers count up; after
    ``growth_interval`` clean steps a margin comes down by a growth binade and the hysteresis
    budget refills (every clean step with ``consecutive_hysteresis``). Each measured region moves
    so that its amax exponent is the top region's minus ``HEADROOM`` and its margin; a region
    that saw only zeros moves ``ZERO_JUMP`` binades per zero-only region between it and its
    nearest measured ancestor (or the top) with that ancestor; the factors are the differences of
    the totals, clamped into ``bounds``. Nothing moves unless the top region measured a positive
    amax and every statistic is finite.
    """
    lo, hi = bounds
    tracker = state.growth_tracker + 1
    grow = tracker >= config.growth_interval
    margin = torch.where(grow, (state.margin - _binade_steps(config)[1]).clamp_min_(0), state.margin)
    left = state.hysteresis_left
    if config.consecutive_hysteresis:
        left = torch.full_like(left, config.hysteresis)
    else:
        left = torch.where(grow, config.hysteresis, left)
    tracker = tracker.masked_fill_(grow, 0)

    _, exponents = torch.frexp(stats)
    lower = stats[1:]
    positive = lower > 0
    measured = torch.where(positive, exponents[0] - exponents[1:] - (margin + HEADROOM), 0)
    # Each row (a region) scores the cut points above it: their depth where measured, 0 where
    # not, -1 off its path; depths differ along a path, so the nearest measured ancestor-or-self
    # is the one column equal to the row's amax (none measured: only unmeasured columns, 0).
    score = topo.scored * positive - topo.outside
    nearest = score.amax(dim=1, keepdim=True)
    moved = ((score == nearest) * measured).sum(dim=1)  # one term per row: exact
    zeros_below = (topo.membership * (lower == 0) * (topo.depth > nearest)).sum(dim=1)
    new_totals = (totals + torch.add(moved, zeros_below, alpha=ZERO_JUMP)).clamp_(-TOTAL_BOUND, TOTAL_BOUND)
    equalised = (topo.step_down @ new_totals).clamp_(lo, hi).to(torch.int32)
    active = (stats[0] > 0) & torch.isfinite(stats).all()
    exponent = torch.where(active, equalised, state.exponent.clamp_min(lo))
    return LayerState(exponent, margin, tracker, left)


def overflow_step(
    state: LayerState, stats: torch.Tensor, topo: Topology, config: ScaleConfig, bounds: tuple[int, int]
) -> tuple[LayerState, torch.Tensor, torch.Tensor]:
    """The rule on a step with an overflow (pure; no host sync): returns the new state, the
    culprits (bool ``(n,)``: cut points whose region overflowed below a region that did not) and
    whether the cut points absorbed the overflow (0-dim bool: there were culprits and each could
    back off or tolerate it, so the loss scale need not back off).

    A culprit spends one unit of hysteresis budget; when the budget is spent (or ``hysteresis``
    is 1) its margin rises and its factor drops by a back-off binade (not below ``bounds[0]``).
    Every growth tracker restarts.
    """
    back_step = _binade_steps(config)[0]
    finite = torch.isfinite(stats)
    culprit = finite.index_select(0, topo.parent) > finite[1:]
    left = state.hysteresis_left
    decremented = (left - 1).clamp_min_(0)
    backoff = culprit & (decremented == 0) if config.hysteresis > 1 else culprit
    margin = torch.add(state.margin, backoff, alpha=back_step)
    exponent = torch.add(state.exponent, backoff, alpha=-back_step).clamp_min_(bounds[0])
    stuck = backoff & (state.exponent <= bounds[0])
    absorbed = culprit.any() & ~stuck.any()
    new = LayerState(exponent, margin, torch.zeros_like(state.growth_tracker), torch.where(culprit, decremented, left))
    return new, culprit, absorbed


def layer_rule(
    state: LayerState, stats: torch.Tensor, totals: torch.Tensor, overflow: bool | torch.Tensor,
    topo: Topology, config: ScaleConfig, bounds: tuple[int, int],
) -> tuple[LayerState, torch.Tensor | None, torch.Tensor | None]:
    """One update of the cut points: :func:`clean_step` or :func:`overflow_step`.

    ``overflow``: a host bool when the step's overflow flag was already read (one branch runs),
    else a 0-dim bool tensor (both run, and the result is selected on the device). Returns the
    new state, the culprits and the absorbed flag (``None`` for both on a clean step known on
    the host: no culprits, nothing absorbed).
    """
    if overflow is False:
        return clean_step(state, stats, totals, topo, config, bounds), None, None
    over, culprit, absorbed = overflow_step(state, stats, topo, config, bounds)
    if overflow is True:
        return over, culprit, absorbed
    clean = clean_step(state, stats, totals, topo, config, bounds)
    chosen = LayerState(*(torch.where(overflow, a, b) for a, b in zip(over, clean)))
    return chosen, overflow & culprit, overflow & absorbed


def host_rule(
    state: LayerState, stats: Sequence[float], overflow: bool, parents: Sequence[int], config: ScaleConfig,
    bounds: tuple[int, int],
) -> tuple[LayerState, list[bool], bool]:
    """:func:`layer_rule` on host numbers: ``state`` holds lists of ints, ``stats`` floats,
    ``parents`` the region each cut point's region hangs from. Returns the new state (lists),
    the culprits and whether the overflow was absorbed (``False`` on a clean step).

    The same results, bit for bit (``tests/scaling/test_scaling_layerwise.py`` compares them on random
    states). The scaler runs it where its state lives in host memory (the CPU), where reading it
    costs no sync and the fifty small tensor ops of :func:`layer_rule` cost more than the rest of
    the step's scaling work together.

    Example:
        >>> s = LayerState([0], [0], [0], [1])
        >>> host_rule(s, [2.0**-3, 2.0**-9], False, [0], ScaleConfig(), (-14, 15))[0].exponent
        [5]
    """
    n = len(parents)
    lo, hi = bounds
    back_step, grow_step = _binade_steps(config)
    exponent, margin, tracker, left = (list(values) for values in state)
    culprit = [False] * n
    if overflow:
        finite = [math.isfinite(s) for s in stats]
        stuck = False
        for k in range(n):
            culprit[k] = finite[parents[k]] and not finite[k + 1]
            decremented = max(left[k] - 1, 0)
            backoff = culprit[k] and (decremented == 0 or config.hysteresis <= 1)
            stuck = stuck or (backoff and exponent[k] <= lo)
            margin[k] += back_step * backoff
            exponent[k] = max(exponent[k] - back_step * backoff, lo)
            left[k] = decremented if culprit[k] else left[k]
        return LayerState(exponent, margin, [0] * n, left), culprit, any(culprit) and not stuck
    for k in range(n):
        tracker[k] += 1
        grow = tracker[k] >= config.growth_interval
        if grow:
            margin[k], tracker[k] = max(margin[k] - grow_step, 0), 0
        if grow or config.consecutive_hysteresis:
            left[k] = config.hysteresis
    if not (stats[0] > 0 and all(math.isfinite(s) for s in stats)):
        return LayerState([max(e, lo) for e in exponent], margin, tracker, left), culprit, False
    top = math.frexp(stats[0])[1]
    totals = _host_totals(exponent, parents)
    moved = []
    for k in range(n):  # up from region k + 1 to its nearest measured region, counting zero-only ones
        j, zeros, change = k, 0, 0
        while j >= 0:
            if stats[j + 1] > 0:
                change = top - math.frexp(stats[j + 1])[1] - margin[j] - HEADROOM
                break
            zeros += stats[j + 1] == 0
            j = parents[j] - 1
        moved.append(min(max(totals[k] + change + ZERO_JUMP * zeros, -TOTAL_BOUND), TOTAL_BOUND))
    exponent = [min(max(moved[k] - (moved[p - 1] if p else 0), lo), hi) for k, p in enumerate(parents)]
    return LayerState(exponent, margin, tracker, left), culprit, False


def _host_totals(exponent: Sequence[int], parents: Sequence[int]) -> list[int]:
    """Each region's total exponent (regions 1..n): the sum of the exponents on its path up."""
    totals = []
    for k in range(len(parents)):
        total, j = 0, k
        while j >= 0:
            total += exponent[j]
            j = parents[j] - 1
        totals.append(total)
    return totals


# ----------------------------------------------------------------------------- the scaler part


class Layerwise:
    """The per-layer part of a :class:`mixprec.GradScaler` (built by ``per_layer=True``).

    Holds the cut points of the watched model, the hooks, the device state (per cut point: the
    exponent of its factor, a margin, a growth tracker and a hysteresis budget; per region: the
    step's amax) and the parameter-to-region map. The scaler calls :meth:`watch`,
    :meth:`observe` (in ``scale``), :meth:`unscale` (in ``unscale_``) and :meth:`update`.

    Preconditions: one watched model; each cut point's module runs at most once per step, with
    its output (a tensor, or a tuple/list whose first item is the tensor that flows on) consumed
    only above it. The graph walk checks this on the first ``scale(loss)`` after :meth:`watch`
    and on every step whose forward differs from the first (see :meth:`observe`).
    """

    #: Device types whose state :meth:`update` reads on the host and updates with
    #: :func:`host_rule` (host memory: no sync); elsewhere :func:`layer_rule` runs on the device.
    host_devices: tuple[str, ...] = ("cpu",)

    def __init__(self, config: ScaleConfig, cut_points: Sequence[str] | None, bounds: tuple[float, float]) -> None:
        if cut_points is not None and (isinstance(cut_points, str) or not all(isinstance(n, str) for n in cut_points)):
            raise TypeError(f"cut_points must be a list of module names, got {cut_points!r}.")
        lo, hi = (_exponent_of(float(b), f"layer_bounds[{i}]") for i, b in enumerate(bounds))
        if lo > hi:
            raise ValueError(f"layer_bounds must be (low, high) with low <= high, got {bounds!r}.")
        self.config = config
        self.requested = None if cut_points is None else list(cut_points)
        self.bounds = (lo, hi)
        self.names: list[str] = []
        self._model: weakref.ref[nn.Module] | None = None
        self._handles: list[Any] = []
        self._device_state: dict[str, torch.Tensor] | None = None
        self._pending: dict[str, Any] | None = None  # a loaded state waiting for the cut points
        self._master_maps: dict[int, tuple[int, dict[int, int]]] = {}
        self._indices: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}
        self._grad_hooks: list[Any] = []  # one backward hook per cut point, made by watch
        self._topology: Topology | None = None
        self.recent: deque[torch.Tensor] = deque(maxlen=HISTORY_LEN)  # exponents after each update
        self._saved_structure: Structure | None = None  # a loaded structure waiting for the first walk
        self._forget_graph()

    def _forget_graph(self) -> None:
        """What the graph walks learnt and what one step planned: back to before the first step."""
        self._edges: dict[tuple[int, int], tuple[int, int]] = {}  # the forwards' cut outputs since scale()
        self._calibrated = False
        self._param_region: dict[int, int] = {}
        self._placed: set[int] = set()  # parameters whose region a walk saw (not guessed by owner)
        self._parents: list[int] = [k + 2 if k + 1 < len(self.names) else 0 for k in range(len(self.names))]
        if self._saved_structure is not None:
            self._parents = list(self._saved_structure.parents)
        self._known: set[int] = set()  # cut points whose parent region a walk saw
        self._regular: list[int] = []  # the cut points one regular forward runs, each once
        self._shared = False  # a parameter reached from several regions: walk every step
        self._canonical_plan: list[tuple[torch.Tensor, ...]] = []  # per cut point: stats, s_k, [s_k, 1], index
        self._hook_plan: list[tuple[torch.Tensor, ...]] = []  # this backward's (the canonical one but where it compensates)
        self._step_hooks: list[Any] = []  # this backward's parameter hooks (removed after it)
        self._fired: set[int] = set()  # cut points whose backward hook ran in this backward
        self._fired_step: set[int] = set()  # ... in any backward since the last update
        self._expected: frozenset[int] | None = None  # what this backward must fire (fast path)
        self._param_names: dict[int, str] | None = None  # id -> qualified name, for errors

    # -- watch --------------------------------------------------------------------------------

    def watch(self, model: nn.Module) -> None:
        """Chooses the cut points of ``model`` and hooks their modules (replacing an earlier model).

        Raises:
            ValueError: see :func:`choose_cut_points`.
        """
        if self._model is not None and self._model() is model:
            return
        names = choose_cut_points(model, self.requested)
        self.remove_hooks()
        modules = dict(model.named_modules())
        self._model = weakref.ref(model)
        self.names = names
        self._grad_hooks = [self._grad_hook(k) for k in range(len(names))]
        self._handles = [modules[n].register_forward_hook(_CutHook(self, k, modules[n])) for k, n in enumerate(names)]
        self._forget_graph()  # until the graph walk says otherwise: a chain
        if self._device_state is not None:
            self._device_state = self._fresh_state(self._device_state["exponent"].device)

    def require_model(self) -> None:
        """Raises ``ValueError`` (what to do) unless a model is watched: without one the scaler
        would train with the loss scale alone."""
        if self._model is None or self._model() is None:
            again = " again (watching is not pickled or copied)" if self.names else ""
            raise ValueError(
                "GradScaler(per_layer=True) scales per cut point of a watched model, and none is "
                f"watched: call scaler.watch(model){again} before the first scale(loss) (it "
                "returns the scaler: scaler = mixprec.GradScaler(..., per_layer=True).watch(model)). "
                "Without it every gradient would carry the loss scale alone."
            )

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._release_step_hooks()

    def _grad_hook(self, cut: int) -> Any:
        """The backward hook of cut point ``cut``'s output: records the incoming gradient's amax
        in the parent region's statistic and, times ``s_k``, in its own region's; returns the
        gradient times ``s_k``. A few device ops, no host sync, nothing cached per step. On a
        step whose graph differs from the first one's (a block skipped), ``s_k`` also brings the
        gradient from the region it arrives from to the parent region's scale (the plan)."""

        def hook(grad: torch.Tensor) -> torch.Tensor | None:
            self._fired.add(cut)
            plan = self._hook_plan
            if not plan:
                return None
            stats, factor, pair, index = plan[cut]
            amax = grad.abs().amax() if grad.numel() else grad.new_zeros(())
            if amax.device != stats.device or amax.dtype != torch.float32:
                amax = amax.to(stats.device, torch.float32, non_blocking=True)
            if self._calibrated:  # [own region, parent] <- [amax * s_k, amax]
                stats.scatter_reduce_(0, index, amax * pair, reduce="amax")
            else:  # the parent is not known yet
                own = stats.narrow(0, cut + 1, 1)
                torch.maximum(own, amax * factor, out=own)
            return grad * (factor if grad.device == factor.device else factor.to(grad.device, non_blocking=True))

        return hook

    # -- device state -------------------------------------------------------------------------

    def _fresh_state(self, device: torch.device | str) -> dict[str, torch.Tensor]:
        n = len(self.names)
        zeros = torch.zeros(n, dtype=torch.int32, device=device)
        state = {
            "exponent": zeros.clone(),
            "margin": zeros.clone(),
            "growth_tracker": zeros.clone(),
            "hysteresis_left": torch.full((n,), self.config.hysteresis, dtype=torch.int32, device=device),
            "stats": torch.full((n + 1,), -1.0, dtype=torch.float32, device=device),
            "overflow": torch.zeros(n, dtype=torch.bool, device=device),
        }
        if self._pending is not None:
            for key, values in self._pending.items():
                state[key] = torch.tensor(values, dtype=torch.int32, device=device)
            self._pending = None
        state["no_overflow"] = state["overflow"]
        # [s_0 .. s_(n-1), 1, 2**T_1 .. 2**T_n]: the factors, then each region's (region 0: 1)
        state["powers"] = torch.ones(2 * n + 1, dtype=torch.float32, device=device)
        state["factor"] = state["powers"][:n]
        state["region_factor"] = state["powers"][n:]
        self._refresh(state)
        return state

    def _refresh(self, state: dict[str, torch.Tensor]) -> None:
        """Rebuilds what derives from the exponents and the parents: the topology, the factors,
        the regions' totals and scales, and the hooks' views of them."""
        device = state["exponent"].device
        self._topology = topology(self._parents, device)
        self._store_factors(state, state["exponent"])
        stats, powers, n = state["stats"], state["powers"], len(self.names)
        indices = torch.tensor([[k + 1, p] for k, p in enumerate(self._parents)], dtype=torch.int64).to(device)
        # per cut point: stats, s_k, [s_k, 1] (a strided view of the powers), [own region, parent]
        self._canonical_plan = [
            (stats, powers[k], powers.as_strided((2,), (n - k,), k), indices[k]) for k in range(n)
        ]
        self._hook_plan = self._canonical_plan

    def _store_factors(self, state: dict[str, torch.Tensor], exponent: torch.Tensor) -> None:
        state["exponent"] = exponent
        state["factor"].copy_(pow2(exponent))
        state["region_factor"][1:].copy_(pow2(self._topology.membership @ exponent.float()))

    def ensure_state(self, device: torch.device) -> dict[str, torch.Tensor]:
        if self._device_state is None:
            self._device_state = self._fresh_state(device)
        return self._device_state

    # -- observe: the graph walk --------------------------------------------------------------

    def observe(self, outputs: Any, device: torch.device) -> None:
        """Called by ``scale(outputs)``, before the backward: creates the device state and plans
        the backward.

        The first time, the graph walk places the cut points and parameters (the canonical
        structure). Later, a forward that ran each of those cut points once, in a model without
        shared parameters, costs nothing here (the hooks check, in the backward, that each
        output reached the loss). Any other forward (a block skipped or exited early, a module
        run twice, a tied weight) is walked again, and this backward gets hooks that bring every
        gradient to its canonical region's scale: a cut point's factor times the factors of
        the cut points skipped above it, a parameter below no cut point that ran times the
        factors of its region's cut points that did not, a tied weight's contributions to its
        topmost region's scale before autograd sums them. All are powers of two: exact.

        Raises:
            ValueError: see :func:`walk`; or the previous backward missed a cut point that ran in
                its forward (see :meth:`check_backward`).
        """
        state = self.ensure_state(device)
        self.check_backward()
        self._release_step_hooks()
        model = self._model() if self._model is not None else None
        edges, self._edges = self._edges, {}
        roots = [t.grad_fn for t in _tensors(outputs) if t.grad_fn is not None]
        if model is None or not roots:
            return
        if self._calibrated and not self._shared and sorted(c for c, _ in edges.values()) == self._regular:
            self._hook_plan, self._expected = self._canonical_plan, frozenset(self._regular)
            return
        if self._param_names is None:
            self._param_names = {id(p): name for name, p in model.named_parameters()}
        graph = walk(roots, edges, self.names, self._param_names)
        if not self._calibrated and not self._adopt(model, graph):
            self._calibrate(model, graph)
            self._refresh(state)
        elif set(graph.incoming) - self._known:
            regions, scales = dict(self._param_region), state["region_factor"].clone()
            self._extend(graph)
            self._refresh(state)
            self._carry_over(model, regions, scales, state["region_factor"])
        else:
            self._shared = self._shared or bool(graph.rescale)
        self._compensate(graph, state)

    def _adopt(self, model: nn.Module, graph: Walk) -> bool:
        """Takes the canonical structure of a loaded checkpoint (see :meth:`load_state_dict`) in
        place of the first walk's, when it names this model's parameters; returns whether it did.
        The walk then goes on as on a later step (new cut points join, the step is planned)."""
        saved, self._saved_structure = self._saved_structure, None
        if saved is None:
            return False
        params = dict(model.named_parameters())
        if set(saved.regions) != set(params):
            warnings.warn(
                "per_layer: the checkpoint's structure (the region of each cut point and parameter) "
                "names other parameters than the watched model's; it is learnt again from this step, "
                "so the run may not continue as it would have without the checkpoint. Load it into "
                "the model it was saved from.",
                RuntimeWarning,
                stacklevel=4,
            )
            return False
        self._parents = list(saved.parents)
        self._known = set(saved.known)
        self._regular = list(saved.regular)
        self._shared = saved.shared
        self._param_region = {id(param): saved.regions[name] for name, param in params.items()}
        self._placed = {id(params[name]) for name in saved.placed if name in params}
        self._calibrated = True
        self._refresh(self._device_state)
        return True

    def _structure(self) -> Structure | None:
        """The canonical structure by parameter name (a loaded one while no walk took it);
        ``None`` before the first walk."""
        if not self._calibrated:
            return self._saved_structure
        names = self._param_names or {}
        return Structure(
            parents=list(self._parents), known=set(self._known), regular=list(self._regular), shared=self._shared,
            regions={names[key]: r for key, r in self._param_region.items() if key in names},
            placed={names[key] for key in self._placed if key in names},
        )

    def _calibrate(self, model: nn.Module, graph: Walk) -> None:
        """The canonical structure from the first walk: each cut point's parent region, each
        parameter's region."""
        inside = self._checkpointed(model, graph.hidden, graph.incoming)
        self._parents = [graph.incoming.get(k, 0) for k in range(len(self.names))]
        self._known = set(graph.incoming)
        self._regular = sorted(graph.incoming)
        self._shared = bool(graph.rescale)
        owners = [(name, k) for k, name in enumerate(self.names)]
        self._param_region = {}
        unplaced = []
        for name, param in model.named_parameters():
            reached = graph.params.get(id(param))
            if reached is not None:
                self._param_region[id(param)] = reached[1]
                self._placed.add(id(param))
                continue
            if id(param) in inside:  # inside a reentrant checkpoint: the checkpoint's region
                self._param_region[id(param)] = inside[id(param)]
                continue
            # Not reached (unused in this step): the cut point whose module owns it, else the
            # top region, until a walk reaches it.
            owner = [k for cut, k in owners if name.startswith(cut + ".")]
            self._param_region[id(param)] = owner[-1] + 1 if owner else 0
            if not owner and param.requires_grad:
                if None in inside:
                    what = f"parameter {name!r}, not in the graph of the first scaled loss, may run"
                    raise ValueError(_reentrant_message(what))
                unplaced.append(name)
        known = {id(p) for p in model.parameters()}
        if unplaced and any(key not in known for key in graph.params):
            warnings.warn(
                f"per_layer: {', '.join(unplaced[:5])}{' ...' if len(unplaced) > 5 else ''} of the "
                "watched model are not in the autograd graph of the first scaled loss, which trains "
                "other tensors (a wrapper's copies of the parameters?); they are taken to lie above "
                "every cut point. If they lie below one, their gradients are unscaled by the wrong "
                "factor: name cut points that own them (cut_points=[...]) or do not use per_layer "
                "with this wrapper.",
                RuntimeWarning,
                stacklevel=4,
            )
        self._calibrated = True

    def _extend(self, graph: Walk) -> None:
        """A later walk reached cut points the canonical structure lacks (skipped in the first
        step). When it reached all the known ones too, its structure becomes the canonical one
        (parents, parameter regions, the regular forward); otherwise the new cut points join
        where this step found them, and so do parameters no walk had reached."""
        reached = set(graph.incoming)
        self._shared = self._shared or bool(graph.rescale)
        complete = reached >= self._known
        for k in reached if complete else reached - self._known:
            self._parents[k] = graph.incoming[k]
        self._known |= reached
        if complete:
            self._regular = sorted(reached)
        for key, (_, label) in graph.params.items():
            if key in self._param_region and (complete or key not in self._placed):
                self._param_region[key] = label
                self._placed.add(key)
        self._master_maps = {}  # built from the parameters' regions

    def _carry_over(
        self, model: nn.Module, regions: dict[int, int], scales: torch.Tensor, new_scales: torch.Tensor
    ) -> None:
        """Gradients accumulated before the canonical structure changed (earlier backward calls
        of this step) carry their old region's scale: brought to the new one (powers of two)."""
        moved: dict[tuple[int, int], list[torch.Tensor]] = {}
        for param in model.parameters():
            key = id(param)
            if param.grad is not None and key in regions and key in self._param_region:
                moved.setdefault((regions[key], self._param_region[key]), []).append(param.grad)
        with torch.no_grad():
            for (old, new), grads in moved.items():
                ratio = new_scales[new] / scales[old]
                torch._foreach_mul_(grads, ratio.to(grads[0].device))

    def _compensate(self, graph: Walk, state: dict[str, torch.Tensor]) -> None:
        """This backward's plan (see :meth:`observe`): factors ``2**(T_to - T_from)`` on the
        device (no host sync) for every gradient that arrives in a region other than its
        canonical one."""
        moves: list[tuple[int, int]] = []  # (to region, from region)
        cuts = {k: len(moves) + i for i, k in enumerate(k for k, lab in graph.incoming.items() if lab != self._parents[k])}
        moves += [(self._parents[k], graph.incoming[k]) for k in cuts]
        leaves = []
        for key, (param, label) in graph.params.items():
            region = self._param_region.get(key)
            if region is not None and region != label and param.requires_grad:
                leaves.append((param, len(moves)))
                moves.append((region, label))
        nodes = []
        for node, index, label, top in graph.rescale:
            nodes.append((node, index, len(moves)))
            moves.append((top, label))
        self._hook_plan = self._canonical_plan
        if not moves:
            return
        exponent = state["exponent"]
        totals = torch.cat([exponent.new_zeros(1, dtype=torch.float32), self._topology.membership @ exponent.float()])
        index = torch.tensor(moves, dtype=torch.int64).to(exponent.device)
        factors = pow2((totals[index[:, 0]] - totals[index[:, 1]]).clamp_(-126, 127)).unbind()
        plan = list(self._canonical_plan)
        for k, i in cuts.items():
            stats, factor, _, where = plan[k]
            moved = factor * factors[i]
            plan[k] = (stats, moved, torch.stack([moved, factors[i]]), where)
        self._hook_plan = plan
        self._step_hooks = [param.register_hook(_Times(factors[i])) for param, i in leaves]
        for node, index_in, i in nodes:
            node.register_hook(_TimesInput(index_in, factors[i]))  # dies with this step's graph

    def _release_step_hooks(self) -> None:
        for handle in self._step_hooks:
            handle.remove()
        self._step_hooks = []

    def check_backward(self) -> None:
        """After a backward planned without a walk: every cut point that ran in the forward got
        its gradient (else the factors of the cut points above the parameters that did get
        gradients are not known here). Folds the backward's cut points into the step's.

        Raises:
            ValueError: a cut point ran in the forward but its output did not reach the loss.
        """
        fired, expected = self._fired, self._expected
        self._fired_step |= fired
        self._fired, self._expected = set(), None
        if expected is None or not fired or fired >= expected:
            return
        missing = ", ".join(repr(self.names[k]) for k in sorted(expected - fired))
        raise ValueError(
            f"per_layer: cut point {missing} ran in the forward but its output did not reach the "
            "loss in the backward (computed and discarded), so the gradients below it carry a "
            "scale that per-layer scaling cannot know, and this step's gradients are wrong. Skip "
            "the block instead of discarding its output (do not call it: skipped blocks, early "
            "exits and unused experts are exact), or name cut points whose outputs always reach "
            "the loss (cut_points=[...])."
        )

    def _checkpointed(
        self, model: nn.Module, hidden: list[tuple[Any, int]], incoming: dict[int, int]
    ) -> dict[Any, int]:
        """What the reentrant checkpoints the walk met hide: ``{id(parameter): region}`` for
        the parameters of checkpointed modules (the region the checkpoint lies in), and the key
        ``None`` when one checkpointed a function that is no module's.

        Raises:
            ValueError: a cut point runs inside a reentrant checkpoint (its nesting, and so the
                scale of every gradient below it, cannot be known).
        """
        inside: dict[Any, int] = {}
        modules = dict(model.named_modules())
        for run_function, label in hidden:
            owner = run_function if isinstance(run_function, nn.Module) else getattr(run_function, "__self__", None)
            if not isinstance(owner, nn.Module):
                inside[None] = 0
                continue
            members = {id(m) for m in owner.modules()}
            cuts = [name for name in self.names if id(modules[name]) in members]
            if cuts:
                raise ValueError(_reentrant_message(f"cut point {cuts[0]!r} runs"))
            for param in owner.parameters():
                inside.setdefault(id(param), label)
        unreached = [name for k, name in enumerate(self.names) if k not in incoming]
        if None in inside and unreached:
            raise ValueError(_reentrant_message(f"cut point {unreached[0]!r} runs"))
        return inside

    # -- unscale --------------------------------------------------------------------------------

    def _region_lookup(self, optimizer: Any) -> dict[int, int]:
        """Parameter id -> region, with ``MasterWeights``' float32 masters mapped to their model
        parameters."""
        pairs = getattr(optimizer, "_pairs", None)
        if not pairs:
            return self._param_region
        cached = self._master_maps.get(id(optimizer))
        if cached is None or cached[0] != len(pairs):
            mapping = dict(self._param_region)
            for model_param, master in pairs:
                if id(model_param) in self._param_region:
                    mapping[id(master)] = self._param_region[id(model_param)]
            cached = (len(pairs), mapping)
            self._master_maps[id(optimizer)] = cached
        return cached[1]

    def unscale(
        self, optimizer: Any, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], scale: torch.Tensor
    ) -> dict[torch.device, torch.Tensor]:
        """Divides each gradient by its region's scale (``scale * 2**T_r``) in place, records the
        regions' amax first; returns the per-device overflow flags (0 or 1). No host sync.

        The reciprocals are taken as :func:`mixprec._unscale.inverse_scale` takes them (float64,
        one per region), and each (device, dtype, region) group goes through torch's
        ``_amp_foreach_non_finite_check_and_unscale_``, as :func:`mixprec._unscale.unscale_` does.
        """
        state = self.ensure_state(scale.device)
        self.check_backward()
        self._release_step_hooks()
        lookup = self._region_lookup(optimizer)
        groups: dict[tuple[torch.device, torch.dtype], dict[int, list[torch.Tensor]]] = {}
        measured: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], list[int]]] = {}
        for param, grad in zip(params, grads):
            values = grad._values() if grad.is_sparse else grad
            key, region = (values.device, values.dtype), lookup.get(id(param), 0)
            groups.setdefault(key, {}).setdefault(region, []).append(values)
            if values.numel():  # FSDP2: empty shards
                tensors, regions_of = measured.setdefault(key, ([], []))
                tensors.append(values)
                regions_of.append(region)
        if not groups:
            return {}
        stats = state["stats"]
        inverse = inverse_scale(scale * state["region_factor"])  # one reciprocal per region
        inverses: dict[torch.device, tuple[torch.Tensor, ...]] = {}
        found: dict[torch.device, torch.Tensor] = {}
        with torch.no_grad():
            for key, per_region in groups.items():
                device = key[0]
                if key in measured:
                    extremes, regions_of = _extremes(*measured[key])
                    if extremes.device != stats.device or extremes.dtype != torch.float32:
                        extremes = extremes.to(stats.device, torch.float32)
                    stats.scatter_reduce_(0, self._index(regions_of, stats.device), extremes, reduce="amax")
                if device not in found:
                    found[device] = torch.zeros((), dtype=torch.float32, device=device)
                    on_device = inverse if device == inverse.device else inverse.to(device, non_blocking=True)
                    inverses[device] = on_device.unbind()
                for region, region_grads in per_region.items():
                    torch._amp_foreach_non_finite_check_and_unscale_(
                        region_grads, found[device], inverses[device][region]
                    )
            skipped = self._known - self._fired_step
            if skipped and measured:
                # A step that skipped cut points: the regions at and below them are not measured
                # (their gradients are not those of the network the factors serve, e.g. larger
                # without a skipped block above, or zeros after zero_grad(set_to_none=False)):
                # their factors keep their value; overflows still count.
                silent = tuple(k + 1 for k in range(len(self.names)) if skipped.intersection(self._path(k)))
                index = self._index(silent, stats.device)
                seen = stats.index_select(0, index)
                stats.index_copy_(0, index, torch.where(seen.isfinite(), -1.0, seen))
        return found

    def _path(self, cut: int) -> list[int]:
        """Cut point ``cut`` and the cut points above it (the canonical tree)."""
        path = [cut]
        while self._parents[path[-1]] and len(path) <= len(self._parents):
            path.append(self._parents[path[-1]] - 1)
        return path

    def _index(self, regions_of: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """The int64 index tensor of ``regions_of`` on ``device``, made once per layout."""
        key = (regions_of, device)
        index = self._indices.get(key)
        if index is None:
            index = torch.tensor(regions_of, dtype=torch.int64).to(device)
            self._indices[key] = index
        return index

    # -- update ---------------------------------------------------------------------------------

    def update(
        self, found_inf: torch.Tensor, group: Any, config: ScaleConfig, overflow: bool | None = None
    ) -> torch.Tensor | None:
        """Applies :func:`layer_rule` to the step's statistics, with the scaler's ``config``
        (hysteresis, growth interval, factors). ``overflow``: the step's overflow flag when the
        scaler has already read it on the host (it does when watching), else ``None``.

        Returns a 0-dim bool tensor: the overflow was absorbed by the cut points below the top
        region (their factors backed off or their hysteresis tolerated it), so the loss scale
        must not back off; ``None`` when nothing can have been absorbed (a clean step known on
        the host, or no state yet). No host sync; with ``group``, one all-reduce (MAX) of the
        statistics so that every rank gets the same factors.
        """
        self.config = config
        self._fired_step = set()
        state = self._device_state
        if state is None:
            return None
        stats = state["stats"]
        if group is not None:
            stats = torch.nan_to_num(stats, nan=math.inf)
            torch.distributed.all_reduce(stats, op=torch.distributed.ReduceOp.MAX, group=group)
        if stats.device.type in self.host_devices:
            return self._update_on_host(state, stats, found_inf, config, overflow)
        flag = (found_inf.to(stats.device) != 0) if overflow is None else overflow
        layer = LayerState(*(state[k] for k in LayerState._fields))
        totals = self._topology.membership @ layer.exponent.float()
        new, culprit, absorbed = layer_rule(layer, stats, totals, flag, self._topology, config, self.bounds)
        state.update(
            margin=new.margin,
            growth_tracker=new.growth_tracker,
            hysteresis_left=new.hysteresis_left,
            overflow=state["no_overflow"] if culprit is None else culprit,
        )
        self._store_factors(state, new.exponent)
        state["stats"].fill_(-1.0)
        self.recent.append(new.exponent)
        return absorbed

    def _update_on_host(
        self, state: dict[str, torch.Tensor], stats: torch.Tensor, found_inf: torch.Tensor, config: ScaleConfig,
        overflow: bool | None,
    ) -> torch.Tensor | None:
        """:meth:`update` through :func:`host_rule`, for a state in host memory: two reads and
        a few writes instead of the rule's fifty small ops."""
        values = self._host_values()
        if overflow is None:
            overflow = bool(found_inf.item())
        layer = LayerState(*(values[k] for k in LayerState._fields))
        new, culprit, absorbed = host_rule(layer, stats.tolist(), overflow, self._parents, config, self.bounds)
        ints = torch.tensor([*new, culprit], dtype=torch.int32, device=stats.device)
        exponent, margin, tracker, left, culprits = ints.unbind()
        state.update(exponent=exponent, margin=margin, growth_tracker=tracker, hysteresis_left=left,
                     overflow=culprits.bool() if overflow else state["no_overflow"])
        powers = [2.0**e for e in new.exponent] + [1.0] + [2.0**t for t in _host_totals(new.exponent, self._parents)]
        state["powers"].copy_(torch.tensor(powers, device=stats.device))
        state["stats"].fill_(-1.0)
        self.recent.append(exponent)
        return torch.tensor(True, device=stats.device) if absorbed else None

    def skip_update(self) -> None:
        """What ``update(new_scale=...)`` does here: the step's statistics are discarded (the next
        update measures its own step only); factors, margins, trackers and budgets stay, and the
        history records the unchanged factors. No host sync."""
        self._fired_step = set()
        state = self._device_state
        if state is None:
            return
        state["stats"].fill_(-1.0)
        state["overflow"] = state["no_overflow"]
        self.recent.append(state["exponent"])

    def reset(self) -> None:
        """Back to the start: every factor 1, margins 0, budgets full (what a checkpoint without
        per-layer state loads into a per-layer scaler)."""
        self._pending = None
        self._saved_structure = None
        if self._device_state is not None:
            self._device_state = self._fresh_state(self._device_state["exponent"].device)
        self.recent.clear()

    # -- reading --------------------------------------------------------------------------------

    def _host_values(self) -> dict[str, list[int]]:
        keys = ("exponent", "margin", "growth_tracker", "hysteresis_left")
        if self._device_state is None:
            n = len(self.names)
            default = {"exponent": [0] * n, "margin": [0] * n, "growth_tracker": [0] * n,
                       "hysteresis_left": [self.config.hysteresis] * n}
            return {k: list((self._pending or default).get(k, default[k])) for k in keys}
        values = torch.stack([self._device_state[k] for k in keys]).tolist()  # one host sync
        return dict(zip(keys, values))

    def scales(self) -> dict[str, float]:
        """``{cut point: s_k}`` (one host sync)."""
        return {name: 2.0**e for name, e in zip(self.names, self._host_values()["exponent"])}

    def region_scales(self, scale: float) -> dict[str, float]:
        """``{parameter region's cut point: total scale}`` of each cut point's region."""
        membership = topology(self._parents, "cpu").membership
        totals = membership @ torch.tensor(self._host_values()["exponent"], dtype=torch.float32)
        return {name: scale * 2.0 ** int(t) for name, t in zip(self.names, totals.tolist())}

    def factors(self) -> torch.Tensor | None:
        """``s_k`` as a new float32 device tensor (no host sync); ``None`` before the state exists."""
        return None if self._device_state is None else pow2(self._device_state["exponent"])

    def history(self) -> list[dict[str, float]]:
        """``{cut point: s_k}`` after each of the last :data:`HISTORY_LEN` updates, oldest first
        (one host sync)."""
        if not self.recent:
            return []
        rows = torch.stack(list(self.recent)).tolist()
        return [{name: 2.0**e for name, e in zip(self.names, row)} for row in rows]

    def last_overflow(self) -> tuple[str, ...]:
        """Cut points whose region overflowed first on the last update (one host sync)."""
        if self._device_state is None:
            return ()
        flags = self._device_state["overflow"].tolist()
        return tuple(name for name, bad in zip(self.names, flags) if bad)

    def state_dict(self) -> dict[str, Any]:
        """``{"cut_points": names, "exponent": [...], "margin": [...], "growth_tracker": [...],
        "hysteresis_left": [...], "structure": {...}}`` (one host sync). ``structure`` (after the
        first step): the region of each cut point and parameter as the graph walks learnt them
        (:func:`mixprec.scaling._structure.encode`), by name, so that a resumed run scales and
        measures as the uninterrupted one would after steps that skipped blocks."""
        saved: dict[str, Any] = {"cut_points": list(self.names), **self._host_values()}
        structure = self._structure()
        if structure is not None:
            saved["structure"] = encode(structure, self.names)
        return saved

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Restores the per-cut-point values of :meth:`state_dict`, and its ``structure`` when
        it has one (the next ``scale(loss)`` takes it in place of the first walk's); a state
        without it (saved before the first step, or by an older mixprec) leaves the structure to
        the walks, as before.

        Raises:
            ValueError: the saved cut points are not this scaler's (after :meth:`watch`), or a
                value is out of range.
        """
        names = list(saved.get("cut_points", []))
        keys = ("exponent", "margin", "growth_tracker", "hysteresis_left")
        values = {k: [int(v) for v in saved[k]] for k in keys if k in saved}
        if set(values) != set(keys) or any(len(v) != len(names) for v in values.values()):
            raise ValueError(f"the 'layerwise' state must hold cut_points and {', '.join(keys)} of one length.")
        if self.names and names != self.names:
            raise ValueError(
                f"the checkpoint's cut points {names!r} are not this scaler's {self.names!r}; build the "
                "scaler with the same cut_points (or the same model) before loading."
            )
        lo, hi = self.bounds
        if any(not lo <= e <= hi for e in values["exponent"]) or any(m < 0 for m in values["margin"]):
            raise ValueError(f"layerwise exponents must lie in layer_bounds [2**{lo}, 2**{hi}] and margins be >= 0.")
        structure = decode(saved["structure"], names) if "structure" in saved else None
        if not self.names:
            self.requested = self.requested or names
        self._pending = values
        self._saved_structure = structure
        if structure is not None:
            self._release_step_hooks()
            self._forget_graph()
        if self._device_state is not None:
            self._device_state = self._fresh_state(self._device_state["exponent"].device)

    def __getstate__(self) -> dict[str, Any]:
        """Options and per-cut-point values; not the hooks or the model (``watch`` again)."""
        state = {k: v for k, v in self.__dict__.items()}
        state.update(
            _pending=self._host_values() if self.names else None, _saved_structure=self._structure(),
            _model=None, _handles=[], _device_state=None, _master_maps={}, _indices={},
            recent=deque(maxlen=HISTORY_LEN), _grad_hooks=[],
            requested=self.requested if self.requested is not None else (list(self.names) or None),
        )
        state.pop("_topology", None)
        for key in [k for k in state if k in _GRAPH_KEYS]:
            del state[key]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("_saved_structure", None)  # pickled by an older mixprec
        self._topology = None
        self._forget_graph()


#: 1-D tensors of at most this many elements (biases, norms) are concatenated per region before
#: the CPU amax (:func:`_extremes`): one reduction for them all.
SMALL = 2**16


def _extremes(tensors: list[torch.Tensor], regions: Sequence[int]) -> tuple[torch.Tensor, tuple[int, ...]]:
    """Values whose maximum over each region is the region's ``max |t|`` (NaN propagates), and
    the region of each value; ``tensors`` are non-empty, on one device, of one dtype, and
    ``regions`` gives each one's region.

    On CUDA, each tensor's ``max |t|``: one ``_foreach_norm(inf)``. On the CPU, where that op
    (and ``vector_norm(inf)``) is 6 to 10x slower: ``|min|`` and ``|max|`` of each group from one
    ``aminmax`` (no copy), the groups being each tensor but the small 1-D ones, which are one
    group per region (one ``cat``).
    """
    if tensors[0].device.type != "cpu":
        return torch.stack(torch._foreach_norm(tensors, float("inf"))), tuple(regions)
    groups: list[tuple[torch.Tensor, int]] = []
    small: dict[int, list[torch.Tensor]] = {}
    for t, region in zip(tensors, regions):
        if t.dim() == 1 and t.numel() <= SMALL:
            small.setdefault(region, []).append(t)
        else:
            groups.append((t, region))
    groups += [(torch.cat(ts) if len(ts) > 1 else ts[0], region) for region, ts in small.items()]
    values = torch.stack([v for t, _ in groups for v in torch.aminmax(t)]).abs_()
    return values, tuple(region for _, region in groups for _ in range(2))


def _tensors(outputs: Any) -> list[torch.Tensor]:
    if isinstance(outputs, torch.Tensor):
        return [outputs]
    if isinstance(outputs, (list, tuple)):
        return [t for o in outputs for t in _tensors(o)]
    return []


class _CutHook:
    """The forward hook on a cut point's module: notes the output's ``grad_fn`` for the graph walk
    and hooks the output's gradient. It does nothing on a copy of the model (``copy.deepcopy``,
    ``pickle``, ``torch.save``: the copy is not watched; a pickled hook is an inert one), nor
    when an activation checkpoint recomputes the module in the backward."""

    def __init__(self, owner: Layerwise | None = None, cut: int = -1, module: nn.Module | None = None) -> None:
        self.owner = None if owner is None else weakref.ref(owner)
        self.module = None if module is None else weakref.ref(module)
        self.cut = cut

    @torch._dynamo.disable  # the hook runs eagerly: torch.compile breaks the graph here
    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        owner = None if self.owner is None else self.owner()
        tensor = _first_tensor(output)
        if owner is None or self.module is None or module is not self.module() or tensor is None:
            return
        if tensor.grad_fn is None or torch._C._current_graph_task_id() != -1:
            return
        edges = owner._edges
        if len(edges) > EDGE_LIMIT:  # forwards without a scale() since (inference with grad)
            for key in list(edges)[: EDGE_LIMIT // 2]:
                del edges[key]
        edges[(id(tensor.grad_fn), tensor.output_nr)] = (self.cut, tensor.grad_fn._sequence_nr())
        tensor.register_hook(owner._grad_hooks[self.cut])

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (_CutHook, ())


#: What :meth:`Layerwise._forget_graph` sets: learnt from the watched model's graphs, not pickled.
_GRAPH_KEYS = frozenset((
    "_edges", "_calibrated", "_param_region", "_placed", "_parents", "_known", "_regular", "_shared",
    "_canonical_plan", "_hook_plan", "_step_hooks", "_fired", "_fired_step", "_expected", "_param_names",
))

#: Cut-point outputs remembered between two ``scale()`` calls at most (ints only).
EDGE_LIMIT = 4096


class _Times:
    """A parameter's gradient hook for one backward: times a power of two (a device tensor)."""

    def __init__(self, factor: torch.Tensor) -> None:
        self.factor = factor

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        factor = self.factor
        return grad * (factor if grad.device == factor.device else factor.to(grad.device, non_blocking=True))


class _TimesInput(_Times):
    """An autograd node's hook for one backward: its gradient for input ``index`` times a power
    of two (one contribution to a tied weight's gradient, before autograd sums them)."""

    def __init__(self, index: int, factor: torch.Tensor) -> None:
        super().__init__(factor)
        self.index = index

    def __call__(self, grad_inputs: tuple[torch.Tensor | None, ...], grad_outputs: Any) -> tuple[Any, ...] | None:
        grad = grad_inputs[self.index]
        if grad is None:
            return None
        moved = list(grad_inputs)
        moved[self.index] = super().__call__(grad)
        return tuple(moved)
