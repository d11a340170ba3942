"""The records behind :class:`mixprec.GradScaler`: its per-optimizer stage and its host snapshot.

:class:`HostSnapshot` is the scaler's device state read onto the host, in one place and with one
sync: ``state_dict()``, pickling and the lazily created device state all go through it, and
:func:`to_state_dict` / :func:`from_state_dict` derive the checkpoint format from its fields.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Optional

import torch
from torch.amp.grad_scaler import OptState

from mixprec.scaling.rule import ScaleConfig, ScaleState, _check_scale_value, init_state

__all__ = [
    "ON_MIN_SCALE",
    "HostSnapshot",
    "OptimizerState",
    "Stage",
    "check_optimizer",
    "chosen_options",
    "from_state_dict",
    "overridden_message",
    "overridden_options",
    "persist",
    "to_state_dict",
    "validated_new_scale",
]

ON_MIN_SCALE = ("raise", "warn", "ignore")
#: The keys of ``torch.amp.GradScaler.state_dict()`` that are ScaleConfig fields.
TORCH_CONFIG_KEYS = ("growth_factor", "backoff_factor", "growth_interval")
_REQUIRED_KEYS = ("scale", *TORCH_CONFIG_KEYS, "_growth_tracker")


#: Where an optimizer is in the iteration: torch's own enum (``READY``, ``UNSCALED``, ``STEPPED``),
#: so code comparing ``scaler._per_optimizer_states[id(opt)]["stage"]`` with it works.
Stage = OptState

#: The keys of torch's per-optimizer dict, readable and writable on :class:`OptimizerState`.
_TORCH_KEYS = ("stage", "found_inf_per_device")


@dataclass
class OptimizerState:
    """What the scaler records for one optimizer between two ``update()`` calls.

    ``found_inf_per_device`` maps each device holding a gradient to its 0-dim overflow flag;
    ``skipped`` is that flag read on the host, once it was (plain step, or watching), else None.

    It is also read and written as torch's per-optimizer dict, for code written against
    ``torch.amp.GradScaler._per_optimizer_states`` (Lightning's tests, other libraries):

    Example:
        >>> state = OptimizerState()
        >>> state["stage"] is torch.amp.grad_scaler.OptState.READY, state["found_inf_per_device"]
        (True, {})
    """

    stage: Stage = Stage.READY
    found_inf_per_device: dict[torch.device, torch.Tensor] = field(default_factory=dict)
    optimizer: Any = None
    skipped: Optional[bool] = None

    def __getitem__(self, key: str) -> Any:
        return getattr(self, self._torch_key(key))

    def __setitem__(self, key: str, value: Any) -> None:
        setattr(self, self._torch_key(key), value)

    def __contains__(self, key: object) -> bool:
        return key in _TORCH_KEYS

    def __iter__(self) -> Iterator[str]:
        return iter(_TORCH_KEYS)

    def __len__(self) -> int:
        return len(_TORCH_KEYS)

    def keys(self) -> tuple[str, ...]:
        """torch's keys: ``("stage", "found_inf_per_device")``."""
        return _TORCH_KEYS

    def get(self, key: str, default: Any = None) -> Any:
        """``self[key]`` for torch's keys, else ``default``."""
        return self[key] if key in _TORCH_KEYS else default

    @staticmethod
    def _torch_key(key: str) -> str:
        if key not in _TORCH_KEYS:
            raise KeyError(f"{key!r}: torch's per-optimizer state has the keys {_TORCH_KEYS}")
        return key


@dataclass(frozen=True)
class HostSnapshot:
    """The scaler's device state as host numbers: what it starts from and what it saves.

    Example:
        >>> snap = HostSnapshot.read(scaler.state, scaler.skipped_steps)   # one host sync
        >>> snap.scale, snap.growth_tracker, snap.hysteresis_left, snap.skipped_steps
        (65536.0, 0, 1, 0)
    """

    scale: float
    growth_tracker: int
    hysteresis_left: int
    skipped_steps: int

    @staticmethod
    def read(state: ScaleState, skipped_steps: torch.Tensor) -> HostSnapshot:
        """Reads ``state`` and ``skipped_steps`` with one host sync (float64 holds each exactly)."""
        values = torch.stack([t.to(torch.float64) for t in (*state, skipped_steps)]).tolist()
        scale, growth_tracker, hysteresis_left, skipped = values
        return HostSnapshot(scale, int(growth_tracker), int(hysteresis_left), int(skipped))

    def device_state(self, config: ScaleConfig, device: torch.device | str) -> tuple[ScaleState, torch.Tensor]:
        """The :class:`ScaleState` and the skipped-steps counter on ``device``."""
        state = init_state(
            self.scale, config, device, growth_tracker=self.growth_tracker, hysteresis_left=self.hysteresis_left
        )
        return state, torch.full((), self.skipped_steps, dtype=torch.int64, device=device)


def persist(live: ScaleState | None, new: ScaleState) -> ScaleState:
    """``live`` holding ``new``'s values, copied in place (``new`` itself when there is no ``live``
    state yet), as torch's ``_amp_update_scale_``/``fill_`` update its tensors: a reference taken
    to the scale (``_get_scale_async()``, a captured CUDA graph) keeps tracking it. The rule stays
    pure (:func:`~mixprec.scaling.update_scale` returns new tensors); this is the shell's store. No
    host sync."""
    if live is None:
        return new
    with torch.no_grad():
        for tensor, value in zip(live, new):
            if value is not tensor:
                tensor.copy_(value)
    return live


def to_state_dict(snapshot: HostSnapshot, config: ScaleConfig, on_min_scale: str, step: int) -> dict[str, Any]:
    """torch's five keys plus ``"mixprec"``: the other config fields and the counters."""
    values = dataclasses.asdict(config)
    extra = {k: v for k, v in values.items() if k not in TORCH_CONFIG_KEYS}
    extra.update(
        on_min_scale=on_min_scale,
        hysteresis_left=snapshot.hysteresis_left,
        skipped_steps=snapshot.skipped_steps,
        step=step,
    )
    return {
        "scale": snapshot.scale,
        **{k: values[k] for k in TORCH_CONFIG_KEYS},
        "_growth_tracker": snapshot.growth_tracker,
        "mixprec": extra,
    }


def _options(config: ScaleConfig, on_min_scale: str) -> dict[str, Any]:
    return {**dataclasses.asdict(config), "on_min_scale": on_min_scale}


_DEFAULT_OPTIONS = _options(ScaleConfig(), ON_MIN_SCALE[0])


def chosen_options(config: ScaleConfig, on_min_scale: str) -> dict[str, Any]:
    """The options that differ from their defaults: what the user asked for explicitly."""
    return {k: v for k, v in _options(config, on_min_scale).items() if v != _DEFAULT_OPTIONS[k]}


def overridden_options(
    chosen: Mapping[str, Any], config: ScaleConfig, on_min_scale: str
) -> dict[str, tuple[Any, Any]]:
    """``{name: (chosen value, loaded value)}`` for each chosen option a load replaced."""
    loaded = _options(config, on_min_scale)
    return {k: (v, loaded[k]) for k, v in chosen.items() if loaded[k] != v}


def overridden_message(overridden: Mapping[str, tuple[Any, Any]]) -> str:
    """The warning for :func:`overridden_options`: what changed, and how to keep one's own."""
    changes = ", ".join(f"{k} {mine!r} -> {theirs!r}" for k, (mine, theirs) in overridden.items())
    return (
        f"GradScaler.load_state_dict: the checkpoint's options replace the ones this scaler was "
        f"given ({changes}). A checkpoint restores the options it was saved with; to keep yours, "
        "delete their keys from state_dict['mixprec'] before loading (growth_factor, "
        "backoff_factor, growth_interval: call the set_* methods after loading)."
    )


def from_state_dict(
    state_dict: Mapping[str, Any], config: ScaleConfig, on_min_scale: str, step: int
) -> tuple[ScaleConfig, str, HostSnapshot, int]:
    """Validates a state dict of either scaler into ``(config, on_min_scale, snapshot, step)``.

    The saved options win: torch's three (``growth_factor``, ``backoff_factor``,
    ``growth_interval``) and, in a mixprec state dict, each one under ``"mixprec"``. A torch state
    dict (no ``"mixprec"``) keeps ``config``'s other fields and ``on_min_scale``, refills the
    hysteresis budget and keeps ``step``. The scale is returned as saved (not clamped).

    Raises:
        RuntimeError: ``state_dict`` is empty (saved from a disabled scaler).
        ValueError: keys are missing, or a value is out of range.
    """
    if len(state_dict) == 0:
        raise RuntimeError(
            "The source state dict is empty, possibly because it was saved "
            "from a disabled instance of GradScaler."
        )
    missing = [k for k in _REQUIRED_KEYS if k not in state_dict]
    if missing:
        raise ValueError(
            f"GradScaler.load_state_dict: the state dict lacks {', '.join(map(repr, missing))} (it has "
            f"{', '.join(map(repr, sorted(map(str, state_dict))))}). Pass what scaler.state_dict() "
            "returned (mixprec.GradScaler or torch.amp.GradScaler), e.g. checkpoint['scaler'], not "
            "the model's or the optimizer's state dict."
        )
    extra = dict(state_dict.get("mixprec", {}))
    fields = {f.name for f in dataclasses.fields(ScaleConfig)}
    config = dataclasses.replace(
        config,
        **{k: state_dict[k] for k in TORCH_CONFIG_KEYS},
        **{k: v for k, v in extra.items() if k in fields},
    )
    on_min_scale = extra.get("on_min_scale", on_min_scale)
    if on_min_scale not in ON_MIN_SCALE:
        raise ValueError(f"on_min_scale must be one of {ON_MIN_SCALE}, got {on_min_scale!r}.")
    scale = float(state_dict["scale"])
    _check_scale_value("scale", scale)
    hysteresis_left = int(extra.get("hysteresis_left", config.hysteresis))
    if not 0 <= hysteresis_left <= config.hysteresis:
        raise ValueError(
            f"hysteresis_left must be in [0, hysteresis={config.hysteresis}], got {hysteresis_left}."
        )
    snapshot = HostSnapshot(
        scale, int(state_dict["_growth_tracker"]), hysteresis_left, int(extra.get("skipped_steps", 0))
    )
    return config, on_min_scale, snapshot, int(extra.get("step", step))


def validated_new_scale(new_scale: float | torch.Tensor, current: torch.Tensor, config: ScaleConfig) -> torch.Tensor:
    """``update(new_scale)``'s value as a scale tensor like ``current`` (no host sync).

    A float must lie in ``[min_scale, max_scale]``; a tensor's value is clamped into it on the
    device, and a NaN keeps ``current``.

    Raises:
        ValueError, TypeError: on an out-of-range float or a tensor of the wrong kind.
    """
    if isinstance(new_scale, (int, float)) and not isinstance(new_scale, bool):
        value = float(new_scale)
        _check_scale_value("new_scale", value)
        if not config.lower <= value <= config.upper:
            raise ValueError(
                f"new_scale={value!r} is outside [min_scale, max_scale] = [{config.lower!r}, {config.upper!r}]."
            )
        return torch.full_like(current, config.clamp(value))  # (a float32 rounding may leave the range)
    if not isinstance(new_scale, torch.Tensor):
        raise TypeError(f"new_scale must be a float or a 1-element tensor, got {type(new_scale).__name__}.")
    if new_scale.device.type != current.device.type or new_scale.numel() != 1 or new_scale.requires_grad:
        raise ValueError(
            "new_scale must be a float or a 1-element tensor on the scaler's device type "
            f"({current.device.type!r}) with requires_grad=False."
        )
    value = new_scale.detach().reshape(()).to(device=current.device, dtype=torch.float32, copy=True)
    return torch.where(value.isnan(), current, value.clamp(*config.float32_bounds))


def check_optimizer(optimizer: Any, funcname: str) -> None:
    """Raises ``TypeError`` unless ``optimizer`` looks like a ``torch.optim.Optimizer``."""
    if not (isinstance(getattr(optimizer, "param_groups", None), list) and callable(getattr(optimizer, "step", None))):
        raise TypeError(
            f"scaler.{funcname}() expects a torch.optim.Optimizer (with param_groups and step()), "
            f"got {type(optimizer).__name__}. Pass the optimizer, not the parameters or the model."
        )
