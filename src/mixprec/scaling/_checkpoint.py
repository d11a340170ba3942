"""How a :class:`mixprec.GradScaler` is saved: ``state_dict``, ``load_state_dict``, pickling and
``copy.deepcopy``.

:class:`ScalerCheckpoint` is a base class of ``GradScaler`` only. The formats themselves (torch's
five keys plus ``"mixprec"``, the host snapshot) are ``_state.py``'s; the unscaling strategy adds
its own entries (``"layerwise"``, :mod:`mixprec.scaling.unscaling`). ``state_dict``, pickling
and ``copy.deepcopy`` cost one host sync each (the scale, growth tracker, hysteresis budget and
skip count are read together); ``load_state_dict`` none.
"""

from __future__ import annotations

import copy
import dataclasses
import types
import warnings
from collections import deque
from typing import Any, Callable, Self

import torch

from mixprec.scaling._state import (
    HostSnapshot,
    OptimizerState,
    from_state_dict,
    overridden_message,
    overridden_options,
    to_state_dict,
)
from mixprec.scaling.rule import ScaleConfig, ScaleState
from mixprec.scaling.unscaling import GlobalUnscaling, Unscaling

__all__ = ["ScalerCheckpoint"]


def _is_unpicklable_function(fn: Any) -> bool:
    """A lambda or a function defined inside another: ``pickle`` cannot store it by name."""
    return isinstance(fn, types.FunctionType) and ("<lambda>" in fn.__qualname__ or "<locals>" in fn.__qualname__)


class ScalerCheckpoint:
    """Saving and restoring a :class:`mixprec.GradScaler` (see the module docstring)."""

    _enabled: bool
    _config: ScaleConfig
    _chosen: dict[str, Any]
    _on_min_scale: str
    _snapshot: HostSnapshot
    _state: ScaleState | None
    _step: int
    _history: Any
    _process_group: Any
    _per_optimizer_states: dict[int, OptimizerState]
    _recent_scales: deque[torch.Tensor]
    _unscaling: Unscaling
    _host_snapshot: Callable[[], HostSnapshot]
    _clamped: Callable[[float], float]
    _lazy_init_scale_growth_tracker: Callable[[torch.device | str], None]

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state; ``{}`` when disabled. One host sync.

        Holds torch's five keys (``scale``, ``growth_factor``, ``backoff_factor``,
        ``growth_interval``, ``_growth_tracker``), so ``torch.amp.GradScaler.load_state_dict``
        accepts it, plus ``"mixprec"``: the other :class:`ScaleConfig` fields, ``on_min_scale``,
        ``hysteresis_left``, ``skipped_steps`` and ``step``. Call it after :meth:`update`.
        """
        if not self._enabled:
            return {}
        saved = to_state_dict(self._host_snapshot(), self._config, self._on_min_scale, self._step)
        saved.update(self._unscaling.state_dict())
        return saved

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state from :meth:`state_dict` of this class or of ``torch.amp.GradScaler``.

        The checkpoint's options win. A torch state keeps this scaler's own mixprec options
        (hysteresis, bounds, ``on_min_scale``) and refills the hysteresis budget; a mixprec state
        restores all the options it was saved with. Either warns (``UserWarning``) naming each
        option set to a non-default value by the constructor (or a setter) that the checkpoint
        replaces with another value. The scale is clamped into ``[min_scale, max_scale]``. No-op when disabled.
        With ``per_layer=True`` a checkpoint without per-layer state (``per_layer=False``, or
        torch's) resets every cut point's factor to 1; a per-layer checkpoint loaded with
        ``per_layer=False`` restores the loss scale only and warns (``UserWarning``).

        Raises:
            RuntimeError: if ``state_dict`` is empty (saved from a disabled scaler).
            ValueError: if keys are missing (the message names them) or values are out of range;
                the scaler is then left unchanged.
        """
        if not self._enabled:
            return
        config, on_min_scale, snapshot, step = from_state_dict(
            state_dict, self._config, self._on_min_scale, self._step
        )
        overridden = overridden_options(self._chosen, config, on_min_scale)
        if overridden:
            warnings.warn(overridden_message(overridden), UserWarning, stacklevel=2)
        self._unscaling.load_state_dict(state_dict)  # validates first
        self._config = config
        self._on_min_scale = on_min_scale
        self._snapshot = dataclasses.replace(snapshot, scale=self._clamped(snapshot.scale))
        self._step = step
        if self._state is not None:
            self._lazy_init_scale_growth_tracker(self._state.scale.device)

    def _host_state(self) -> dict[str, Any]:
        """``__dict__`` with the device state replaced by its host snapshot (one host sync)."""
        if self._enabled and len(self._per_optimizer_states) != 0:
            raise RuntimeError(
                "A GradScaler instance may only be pickled at the beginning "
                "of an iteration, or at the end after scaler.update()."
            )
        state = self.__dict__.copy()
        state.update(
            _snapshot=self._host_snapshot() if self._enabled else self._snapshot,
            _state=None,
            _skipped_steps=None,
            _last_step_skipped=None,
            _skipped_by_optimizer={},
            _recent_scales=deque(maxlen=self._recent_scales.maxlen),
        )
        return state

    def __getstate__(self) -> dict[str, Any]:
        if _is_unpicklable_function(self._history):
            raise TypeError(
                f"This GradScaler's history callback {self._history.__qualname__!r} is a lambda or a "
                "local function, which pickle cannot store. Pass a module-level function or a "
                "callable object (e.g. mixprec.scaling.CSVHistory) as history=, or save "
                "scaler.state_dict() instead of pickling the scaler."
            )
        if not (self._process_group is None or isinstance(self._process_group, str)):
            raise TypeError(
                "This GradScaler holds a ProcessGroup, which cannot be pickled (it belongs to one "
                "process). Save scaler.state_dict() instead and build the scaler again with the "
                "group in the new process, or use process_group='default', which pickles."
            )
        return self._host_state()

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "_layerwise" in state:  # pickled by a mixprec without unscaling strategies
            layerwise = state.pop("_layerwise")
            state["_unscaling"] = GlobalUnscaling() if layerwise is None else layerwise
        self.__dict__.update(state)

    def __deepcopy__(self, memo: dict[int, Any]) -> Self:
        """A copy with the same options, state, history and process group (one host sync)."""
        for shared in (self._history, self._process_group):
            memo[id(shared)] = shared  # kept by reference, as they are not values
        clone = type(self).__new__(type(self))
        clone.__setstate__(copy.deepcopy(self._host_state(), memo))
        return clone
