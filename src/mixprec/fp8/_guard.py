"""The fp8 guard: per-layer thresholds on the cast statistics, and the fallback decisions."""

from __future__ import annotations

import dataclasses
import math
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from mixprec.fp8._quant import STAT_NAMES
from mixprec.fp8._state import OPERANDS, LayerState

__all__ = ["Guard", "Fallback", "Float8FallbackWarning", "layer_states"]


class Float8FallbackWarning(UserWarning):
    """A layer left fp8 for the compute dtype (issued once per layer, by :meth:`Guard.check`)."""


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
    """``{fqn: LayerState}`` of the modules of ``model`` that have one (see :func:`layer_state`)."""
    from mixprec.fp8._state import layer_state

    return {name: st for name, mod in model.named_modules()
            if (st := layer_state(mod, create=False)) is not None}


@dataclass
class Guard:
    """Thresholds on each fp8 layer's statistics; a layer that crosses one falls back for good.

    Every ``every`` steps, :meth:`check` reads the statistics accumulated since the last check
    (the worst value over the window), all-reduces them (MAX) when ``torch.distributed`` is
    initialized so that every rank takes the same decision, and moves each layer where
    ``nonfinite > max_nonfinite``, ``saturated > max_saturated``, ``underflow > max_underflow``
    (for input, weight or grad_output) or, when ``min_sqnr_db`` is set, the sampled output SQNR
    against the high-precision GEMM is below it, to the compute dtype, with a
    :class:`Float8FallbackWarning` naming the layer, the operand, the statistic and its value.
    ``None`` switches a threshold off; ``max_saturated`` is off by default: a current scale clips
    nothing finite, and the fraction beyond the previous step's amax moves with the data (it is
    a diagnostic of what a delayed scale would clip). The decisions are saved by :meth:`state_dict`.

    .. warning:: :meth:`check` on a check step reads the device statistics: one host sync (and
       one all-reduce) per ``every`` steps; other steps cost nothing.

    Example:
        >>> guard = Guard(max_underflow=0.1, every=10)
        >>> guard.check({}, step=0)
        []
    """

    max_saturated: float | None = None
    max_underflow: float | None = 0.05
    max_nonfinite: float | None = 0.0
    min_sqnr_db: float | None = None
    every: int = 1
    _decisions: dict[str, Fallback] = field(default_factory=dict, init=False, repr=False, compare=False)
    _states: Any = field(default_factory=weakref.WeakValueDictionary, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("max_saturated", "max_underflow", "max_nonfinite"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and value >= 0):
                raise ValueError(f"Guard.{name} must be None or a number >= 0, got {value!r}")
        if self.min_sqnr_db is not None and not isinstance(self.min_sqnr_db, (int, float)):
            raise ValueError(f"Guard.min_sqnr_db must be None or a number of dB, got {self.min_sqnr_db!r}")
        if not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"Guard.every must be an int >= 1, got {self.every!r}")

    @property
    def decisions(self) -> dict[str, Fallback]:
        """``{layer: Fallback}`` of the layers moved to the compute dtype (a copy)."""
        return dict(self._decisions)

    def track(self, states: Mapping[str, LayerState] | torch.nn.Module) -> dict[str, LayerState]:
        """Remember ``states`` (by name) and set their ``fallback`` flags from the decisions."""
        states = layer_states(states) if isinstance(states, torch.nn.Module) else dict(states)
        for name, st in states.items():
            if not isinstance(st, LayerState):
                raise ValueError(f"Guard: states[{name!r}] must be a LayerState, got {type(st).__name__}")
            self._states[name] = st
            st.fallback = name in self._decisions
        return states

    def check(self, states: Mapping[str, LayerState] | torch.nn.Module, step: int) -> list[Fallback]:
        """Decide fallbacks on check steps (``step % every == 0``); returns the new ones.

        ``states``: ``{fqn: LayerState}`` (the same names on every rank) or a model, whose
        states are found with :func:`layer_states`. Call it once per step, after backward.
        """
        states = self.track(states)
        if self.min_sqnr_db is not None:  # sample on the last step of each window
            for st in states.values():
                st.sample_sqnr = (step + 1) % self.every == 0 and not st.fallback
        if step % self.every != 0 or not states:
            return []
        names = sorted(states)
        rows = _all_reduce_max(torch.stack([
            torch.cat([states[n].stats.flatten(), -states[n].output_sqnr_db.reshape(1)]) for n in names]))
        new = []
        for name, row in zip(names, rows.tolist()):
            states[name].reset()
            if name in self._decisions:
                continue
            decision = self._decide(name, row, step)
            if decision is not None:
                self._decisions[name] = decision
                states[name].fallback = True
                states[name].sample_sqnr = False
                warnings.warn(decision.message(), Float8FallbackWarning, stacklevel=2)
                new.append(decision)
        return new

    def _decide(self, name: str, row: list[float], step: int) -> Fallback | None:
        limits = {"nonfinite": self.max_nonfinite, "saturated": self.max_saturated,
                  "underflow": self.max_underflow}
        ncol = len(STAT_NAMES)
        for i, operand in enumerate(OPERANDS):
            values = dict(zip(STAT_NAMES, row[i * ncol:(i + 1) * ncol]))
            for stat, limit in limits.items():
                if limit is not None and values[stat] > limit:
                    return Fallback(name, operand, stat, values[stat], float(limit), step)
        sqnr = -row[-1]
        if self.min_sqnr_db is not None and not math.isinf(sqnr) and not sqnr >= self.min_sqnr_db:
            return Fallback(name, "output", "sqnr_db", sqnr, float(self.min_sqnr_db), step)
        return None

    def state_dict(self) -> dict[str, Any]:
        """The fallback decisions, as plain data: ``{"decisions": {layer: {...}}}``."""
        return {"decisions": {n: dataclasses.asdict(d) for n, d in self._decisions.items()}}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the decisions and re-apply them to the tracked layer states."""
        try:
            decisions = {n: Fallback(**d) for n, d in state_dict["decisions"].items()}
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"Guard.load_state_dict expects the dict of Guard.state_dict(), got {state_dict!r}") from exc
        self._decisions = decisions
        for name, st in list(self._states.items()):
            st.fallback = name in decisions


def _all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return t
    on_cpu = dist.get_backend() == "gloo" and t.device.type != "cpu"
    buf = t.cpu() if on_cpu else t.clone()
    dist.all_reduce(buf, op=dist.ReduceOp.MAX)
    return buf
