"""The fp8 controller: per-layer statistics and their trend, a ladder of formats, decisions at
check steps (promote before a statistic crosses its limit, demote once the lower format is safe)."""

from __future__ import annotations

import csv
import dataclasses
import io
import math
import os
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import torch.nn as nn

from mixprec.fp8._blocks import amax_to_scale
from mixprec.fp8._collective import agree_on_layers, all_reduce_max, distributed
from mixprec.fp8._guard import _check_int, _check_number, count_unstepped_forward, deepcopy_attributes
from mixprec.fp8._layers import Float8Conv1D, Float8Linear, eligible
from mixprec.fp8._quant import STAT_NAMES, cast_to_fp8
from mixprec.fp8._recipe import Float8Recipe
from mixprec.fp8._state import (GRAD_OUTPUT, INPUT, OPERANDS, WEIGHT, LayerState, clear_window, layer_state, new_window,
                                 record_cast, window_stats)

__all__ = ["Controller", "Decision", "RUNGS"]

#: the rungs a ladder may hold, lowest precision first: fp8 recipes (the block-scaled ones in the
#: order of the audit's cost model), the compute dtype, fp32.
RUNGS = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8", "blockwise", "compute", "fp32")
_FP8_RUNGS = RUNGS[:5]
_FP16_MAX = float(torch.finfo(torch.float16).max)
_NCOL = len(STAT_NAMES)
_UNDERFLOW, _NONFINITE = STAT_NAMES.index("underflow"), STAT_NAMES.index("nonfinite")
_RANGE = ("input", "output")  # the range row: the layer's input and output amax, in its own dtype
_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
_COMPUTE_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16)  # a check's header code (MAX): fp16 wins
_COMPUTE_CODES = {dtype: code for code, dtype in enumerate(_COMPUTE_DTYPES)}


@dataclass(frozen=True)
class Decision:
    """One switch of one layer: at ``step`` (the :meth:`Controller.step` count), ``layer`` went
    from ``from_`` to ``to`` (``action``: ``"promote"`` up the ladder, ``"demote"`` down) because
    ``operand``'s ``statistic`` was ``value`` (against ``threshold``); ``reason`` says it in words.

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


@dataclass
class _Trend:
    """One statistic's last window value (log2 of an amax, or a fraction), the EMA of its
    per-step slope, and the per-step slopes of the last windows (``recent``, newest last)."""

    last: float | None = None
    slope: float = 0.0
    recent: tuple[float, ...] = ()

    def update(self, value: float, steps: int, weight: float, keep: int) -> None:
        if not math.isfinite(value):
            return  # no data in the window (an amax of 0), or non-finite: the nonfinite limit judges
        if self.last is not None:
            step_slope = (value - self.last) / steps
            self.slope = weight * step_slope + (1 - weight) * self.slope
            self.recent = (*self.recent, step_slope)[-keep:]
        self.last = value

    def rise(self, steps: int, windows: int) -> float:
        """How much the statistic is forecast to rise over ``steps``: see :func:`sustained_slope`."""
        return sustained_slope(self.slope, self.recent, windows) * steps


def sustained_slope(ema: float, recent: tuple[float, ...], windows: int) -> float:
    """The per-step slope a forecast may extrapolate: the EMA slope ``ema``, clamped to the
    slowest of the last ``windows`` per-window slopes ``recent``; 0 unless the statistic rose in
    each of them (a trend seen in fewer windows, a noisy one, or a falling one forecasts nothing).

    Example:
        >>> sustained_slope(0.2, (0.1, 0.3, 0.25), 3), sustained_slope(0.2, (0.5, -0.1, 0.4), 3)
        (0.1, 0.0)
        >>> sustained_slope(0.2, (0.3,), 3)  # too few windows since warm-up
        0.0
    """
    if len(recent) < windows:
        return 0.0
    return max(0.0, min(ema, *recent[-windows:]))


def shadow_phase(step: int, every: int, shadow_steps: int) -> bool:
    """Whether the step after ``step`` :meth:`Controller.step` calls is one of the last
    ``shadow_steps`` of its window of ``every`` (the steps a promoted layer's shadow measures).

    Example:
        >>> [shadow_phase(s, 5, 2) for s in range(6)]
        [False, False, False, True, True, False]
    """
    return every - 1 - step % every < shadow_steps


def qualified(known: str, seen: str) -> str:
    """The name a layer's record keeps when the layer recorded as ``known`` is reached as
    ``seen`` (its name under the module called): ``seen`` when it qualifies ``known`` (the model
    called after one of its submodules), else ``known`` (a submodule called directly).

    Example:
        >>> qualified("attn.qkv", "blocks.0.attn.qkv"), qualified("blocks.0.attn.qkv", "attn.qkv")
        ('blocks.0.attn.qkv', 'blocks.0.attn.qkv')
    """
    return seen if known and seen.endswith("." + known) else known


def _grow(value: float, exponent: float) -> float:
    """``value * 2 ** exponent``: inf beyond float64's range (not OverflowError), 0 for a value of 0."""
    if value == 0:
        return 0.0
    return value * 2.0 ** exponent if exponent < 1024 else math.copysign(math.inf, value)


def _log2(amax: float) -> float:
    return math.log2(amax) if amax > 0 else -math.inf


def _ratio(value: float, limit: float) -> float:
    return value / limit if limit > 0 else 0.0


class _Layer:
    """The controller's record of one layer: its rung, its device windows, its trend."""

    def __init__(self, module: nn.Module | None, state: LayerState, rung: int, floor: int,
                 allowed: tuple[bool, ...]) -> None:
        # None: a layer this rank has not run yet (Controller._detached)
        self.module = weakref.ref(module) if module is not None else _no_module
        self.state = state
        self.rung = rung
        self.floor = floor  # the lowest rung it may be demoted to
        self.allowed = allowed  # per rung of the ladder: whether the layer can run it (block multiples)
        # the rung below's casts measured on a sample (promoted layers): a window, as LayerState's
        self.shadow = new_window(state.device)
        self.range = torch.zeros(len(_RANGE), device=state.device)  # worst input/output amax
        # log2 amax per operand and range entry; underflow of the layer's casts and of the shadow's
        self.trends = {key: _Trend() for key in (*OPERANDS, *(f"range_{r}" for r in _RANGE),
                                                 *(f"underflow_{op}" for op in OPERANDS),
                                                 *(f"shadow_{op}" for op in OPERANDS))}
        self.clean = 0  # consecutive windows in which the rung below was safe
        self.switches: list[int] = []  # steps of its switches
        self.below: Float8Recipe | None = None  # the fp8 rung below, while it may go there: its shadow's casts
        self.probe: Any = None  # its _Probe (also in state.probe)

    def windows(self) -> torch.Tensor:
        return torch.cat([self.state.stats.flatten(), window_stats(self.shadow).flatten(), self.range])

    def reset(self) -> None:
        self.state.reset()
        clear_window(self.shadow)
        self.range.zero_()


def _no_module() -> None:
    return None


class _Probe:
    """What :func:`mixprec.fp8.linear` calls after a controlled layer's GEMM (``LayerState.probe``),
    in eager mode and traced alike: the range (fp16 inputs) and, on the last steps of each window,
    the shadow of a promoted layer. A copy or a pickle of the model (``copy.deepcopy``) drops it:
    the copy runs its rung without measurements."""

    def __init__(self, controller: Controller, rec: _Layer) -> None:
        self.controller, self.rec = controller, rec
        self.fp32 = False  # the fp32 rung: fp8.linear's fallback runs the GEMM in float32

    def __deepcopy__(self, memo: dict) -> None:
        return None

    def __reduce__(self) -> tuple:
        return type(None), ()

    def __call__(self, x: torch.Tensor, weight: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
        """Measure ``x`` (the GEMM's input, in its dtype), ``weight`` (``(out, in)``; None: not
        measured) and ``out``; returns ``out``."""
        ctl, rec = self.controller, self.rec
        if ctl._compute is None:  # fp8.convert's layers: the dtype the layer computes in
            ctl._compute = x.dtype
        if x.dtype is torch.float16:
            _range(rec.range, x, out)
        below = rec.below
        if below is None or not ctl._measuring:
            return out
        _shadow(rec.shadow, INPUT, x, below.input, below.pow2_scales, ctl.sample)
        if weight is not None:
            _shadow(rec.shadow, WEIGHT, weight.detach(), below.weight, below.pow2_scales, ctl.sample)
        if out.requires_grad:
            buf, sample = rec.shadow, ctl.sample
            out.register_hook(lambda g: _shadow(buf, GRAD_OUTPUT, g, below.grad_output, below.pow2_scales, sample))
        return out


def _range(buf: torch.Tensor, x: torch.Tensor, out: torch.Tensor) -> None:
    """``buf`` (the range row) = max(``buf``, [amax of x, amax of out]). No host sync."""
    amax = torch.stack([x.detach().abs().amax().float(), out.detach().abs().amax().float()])
    torch.maximum(buf, amax, out=buf)


#: the largest ``Controller.horizon`` (windows ahead): a forecast further out is no forecast.
MAX_HORIZON = 100


@dataclass
class Controller:
    """Moves each fp8 layer up and down a ladder of formats, before its statistics fail.

    Attach it with ``Policy.fp8(recipe, controller=ctl)`` and call :meth:`step` once per
    optimizer step on every rank. Per layer and operand (input, weight, grad_output) the
    statistics of :class:`~mixprec.fp8.LayerState` accumulate on the device (worst value over the
    window, no host sync); every ``every`` steps the controller reads the windows of all layers
    (one all-reduce MAX, one host sync), updates each operand's trend (an EMA, weight ``ema``, of
    the per-step slope of log2 amax, and of the underflow fraction) and forecasts ``horizon``
    windows ahead: the underflow of a current scale grows with the amax, so the larger of
    ``underflow * 2**(amax slope * ahead)`` and ``underflow + underflow slope * ahead``. A slope
    counts only once the statistic rose in each of the last ``trend_windows`` windows, and at
    most at the slowest of their rates (:func:`sustained_slope`): no forecast from the first
    windows after warm-up, nor from a noisy amax.

    *Promote* (one rung up ``ladder``): a forecast underflow above ``max_underflow``; straight
    to the compute dtype on a nonfinite count above ``max_nonfinite``; straight to fp32, under
    fp16 compute, when the forecast input or output amax passes ``max_range * 65504``.
    *Demote* (one rung down): a promoted layer measures, on a sample of ``sample`` elements per
    operand and on the last ``shadow_steps`` steps of each window, what the rung below's casts
    would do (its shadow); after ``demote_windows``
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
    ``fp32`` (reached only on range trouble under fp16 compute). Decisions go to :attr:`log` (and
    :meth:`write_csv`); :meth:`precision` names a layer's format now; :meth:`state_dict` resumes
    bitwise. A layer has one record however it is reached (the model, or a submodule called
    directly: :func:`qualified` names it). It governs the layers of ``fp8.convert(model,
    controller=ctl)`` too (:meth:`track`), and compiled models: :func:`mixprec.fp8.linear` calls
    its probe (``LayerState.probe``) and traced code reads the rung, so a switch recompiles.

    Raises ValueError on a setting out of range, a ladder not in the order of :data:`RUNGS`, or a
    ``floor`` not an fp8 rung of it (and, when a layer is first seen, a recipe below the floor).

    Example:
        >>> ctl = Controller(every=10)
        >>> ctl.step(), ctl.steps
        ([], 1)
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
    _layers: dict[str, _Layer] = field(default_factory=dict, init=False, repr=False, compare=False)
    _names: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary, init=False, repr=False,
                                              compare=False)  # module -> the name of its record
    _steps: int = field(default=0, init=False, repr=False, compare=False)
    _log: list[Decision] = field(default_factory=list, init=False, repr=False, compare=False)
    _pending: dict[str, dict[str, Any]] = field(default_factory=dict, init=False, repr=False, compare=False)
    _compute: torch.dtype | None = field(default=None, init=False, repr=False, compare=False)
    _stepped: bool = field(default=False, init=False, repr=False, compare=False)
    _forwards: int = field(default=0, init=False, repr=False, compare=False)
    _warned_empty: bool = field(default=False, init=False, repr=False, compare=False)
    _measuring: bool = field(default=False, init=False, repr=False, compare=False)  # this step feeds the shadows
    _recipes: dict[str, Float8Recipe] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.max_nonfinite is not None:
            _check_number("Controller", "max_nonfinite", self.max_nonfinite, 0, math.inf, "a count, or None")
        for name, what in (("max_underflow", "a fraction"), ("demote_underflow", "a fraction"),
                           ("max_range", "a fraction of 65504"), ("demote_range", "a fraction of 65504")):
            _check_number("Controller", name, getattr(self, name), 0, 1, what)
        _check_number("Controller", "ema", self.ema, 0, 1, "the weight of the newest window", low_open=True)
        for name, low, high in (("every", 1, None), ("horizon", 1, MAX_HORIZON), ("trend_windows", 1, None),
                                ("demote_windows", 1, None), ("min_dwell", 0, None), ("max_switches", 1, None),
                                ("budget_steps", 1, None), ("sample", 1, None), ("shadow_steps", 1, None)):
            _check_int("Controller", name, getattr(self, name), low, high)
        if self.demote_underflow > self.max_underflow or self.demote_range > self.max_range:
            raise ValueError("Controller: demote_underflow and demote_range must not exceed max_underflow and "
                             "max_range (the lower threshold of the hysteresis)")
        ladder = tuple(self.ladder) if isinstance(self.ladder, (list, tuple)) else None
        order = [RUNGS.index(r) for r in ladder] if ladder and all(r in RUNGS for r in ladder) else None
        if order is None or order != sorted(set(order)) or "compute" not in ladder or ladder[0] not in _FP8_RUNGS:
            raise ValueError(f"Controller.ladder must be fp8 recipes then 'compute' (then optionally 'fp32'), "
                             f"each once, in the order of {RUNGS}, got {self.ladder!r}")
        self.ladder = ladder
        self._recipes = {r: Float8Recipe.from_name(r) for r in ladder if r in _FP8_RUNGS}  # one object per rung
        self._measuring = shadow_phase(0, self.every, self.shadow_steps)
        if self.floor is not None and self.floor not in [r for r in ladder if r in _FP8_RUNGS]:
            raise ValueError(f"Controller.floor must be None (each layer's recipe) or an fp8 rung of the ladder "
                             f"{ladder}, got {self.floor!r}")

    # ----------------------------------------------------------------- queries
    @property
    def steps(self) -> int:
        """The :meth:`step` calls counted so far."""
        return self._steps

    @property
    def log(self) -> list[Decision]:
        """Every switch so far, in order (a copy)."""
        return list(self._log)

    def precision(self, layer: str) -> str:
        """The format ``layer`` (its qualified name) runs in now: ``"fp8-tensorwise"``,
        ``"fp8-rowwise"``, ``"bf16"``/``"fp16"`` (the compute dtype) or ``"fp32"``.

        Raises KeyError naming the layers it knows when it does not know ``layer``.
        """
        if layer not in self._layers:
            raise KeyError(f"Controller.precision: no fp8 layer {layer!r}; it controls {sorted(self._layers)} "
                           f"(layers are known after the policy's first forward)")
        return self._rung_name(self._layers[layer].rung)

    def precisions(self) -> dict[str, str]:
        """``{layer: format}`` of every controlled layer (see :meth:`precision`)."""
        return {name: self._rung_name(rec.rung) for name, rec in sorted(self._layers.items())}

    def config(self) -> dict[str, Any]:
        """The settings (the constructor's keyword arguments), as plain JSON data."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        out["ladder"] = list(self.ladder)
        return out

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Controller:
        """A fresh controller with the settings of :meth:`config`.

        Raises ValueError naming unknown keys.
        """
        known = {f.name for f in dataclasses.fields(cls) if f.init}
        if set(config) - known:
            raise ValueError(f"unknown Controller setting(s) {sorted(map(str, set(config) - known))}; "
                             f"settings: {sorted(known)}")
        values = dict(config)
        if "ladder" in values and isinstance(values["ladder"], list):
            values["ladder"] = tuple(values["ladder"])
        return cls(**values)

    def write_csv(self, path: str | os.PathLike[str] | None = None) -> str:
        """The log as CSV (columns: step, layer, operand, action, from, to, statistic, value,
        threshold, reason); written to ``path`` when given. Returns the text."""
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(["step", "layer", "operand", "action", "from", "to", "statistic", "value", "threshold",
                         "reason"])
        for d in self._log:
            writer.writerow([d.step, d.layer, d.operand, d.action, d.from_, d.to, d.statistic, repr(d.value),
                             repr(d.threshold), d.reason])
        text = buf.getvalue()
        if path is not None:
            with open(path, "w", encoding="utf-8", newline="") as f:
                f.write(text)
        return text

    # ----------------------------------------------------------------- tracking
    def _rung_name(self, rung: int) -> str:
        name = self.ladder[rung]
        if name in _FP8_RUNGS:
            return f"fp8-{name}"
        if name == "compute":
            return _DTYPE_NAMES.get(self._compute, "compute") if self._compute is not None else "compute"
        return name

    def _policy_forward(self, layers: Mapping[str, nn.Module], policy: Any) -> None:
        """A forward of a model under a policy with this controller: track its selected layers,
        learn the compute dtype, warn once when training forwards go on without :meth:`step`."""
        for name, module in layers.items():
            if not self._known(name, module):
                dev = module.weight.device.type
                self._compute = policy.compute if policy.compute is not None else torch.get_autocast_dtype(dev)
                self._track(name, module, policy.fp8_rule.recipe_for(name))  # its ladder starts there
        count_unstepped_forward(self, "decides", "ctl.step()")

    def track(self, model: nn.Module) -> list[str]:
        """Control the layers :func:`mixprec.fp8.convert` made in ``model`` (``Float8Linear``,
        ``Float8Conv1D``), each from its ``recipe`` up; ``fp8.convert(model, recipe,
        controller=ctl)`` calls it. Returns their qualified names. (A policy's layers are
        tracked at its first forward.) The compute dtype is the one the first layer computes in.

        Raises ValueError when ``model`` has no converted layer, or a recipe is not on the ladder.

        Example:
            >>> from mixprec import fp8
            >>> m = fp8.convert(nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 16)))
            >>> Controller().track(m)
            ['1']
        """
        names = [n for n, m in model.named_modules() if isinstance(m, (Float8Linear, Float8Conv1D))]
        if not names:
            raise ValueError(f"Controller.track: {type(model).__name__} has no layer converted by fp8.convert, "
                             f"nothing to control; for a model under a policy use Policy.fp8(controller=ctl)")
        modules = dict(model.named_modules())
        for name in names:
            if not self._known(name, modules[name]):
                self._track(name, modules[name], modules[name].recipe)
        return names

    def _known(self, name: str, module: nn.Module) -> bool:
        """Whether ``module`` (reached as ``name``) has a record already; names it by the
        :func:`qualified` rule."""
        known = self._names.get(module)
        rec = self._layers.get(known) if known is not None else None
        if rec is None or rec.module() is not module:
            return False
        if qualified(known, name) != known:
            self._rename(known, name)
        return True

    def _rename(self, old: str, new: str) -> None:
        """Give the record of ``old`` (and its decisions) the name ``new``; a loaded state of ``new``
        not applied yet applies now."""
        rec = self._layers.pop(old)
        self._untrack(self._layers.pop(new, None))  # another module under that name: no longer reached
        self._layers[new] = rec
        self._names[rec.module()] = new
        self._log = [dataclasses.replace(d, layer=new) if d.layer == old else d for d in self._log]
        if new in self._pending:
            self._load_layer(rec, self._pending.pop(new))
            self._apply(rec)

    def _track(self, name: str, module: nn.Module, recipe: Float8Recipe) -> None:
        if recipe.name not in _FP8_RUNGS or Float8Recipe.from_name(recipe.name) != recipe:
            raise ValueError(f"Controller: layer {name!r}'s fp8 recipe {recipe.name!r} is not a named recipe "
                             f"({', '.join(_FP8_RUNGS)}): a controller's rungs are named recipes; give the layer "
                             f"one of them, or leave the controller out")
        if recipe.name not in self.ladder:
            ladder = tuple(r for r in RUNGS if r in self.ladder or r == recipe.name)
            raise ValueError(f"Controller: layer {name!r}'s fp8 recipe {recipe.name!r} is not on the controller's "
                             f"ladder {self.ladder} (a layer starts on its ladder at its recipe): pass "
                             f"Controller(ladder={ladder!r})")
        start = self.ladder.index(recipe.name)
        floor = start if self.floor is None else self.ladder.index(self.floor)
        if floor > start:
            raise ValueError(f"Controller: layer {name!r}'s fp8 recipe {recipe.name!r} is below the controller's "
                             f"floor {self.floor!r}; pass floor=None (each layer's recipe) or a rung at or below "
                             f"{recipe.name!r}")
        allowed = tuple(r not in _FP8_RUNGS or i == start or eligible(module, name, self._recipes[r])[0]
                        for i, r in enumerate(self.ladder))
        rec = _Layer(module, layer_state(module), start, floor, allowed)
        old = self._layers.get(name)
        data = self._pending.pop(name, None)
        if old is not None and old.module() is None:  # decided so far as its peers' (_detached): take it over
            data = self._layer_data(old)
        if data is not None:
            self._load_layer(rec, data)
        self._untrack(old)  # another module under that name: no longer controlled
        rec.probe = _Probe(self, rec)
        self._layers[name] = rec
        self._names[module] = name
        self._apply(rec)

    @staticmethod
    def _up(rec: _Layer) -> int:
        """The rung a promotion goes to: the next one up the layer can run (a block rung needs
        features that are multiples of its blocks)."""
        return next(i for i in range(rec.rung + 1, len(rec.allowed)) if rec.allowed[i])

    @staticmethod
    def _down(rec: _Layer) -> int | None:
        """The rung a demotion goes to (the next one down it can run, not below its floor), or None."""
        return next((i for i in range(rec.rung - 1, rec.floor - 1, -1) if rec.allowed[i]), None)

    @staticmethod
    def _untrack(rec: _Layer | None) -> None:
        if rec is not None:
            rec.state.probe = None

    def _apply(self, rec: _Layer) -> None:
        """Set the layer's state for its rung (an fp8 recipe, or the fallback flag, in float32 on
        the fp32 rung) and the casts of its shadow. (Traced code reads these: a switch recompiles.)"""
        name = self.ladder[rec.rung]
        rec.state.fallback = name not in _FP8_RUNGS
        rec.state.recipe = self._recipes.get(name)
        rec.state.probe, rec.probe.fp32 = rec.probe, name == "fp32"
        down = self._down(rec)
        rec.below = self._recipes.get(self.ladder[down]) if down is not None else None

    # ----------------------------------------------------------------- deciding
    def step(self) -> list[Decision]:
        """Count one optimizer step and, every ``every`` steps, decide; returns the new decisions.

        Call it once per optimizer step on every rank, after backward (with gradient
        accumulation: once per optimizer step). A check step reads the windows of every layer
        (one all-reduce MAX when ``torch.distributed`` is initialized, one host sync); the other
        steps touch nothing. Warns once when it tracks no layer yet.

        Example:
            >>> Controller(every=2).step()
            []
        """
        self._steps += 1
        self._stepped = True
        self._measuring = shadow_phase(self._steps, self.every, self.shadow_steps)
        if not self._layers and not self._warned_empty and not distributed():
            self._warned_empty = True
            warnings.warn("fp8: Controller.step() tracks no fp8 layer, so it decides nothing: give it to "
                          "Policy.fp8(controller=ctl) and run a forward under that policy first",
                          UserWarning, stacklevel=2)
        if self._steps % self.every != 0:
            return []
        # every rank: the same collectives, whichever layers its forwards have shown it (_collective)
        names, missing, code = agree_on_layers(list(self._layers), self._metadata, _COMPUTE_CODES.get(self._compute, 0))
        if self._compute is None and code:
            self._compute = _COMPUTE_DTYPES[code]  # a rank without a forward yet: its peers' compute dtype
        for name, meta in missing.items():
            self._layers[name] = self._detached(name, meta)
        if not names:
            return []
        recs = [self._layers[n] for n in names]
        rows = all_reduce_max(torch.stack([r.windows() for r in recs])).tolist()  # the one sync
        new = []
        for name, rec, row in zip(names, recs, rows):
            rec.reset()
            decided = self._decide(name, rec, row)
            if decided is not None:
                decision, rec.rung = decided
                rec.clean = 0
                for op in OPERANDS:  # the casts these measure change with the rung
                    rec.trends[f"underflow_{op}"] = _Trend()
                    rec.trends[f"shadow_{op}"] = _Trend()
                rec.switches.append(self._steps)
                self._apply(rec)
                self._log.append(decision)
                new.append(decision)
        return new

    def _decide(self, name: str, rec: _Layer, row: list[float]) -> tuple[Decision, int] | None:
        """The layer's switch after this window (the decision and the new rung), or None."""
        own = [row[i * _NCOL:(i + 1) * _NCOL] for i in range(len(OPERANDS))]
        off = len(OPERANDS) * _NCOL
        shadow = [row[off + i * _NCOL:off + (i + 1) * _NCOL] for i in range(len(OPERANDS))]
        ranges = row[2 * off:]
        ladder = self.ladder
        on_fp8 = ladder[rec.rung] in _FP8_RUNGS
        down = self._down(rec)
        has_shadow = down is not None and ladder[down] in _FP8_RUNGS
        fit, windows = (self.every, self.ema, self.trend_windows), self.trend_windows
        measured = own if on_fp8 else (shadow if has_shadow else None)
        for op, stats in zip(OPERANDS, measured or []):
            rec.trends[op].update(_log2(stats[0]), *fit)
        for op, own_stats, shadow_stats in zip(OPERANDS, own, shadow):
            if on_fp8:
                rec.trends[f"underflow_{op}"].update(own_stats[_UNDERFLOW], *fit)
            if has_shadow:
                rec.trends[f"shadow_{op}"].update(shadow_stats[_UNDERFLOW], *fit)
        fp16 = self._compute is torch.float16
        if fp16:
            for r, amax in zip(_RANGE, ranges):
                rec.trends[f"range_{r}"].update(_log2(amax), *fit)
        ahead = self.horizon * self.every

        def underflow(op: str, u: float, key: str) -> float:
            # a current scale flushes a share about proportional to the amax; or the share's own trend
            return min(1.0, max(_grow(u, rec.trends[op].rise(ahead, windows)),
                                u + rec.trends[key].rise(ahead, windows)))

        def amax_forecast(r: str, amax: float) -> float:
            return _grow(amax, rec.trends[f"range_{r}"].rise(ahead, windows))

        here = self._rung_name(rec.rung)

        def decision(op: str, action: str, to: int, stat: str, value: float, limit: float, side: str
                     ) -> tuple[Decision, int]:
            reason = f"{op} {stat.replace('_', ' ')} {value:.4g} {side} {limit:g}"
            return Decision(self._steps, name, op, action, here, self._rung_name(to), stat, value, float(limit),
                            reason), to

        # promote: the worst trouble first
        compute, top = ladder.index("compute"), len(ladder) - 1
        if on_fp8 and self.max_nonfinite is not None:
            for op, stats in zip(OPERANDS, own):
                if stats[_NONFINITE] > self.max_nonfinite:
                    return decision(op, "promote", compute, "nonfinite", stats[_NONFINITE], self.max_nonfinite, ">")
        if fp16 and ladder[top] == "fp32" and rec.rung < top:
            for r, amax in zip(_RANGE, ranges):
                forecast = amax_forecast(r, amax)
                if forecast > self.max_range * _FP16_MAX:
                    return decision(r, "promote", top, "amax_forecast", forecast, self.max_range * _FP16_MAX, ">")
        if on_fp8:
            for op, stats in zip(OPERANDS, own):
                forecast = underflow(op, stats[_UNDERFLOW], f"underflow_{op}")
                if forecast > self.max_underflow:
                    return decision(op, "promote", self._up(rec), "underflow_forecast", forecast,
                                    self.max_underflow, ">")
        if down is None:
            return None
        # demote: the rung below, judged by the shadow (fp8 below) or the range (compute below fp32)
        worst = ("input", "underflow_forecast", 0.0, self.demote_underflow)  # the closest to its limit
        # a window without a measurement (no forward in its last steps) is not evidence of safety
        safe = not (has_shadow and not (shadow[0][0] > 0 and shadow[1][0] > 0)) and not (fp16 and not ranges[1] > 0)
        if has_shadow:
            for op, stats in zip(OPERANDS, shadow):
                forecast = underflow(op, stats[_UNDERFLOW], f"shadow_{op}")
                nonfinite = self.max_nonfinite is not None and stats[_NONFINITE] > self.max_nonfinite
                if nonfinite or not forecast <= self.demote_underflow:
                    safe = False
                elif _ratio(forecast, self.demote_underflow) > _ratio(worst[2], worst[3]):
                    worst = (op, "underflow_forecast", forecast, self.demote_underflow)
        if fp16:
            for r, amax in zip(_RANGE, ranges):
                forecast = amax_forecast(r, amax)
                limit = self.demote_range * _FP16_MAX
                if not forecast <= limit:
                    safe = False
                elif ladder[rec.rung] == "fp32" and _ratio(forecast, limit) > _ratio(worst[2], worst[3]):
                    worst = (r, "amax_forecast", forecast, limit)
        rec.clean = rec.clean + 1 if safe else 0
        recent = [s for s in rec.switches if s > self._steps - self.budget_steps]
        last = rec.switches[-1] if rec.switches else -math.inf
        if (rec.clean >= self.demote_windows and self._steps - last >= self.min_dwell
                and len(recent) < self.max_switches):
            op, stat, value, limit = worst
            return decision(op, "demote", down, stat, value, limit, "<=")
        return None

    # ----------------------------------------------------------------- checkpoints
    def __getstate__(self) -> dict[str, Any]:
        """Pickling (``pickle``, ``torch.save`` of the object): the settings and :meth:`state_dict`.
        The unpickled controller controls each layer again from the state it had when the layer
        is next reached: at the policy's next forward, or ``ctl.track(model)`` for converted
        layers (whose pickled or copied model runs its rungs without the probe until then).
        Reads the device windows (one host sync per layer)."""
        return {"config": self.config(), "state": self.state_dict()}

    def __deepcopy__(self, memo: dict) -> Controller:
        return deepcopy_attributes(self, memo)

    def __setstate__(self, state: Mapping[str, Any]) -> None:
        fresh = Controller.from_config(state["config"])
        self.__dict__.update(fresh.__dict__)
        self.load_state_dict(state["state"])

    def state_dict(self) -> dict[str, Any]:
        """Everything a bitwise resume needs, as plain data: the step count, the log, and per
        layer its rung, trend, hysteresis counters and open windows (the rank's own, before the
        all-reduce: save it on every rank).

        .. warning:: reads the device windows: one host sync per layer.
        """
        layers = {n: dict(d) for n, d in self._pending.items()}
        for name, rec in self._layers.items():
            layers[name] = self._layer_data(rec)
        return {"steps": self._steps, "log": [dataclasses.asdict(d) for d in self._log],
                "layers": dict(sorted(layers.items()))}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the step count, the log and every layer's rung, trend and windows (layers
        tracked later get theirs at the policy's first forward).

        Raises ValueError for anything but the dict of :meth:`state_dict`.
        """
        try:
            steps = state_dict["steps"]
            log = [Decision(**d) for d in state_dict["log"]]
            layers = {str(n): dict(d) for n, d in state_dict["layers"].items()}
            if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
                raise TypeError(steps)
            for d in layers.values():
                if d["rung"] not in self.ladder:
                    raise ValueError(f"rung {d['rung']!r} is not on the ladder {self.ladder}")
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise ValueError(f"Controller.load_state_dict expects the dict of Controller.state_dict() (steps, log, "
                             f"layers) for the same ladder: {exc}") from exc
        self._steps, self._log, self._stepped = steps, log, steps > 0
        self._measuring = shadow_phase(steps, self.every, self.shadow_steps)
        self._pending = {}
        for name, data in layers.items():
            rec = self._layers.get(name)
            if rec is None:
                self._pending[name] = data
            else:
                self._load_layer(rec, data)
                self._apply(rec)

    def _layer_data(self, rec: _Layer, windows: bool = True) -> dict[str, Any]:
        """A layer's entry of :meth:`state_dict` (without its open windows: ``windows=False``)."""
        data = {"rung": self.ladder[rec.rung], "clean": rec.clean, "switches": list(rec.switches),
                "trends": {key: [t.last, t.slope, list(t.recent)] for key, t in rec.trends.items()}}
        if windows:
            data.update(state=rec.state.window.tolist(), shadow=rec.shadow.tolist(), range=rec.range.tolist())
        return data

    def _metadata(self) -> dict[str, dict[str, Any]]:
        """Per known layer, what a rank that has not run it needs to decide as this one does
        (:meth:`_detached`): its record without the windows, its floor and allowed rungs."""
        return {name: {**self._layer_data(rec, windows=False), "floor": rec.floor, "allowed": rec.allowed}
                for name, rec in self._layers.items()}

    def _detached(self, name: str, meta: Mapping[str, Any]) -> _Layer:
        """The record of a layer this rank has not run yet but a peer has (``meta``: the peer's
        :meth:`_metadata`): the peer's rung, trends and counters (or this rank's loaded state of
        it), empty windows. The layer's module takes it over at its first forward here (:meth:`_track`)."""
        rec = _Layer(None, LayerState(), self.ladder.index(meta["rung"]), int(meta["floor"]),
                     tuple(meta["allowed"]))
        self._load_layer(rec, self._pending.pop(name, meta))
        rec.probe = _Probe(self, rec)
        self._apply(rec)
        return rec

    def _load_layer(self, rec: _Layer, data: Mapping[str, Any]) -> None:
        rung = self.ladder.index(data["rung"])
        if not rec.allowed[rung]:
            raise ValueError(f"Controller.load_state_dict: a layer at rung {data['rung']!r}, whose blocks its "
                             f"features are not multiples of")
        if rung < rec.floor:
            raise ValueError(f"Controller.load_state_dict: a layer at rung {data['rung']!r}, below its floor "
                             f"{self.ladder[rec.floor]!r} (its recipe, or Controller.floor)")
        rec.rung = rung
        rec.clean, rec.switches = int(data["clean"]), [int(s) for s in data["switches"]]
        for key, (last, slope, recent) in data["trends"].items():
            rec.trends[key] = _Trend(last, slope, tuple(recent))
        for target, key in ((rec.state.window, "state"), (rec.shadow, "shadow"), (rec.range, "range")):
            if key not in data:  # a peer's record (_detached): the windows stay empty
                continue
            t = torch.tensor(data[key], dtype=torch.float32)
            if t.shape != target.shape:
                raise ValueError(f"Controller.load_state_dict: a window of shape {tuple(t.shape)}, expected "
                                 f"{tuple(target.shape)}")
            target.copy_(t)


def _shadow(window: torch.Tensor, operand: int, x: torch.Tensor, cast: Any, pow2: bool, sample: int) -> None:
    """Accumulate into row ``operand`` of ``window`` (a shadow window) the statistics ``cast`` would
    have on ``x``, measured on about ``sample`` elements: evenly strided rows (a row cast is exact
    on them), scaled by the whole tensor's amax for a tensor cast. No host sync."""
    x2 = x.detach().reshape(-1, x.shape[-1]) if x.dim() else x.detach().reshape(1, 1)
    if x2.numel() == 0:
        return
    # (a 2-D block, 128x128, is measured on the whole tensor: a sample of rows would cut its blocks)
    two_d = cast.block is not None and cast.block[0] > 1
    stride = 1 if two_d else max(1, x2.numel() // sample // max(x2.shape[1], 1))
    rows = x2[::stride]
    if cast.granularity == "tensor":
        amax = torch.max(torch.abs(x2))
        fmax = torch.finfo(cast.dtype).max
        q = (rows.to(torch.float32) * amax_to_scale(amax, cast.dtype, pow2)).clamp_(min=-fmax, max=fmax).to(cast.dtype)
    else:
        q, _, _ = cast_to_fp8(rows, cast, -1, pow2)
        amax = torch.max(torch.abs(x2)) if stride > 1 else torch.max(torch.abs(rows))
    record_cast(window, operand, rows, q, amax)
