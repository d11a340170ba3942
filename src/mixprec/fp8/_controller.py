"""The fp8 controller: per-layer (or per-GEMM) statistics and their trend, a ladder of formats
from fp4 to fp32, decisions at check steps (promote before a statistic crosses its limit, demote
once the lower format is safe). The forecast rules live in :mod:`mixprec.fp8._trend`, the rungs,
the per-layer record and the probe in :mod:`mixprec.fp8._ladder`, the decisions (per layer, per
GEMM) in :mod:`mixprec.fp8._decide`; this module holds the settings, the tracking of layers, the
check and the checkpoints."""

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

from mixprec._dtype_names import short_name
from mixprec._modules import clean_name, named_modules
from mixprec.fp8._collective import agree_on_layers, all_reduce_max, distributed
from mixprec.fp8._fsdp import Float8AllGatherWeight
from mixprec.fp8._decide import apply_gemms, decide_gemms, decide_layer, layer_down, layer_up
from mixprec.fp8._guard import _check_int, _check_number, count_unstepped_forward, deepcopy_attributes
from mixprec.fp8._ladder import FP4_RUNGS, GEMMS, LOW_RUNGS, RUNGS, Decision, LayerRecord, Probe
from mixprec.fp8._like import features
from mixprec.fp8._recipe import RECIPE_NAMES, Float8Recipe
from mixprec.fp8._state import OPERANDS, LayerState, layer_state
from mixprec.fp8._trend import MAX_HORIZON, Trend, shadow_phase, sustained_slope
from mixprec._scaled import Scaled, last_count, scaled_since

__all__ = ["Controller", "Decision", "MAX_HORIZON", "RUNGS", "qualified", "shadow_phase", "sustained_slope"]

_COMPUTE_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16)  # a check's header code (MAX): fp16 wins
_COMPUTE_CODES = {dtype: code for code, dtype in enumerate(_COMPUTE_DTYPES)}


def qualified(known: str, seen: str) -> str:
    """The name a layer's record keeps when the layer recorded as ``known`` is reached as
    ``seen`` (its name under the module called): ``seen`` when it qualifies ``known`` (the model
    called after one of its submodules), else ``known`` (a submodule called directly).

    Example:
        >>> qualified("attn.qkv", "blocks.0.attn.qkv"), qualified("blocks.0.attn.qkv", "attn.qkv")
        ('blocks.0.attn.qkv', 'blocks.0.attn.qkv')
    """
    return seen if known and seen.endswith("." + known) else known


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

    ``per_gemm=True``: the forward, input-gradient and weight-gradient GEMMs of a layer each take
    their own rung, decided from the two operands that GEMM reads (:mod:`mixprec.fp8._decide`);
    the layer runs the recipe composed from them. Below fp8 the ladder may start with ``mxfp4``
    and ``nvfp4``, whose casts are judged against ``fp4_max_underflow`` and
    ``fp4_demote_underflow`` (an e2m1 block flushes several percent of ordinary data); their
    underflow forecast follows the flush's own trend, not the amax (a block cast's flush does not
    change with the tensor's scale), and a demotion to an fp4 rung waits twice as many clean
    windows for each round trip in the last ``budget_steps`` (:func:`~mixprec.fp8._trend.demote_windows`).

    ``max_loss_cost`` (None: off): the most a layer's forward GEMM may add to the loss through
    its output error, in the loss's units (nats for a cross-entropy), estimated on every training
    step to second order from the error against a float32 GEMM and the output's gradient
    (:func:`~mixprec.fp8._ladder.loss_cost`; one extra float32 GEMM per layer and step, the
    error kept until the backward) and averaged over the window. Underflow statistics miss the
    layers whose error the loss is sensitive to (a language model's head: an ordinary flush,
    yet as much loss as all other layers' errors together); a forward GEMM costing more is
    promoted, and comes down once the recipe below's forward (measured while promoted, an
    emulated GEMM per step) costs at most ``demote_loss_cost`` (None: half of
    ``max_loss_cost``) as well. The estimate is of the loss: the scale a
    :class:`mixprec.GradScaler` gave each layer's gradient (per-layer factors included) is
    divided out by itself; under another loss scaler pass ``step(loss_scale=...)``.

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
    per_gemm: bool = False
    fp4_max_underflow: float = 0.15
    fp4_demote_underflow: float = 0.12
    max_loss_cost: float | None = None
    demote_loss_cost: float | None = None
    _layers: dict[str, LayerRecord] = field(default_factory=dict, init=False, repr=False, compare=False)
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
    _loss_scaled: bool = field(default=False, init=False, repr=False, compare=False)  # a step got loss_scale
    _warned_scale: bool = field(default=False, init=False, repr=False, compare=False)
    _scaled_seen: int = field(default=0, init=False, repr=False, compare=False)  # the last GradScaler note taken

    def __post_init__(self) -> None:
        if self.max_nonfinite is not None:
            _check_number("Controller", "max_nonfinite", self.max_nonfinite, 0, math.inf, "a count, or None")
        for name, what in (("max_underflow", "a fraction"), ("demote_underflow", "a fraction"),
                           ("max_range", "a fraction of 65504"), ("demote_range", "a fraction of 65504"),
                           ("fp4_max_underflow", "a fraction"), ("fp4_demote_underflow", "a fraction")):
            _check_number("Controller", name, getattr(self, name), 0, 1, what)
        _check_number("Controller", "ema", self.ema, 0, 1, "the weight of the newest window", low_open=True)
        for name, low, high in (("every", 1, None), ("horizon", 1, MAX_HORIZON), ("trend_windows", 1, None),
                                ("demote_windows", 1, None), ("min_dwell", 0, None), ("max_switches", 1, None),
                                ("budget_steps", 1, None), ("sample", 1, None), ("shadow_steps", 1, None)):
            _check_int("Controller", name, getattr(self, name), low, high)
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
        self.ladder = ladder
        self._recipes = {r: Float8Recipe.from_name(r) for r in ladder if r in LOW_RUNGS}  # one object per rung
        self._measuring = shadow_phase(0, self.every, self.shadow_steps)
        self._scaled_seen = last_count()  # a loss scaled before the controller existed is no step of its own
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
                          stacklevel=3)
        for name in ("max_loss_cost", "demote_loss_cost"):
            if getattr(self, name) is not None:
                _check_number("Controller", name, getattr(self, name), 0, math.inf, "a loss (nats for a cross-entropy), or None")
        if self.max_loss_cost is None and self.demote_loss_cost is not None:
            raise ValueError("Controller.demote_loss_cost needs max_loss_cost (the promotion threshold it is the "
                             "lower end of the hysteresis of); set both, or neither")
        if self.max_loss_cost is not None and self.demote_cost > self.max_loss_cost:
            raise ValueError(f"Controller: demote_loss_cost ({self.demote_loss_cost}) must not exceed max_loss_cost "
                             f"({self.max_loss_cost}) (the lower threshold of the hysteresis)")

    # ----------------------------------------------------------------- queries
    @property
    def demote_cost(self) -> float:
        """The loss cost under which a forward GEMM may come down: ``demote_loss_cost``, by
        default half of ``max_loss_cost``."""
        if self.demote_loss_cost is not None:
            return self.demote_loss_cost
        return self.max_loss_cost / 2 if self.max_loss_cost is not None else math.inf

    @property
    def steps(self) -> int:
        """The :meth:`step` calls counted so far."""
        return self._steps

    @property
    def log(self) -> list[Decision]:
        """Every switch so far, in order (a copy)."""
        return list(self._log)

    def precision(self, layer: str, gemm: str | None = None) -> str:
        """The format ``layer`` (its qualified name) runs in now: ``"fp8-tensorwise"``,
        ``"fp8-rowwise"``, ``"nvfp4"``, ``"bf16"``/``"fp16"`` (the compute dtype) or ``"fp32"``;
        with ``gemm`` (``"output"``, ``"grad_input"``, ``"grad_weight"``), that GEMM's (the
        layer's is its forward GEMM's; they differ only under ``per_gemm=True``).

        Raises KeyError naming the layers it knows when it does not know ``layer``, ValueError
        for an unknown ``gemm``.
        """
        if layer not in self._layers:
            raise KeyError(f"Controller.precision: no fp8 layer {layer!r}; it controls {sorted(self._layers)} "
                           f"(layers are known after the policy's first forward)")
        if gemm is not None and gemm not in GEMMS:
            raise ValueError(f"Controller.precision: gemm must be one of {GEMMS} or None, got {gemm!r}")
        return self._rung_name(self._layers[layer].rungs[GEMMS.index(gemm) if gemm else 0])

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
        threshold, reason, and ``gemm`` under ``per_gemm=True``: empty for the whole layer);
        written to ``path`` when given. Returns the text."""
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(["step", "layer", "operand", "action", "from", "to", "statistic", "value", "threshold",
                         "reason"] + ["gemm"] * self.per_gemm)
        for d in self._log:
            writer.writerow([d.step, d.layer, d.operand, d.action, d.from_, d.to, d.statistic, repr(d.value),
                             repr(d.threshold), d.reason] + [d.gemm or ""] * self.per_gemm)
        text = buf.getvalue()
        if path is not None:
            with open(path, "w", encoding="utf-8", newline="") as f:
                f.write(text)
        return text

    # ----------------------------------------------------------------- tracking

    def _rung_name(self, rung: int) -> str:
        self._learn_compute()
        name = self.ladder[rung]
        if name in FP4_RUNGS:
            return name
        if name in LOW_RUNGS:
            return f"fp8-{name}"
        if name == "compute":
            return short_name(self._compute, "compute") if self._compute is not None else "compute"
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
        modules = dict(named_modules(model))  # the bare model's names (without DDP's module., ...)
        names = [n for n, m in modules.items() if _converted(m)]
        if not names:
            raise ValueError(f"Controller.track: {type(model).__name__} has no layer converted by fp8.convert, "
                             f"nothing to control; for a model under a policy use Policy.fp8(controller=ctl)")
        for name in names:
            if not self._known(name, modules[name]):
                self._track(name, modules[name], modules[name].recipe)
        blind = [n for n in names if self._names.get(modules[n]) in self._layers
                 and self._layers[self._names[modules[n]]].cost_blind]
        if blind and self.max_loss_cost is not None:
            warnings.warn(f"fp8: Controller(max_loss_cost=...) cannot measure the loss cost of {blind}: FSDP2 "
                          f"all-gathers their weights in fp8 (fp8.convert(..., fsdp_fp8_all_gather=True)), so no "
                          f"rank holds the high-precision weight the cost's reference GEMM needs; their rungs follow "
                          f"their casts' statistics alone. Convert them without fsdp_fp8_all_gather to measure it",
                          UserWarning, stacklevel=2)
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
        named = [r for r in LOW_RUNGS if r in RECIPE_NAMES]
        if recipe.name not in named or Float8Recipe.from_name(recipe.name) != recipe:
            raise ValueError(f"Controller: layer {name!r}'s fp8 recipe {recipe.name!r} is not a named recipe "
                             f"({', '.join(named)}): a controller's rungs are named recipes; give the layer "
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
        # the layer runs its recipe; another rung needs features that are multiples of its blocks
        allowed = tuple(r not in LOW_RUNGS or i == start or all(f % self._recipes[r].multiple == 0
                                                                  for f in features(module))
                        for i, r in enumerate(self.ladder))
        rec = LayerRecord(module, layer_state(module), start, floor, allowed, self.per_gemm,
                          self.max_loss_cost is not None)
        old = self._layers.get(name)
        data = self._pending.pop(name, None)
        if old is not None and old.module() is None:  # decided so far as its peers' (_detached): take it over
            data = self._layer_data(old)
        if data is not None:
            self._load_layer(rec, data)
        self._untrack(old)  # another module under that name: no longer controlled
        rec.probe = Probe(self, rec)
        rec.measuring.fill_(self._measuring)
        rec.cost_blind = _all_gathered(module)
        self._layers[name] = rec
        self._names[module] = name
        self._apply(rec)

    #: the rung a promotion / a demotion of the whole layer goes to (:mod:`mixprec.fp8._decide`)
    _up = staticmethod(layer_up)
    _down = staticmethod(layer_down)

    @staticmethod
    def _untrack(rec: LayerRecord | None) -> None:
        if rec is not None:
            rec.state.probe = None

    def _apply(self, rec: LayerRecord) -> None:
        """Set the layer's state for its rung (an fp8 recipe, or the fallback flag, in float32 on
        the fp32 rung) and the casts of its shadow. (Traced code reads these: a switch recompiles.)"""
        if self.per_gemm:
            apply_gemms(self, rec)
            return
        name = self.ladder[rec.rung]
        rec.state.fallback = name not in LOW_RUNGS
        rec.state.recipe = self._recipes.get(name)
        rec.state.probe, rec.probe.fp32 = rec.probe, name == "fp32"
        down = layer_down(rec)
        rec.below = self._recipes.get(self.ladder[down]) if down is not None else None
        rec.forward_low = name in LOW_RUNGS
        rec.forward_below = rec.below if rec.cost is not None else None

    # ----------------------------------------------------------------- deciding
    def step(self, loss_scale: float | torch.Tensor | None = None) -> list[Decision]:
        """Count one optimizer step and, every ``every`` steps, decide; returns the new decisions.

        Call it once per optimizer step on every rank, after backward (with gradient
        accumulation: once per optimizer step). A check step reads the windows of every layer
        (one all-reduce MAX when ``torch.distributed`` is initialized, one host sync); the other
        steps touch nothing but, under ``max_loss_cost``, fold the step's loss-cost sums into
        the window on the device. The loss cost divides out the scale each layer's gradient
        carried: a :class:`mixprec.GradScaler` that scaled a loss since the last step says it
        (per layer: its loss scale times the per-layer factors above the layer, as its
        ``scale()`` applied them; :mod:`mixprec._scaled`), whatever the compute dtype.
        ``loss_scale``: what the loss was multiplied by, for another scaler (``torch.amp``'s:
        ``scaler.get_scale()`` before ``scaler.update()``, or its scale tensor, no sync), or
        to override a GradScaler's loss scale (its per-layer factors still apply); None: the
        GradScaler's, else 1. Warns once when it tracks no layer yet, and once, under
        ``max_loss_cost`` and fp16 compute, when no step got a scale (neither ``loss_scale``
        nor a GradScaler's).

        Raises ValueError for a ``loss_scale`` that is not a positive number or a tensor.

        Example:
            >>> Controller(every=2).step()
            []
        """
        if loss_scale is not None:
            if isinstance(loss_scale, bool) or not (isinstance(loss_scale, torch.Tensor) or (
                    isinstance(loss_scale, (int, float)) and 0 < loss_scale < math.inf)):
                raise ValueError(f"Controller.step: loss_scale must be a positive finite number or a tensor (the "
                                 f"scale the loss was multiplied by), or None, got {loss_scale!r}")
            self._loss_scaled = True
        scaled = scaled_since(self._scaled_seen)
        if scaled is not None:
            self._scaled_seen = scaled.count
            self._loss_scaled = True
        if self.max_loss_cost is not None:
            for rec in self._layers.values():
                rec.end_step(_grad_scale(rec, loss_scale, scaled))
        self._steps += 1
        self._stepped = True
        self._set_measuring(shadow_phase(self._steps, self.every, self.shadow_steps))
        self._learn_compute()
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
        if (self.max_loss_cost is not None and self._compute is torch.float16 and not self._loss_scaled
                and not self._warned_scale):
            self._warned_scale = True
            warnings.warn("fp8: Controller(max_loss_cost=...) under fp16 compute got no loss_scale: the loss cost is "
                          "measured on the gradients backward computed, which a loss scaler multiplies (a "
                          "mixprec.GradScaler says its scale itself; another does not): pass "
                          "ctl.step(loss_scale=scaler.get_scale()) before scaler.update() (or loss_scale=1.0 "
                          "without a scaler)", UserWarning, stacklevel=2)
        recs = [self._layers[n] for n in names]
        rows = all_reduce_max(torch.stack([r.windows() for r in recs])).tolist()  # the one sync
        new = []
        for name, rec, row in zip(names, recs, rows):
            rec.reset()
            row, cost = rec.split(row)
            if self.per_gemm:
                decisions = decide_gemms(self, name, rec, row, cost)
                self._log.extend(decisions)
                new.extend(decisions)
                continue
            decided = decide_layer(self, name, rec, row, cost)
            if decided is not None:
                decision, rec.rung = decided
                rec.clean = 0
                for op in OPERANDS:  # the casts these measure change with the rung
                    rec.trends[f"underflow_{op}"] = Trend()
                    rec.trends[f"shadow_{op}"] = Trend()
                rec.switches.append(self._steps)
                self._apply(rec)
                self._log.append(decision)
                new.append(decision)
        return new

    def _set_measuring(self, measuring: bool) -> None:
        """Whether the coming steps feed the shadows: the flag eager code reads, and each record's
        device copy that compiled code reads (written when it changes: no host sync)."""
        if measuring != self._measuring:
            for rec in self._layers.values():
                rec.measuring.fill_(measuring)
        self._measuring = measuring

    def _learn_compute(self) -> None:
        """The compute dtype, when only compiled forwards saw it (their probes keep it: traced
        code reads no controller state)."""
        if self._compute is None:
            seen = [r.probe.dtype for r in self._layers.values() if r.probe is not None and r.probe.dtype is not None]
            if seen:
                self._compute = seen[0]

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
        layer its rung, trend, hysteresis counters, open windows (the rank's own, before the
        all-reduce: save it on every rank) and fp4 call count (``rounding_step``, which seeds
        stochastic rounding).

        .. warning:: reads the device windows: one host sync per layer.
        """
        layers = {n: dict(d) for n, d in self._pending.items()}
        for name, rec in self._layers.items():
            layers[name] = self._layer_data(rec)
        log = [{k: v for k, v in dataclasses.asdict(d).items() if k != "gemm" or v is not None} for d in self._log]
        return {"steps": self._steps, "log": log, "layers": dict(sorted(layers.items()))}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the step count, the log and every layer's rung, trend and windows (layers
        tracked later get theirs at the policy's first forward).

        Raises ValueError for anything but the dict of :meth:`state_dict`.
        """
        try:
            steps = state_dict["steps"]
            log = [Decision(**{**d, "layer": clean_name(d["layer"])}) for d in state_dict["log"]]
            layers = {clean_name(str(n)): dict(d) for n, d in state_dict["layers"].items()}
            if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
                raise TypeError(steps)
            for d in layers.values():
                for rung in (d["rung"], *dict(d.get("gemms", {})).values()):
                    if rung not in self.ladder:
                        raise ValueError(f"rung {rung!r} is not on the ladder {self.ladder}")
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise ValueError(f"Controller.load_state_dict expects the dict of Controller.state_dict() (steps, log, "
                             f"layers) for the same ladder: {exc}") from exc
        self._steps, self._log, self._stepped = steps, log, steps > 0
        self._set_measuring(shadow_phase(steps, self.every, self.shadow_steps))
        self._pending = {}
        for name, data in layers.items():
            rec = self._layers.get(name)
            if rec is None:
                self._pending[name] = data
            else:
                self._load_layer(rec, data)
                self._apply(rec)

    def _layer_data(self, rec: LayerRecord, windows: bool = True) -> dict[str, Any]:
        """A layer's entry of :meth:`state_dict` (without its open windows: ``windows=False``)."""
        data = {"rung": self.ladder[max(rec.rungs)], "clean": rec.clean, "switches": list(rec.switches),
                "trends": {key: [t.last, t.slope, list(t.recent)] for key, t in rec.trends.items()}}
        if self.per_gemm:  # (a state_dict without them: the three GEMMs on "rung" together)
            data.update(gemms={g: self.ladder[r] for g, r in zip(GEMMS, rec.rungs)}, gemm_clean=list(rec.gemm_clean),
                        gemm_switches=[list(s) for s in rec.gemm_switches])
        if windows:
            data.update(state=rec.state.window.tolist(), shadow=rec.shadow.tolist(), range=rec.range.tolist(),
                        rounding_step=rec.state.rounding_step)
            if rec.gemm_windows is not None:
                data["gemm_windows"] = rec.gemm_windows.tolist()
            if rec.cost is not None:
                data["loss_cost"] = rec.cost.tolist()
        return data

    def _metadata(self) -> dict[str, dict[str, Any]]:
        """Per known layer, what a rank that has not run it needs to decide as this one does
        (:meth:`_detached`): its record without the windows, its floor and allowed rungs."""
        return {name: {**self._layer_data(rec, windows=False), "floor": rec.floor, "allowed": rec.allowed}
                for name, rec in self._layers.items()}

    def _detached(self, name: str, meta: Mapping[str, Any]) -> LayerRecord:
        """The record of a layer this rank has not run yet but a peer has (``meta``: the peer's
        :meth:`_metadata`): the peer's rung, trends and counters (or this rank's loaded state of
        it), empty windows. The layer's module takes it over at its first forward here (:meth:`_track`)."""
        rec = LayerRecord(None, LayerState(), self.ladder.index(meta["rung"]), int(meta["floor"]),
                          tuple(meta["allowed"]), self.per_gemm, self.max_loss_cost is not None)
        self._load_layer(rec, self._pending.pop(name, meta))
        rec.probe = Probe(self, rec)
        rec.measuring.fill_(self._measuring)
        self._apply(rec)
        return rec

    def _load_layer(self, rec: LayerRecord, data: Mapping[str, Any]) -> None:
        gemms = dict(data.get("gemms", {})) if self.per_gemm else {}
        names = [gemms.get(g, data["rung"]) for g in GEMMS]
        for name in names:
            rung = self.ladder.index(name)
            if not rec.allowed[rung]:
                raise ValueError(f"Controller.load_state_dict: a layer at rung {name!r}, whose blocks its "
                                 f"features are not multiples of")
            if rung < rec.floor:
                raise ValueError(f"Controller.load_state_dict: a layer at rung {name!r}, below its floor "
                                 f"{self.ladder[rec.floor]!r} (its recipe, or Controller.floor)")
        rec.rungs = [self.ladder.index(name) for name in names]
        rec.clean, rec.switches = int(data["clean"]), [int(s) for s in data["switches"]]
        if self.per_gemm:
            rec.gemm_clean = [int(c) for c in data.get("gemm_clean", [rec.clean] * len(GEMMS))]
            rec.gemm_switches = [[int(s) for s in sw] for sw in data.get("gemm_switches", [rec.switches] * len(GEMMS))]
        for key, (last, slope, recent) in data["trends"].items():
            if key in rec.trends:  # (a whole-layer record's operand trends are no GEMM's)
                rec.trends[key] = Trend(last, slope, tuple(recent))
        windows = ((rec.state.window, "state"), (rec.shadow, "shadow"), (rec.range, "range"),
                   (rec.gemm_windows, "gemm_windows"), (rec.cost, "loss_cost"))
        for target, key in windows:
            if key not in data or target is None:  # a peer's record (_detached): the windows stay empty
                continue
            t = torch.tensor(data[key], dtype=torch.float32)
            if t.shape != target.shape:
                raise ValueError(f"Controller.load_state_dict: a window of shape {tuple(t.shape)}, expected "
                                 f"{tuple(target.shape)}")
            target.copy_(t)
        if "state" in data:  # (saved before the fp4 call count was: 0, what a resumed run of that code drew from)
            rec.state.rounding_step = int(data.get("rounding_step", 0))



def _grad_scale(rec: LayerRecord, loss_scale: float | torch.Tensor | None,
                scaled: Scaled | None) -> float | torch.Tensor:
    """The scale the gradient at ``rec``'s output carried this step: a GradScaler's note
    (``scaled``: its loss scale times the per-layer factors of the layer's region, read by its
    weight), with an explicit ``loss_scale`` in place of the loss scale; else ``loss_scale``, or 1."""
    if scaled is None:
        return 1.0 if loss_scale is None else loss_scale
    module = rec.module()
    carried = scaled.of(getattr(module, "weight", None) if module is not None else None)
    if loss_scale is None:
        return carried
    return carried / scaled.regions[0] * loss_scale  # (the factors are powers of 2: exact)


def _all_gathered(module: nn.Module) -> bool:
    """Whether FSDP2 all-gathers ``module``'s weight in fp8 (``fp8.convert(...,
    fsdp_fp8_all_gather=True)``, sharded or not yet)."""
    weight = getattr(module, "weight", None)
    return isinstance(getattr(weight, "_local_tensor", weight), Float8AllGatherWeight)


def _converted(module: nn.Module) -> bool:
    """Whether ``module`` is a layer :func:`mixprec.fp8.convert` made (``Float8Linear``,
    ``Float8Conv1D``): one that holds its own fp8 recipe and layer state."""
    return isinstance(getattr(module, "recipe", None), Float8Recipe) and layer_state(module, create=False) is not None
