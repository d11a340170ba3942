"""The Controller's stateful shell: the layers it tracks, the step count, the check and the
checkpoints, around its settings (:class:`~mixprec.control._settings.ControllerSettings`, a value)
and pure parts: forecasts (:mod:`._trend`), rungs, records and the probe (:mod:`._ladder`),
decisions (:mod:`._decide`), records as data (:mod:`._records`)."""

from __future__ import annotations

import dataclasses
import time
import warnings
import weakref
from typing import Any, Mapping

import torch
import torch.nn as nn

from mixprec._modules import named_modules
from mixprec._scaled import last_count, scaled_since
from mixprec.control._clock import CheckClock
from mixprec.control._check import Check
from mixprec.control._decide import apply_gemms, apply_layer, decide_gemms, decide_layer, peel, switch_layer
from mixprec.control._early import early_window, promote_early
from mixprec.control._estimate_gap import learn_gaps
from mixprec.control._fold import StepWrites
from mixprec.control._ladder import GEMMS, Decision, LayerRecord
from mixprec.control._owners import refuse_shared, root_of
from mixprec.control._probe import Probe
from mixprec.control._reach import ReachMap, StartsOver
from mixprec.control._records import (all_gathered, check_loss_scale, converted, converted_experts, detached_record,
                                      flop_shares, grad_scale, layer_data, load_layer, log_csv, log_data, measures_backward,
                                      metadata, parse_state_dict, qualified, seen_compute, set_measuring, start_rungs,
                                      untrack, warn_cost_blind, warn_unscaled)
from mixprec.control._settings import LOW_RUNGS, RUNGS, ControllerSettings
from mixprec.control._shell import Shell
from mixprec.control._trend import MAX_HORIZON, shadow_phase, sustained_slope
from mixprec.control._windows import stacked_windows
from mixprec.formats._like import features
from mixprec.formats._recipe import Float8Recipe
from mixprec.formats._state import layer_state

__all__ = ["Controller", "Decision", "MAX_HORIZON", "RUNGS", "qualified", "shadow_phase", "sustained_slope"]

_COMPUTE_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16)  # a check's header code (MAX): fp16 wins
_COMPUTE_CODES = {dtype: code for code, dtype in enumerate(_COMPUTE_DTYPES)}


class Controller(Shell):
    """Moves each fp8 layer up and down a ladder of formats, before its statistics fail.

    Build it from its settings (``Controller(every=10)``, or ``Controller(settings)`` with a
    :class:`~mixprec.fp8.ControllerSettings`, which says what each setting does), attach it to the
    model (``ctl.attach(model)``; ``fp8.convert(model, controller=ctl)`` does) and run the model
    under a policy with an fp8 rule (``Policy.fp8(recipe, controller=ctl.settings)`` names the
    settings it expects; the older ``Policy.fp8(recipe, controller=ctl)`` carries the object
    itself beside the policy's value). Call :meth:`step` once per optimizer step on every rank of
    its ``process_group`` (a keyword of the constructor, never a setting: ``"default"``, the world;
    a ProcessGroup; ``(DeviceMesh, dim_name)``, a pipeline stage's data-parallel ranks: ``_shell``).

    Decisions go to :attr:`log` (and :meth:`write_csv`); :meth:`precision` names a layer's
    format now; :meth:`state_dict` resumes bitwise. A layer has one record however it is
    reached (the model, or a submodule called directly: :func:`qualified` names it). It governs
    the layers of ``fp8.convert(model, controller=ctl)`` too (:meth:`track`), and compiled
    models: :func:`mixprec.fp8.linear` calls its probe (``LayerState.probe``) and traced code
    reads the rung, so a switch recompiles. Its settings are fixed: ``ctl.every`` reads them.

    Raises ValueError on a setting out of range (see :class:`~mixprec.fp8.ControllerSettings`) and, when a layer
    is first seen, a recipe not on the ladder or below the floor, or a second model's layer under a name of the
    first's (one Controller per model: :mod:`._owners`).

    Example:
        >>> ctl = Controller(every=10)
        >>> ctl.step(), ctl.steps, ctl.every
        ([], 1, 10)
    """

    SETTINGS = ControllerSettings
    CALL, DOES = "ctl.step()", "decides"

    def __init__(self, settings: ControllerSettings | None = None, **changes: Any) -> None:
        super().__init__(settings, **changes)
        self._layers: dict[str, LayerRecord] = {}
        self._names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> the name of its record
        self._steps, self._log, self._pending, self._compute = 0, [], {}, None  # (pending: loaded, not tracked yet)
        self._warned_empty = self._warned_scale = self._loss_scaled = False  # (_loss_scaled: a step got a loss scale)
        self._measuring = shadow_phase(0, self.settings.every, self.settings.shadow_steps)  # this step feeds the shadows
        self._recipes = {r: Float8Recipe.from_name(r) for r in self.settings.ladder if r in LOW_RUNGS}  # one per rung
        self._scaled_seen = last_count()  # a loss scaled before the controller existed is no step of its own
        self._clock, self._reaches, self._writes = CheckClock(), ReachMap(), StepWrites()  # (_reach: the step's GEMM output nodes)

    # ----------------------------------------------------------------- queries
    @property
    def steps(self) -> int:
        """The :meth:`step` calls counted so far."""
        return self._steps

    @property
    def log(self) -> list[Decision]:
        """Every switch so far, in order (a copy)."""
        return list(self._log)

    def precision(self, layer: str, gemm: str | None = None) -> str:
        """The format ``layer`` runs in now (``"nvfp4"``, ``"fp8-tensorwise"``, ``"bf16"``, ...); with ``gemm``
        (``"output"``, ...), that GEMM's. KeyError (naming the known layers), ValueError: an unknown layer, gemm."""
        if layer not in self._layers:
            raise KeyError(f"Controller.precision: no fp8 layer {layer!r}; it controls {sorted(self._layers)} "
                           f"(layers are known after the policy's first forward)")
        if gemm is not None and gemm not in GEMMS:
            raise ValueError(f"Controller.precision: gemm must be one of {GEMMS} or None, got {gemm!r}")
        return self._check().rung_name(self._layers[layer].rungs[GEMMS.index(gemm) if gemm else 0])

    def precisions(self) -> dict[str, str]:
        """``{layer: format}`` of every controlled layer (see :meth:`precision`)."""
        return {name: self.precision(name) for name in sorted(self._layers)}

    def write_csv(self, path: Any = None) -> str:
        """The log as CSV (:func:`~mixprec.control._records.log_csv`), written to ``path`` when given."""
        return log_csv(self._log, self.settings.per_gemm, path)

    def _check(self, decide: bool = False) -> Check:  # what a decision reads of this controller now: a value
        self._learn_compute()  # (a check's decisions: with the layers' shares of the limits, cost_scope="model")
        return Check(self.settings, self._steps, self._compute, self._recipes, flop_shares(self.settings, self._layers) if decide else {})

    # ----------------------------------------------------------------- tracking
    def govern(self, model: nn.Module, layers: Mapping[str, tuple[nn.Module, Float8Recipe]],
               compute: torch.dtype | None) -> None:
        """A forward of ``model`` under a policy this controller runs (``mixprec.fp8.internals.select_targets``):
        track its selected ``layers`` (``{name: (module, its recipe in the policy)}``, each from its recipe up),
        learn the compute dtype, start the reaches' map over (a micro-batch's forward: :mod:`._reach`) and
        warn once when training forwards go on without :meth:`step`."""
        self._reaches.clear()
        for name, (module, recipe) in layers.items():
            if not self._known(name, module):
                self._compute = compute if compute is not None else torch.get_autocast_dtype(module.weight.device.type)
                self._track(name, module, recipe, model)
        self.count_forward()

    def track(self, model: nn.Module) -> list[str]:
        """Control the layers :func:`mixprec.fp8.convert` made in ``model`` and its experts (``"moe.experts.w1[3]"``),
        each from its ``recipe`` up (``fp8.convert(model, recipe, controller=ctl)`` calls it; each forward of ``model``
        starts the reaches' map over: :class:`~mixprec.control._reach.StartsOver`); returns their qualified names.
        Raises ValueError when ``model`` has none, or a recipe is not on the ladder.

        Example:
            >>> from mixprec import fp8
            >>> m = fp8.convert(nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 16)))
            >>> Controller().track(m)
            ['1']
        """
        modules = dict(named_modules(model))  # the bare model's names (without DDP's module., ...)
        layers = {n: (m, m.recipe) for n, m in modules.items() if converted(m)} | converted_experts(modules)
        if not layers:
            raise ValueError(f"Controller.track: {type(model).__name__} has no layer converted by fp8.convert, "
                             f"nothing to control; for a model under a policy use ctl.attach(model)")
        for name, (module, recipe) in layers.items():
            if not self._known(name, module):
                self._track(name, module, recipe, model)
        StartsOver.hook(model, self._reaches)
        blind = [n for n, (m, _) in layers.items() if self._names.get(m) in self._layers
                 and self._layers[self._names[m]].cost_blind]
        if blind and self.settings.max_loss_cost is not None:
            warn_cost_blind(blind)
        return list(layers)

    def _known(self, name: str, module: nn.Module) -> bool:
        """Whether ``module`` (reached as ``name``) has a record; names it by the :func:`qualified` rule."""
        known = self._names.get(module)
        rec = self._layers.get(known) if known is not None else None
        if rec is None or rec.module() is not module:
            return False
        if qualified(known, name) != known:
            self._rename(known, name)
        return True

    def _rename(self, old: str, new: str) -> None:
        """Give the record of ``old`` (and its decisions) the name ``new`` (a loaded state of it applies now)."""
        rec = self._layers.pop(old)
        untrack(self._layers.pop(new, None))  # another module under that name: no longer reached
        self._layers[new], self._names[rec.module()] = rec, new
        self._log = [dataclasses.replace(d, layer=new) if d.layer == old else d for d in self._log]
        if new in self._pending:
            load_layer(self.settings, rec, self._pending.pop(new))
            self._apply(rec)

    def _track(self, name: str, module: nn.Module, recipe: Float8Recipe, root: nn.Module) -> None:
        start, floor, allowed = start_rungs(self.settings, name, recipe, features(module))
        old = self._layers.get(name)  # (its place in the layers' order stays: a peer's record keeps the peer's)
        refuse_shared(self, name, old and old.root(), root, lambda r: any(m is old.module() for m in r.modules()))
        rec = LayerRecord(module, layer_state(module), start, floor, allowed, self.settings.per_gemm,
                          self.settings.max_loss_cost is not None, old.order if old is not None else len(self._layers))
        self._writes.bank(rec)
        data = self._pending.pop(name, None)
        if old is not None and old.module() is None:  # decided so far as its peers' (_detached): take it over
            data = layer_data(self.settings, old)
        if data is not None:
            load_layer(self.settings, rec, data)
        untrack(old)  # another module under that name: no longer controlled
        self._probe(rec)
        rec.cost_blind = all_gathered(module)
        self._layers[name], self._names[module], rec.root = rec, name, root_of(root)
        self._apply(rec)

    def _probe(self, rec: LayerRecord) -> None:  # (and whether the coming step measures its backward GEMMs)
        rec.probe = Probe(rec, self.settings, self._measuring, self._clock, self._reaches)
        rec.backward_now = measures_backward(self._steps, self._measuring, self.settings)
        rec.at_step(self._steps, self.settings.cost_row_share < 1)  # (a layer first reached now, or after a resume)

    def _apply(self, rec: LayerRecord) -> None:
        """Route the layer for its rungs (``_decide.apply_layer``/``apply_gemms``; traced code reads it: a switch recompiles)."""
        (apply_gemms if self.settings.per_gemm else apply_layer)(self._check(), rec)

    # ----------------------------------------------------------------- deciding
    def step(self, loss_scale: float | torch.Tensor | None = None) -> list[Decision]:
        """Count one optimizer step and, every ``every`` steps, decide; returns the new decisions.

        Call it once per optimizer step on every rank, after backward (with gradient
        accumulation: once per optimizer step). A check step reads every layer's windows (one
        all-reduce MAX when ``torch.distributed`` is initialized, one host sync); other steps
        only fold, under ``max_loss_cost``, the step's loss-cost sums into the device window, but
        in a window that measures the forward GEMMs' cost on every step (the first, one after a
        forward switched) read it from its 3rd step on: one far over is promoted early (``_early``).
        The loss cost divides out the scale each layer's gradient carried, as a
        :class:`mixprec.GradScaler` that scaled a loss since the last step says it (its loss
        scale times the per-layer factors above the layer: :mod:`mixprec._scaled`).
        ``loss_scale``: what the loss was multiplied by, for another scaler (``torch.amp``'s
        ``scaler.get_scale()`` before ``scaler.update()``, or its scale tensor: no sync), or in
        place of a GradScaler's loss scale (its factors still apply); None: the GradScaler's,
        else 1. Warns once when it tracks no layer yet, and once, under ``max_loss_cost`` and
        fp16 compute, when no step got a scale.

        Raises ValueError for a ``loss_scale`` that is not a positive number or a tensor.

        Example:
            >>> Controller(every=2).step()
            []
        """
        self._clock.entered()
        new = self._step(loss_scale)
        self._clock.left()
        return new

    def stats(self) -> dict[str, Any]:  # what its checks cost so far (host seconds: CheckClock)
        return self._clock.stats()

    def _step(self, loss_scale: float | torch.Tensor | None) -> list[Decision]:
        check_loss_scale(loss_scale)
        self._scaled_seen = self._scaled_seen if (scaled := scaled_since(self._scaled_seen)) is None else scaled.count
        self._loss_scaled = self._loss_scaled or loss_scale is not None or scaled is not None
        if self.settings.max_loss_cost is not None or self.settings.max_backward_cost is not None:
            self._writes.end_steps(self._layers.values(), [grad_scale(rec, loss_scale, scaled) for rec in self._layers.values()])
        self._steps, self._stepped = self._steps + 1, True
        self._reaches.clear()
        self._learn_compute()
        if not self._layers and not self._warned_empty and not self._distributed():
            self._warned_empty = True
            warnings.warn("fp8: Controller.step() tracks no fp8 layer, so it decides nothing: attach it to the model "
                          "(ctl.attach(model)) and run a forward under a policy with an fp8 rule first", stacklevel=2)
        new: list[Decision] = []
        if self._steps % self.settings.every == 0:
            start = time.perf_counter()
            new = self._decide_all()
            self._clock.checked(time.perf_counter() - start, len(self._layers), self.settings.every)
        elif self.settings.max_loss_cost is not None and early_window(self._steps, self.settings.every, self._log):
            new = self._decide_all(early=True)
        self._set_measuring(shadow_phase(self._steps, self.settings.every, self.settings.shadow_steps))
        return new

    def _decide_all(self, early: bool = False) -> list[Decision]:
        # every rank: the same collectives, whichever layers its forwards have shown it (_collective)
        names, missing, code = self._agree_on_layers(list(self._layers), lambda: {  # (what a peer decides with)
            n: metadata(self.settings, r) for n, r in self._layers.items()}, _COMPUTE_CODES.get(self._compute, 0))
        if self._compute is None and code:
            self._compute = _COMPUTE_DTYPES[code]  # a rank without a forward yet: its peers' compute dtype
        for name, meta in missing.items():
            self._layers[name] = self._detached(name, meta)
        recs = [self._layers[n] for n in names]
        if early:  # a step of a window that promotes a forward GEMM far over max_loss_cost early (_early)
            self._log.extend(new := promote_early(self._check(decide=True), names, recs, self._all_reduce_max))
            return new
        if not names:
            return []
        if (self.settings.max_loss_cost is not None and self._compute is torch.float16 and not self._loss_scaled
                and not self._warned_scale):
            self._warned_scale = True
            warn_unscaled()
        rows = self._all_reduce_max(stacked_windows(recs)).tolist()  # the one sync
        (rows, backs), new, check = peel(names, rows, {n: r.order for n, r in self._layers.items()}, self.settings), [], self._check(decide=True)
        for name, rec, row in zip(names, recs, rows):
            rec.reset()
            row, cost = rec.split(row, check.for_layer(name).settings)
            if self.settings.per_gemm:
                new.extend(decide_gemms(check, name, rec, row, cost, backs[name]))
                continue
            decided = decide_layer(check, name, rec, row, cost)
            if decided is not None:
                switch_layer(check, rec, decided[1])
                new.append(decided[0])
        self._log.extend(learn_gaps(check, self._layers, new))
        return new

    def _set_measuring(self, measuring: bool) -> None:
        """Whether the coming step feeds the shadows and measures the loss costs (:func:`~mixprec.control._records.set_measuring`)."""
        set_measuring(self._layers.values(), measuring, measuring != self._measuring, self._steps, self.settings)
        self._measuring = measuring

    def _learn_compute(self) -> None:  # the compute dtype, when no policy said it: the one its probes saw
        self._compute = self._compute or seen_compute(self._layers.values())

    # ----------------------------------------------------------------- checkpoints
    def __getstate__(self) -> dict[str, Any]:
        """Pickling and deepcopy: the settings and :meth:`state_dict`; each layer retaken when reached (or ``track``)."""
        return {"config": self.config(), "state": self.state_dict()}

    def __setstate__(self, state: Mapping[str, Any]) -> None:
        self.__dict__.update(Controller.from_config(state["config"]).__dict__)
        self.load_state_dict(state["state"])

    def __deepcopy__(self, memo: dict) -> Controller:  # (a copied record would hold no probe; the group: shared)
        memo[id(self)] = new = Controller(self.settings, process_group=self._process_group)
        new.load_state_dict(self.state_dict())
        return new

    def state_dict(self) -> dict[str, Any]:
        """Everything a bitwise resume needs, as plain data: the step count, the log, and per layer its rung,
        trends, counters, open windows (this rank's) and fp4 call count. One host sync per layer (the windows)."""
        layers = {n: dict(d) for n, d in self._pending.items()}
        for name, rec in self._layers.items():
            layers[name] = layer_data(self.settings, rec)
        return {"steps": self._steps, "log": log_data(self._log), "layers": dict(sorted(layers.items()))}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the step count, the log and every layer's rung, trend and windows (layers tracked
        later get theirs when first reached). Raises ValueError for anything but :meth:`state_dict`'s dict."""
        steps, log, layers = parse_state_dict(self.settings, state_dict)
        self._steps, self._log, self._stepped = steps, log, steps > 0
        self._set_measuring(shadow_phase(steps, self.settings.every, self.settings.shadow_steps))
        self._pending = {}
        for name, data in layers.items():
            if (rec := self._layers.get(name)) is None:
                self._pending[name] = data
                continue
            load_layer(self.settings, rec, data)
            self._apply(rec)

    def _detached(self, name: str, meta: Mapping[str, Any]) -> LayerRecord:
        """The record (:func:`detached_record`) of a layer a peer ran and this rank not yet (taken at its forward)."""
        rec = detached_record(self.settings, meta, self._pending.pop(name, meta))
        self._probe(rec)
        self._apply(rec)
        return rec

