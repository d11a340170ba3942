"""The fp8 guard: per-layer thresholds on the cast statistics, and the fallback decisions."""

from __future__ import annotations

import copy
import dataclasses
import math
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from mixprec._modules import clean_name, named_modules
from mixprec.fp8._collective import agree_on_layers, all_reduce_max, distributed
from mixprec.fp8._quant import STAT_NAMES
from mixprec.fp8._state import OPERANDS, LayerState, layer_state, new_window, window_stats

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
    the names are those of the bare model, without DDP's, FSDP1's or torch.compile's parts."""
    return {name: st for name, mod in named_modules(model)
            if (st := layer_state(mod, create=False)) is not None}


#: training forwards of a policy's guard, without a single :meth:`Guard.step`, before it warns.
NO_STEP_FORWARDS = 100


def count_unstepped_forward(owner: Any, what: str, call: str) -> None:
    """Count a training forward of ``owner`` (a Guard or Controller, with ``_stepped`` and
    ``_forwards``) that has never been stepped; at :data:`NO_STEP_FORWARDS` warn once that its
    ``call`` (``"guard.step()"``) is missing, so it never decides."""
    if owner._stepped or not torch.is_grad_enabled():
        return
    owner._forwards += 1
    if owner._forwards == NO_STEP_FORWARDS:
        warnings.warn(f"fp8: the policy's {type(owner).__name__} has seen {NO_STEP_FORWARDS} training "
                      f"forwards and no {call}: it never {what}. Call {call} once per optimizer step, "
                      f"on every rank", UserWarning, stacklevel=5)


def _check_int(owner: str, name: str, value: Any, low: int, high: Any) -> None:
    """Raise ValueError unless ``value`` is an int (not a bool) in ``[low, high]`` (``high`` None: no bound)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{owner}.{name} must be an int {bound}, got {value!r}")


def _check_number(owner: str, name: str, value: Any, low: float, high: float, what: str,
                  low_open: bool = False) -> None:
    """Raise ValueError unless ``value`` is a real number (not a bool, not NaN) in ``[low, high]``
    (``(low, high]`` with ``low_open``); ``what`` says what it is."""
    ok = (not isinstance(value, bool) and isinstance(value, (int, float))
          and (value > low if low_open else value >= low) and value <= high)
    if not ok:
        bound = f"{'(' if low_open else '['}{low:g}, {high:g}]" if math.isfinite(high) else f">= {low:g}"
        raise ValueError(f"{owner}.{name} must be a number in {bound} ({what}), got {value!r}")


@dataclass
class Guard:
    """Thresholds on each fp8 layer's statistics; a layer that crosses one falls back for good.

    Call :meth:`step` once per optimizer step, on every rank (with gradient accumulation: once
    per optimizer step, not per micro-batch). Every ``every`` steps it reads the statistics
    accumulated since the last check (the worst value over the window), all-reduces them (MAX)
    when ``torch.distributed`` is initialized so that every rank takes the same decision, and
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

    max_saturated: float | None = None
    max_underflow: float | None = 0.05
    max_nonfinite: float | None = 0.0
    min_sqnr_db: float | None = None
    every: int = 1
    fp4_max_underflow: float | None = 0.25
    _decisions: dict[str, Fallback] = field(default_factory=dict, init=False, repr=False, compare=False)
    _states: Any = field(default_factory=weakref.WeakValueDictionary, init=False, repr=False, compare=False)
    _steps: int = field(default=0, init=False, repr=False, compare=False)
    # windows of a loaded state dict for layers not tracked yet: name -> (data, output sqnr, fp4 call count)
    _pending: dict[str, tuple[torch.Tensor, float, int]] = field(default_factory=dict, init=False, repr=False,
                                                             compare=False)
    _stepped: bool = field(default=False, init=False, repr=False, compare=False)  # this process
    _forwards: int = field(default=0, init=False, repr=False, compare=False)
    _warned_empty: bool = field(default=False, init=False, repr=False, compare=False)
    _warned_fp4: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name, high, what in (("max_saturated", 1, "a fraction, or None"),
                                 ("max_underflow", 1, "a fraction, or None"),
                                 ("fp4_max_underflow", 1, "a fraction, or None"),
                                 ("max_nonfinite", math.inf, "a count, or None")):
            value = getattr(self, name)
            if value is not None:
                _check_number("Guard", name, value, 0, high, what)
        sqnr = self.min_sqnr_db
        if sqnr is not None and (isinstance(sqnr, bool) or not isinstance(sqnr, (int, float))
                                 or not math.isfinite(sqnr)):
            raise ValueError(f"Guard.min_sqnr_db must be a finite number of dB, or None, got {sqnr!r}")
        _check_int("Guard", "every", self.every, 1, None)

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
        them the windows of a loaded state dict, and arm SQNR sampling for the next step."""
        states = layer_states(states) if isinstance(states, torch.nn.Module) else dict(states)
        sample = self.min_sqnr_db is not None and (self._steps + 1) % self.every == 0
        for name, st in states.items():
            if not isinstance(st, LayerState):
                raise ValueError(f"Guard: states[{name!r}] must be a LayerState, got {type(st).__name__}")
            self._states[name] = st
            if name in self._pending:
                _load_window(st, *self._pending.pop(name))
            st.fallback = name in self._decisions
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
        if model is None and not states and not self._warned_empty and not distributed():  # (a lagging rank: its peers')
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
        names, _, _ = agree_on_layers(list(states), dict)
        if not names:
            return []
        device = next((st.device for st in states.values()), torch.device("cpu"))
        rows = all_reduce_max(torch.stack([self._window_row(n, states.get(n), device) for n in names])).tolist()
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
                    st.fallback = True
                    st.sample_sqnr = False
                warnings.warn(decision.message(), Float8FallbackWarning, stacklevel=stacklevel)
                new.append(decision)
        return new

    def _warn_unused_fp4_limit(self, rows: list[list[float]]) -> None:
        """Warn once when ``fp4_max_underflow`` was set but no layer that ran (on any rank: the
        rows are all-reduced) casts an operand to e2m1: the setting would take no effect."""
        default = type(self).__dataclass_fields__["fp4_max_underflow"].default
        if self._warned_fp4 or self.fp4_max_underflow in (None, default):
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

    def _policy_forward(self, model: torch.nn.Module) -> None:
        """A forward of a model under a policy with this guard: track its layers, and warn once
        when training forwards go on without a :meth:`step` (the guard would never decide)."""
        self.track(model)
        count_unstepped_forward(self, "checks the layers", "guard.step()")

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
        settings = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        return {"settings": settings, "state": self.state_dict(), "tracked": dict(self._states)}

    def __deepcopy__(self, memo: dict) -> Guard:
        return deepcopy_attributes(self, memo)

    def __setstate__(self, state: Mapping[str, Any]) -> None:
        self.__dict__.update(Guard(**state["settings"]).__dict__)
        self.load_state_dict(state["state"])
        self._states.update(state["tracked"])  # alive while their model is: a guard pickled alone tracks none

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
        window saved without ``rounding_step`` (before it was saved) restores a count of 0: what
        a resumed run of that code drew from.

        Raises ValueError for anything but the dict of :meth:`state_dict`.
        """
        try:
            steps = state_dict["steps"]
            decisions = {clean_name(n): Fallback(**{**d, "layer": clean_name(d["layer"])})
                         for n, d in state_dict["decisions"].items()}
            windows = {clean_name(n): (torch.tensor(w["stats"], dtype=torch.float32), float(w["output_sqnr_db"]),
                           int(w.get("rounding_step", 0))) for n, w in state_dict["windows"].items()}
            if not isinstance(steps, int) or steps < 0:
                raise TypeError(steps)
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise ValueError(f"Guard.load_state_dict expects the dict of Guard.state_dict() (steps, decisions, "
                             f"windows), got {state_dict!r}") from exc
        self._steps, self._decisions, self._pending = steps, decisions, windows
        tracked = dict(self._states)
        for name, st in tracked.items():
            if name not in windows:  # as a fresh layer: no window, no previous amax
                _load_window(st, new_window(), math.inf, 0)
        self.track(tracked)


def _load_window(st: LayerState, data: torch.Tensor, sqnr: float, rounding_step: int) -> None:
    try:
        st.load_window(data, sqnr)
        st.rounding_step = rounding_step
    except ValueError as exc:
        raise ValueError(f"Guard.load_state_dict: {exc}") from None


def deepcopy_attributes(obj: Any, memo: dict) -> Any:
    """``copy.deepcopy`` of a Guard or Controller: every attribute copied, as for a dataclass,
    not through ``__getstate__`` (pickling's settings and ``state_dict``)."""
    new = object.__new__(type(obj))
    memo[id(obj)] = new
    new.__dict__.update(copy.deepcopy(obj.__dict__, memo))
    return new
