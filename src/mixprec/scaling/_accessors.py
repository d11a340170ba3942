"""What a :class:`mixprec.GradScaler` lets one read and set, apart from the iteration itself.

:class:`ScalerAccessors` holds the scaler's read-only views (the state, the config, the skip
flags, the overflow attributions, the per-layer factors) and ``torch.amp.GradScaler``'s getters
and setters, with the private names that code ported from torch calls or sets (``_scale``,
``_get_scale_async``, ``_check_scale_growth_tracker``, ``_init_scale``, ``_growth_factor``, ...).
A base class of ``GradScaler`` only: it reads the scaler's attributes (declared below) and touches
no device state but through them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from mixprec.scaling._attribution import Attribution
from mixprec.scaling._state import HostSnapshot
from mixprec.scaling.layerwise import Layerwise
from mixprec.scaling.rule import ScaleConfig, ScaleState, _check_scale_value
from mixprec.scaling.unscaling import Unscaling

__all__ = ["ScalerAccessors"]



def _torch_setting(name: str) -> property:
    """torch's private ``_<name>`` (code assigns it): reads ``get_<name>()``, writes through
    ``set_<name>(value)``, which checks the value."""
    return property(lambda self: getattr(self, f"get_{name}")(),
                    lambda self, value: getattr(self, f"set_{name}")(value),
                    doc=f"torch's name for :meth:`get_{name}`; set: :meth:`set_{name}`.")

class ScalerAccessors:
    """Readers, getters and setters of :class:`mixprec.GradScaler` (see the module docstring)."""

    _enabled: bool
    _config: ScaleConfig
    _chosen: dict[str, Any]
    _snapshot: HostSnapshot
    _state: ScaleState | None
    _skipped_steps: torch.Tensor | None
    _last_step_skipped: torch.Tensor | None
    _skipped_by_optimizer: dict[int, torch.Tensor]
    _attribution: Attribution
    _unscaling: Unscaling
    _require_state: Callable[[str], ScaleState]

    def _check_scale_growth_tracker(self, funcname: str) -> tuple[torch.Tensor, torch.Tensor]:
        """torch's ``(scale, growth_tracker)`` accessor; raises before :meth:`scale`."""
        state = self._require_state(funcname)
        return state.scale, state.growth_tracker

    def _host_snapshot(self) -> HostSnapshot:
        """The state as host numbers: the snapshot before :meth:`scale`, else one host sync."""
        if self._state is None or self._skipped_steps is None:
            return self._snapshot
        return HostSnapshot.read(self._state, self._skipped_steps)

    def _clamped(self, scale: float) -> float:
        """``scale`` clamped into ``[min_scale, max_scale]``, as a float32 too (host floats, no sync)."""
        return self._config.clamp(scale)

    def _get_scale_async(self) -> torch.Tensor | None:
        """The scale tensor (no host sync), or ``None`` before :meth:`scale`; as torch's, one tensor
        for the scaler's life, updated in place (clone it to keep a value)."""
        return None if self._state is None else self._state.scale

    @property  # type: ignore[override]
    def _scale(self) -> torch.Tensor | None:
        """torch's name for the scale tensor (``None`` before :meth:`scale`), for code ported from it."""
        return None if self._state is None else self._state.scale

    @property  # type: ignore[override]
    def _growth_tracker(self) -> torch.Tensor | None:
        """torch's name for the growth-tracker tensor (``None`` before :meth:`scale`)."""
        return None if self._state is None else self._state.growth_tracker

    # torch's private settings (``scaler._init_scale = 32.0``, ``assert scaler._growth_factor == 2``
    # in code ported from torch): views of the snapshot and the config, with torch's meaning.

    @property  # type: ignore[override]
    def _init_scale(self) -> float:
        """torch's first scale: what :meth:`scale` creates the scale tensor from (set before it does,
        as in torch: afterwards the live scale is :meth:`get_scale`, ``update(new_scale)`` sets it);
        after ``load_state_dict`` the loaded scale. Set: a finite normal float32 number (clamped into
        ``[min_scale, max_scale]``; ``ValueError`` otherwise)."""
        return self._snapshot.scale

    @_init_scale.setter
    def _init_scale(self, value: float) -> None:
        _check_scale_value("_init_scale", float(value))
        self._snapshot = dataclasses.replace(self._snapshot, scale=self._clamped(float(value)))

    @property  # type: ignore[override]
    def _init_growth_tracker(self) -> int:
        """torch's first growth tracker (0; the loaded one after ``load_state_dict``), what
        :meth:`scale` creates the tracker from. Set: an int >= 0 (``ValueError`` otherwise)."""
        return self._snapshot.growth_tracker

    @_init_growth_tracker.setter
    def _init_growth_tracker(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"_init_growth_tracker must be an int >= 0, got {value!r}.")
        self._snapshot = dataclasses.replace(self._snapshot, growth_tracker=value)

    _growth_factor = _torch_setting("growth_factor")  # type: ignore[assignment]
    _backoff_factor = _torch_setting("backoff_factor")  # type: ignore[assignment]
    _growth_interval = _torch_setting("growth_interval")  # type: ignore[assignment]

    @property
    def state(self) -> ScaleState | None:
        """The current :class:`ScaleState` (device tensors, updated in place by :meth:`update` and
        ``load_state_dict``: clone them to keep values), or ``None`` before :meth:`scale`."""
        return self._state

    @property
    def config(self) -> ScaleConfig:
        """The rule's parameters as a frozen :class:`ScaleConfig`."""
        return self._config

    @property
    def last_step_skipped(self) -> torch.Tensor:
        """0-dim bool tensor on the scaler's device: whether the last :meth:`step` was skipped.

        Producing it costs no host sync; reading it (``bool(...)``, ``.item()``) does. ``False``
        (on the CPU) before the first :meth:`scale`.
        """
        if self._last_step_skipped is None:
            return torch.zeros((), dtype=torch.bool)
        return self._last_step_skipped

    @property
    def skipped_steps(self) -> torch.Tensor:
        """0-dim int64 tensor: the number of iterations (``update()`` calls) with an overflow."""
        if self._skipped_steps is None:
            return torch.full((), self._snapshot.skipped_steps, dtype=torch.int64)
        return self._skipped_steps

    @property
    def last_overflow(self) -> tuple[str, ...] | None:
        """Names of the watched parameters whose gradients were inf/NaN in the last step.

        ``()`` after a clean step, ``None`` when no model is :meth:`watch`-ed. Computed only on a
        skipped step.
        """
        return self._attribution.last_overflow

    def skipped_for(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """0-dim bool tensor: whether ``optimizer``'s last :meth:`step` was skipped (no sync).

        :attr:`last_step_skipped` for an optimizer this scaler has not stepped.
        """
        return self._skipped_by_optimizer.get(id(optimizer), self.last_step_skipped)

    # ------------------------------------------------------------------ per-layer factors

    @property
    def _layerwise(self) -> Layerwise | None:
        """The per-layer unscaling strategy (``per_layer=True``: its cut points, its state), else
        ``None``."""
        unscaling = self._unscaling
        return unscaling if isinstance(unscaling, Layerwise) else None

    def layer_scales(self) -> dict[str, float]:
        """``{cut point: s}`` with ``per_layer=True``: the power of two each cut point multiplies
        the gradient by (one host sync). See :mod:`mixprec.scaling.layerwise`.

        Raises:
            RuntimeError: without ``per_layer=True``, or before :meth:`watch`.
        """
        if not self._unscaling.names:
            raise RuntimeError("layer_scales() needs GradScaler(..., per_layer=True).watch(model).")
        return self._unscaling.scales()

    def layer_scales_async(self) -> torch.Tensor | None:
        """The factors of :meth:`layer_scales` as a float32 tensor on the scale's device, in the
        cut points' order, without a host sync (a new tensor each call: record it every step and
        read later); ``None`` without ``per_layer=True`` or before the first :meth:`scale`."""
        return self._unscaling.factors()

    def layer_scale_history(self) -> list[dict[str, float]]:
        """:meth:`layer_scales` after each of the last 16 :meth:`update` calls, oldest first (kept
        on the device; one host sync to read). ``[]`` without ``per_layer=True``."""
        return self._unscaling.history()

    @property
    def last_overflow_cuts(self) -> tuple[str, ...]:
        """With ``per_layer=True``: the cut points whose regions overflowed first in the last
        :meth:`update` (their margins backed off); ``()`` otherwise. One host sync."""
        return self._unscaling.last_overflow()

    # ------------------------------------------------------------------ getters and setters

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled). One host sync."""
        if not self._enabled:
            return 1.0
        return self._snapshot.scale if self._state is None else float(self._state.scale.item())

    def _get_growth_tracker(self) -> int:
        """torch's accessor for the growth tracker (0 when disabled). One host sync."""
        if not self._enabled:
            return 0
        return self._snapshot.growth_tracker if self._state is None else int(self._state.growth_tracker.item())

    def get_growth_factor(self) -> float:
        """The growth factor."""
        return self._config.growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Sets the growth factor (> 1; ``ValueError`` otherwise)."""
        self._config = dataclasses.replace(self._config, growth_factor=new_factor)
        self._chosen["growth_factor"] = new_factor

    def get_backoff_factor(self) -> float:
        """The backoff factor."""
        return self._config.backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Sets the backoff factor (in (0, 1); ``ValueError`` otherwise)."""
        self._config = dataclasses.replace(self._config, backoff_factor=new_factor)
        self._chosen["backoff_factor"] = new_factor

    def get_growth_interval(self) -> int:
        """The growth interval."""
        return self._config.growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Sets the growth interval (>= 1; ``ValueError`` otherwise)."""
        self._config = dataclasses.replace(self._config, growth_interval=new_interval)
        self._chosen["growth_interval"] = new_interval

    def is_enabled(self) -> bool:
        """Whether scaling is enabled."""
        return self._enabled
