"""The settings of a Guard and of a Controller, as values: frozen, validated, JSON-able.

A :class:`~mixprec.fp8.Guard` or :class:`~mixprec.Controller` is a stateful shell around one of
these (its decisions, rungs and windows are runtime state); a :class:`~mixprec.Policy`'s fp8 rule
holds the settings alone, so the policy stays a value. This module is a leaf of precision control:
it imports the recipe names and the forecast horizon only, never a state machine.

Example:
    >>> s = ControllerSettings(every=5, ladder=["tensorwise", "compute"])
    >>> s.ladder, ControllerSettings.from_dict(s.to_dict()) == s
    (('tensorwise', 'compute'), True)
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from mixprec._dtype_names import short_name
from mixprec.control._reference import REFERENCES

#: what the loss-cost limits bound (ControllerSettings.cost_scope): each GEMM, or the model's total
COST_SCOPES = ("gemm", "model")
from mixprec.control._trend import MAX_HORIZON
from mixprec.formats._recipe import RECIPE_NAMES

if TYPE_CHECKING:
    import torch

__all__ = ["COST_SCOPES", "ControllerSettings", "FP4_RUNGS", "FP8_RUNGS", "GuardSettings", "LOW_RUNGS", "RUNGS", "check_int", "rung_name",
           "check_number"]

#: a Controller's ladder, bottom to top: the fp4 recipes, the fp8 recipes, the compute dtype, float32
RUNGS = ("mxfp4", "nvfp4", "tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8", "blockwise", "compute", "fp32")
FP4_RUNGS = RUNGS[:2]
FP8_RUNGS = RUNGS[2:7]
LOW_RUNGS = RUNGS[:7]  # the rungs that run a recipe's casts


def check_int(who: str, name: str, value: Any, low: int, high: Any) -> None:
    """Raise ValueError unless ``value`` is an int (not a bool) in ``[low, high]`` (``high`` None: no bound)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{who}.{name} must be an int {bound}, got {value!r}")


def check_number(who: str, name: str, value: Any, low: float, high: float, what: str,
                 low_open: bool = False) -> None:
    """Raise ValueError unless ``value`` is a real number (not a bool, not NaN) in ``[low, high]``
    (``(low, high]`` with ``low_open``); ``what`` says what it is."""
    ok = (not isinstance(value, bool) and isinstance(value, (int, float))
          and (value > low if low_open else value >= low) and value <= high)
    if not ok:
        bound = f"{'(' if low_open else '['}{low:g}, {high:g}]" if math.isfinite(high) else f">= {low:g}"
        raise ValueError(f"{who}.{name} must be a number in {bound} ({what}), got {value!r}")


class _Settings:
    """What both settings values share: their JSON form and a checked copy with changes."""

    def to_dict(self) -> dict[str, Any]:
        """The settings as plain JSON data (the constructor's keyword arguments)."""
        return {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v)
                for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Any:
        """The settings :meth:`to_dict` wrote, validated like built ones.

        Raises ValueError naming unknown keys (and any setting out of range).
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"{cls.__name__}.from_dict expects an object of settings, got {type(data).__name__}")
        known = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
        unknown = sorted(map(str, set(data) - set(known)))
        if unknown:
            raise ValueError(f"unknown {cls.__name__.removesuffix('Settings')} setting(s) {unknown}; settings: "
                             f"{sorted(known)}")
        return cls(**data)

    def replace(self, **changes: Any) -> Any:
        """A copy with ``changes``, validated."""
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]

    def changed(self) -> dict[str, Any]:
        """The settings that differ from the defaults (JSON data)."""
        default = type(self)().to_dict()
        return {k: v for k, v in self.to_dict().items() if default[k] != v}


@dataclass(frozen=True)
class GuardSettings(_Settings):
    """A :class:`~mixprec.fp8.Guard`'s thresholds and schedule (see there for their meaning).

    Raises ValueError on a threshold out of range.

    Example:
        >>> GuardSettings(every=10).changed()
        {'every': 10}
    """

    max_saturated: float | None = None
    max_underflow: float | None = 0.05
    max_nonfinite: float | None = 0.0
    min_sqnr_db: float | None = None
    every: int = 1
    fp4_max_underflow: float | None = 0.25

    def __post_init__(self) -> None:
        for name, high, what in (("max_saturated", 1, "a fraction, or None"),
                                 ("max_underflow", 1, "a fraction, or None"),
                                 ("fp4_max_underflow", 1, "a fraction, or None"),
                                 ("max_nonfinite", math.inf, "a count, or None")):
            value = getattr(self, name)
            if value is not None:
                check_number("Guard", name, value, 0, high, what)
        sqnr = self.min_sqnr_db
        if sqnr is not None and (isinstance(sqnr, bool) or not isinstance(sqnr, (int, float))
                                 or not math.isfinite(sqnr)):
            raise ValueError(f"Guard.min_sqnr_db must be a finite number of dB, or None, got {sqnr!r}")
        check_int("Guard", "every", self.every, 1, None)


@dataclass(frozen=True)
class ControllerSettings(_Settings):
    """A :class:`~mixprec.Controller`'s limits, schedule, ladder and options. ``ladder`` is kept
    as a tuple (a list is accepted).

    Per layer and operand (input, weight, grad_output) the
    statistics of :class:`~mixprec.fp8.LayerState` accumulate on the device (worst value over the
    window, no host sync); every ``every`` steps the controller reads the windows of all layers
    (one all-reduce MAX, one host sync), updates each operand's trend (an EMA, weight ``ema``, of
    the per-step slope of log2 amax, and of the underflow fraction) and forecasts ``horizon``
    windows ahead: the underflow of a current scale grows with the amax, so the larger of
    ``underflow * 2**(amax slope * ahead)`` and ``underflow + underflow slope * ahead``. A slope
    counts only once the statistic rose in each of the last ``trend_windows`` windows, and at
    most at the slowest of their rates (:func:`~mixprec.control._trend.sustained_slope`): no forecast from the first
    windows after warm-up, nor from a noisy amax.

    *Promote* (one rung up ``ladder``; a forward over ``max_loss_cost``: to the first rung whose
    forecast cost fits it, :func:`~mixprec.control._ladder.past_costly`): a forecast underflow above ``max_underflow``; straight
    to the compute dtype on a nonfinite count above ``max_nonfinite``; straight to fp32, under
    fp16 compute, when the forecast input or output amax passes ``max_range * 65504``.
    *Demote* (one rung down): a promoted layer measures, on a sample of ``sample`` elements per
    operand and on the last ``shadow_steps`` steps of each window, what the rung below's casts
    would do (its shadow; with ``per_gemm``, each GEMM's own casts are measured on those steps
    too); after ``demote_windows``
    consecutive windows whose shadow forecast stays below ``demote_underflow`` (and
    ``demote_range * 65504``, no nonfinite), at least ``min_dwell`` steps after its last switch,
    and while it made fewer than ``max_switches`` switches in the last ``budget_steps`` steps.
    Promotions are never refused. ``max_nonfinite=None`` leaves inf/NaN to a loss scaler.

    Each layer starts at its recipe in the policy (``Policy.fp8(recipes=...)``; it must be on the
    ladder) and is never demoted below it: ``floor=None``. ``floor="tensorwise"`` (an fp8 rung of
    the ladder, at or below every layer's recipe) lets the controller demote layers down to that
    rung, below their recipe, when its shadow is safe. Rungs: fp8 ``tensorwise``,
    ``rowwise``, ``rowwise_with_gw_hp``, ``mxfp8``, ``blockwise`` (a layer skips a block rung
    its features are not multiples of the blocks of), then ``compute`` (the region's dtype) and
    ``fp32`` (reached only on range trouble under fp16 compute).

    ``per_gemm=True``: the forward, input-gradient and weight-gradient GEMMs of a layer each take
    their own rung, decided from the two operands that GEMM reads (:mod:`mixprec.control._decide`);
    the layer runs the recipe composed from them. Below fp8 the ladder may start with ``mxfp4``
    and ``nvfp4``, whose casts are judged against ``fp4_max_underflow`` and
    ``fp4_demote_underflow`` (an e2m1 block flushes several percent of ordinary data); their
    underflow forecast follows the flush's own trend, not the amax (a block cast's flush does not
    change with the tensor's scale), and a demotion to an fp4 rung waits twice as many clean
    windows for each round trip in the last ``budget_steps`` (:func:`~mixprec.control._trend.demote_windows`).

    ``max_loss_cost`` (None: off): the most a layer's forward GEMM may add to the loss through
    its output error, in the loss's units (nats for a cross-entropy), estimated to second order
    from the error against a float32 GEMM and the output's gradient
    (:func:`~mixprec.control._cost.loss_cost`; one extra float32 GEMM per layer and measured step,
    the error kept until the backward) and averaged over the window's measured steps: every step
    of a layer's first window (and of the first after its forward GEMM switches), then the last
    steps of each window (at least ``shadow_steps`` and 2), as many as keep the window's mean
    :data:`~mixprec.control._cost.COST_Z` standard errors from its threshold, by the per-step
    variance measured so far (:func:`~mixprec.control._cost.cost_steps`): every step near it. Underflow statistics miss the
    layers whose error the loss is sensitive to (a language model's head: an ordinary flush,
    yet as much loss as all other layers' errors together); a forward GEMM costing more is
    promoted on a second sign (two checks in a row over the limit, its windows since its last
    switch over it together, or a window clear over it on its own steps:
    :func:`~mixprec.control._decide.too_costly`; within a window when 3 standard errors over:
    :mod:`~mixprec.control._early`), and comes down once the recipe below's forward (measured while promoted, an
    emulated GEMM per step) costs at most ``demote_loss_cost`` (None: half of
    ``max_loss_cost``) as well. The estimate is of the loss: the scale a
    :class:`mixprec.GradScaler` gave each layer's gradient (per-layer factors included) is
    divided out by itself; under another loss scaler pass ``step(loss_scale=...)``.

    ``max_backward_cost`` (None: off; needs ``per_gemm``): the most a backward GEMM's error may
    cost the loss per step through the update it steers (:mod:`mixprec.control._backward`),
    measured on shadow steps; where measured, it replaces the flush rule for the input- and
    weight-gradient GEMMs (promoted above it, brought down when the rung below costs at most half
    of it; a non-finite cast still promotes). It is a cost per step, paid again on every step the
    GEMM runs, where ``max_loss_cost`` is a level: ``max_loss_cost / (every * horizon)`` (the
    cost the windows the controller forecasts accumulate) compares like with like, as the demo's
    ``mixprec-fp4`` sets it. A weight gradient's noise is priced by the slope at its step's end
    (the next step's gradient along the update), not its own batch's gain (docs/controller.md).
    ``normalized_updates`` (default True: Adam, AdamW, Lion, Adafactor and their kin): the
    optimizer sets each step's scale itself, so the part of a backward GEMM's error along the
    gradient, which only rescales it, costs nothing; the part across it is costed against the
    rescaled gradient (a result pointing against the gradient is costed whole:
    :func:`~mixprec.control._backward.step_error`). False (SGD, with or without momentum): the
    whole error is costed against the step taken.

    ``late_start`` (None: off): from that step on (the late phase of training, where NVIDIA's
    NVFP4 recipe switches to higher precision), the loss-cost limits (``max_loss_cost``,
    ``demote_loss_cost``, ``max_backward_cost``) are ``late_factor`` times theirs, so the GEMMs
    whose measured cost matters at the tighter limit are promoted, and no other.

    ``reference`` (``"auto"``, ``"bfloat16"``, ``"float32"``; with a loss-cost limit): the
    operands of the GEMMs the loss costs take their errors against, accumulated in float32
    (:mod:`mixprec.control._reference`); ``"auto"``, bfloat16 for a layer computing in bfloat16
    where the device multiplies it natively (CUDA from sm80, a CPU with AVX512-BF16 or AMX), else
    float32. A cast's error lies an order of magnitude or more over bfloat16's rounding, and a
    float32 GEMM beside an NVFP4 step on a GPU would cost more than the step; ``"float32"``
    measures the same costs on every machine.

    ``cost_row_share`` (in (0, 1], default 1: every row; below 1 with ``max_loss_cost``): the
    share of a forward GEMM's output rows (tokens) its loss cost measures on a step, evenly
    spaced from a first row that moves each step, so every row is measured equally often
    (:func:`~mixprec.control._cost.sampled_rows`); the sums are scaled up to the whole output's,
    an estimate without bias whose extra noise the plan's per-step variance takes in (it
    measures more steps where it needs them). The reference GEMM, the rung below's and the
    errors' passes cost that share of a measured step's; the estimate's variance grows by
    about ``1 + rho * (1 / share - 1)`` (``rho``: the rows' part of its step-to-step variance,
    0.05-0.94 on the demo's models), whatever the batch. With ``max_backward_cost`` the
    backward GEMMs' costs take the same rows where a term is per row (the input gradient's
    reference, the Fisher projections, the end slope), all of them for the weight gradient's
    reference (a sum over rows).

    ``cost_scope`` (``"gemm"``, the default, or ``"model"``; with a loss-cost limit): what the
    loss-cost limits bound. ``"gemm"``: each GEMM's cost on its own, so the model's total grows
    with its GEMM count. ``"model"``: the whole model's, shared out by FLOPs: each forward GEMM's
    limit is ``max_loss_cost`` (and ``demote_loss_cost``) times its layer's share of the controlled
    layers' ``in_features * out_features`` (every GEMM of a layer does that many multiply-adds per
    row), each backward GEMM's half that share of ``max_backward_cost``; so the forward GEMMs'
    limits sum to ``max_loss_cost``, the backward ones' to ``max_backward_cost``, and a GEMM stays
    low while its cost per FLOP is under the model's (the rule that keeps the most FLOPs low for a
    total cost). The shares are taken at each check over the layers every rank has seen, the same
    on every rank.

    Raises ValueError on a setting out of range, a ladder not in the order of :data:`RUNGS`, or a
    ``floor`` not an fp8 rung of it; warns when fp4 limits are set for a ladder without fp4 rungs.

    Example:
        >>> ControllerSettings(max_loss_cost=0.01).demote_cost
        0.005
    """

    max_underflow: float = 0.05
    max_nonfinite: float | None = 0.0
    max_range: float = 0.25
    demote_underflow: float = 0.01
    demote_range: float = 0.03125
    every: int = 10
    horizon: int = 3
    ema: float = 0.5
    trend_windows: int = 3
    demote_windows: int = 3
    min_dwell: int = 30
    max_switches: int = 8
    budget_steps: int = 1000
    sample: int = 4096
    shadow_steps: int = 2
    ladder: tuple[str, ...] = ("tensorwise", "rowwise", "compute", "fp32")
    floor: str | None = None
    per_gemm: bool = False
    fp4_max_underflow: float = 0.15
    fp4_demote_underflow: float = 0.12
    max_loss_cost: float | None = None
    demote_loss_cost: float | None = None
    max_backward_cost: float | None = None
    normalized_updates: bool = True
    late_start: int | None = None
    late_factor: float = 0.1
    reference: str = "auto"
    cost_row_share: float = 1.0
    cost_scope: str = "gemm"

    def __post_init__(self) -> None:
        if self.max_nonfinite is not None:
            check_number("Controller", "max_nonfinite", self.max_nonfinite, 0, math.inf, "a count, or None")
        for name, what in (("max_underflow", "a fraction"), ("demote_underflow", "a fraction"),
                           ("max_range", "a fraction of 65504"), ("demote_range", "a fraction of 65504"),
                           ("fp4_max_underflow", "a fraction"), ("fp4_demote_underflow", "a fraction")):
            check_number("Controller", name, getattr(self, name), 0, 1, what)
        check_number("Controller", "ema", self.ema, 0, 1, "the weight of the newest window", low_open=True)
        for name, low, high in (("every", 1, None), ("horizon", 1, MAX_HORIZON), ("trend_windows", 1, None),
                                ("demote_windows", 1, None), ("min_dwell", 0, None), ("max_switches", 1, None),
                                ("budget_steps", 1, None), ("sample", 1, None), ("shadow_steps", 1, None)):
            check_int("Controller", name, getattr(self, name), low, high)
        if (self.demote_underflow > self.max_underflow or self.demote_range > self.max_range
                or self.fp4_demote_underflow > self.fp4_max_underflow):
            raise ValueError("Controller: demote_underflow, demote_range and fp4_demote_underflow must not exceed "
                             "max_underflow, max_range and fp4_max_underflow (the lower threshold of the hysteresis)")
        ladder = tuple(self.ladder) if isinstance(self.ladder, (list, tuple)) else None
        order = [RUNGS.index(r) for r in ladder] if ladder and all(r in RUNGS for r in ladder) else None
        if order is None or order != sorted(set(order)) or "compute" not in ladder or ladder[0] not in LOW_RUNGS:
            raise ValueError(f"Controller.ladder must be fp4 and fp8 recipes then 'compute' (then optionally "
                             f"'fp32'), each once, in the order of {RUNGS}, got {self.ladder!r}")
        missing = [r for r in ladder if r in LOW_RUNGS and r not in RECIPE_NAMES]
        if missing:
            raise ValueError(f"Controller.ladder: no recipe {missing} in this mixprec (recipes: {RECIPE_NAMES})")
        object.__setattr__(self, "ladder", ladder)
        if self.floor is not None and self.floor not in [r for r in ladder if r in LOW_RUNGS]:
            raise ValueError(f"Controller.floor must be None (each layer's recipe) or an fp8 rung of the ladder "
                             f"{ladder}, got {self.floor!r}")
        if not isinstance(self.per_gemm, bool):
            raise ValueError(f"Controller.per_gemm must be a bool, got {self.per_gemm!r}")
        fields = type(self).__dataclass_fields__
        unused = [f"{n}={getattr(self, n)}" for n in ("fp4_max_underflow", "fp4_demote_underflow")
                  if getattr(self, n) != fields[n].default]
        if unused and not any(r in FP4_RUNGS for r in ladder):
            warnings.warn(f"fp8: Controller({', '.join(unused)}) takes no effect: the fp4 limits judge fp4 rungs, "
                          f"and the ladder {ladder} has none (start it with 'mxfp4' or 'nvfp4')", UserWarning,
                          stacklevel=4)
        for name in ("max_loss_cost", "demote_loss_cost"):
            if getattr(self, name) is not None:
                check_number("Controller", name, getattr(self, name), 0, math.inf,
                             "a loss (nats for a cross-entropy), or None")
        if self.max_backward_cost is not None:
            check_number("Controller", "max_backward_cost", self.max_backward_cost, 0, math.inf,
                         "a loss per step (nats for a cross-entropy), or None")
            if not self.per_gemm:
                raise ValueError("Controller.max_backward_cost judges the backward GEMMs on their own rungs: it needs "
                                 "per_gemm=True")
        if not isinstance(self.normalized_updates, bool):
            raise ValueError(f"Controller.normalized_updates must be True (an optimizer that normalizes its updates: "
                             f"Adam, AdamW, Lion) or False (SGD), got {self.normalized_updates!r}")
        if not self.normalized_updates and self.max_backward_cost is None:
            raise ValueError("Controller(normalized_updates=False) says how the backward GEMMs' loss cost models the "
                             "optimizer: it takes effect with max_backward_cost=... (per_gemm=True)")
        if self.late_start is not None:
            check_int("Controller", "late_start", self.late_start, 0, None)
            if self.max_loss_cost is None and self.max_backward_cost is None:
                raise ValueError("Controller.late_start tightens the loss-cost limits for the late phase: it needs "
                                 "max_loss_cost or max_backward_cost")
        check_number("Controller", "late_factor", self.late_factor, 0, 1, "the late phase's share of the cost limits",
                     low_open=True)
        if self.late_start is None and self.late_factor != type(self).__dataclass_fields__["late_factor"].default:
            raise ValueError(f"Controller(late_factor={self.late_factor}) takes effect from late_start: set late_start "
                             f"(the step the late phase begins at)")
        if self.reference not in REFERENCES:
            raise ValueError(f"Controller.reference must be one of {REFERENCES} (the loss costs' reference GEMMs), "
                             f"got {self.reference!r}")
        if self.reference != "auto" and self.max_loss_cost is None and self.max_backward_cost is None:
            raise ValueError(f"Controller.reference={self.reference!r} sets the loss costs' reference GEMMs: it takes "
                             f"effect with max_loss_cost or max_backward_cost")
        check_number("Controller", "cost_row_share", self.cost_row_share, 0, 1,
                     "the share of output rows a loss cost measures", low_open=True)
        if self.cost_row_share != 1 and self.max_loss_cost is None:
            raise ValueError(f"Controller(cost_row_share={self.cost_row_share}) samples the rows the forward GEMMs' "
                             f"loss costs measure (and the backward GEMMs' with them): it takes effect with max_loss_cost=...")
        if self.cost_scope not in COST_SCOPES:
            raise ValueError(f"Controller.cost_scope must be one of {COST_SCOPES} (what the loss-cost limits bound: each "
                             f"GEMM, or the whole model shared out by FLOPs), got {self.cost_scope!r}")
        if self.cost_scope != "gemm" and self.max_loss_cost is None and self.max_backward_cost is None:
            raise ValueError(f"Controller(cost_scope={self.cost_scope!r}) shares the loss-cost limits out among the "
                             f"GEMMs: it takes effect with max_loss_cost or max_backward_cost")
        if self.max_loss_cost is None and self.demote_loss_cost is not None:
            raise ValueError("Controller.demote_loss_cost needs max_loss_cost (the promotion threshold it is the "
                             "lower end of the hysteresis of); set both, or neither")
        if self.max_loss_cost is not None and self.demote_cost > self.max_loss_cost:
            raise ValueError(f"Controller: demote_loss_cost ({self.demote_loss_cost}) must not exceed max_loss_cost "
                             f"({self.max_loss_cost}) (the lower threshold of the hysteresis)")

    @property
    def demote_cost(self) -> float:
        """The loss cost under which a forward GEMM may come down: ``demote_loss_cost``, by
        default half of ``max_loss_cost`` (inf without ``max_loss_cost``)."""
        if self.demote_loss_cost is not None:
            return self.demote_loss_cost
        return self.max_loss_cost / 2 if self.max_loss_cost is not None else math.inf

    def late(self, steps: int) -> "ControllerSettings":
        """The settings a check at ``steps`` decides with: these, or in the late phase (``steps >=
        late_start``) these with the loss-cost limits times ``late_factor``.

        Example:
            >>> s = ControllerSettings(max_loss_cost=1e-3, late_start=100, late_factor=0.5)
            >>> s.late(99).max_loss_cost, s.late(100).max_loss_cost, s.late(100).demote_cost
            (0.001, 0.0005, 0.00025)
        """
        if self.late_start is None or steps < self.late_start:
            return self
        f = self.late_factor
        return dataclasses.replace(
            self, late_start=None, late_factor=type(self).__dataclass_fields__["late_factor"].default,
            max_loss_cost=None if self.max_loss_cost is None else self.max_loss_cost * f,
            demote_loss_cost=None if self.max_loss_cost is None else self.demote_cost * f,
            max_backward_cost=None if self.max_backward_cost is None else self.max_backward_cost * f)

    def shared(self, forward: float, backward: float) -> "ControllerSettings":
        """These settings with the loss-cost limits times a GEMM's shares of them (``forward`` of
        ``max_loss_cost`` and ``demote_loss_cost``, ``backward`` of ``max_backward_cost``), to
        decide that GEMM by (``cost_scope="model"``).

        Example:
            >>> s = ControllerSettings(max_loss_cost=1e-3, max_backward_cost=1e-4, per_gemm=True, cost_scope="model")
            >>> t = s.shared(0.25, 0.125)
            >>> t.max_loss_cost, t.demote_cost, t.max_backward_cost
            (0.00025, 0.000125, 1.25e-05)
        """
        return dataclasses.replace(
            self, max_loss_cost=None if self.max_loss_cost is None else self.max_loss_cost * forward,
            demote_loss_cost=None if self.demote_loss_cost is None else self.demote_loss_cost * forward,
            max_backward_cost=None if self.max_backward_cost is None else self.max_backward_cost * backward)

    @property
    def demote_backward(self) -> float:
        """The backward cost under which a backward GEMM may come down: half of ``max_backward_cost``."""
        return self.max_backward_cost / 2 if self.max_backward_cost is not None else math.inf


def rung_name(ladder: tuple[str, ...], rung: int, compute: torch.dtype | None) -> str:
    """What rung ``rung`` of ``ladder`` runs, as :meth:`Controller.precision` names it:
    ``"nvfp4"``, ``"fp8-rowwise"``, the compute dtype (``"bf16"``; ``"compute"`` while unknown), ``"fp32"``.

    Example:
        >>> import torch
        >>> rung_name(("tensorwise", "compute", "fp32"), 1, torch.bfloat16)
        'bf16'
    """
    name = ladder[rung]
    if name in FP4_RUNGS:
        return name
    if name in LOW_RUNGS:
        return f"fp8-{name}"
    if name == "compute":
        return short_name(compute, "compute") if compute is not None else "compute"
    return name
