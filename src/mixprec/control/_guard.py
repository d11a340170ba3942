"""The fp8 guard: per-layer thresholds on the cast statistics, and the fallback decisions."""

from __future__ import annotations

import copy
import dataclasses
import math
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from mixprec._modules import clean_name, named_modules
from mixprec.control._owners import refuse_shared, root_of
from mixprec.control._settings import GuardSettings
from mixprec.control._shell import NO_STEP_FORWARDS, Shell
from mixprec.formats._grouped import grouped_states
from mixprec.formats._quant import STAT_NAMES
from mixprec.formats._state import OPERANDS, LayerState, layer_state, new_window, window_stats

__all__ = ["Guard", "Fallback", "Float8FallbackWarning", "NO_STEP_FORWARDS", "layer_states"]


class Float8FallbackWarning(UserWarning):
    """A layer left fp8 for the compute dtype (issued once per layer, by :meth:`Guard.step`)."""


@dataclass(frozen=True)
class Fallback:
    """Why a layer left fp8: ``operand`` (input, weight, grad_output or output), ``statistic``,
    its ``value`` (after the all-reduce), the ``threshold`` it crossed and the ``step``."""

    layer: str
    operand: str
    statistic: str
    value: float
    threshold: float
    step: int

    def message(self) -> str:
        side = "<" if self.statistic == "sqnr_db" else ">"
        return (f"fp8 layer {self.layer!r} falls back to the compute dtype at step {self.step}: "
                f"{self.operand} {self.statistic} = {self.value:.4g} {side} {self.threshold:g}")


def layer_states(model: torch.nn.Module) -> dict[str, LayerState]:
    """``{fqn: LayerState}`` of the modules of ``model`` that have one (see :func:`layer_state`);
    the names are those of the bare model, without DDP's, FSDP1's or torch.compile's parts. The
    experts of a converted ``GroupedExperts`` are a layer each (``f"{fqn}.w1[3]"``: :func:`grouped_states`)."""
    states = {}
    for name, mod in named_modules(model):
        if (st := layer_state(mod, create=False)) is not None:
            states[name] = st
        states.update({f"{name}.{key}" if name else key: st for key, st in grouped_states(mod).items()})
    return states


class Guard(Shell):
    """Thresholds on each fp8 layer's statistics; a layer that crosses one falls back for good.

    Call :meth:`step` once per optimizer step, on every rank (with gradient accumulation: once
    per optimizer step, not per micro-batch). Every ``every`` steps it reads the statistics
    accumulated since the last check (the worst value over the window), all-reduces them (MAX)
    over its ``process_group`` (a keyword of the constructor: ``"default"``, the world when
    ``torch.distributed`` is initialized; a ProcessGroup; ``(DeviceMesh, dim_name)``: see
    :mod:`mixprec.control._shell`) so that every rank of it takes the same decision, and
    moves each layer where ``nonfinite > max_nonfinite``, ``saturated > max_saturated``,
    ``underflow > max_underflow`` (for input, weight or grad_output; ``fp4_max_underflow`` for an
    operand the layer's recipe casts to e2m1, whose 16- or 32-element blocks flush several
    percent of ordinary data: 7-11% of a Gaussian, 13-22% of a Student-t(3)) or, when ``min_sqnr_db`` is
    set, the sampled output SQNR against the high-precision GEMM is below it, to the compute
    dtype, with a :class:`Float8FallbackWarning` naming the layer, the operand, the statistic and
    its value. ``None`` switches a threshold off; ``max_saturated`` is off by default: a current
    scale clips nothing finite, and the fraction beyond the previous step's amax moves with the
    data (it is a diagnostic of what a delayed scale would clip).

    The schedule counts :meth:`step` calls only: forwards (evaluation on one rank, an extra
    micro-batch) never trigger a check, so every rank issues the same all-reduces.
    :meth:`state_dict` holds the step count, the decisions and the open windows' statistics: a
    run resumed from it at any step decides exactly as the uninterrupted run (save it on every
    rank: the windows are the rank's own, before the all-reduce).

    .. warning:: a check step reads the device statistics: one host sync (and one all-reduce)
       per ``every`` steps; other steps cost nothing.

    Example:
        >>> guard = Guard(max_underflow=0.1, every=10)
        >>> guard.step({}), guard.steps
        ([], 1)
    """

    SETTINGS = GuardSettings
    CALL, DOES = "guard.step()", "checks the layers"

    def __init__(self, settings: GuardSettings | None = None, **changes: Any) -> None:
        super().__init__(settings, **changes)
        self._decisions: dict[str, Fallback] = {}
        self._states: Any = weakref.WeakValueDictionary()
        self._roots: dict[str, weakref.ref] = {}  # name -> the model its state was tracked in (_owners)
        self._steps = 0
        # windows of a loaded state dict for layers not tracked yet: name -> (data, output sqnr, fp4 call count)
        self._pending: dict[str, tuple[torch.Tensor, float, int | None]] = {}
        self._warned_empty = self._warned_fp4 = False

    @property
    def decisions(self) -> dict[str, Fallback]:
        """``{layer: Fallback}`` of the layers moved to the compute dtype (a copy)."""
        return dict(self._decisions)

    @property
    def steps(self) -> int:
        """The steps counted so far (:meth:`step` calls, or the last ``step`` given to :meth:`check`)."""
        return self._steps

    def track(self, states: Mapping[str, LayerState] | torch.nn.Module) -> dict[str, LayerState]:
        """Remember ``states`` (by name), set their ``fallback`` flags from the decisions, give
        them the windows of a loaded state dict, and arm SQNR sampling for the next step.

        Raises ValueError for a value that is not a LayerState, and for a second model (``states``
        a model) that brings another layer under the name of one a model it tracked still holds: one
        Guard per model (:func:`~mixprec.control._owners.refuse_shared`; a layer replaced, a model
        that replaced the old one, are taken over)."""
        root = states if isinstance(states, torch.nn.Module) else None
        states = layer_states(states) if root is not None else dict(states)
        sample = self.min_sqnr_db is not None and (self._steps + 1) % self.every == 0
        for name, st in states.items():
            if not isinstance(st, LayerState):
                raise ValueError(f"Guard: states[{name!r}] must be a LayerState, got {type(st).__name__}")
            if root is not None and (old := self._states.get(name)) is not None and old is not st:
                refuse_shared(self, name, self._roots[name]() if name in self._roots else None, root,
                              lambda r: any(s is old for s in layer_states(r).values()))
            self._states[name] = st
            if root is not None:
                self._roots[name] = root_of(root)
            if name in self._pending:
                _load_window(st, *self._pending.pop(name))
            st.route(fallback=name in self._decisions)
            st.sample_sqnr = sample and not st.fallback
        return states

    def step(self, model: Mapping[str, LayerState] | torch.nn.Module | None = None) -> list[Fallback]:
        """Count one optimizer step and, every ``every`` steps, decide; returns the new fallbacks.

        Call it once per optimizer step on every rank, after backward. ``model``: the model (or
        ``{fqn: LayerState}``, the same names on every rank); by default the layers tracked
        already (by :func:`convert` with ``guard=``, or by the policy's forwards). Without
        ``model``, while it tracks no layer, it warns once (it would never decide anything).

        Example:
            >>> Guard(every=2).step({})
            []
        """
        states = dict(self._states) if model is None else model
        if (model is None and not states and not self._warned_empty
                and not self._distributed()):  # (a lagging rank: its peers')
            self._warned_empty = True
            warnings.warn("fp8: Guard.step() tracks no fp8 layer, so it decides nothing: pass the model "
                          "(guard.step(model)), or give the guard to fp8.convert(..., guard=guard) or to "
                          "Policy.fp8(guard=guard)", UserWarning, stacklevel=2)
        return self._check(states, self._steps + 1, stacklevel=3)

    def check(self, states: Mapping[str, LayerState] | torch.nn.Module, step: int) -> list[Fallback]:
        """:meth:`step` with the step number given: decide when ``step % every == 0``; later
        :meth:`step` calls count on from ``step``. Returns the new fallbacks.

        Example:
            >>> Guard(every=10).check({}, step=20)
            []
        """
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"Guard.check: step must be an int >= 0, got {step!r}")
        return self._check(states, step, stacklevel=3)

    def _check(self, states: Mapping[str, LayerState] | torch.nn.Module, step: int,
               stacklevel: int) -> list[Fallback]:
        self._steps, self._stepped = step, True
        states = self.track(states)  # arms the sampling of step + 1
        if step % self.every != 0:
            return []
        # every rank: the same collectives, whichever layers its forwards have shown it (_collective)
        names, _, _ = self._agree_on_layers(list(states), dict)
        if not names:
            return []
        device = next((st.device for st in states.values()), torch.device("cpu"))
        rows = self._all_reduce_max(torch.stack([self._window_row(n, states.get(n), device) for n in names])).tolist()
        self._warn_unused_fp4_limit(rows)
        new = []
        for name, row in zip(names, rows):
            st = states.get(name)
            if st is not None:
                st.reset()
            pending = self._pending.pop(name, None)  # a loaded window of a layer not tracked here: counted now
            if pending is not None and pending[2]:  # (its fp4 call count waits for the layer)
                self._pending[name] = (new_window(), math.inf, pending[2])
            if name in self._decisions:
                continue
            decision = self._decide(name, row, step)
            if decision is not None:
                self._decisions[name] = decision
                if st is not None:
                    st.route(fallback=True)
                    st.sample_sqnr = False
                warnings.warn(decision.message(), Float8FallbackWarning, stacklevel=stacklevel)
                new.append(decision)
        return new

    def _warn_unused_fp4_limit(self, rows: list[list[float]]) -> None:
        """Warn once when ``fp4_max_underflow`` was set but no layer that ran (on any rank: the
        rows are all-reduced) casts an operand to e2m1: the setting would take no effect."""
        if self._warned_fp4 or self.fp4_max_underflow in (None, GuardSettings.fp4_max_underflow):
            return
        ncol, e2m1 = len(STAT_NAMES), len(OPERANDS) * len(STAT_NAMES) + 1  # (row: stats, -sqnr, e2m1 flags)
        ran = any(row[i * ncol] > 0 for row in rows for i in range(len(OPERANDS)))
        if ran and not any(flag > 0 for row in rows for flag in row[e2m1:]):
            self._warned_fp4 = True
            warnings.warn(f"fp8: Guard(fp4_max_underflow={self.fp4_max_underflow}) takes no effect: it judges "
                          f"operands cast to e2m1 (the fp4 recipes mxfp4, nvfp4), and none of the layers it "
                          f"watches casts one; their underflow is judged against max_underflow="
                          f"{self.max_underflow}", UserWarning, stacklevel=4)

    def _window_row(self, name: str, st: LayerState | None, device: torch.device) -> torch.Tensor:
        """The check's row of a layer: its window's statistics, then minus its output SQNR; for a
        layer this rank has not run, its loaded window or the neutral row (nothing seen)."""
        if st is not None:
            e2m1 = torch.tensor(getattr(st, "e2m1", (False,) * len(OPERANDS)), dtype=torch.float32)
            return torch.cat([st.stats.flatten(), -st.output_sqnr_db.reshape(1), e2m1.to(st.device)]).to(device)
        data, sqnr, _ = self._pending.get(name, (new_window(), math.inf, 0))
        return torch.cat([window_stats(data).flatten(), torch.tensor([-sqnr]), torch.zeros(len(OPERANDS))]).to(device)

    def govern(self, model: torch.nn.Module, layers: Mapping[str, Any], compute: torch.dtype | None) -> None:
        """A forward of ``model`` under a policy this guard runs: track its layers (every layer
        state in ``model``; ``layers``, the policy's selection, and ``compute`` are a Controller's
        concern), and warn once when training forwards go on without a :meth:`step`. The fp8 seam
        calls it (``mixprec.fp8.internals.select_targets``)."""
        self.track(model)
        self.count_forward()

    def _decide(self, name: str, row: list[float], step: int) -> Fallback | None:
        ncol = len(STAT_NAMES)
        sqnr, e2m1 = -row[len(OPERANDS) * ncol], row[len(OPERANDS) * ncol + 1:]  # (e2m1: on any rank)
        for i, operand in enumerate(OPERANDS):
            limits = {"nonfinite": self.max_nonfinite, "saturated": self.max_saturated,
                      "underflow": self.fp4_max_underflow if e2m1[i] else self.max_underflow}
            values = dict(zip(STAT_NAMES, row[i * ncol:(i + 1) * ncol]))
            for stat, limit in limits.items():
                if limit is not None and values[stat] > limit:
                    return Fallback(name, operand, stat, values[stat], float(limit), step)
        if self.min_sqnr_db is not None and not math.isinf(sqnr) and not sqnr >= self.min_sqnr_db:
            return Fallback(name, "output", "sqnr_db", sqnr, float(self.min_sqnr_db), step)
        return None

    def __getstate__(self) -> dict[str, Any]:
        """Pickling: the settings, :meth:`state_dict` and the tracked layer states (by reference:
        pickled with their model, the unpickled guard tracks the unpickled model's layers).
        Reads the device windows (one host sync per layer)."""
        return {"settings": self.config(), "state": self.state_dict(), "tracked": dict(self._states)}

    def __setstate__(self, state: Mapping[str, Any]) -> None:
        self.__dict__.update(Guard.from_config(state["settings"]).__dict__)
        self.load_state_dict(state["state"])
        tracked = state["tracked"]  # alive while their model is: a guard pickled alone tracks none
        self._states.update(tracked)
        for name in tracked:  # (their windows came with them: a later track() must not load the saved ones over
            self._pending.pop(name, None)  # what they record from now on)

    def __deepcopy__(self, memo: dict) -> Any:
        """Every attribute copied, the tracked layer states too (through ``memo``: copied with their
        model, the copy tracks the copied model's layers; copied alone, it tracks none)."""
        new = super().__deepcopy__(memo)
        new._states = weakref.WeakValueDictionary({n: copy.deepcopy(st, memo) for n, st in self._states.items()})
        new._roots = {}  # (the copy learns its models at their next track)
        return new

    def state_dict(self) -> dict[str, Any]:
        """Everything a bitwise resume needs, as plain data: ``{"steps": n, "decisions": {layer:
        {...}}, "windows": {layer: {"stats": [[...]], "output_sqnr_db": x, "rounding_step": n}}}``
        (the windows of the tracked layers, and of loaded ones not tracked yet; ``rounding_step``:
        the layer's fp4 call count, :attr:`LayerState.rounding_step`).

        .. warning:: reads the device statistics: one host sync per layer.
        """
        windows = {n: {"stats": d.tolist(), "output_sqnr_db": s, "rounding_step": r}
                   for n, (d, s, r) in self._pending.items()}
        for name, st in self._states.items():
            windows[name] = {"stats": st.window.tolist(), "output_sqnr_db": float(st.output_sqnr_db),
                             "rounding_step": st.rounding_step}
        return {"steps": self._steps,
                "decisions": {n: dataclasses.asdict(d) for n, d in self._decisions.items()},
                "windows": dict(sorted(windows.items()))}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the step count, the decisions and the windows; re-apply them to the tracked
        layer states (layers tracked later get theirs when :meth:`track` first sees them). A
        window saved without ``rounding_step`` (before it was saved) leaves the layer's count as
        it is: the one the model's ``state_dict`` restored (:func:`~mixprec.fp8.keep_rounding_state`),
        else 0 in a fresh model (what a resumed run of that code drew from).

        Raises ValueError for anything but the dict of :meth:`state_dict`.
        """
        try:
            steps = state_dict["steps"]
            decisions = {clean_name(n): Fallback(**{**d, "layer": clean_name(d["layer"])})
                         for n, d in state_dict["decisions"].items()}
            windows = {clean_name(n): (torch.tensor(w["stats"], dtype=torch.float32), float(w["output_sqnr_db"]),
                           None if w.get("rounding_step") is None else int(w["rounding_step"]))
                       for n, w in state_dict["windows"].items()}
            if not isinstance(steps, int) or steps < 0:
                raise TypeError(steps)
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise ValueError(f"Guard.load_state_dict expects the dict of Guard.state_dict() (steps, decisions, "
                             f"windows), got {state_dict!r}") from exc
        self._steps, self._decisions, self._pending = steps, decisions, windows
        tracked = dict(self._states)
        for name, st in tracked.items():
            if name not in windows:  # as a fresh layer: no window, no previous amax
                _load_window(st, new_window(), math.inf, None)
        self.track(tracked)


def _load_window(st: LayerState, data: torch.Tensor, sqnr: float, rounding_step: int | None) -> None:
    try:
        st.load_window(data, sqnr)
        if rounding_step is not None:
            st.rounding_step = rounding_step
    except ValueError as exc:
        raise ValueError(f"Guard.load_state_dict: {exc}") from None
