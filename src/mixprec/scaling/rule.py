"""The dynamic loss-scale rule as a pure transition ``(state, found_inf) -> state``.

Everything here is a function of its arguments: no module state, no in-place change of the inputs,
no host synchronisation. The state is a :class:`ScaleState` of 0-dim tensors that live on the
scaler's device, so the rule runs there (for example on a CUDA stream) without reading anything
back to the host. :class:`mixprec.GradScaler` is a thin stateful shell around :func:`update_scale`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import torch

__all__ = [
    "FLOAT32_TINY",
    "FLOAT32_MAX",
    "ScaleConfig",
    "ScaleState",
    "init_state",
    "update_scale",
    "backoff_blocked",
]

#: Smallest positive *normal* float32 (2**-126): the scale never goes below it, even without
#: ``min_scale``, so it never becomes subnormal or 0.
FLOAT32_TINY: float = torch.finfo(torch.float32).tiny
#: Largest finite float32: the scale never becomes inf.
FLOAT32_MAX: float = torch.finfo(torch.float32).max


def _check_scale_value(name: str, value: float) -> None:
    if not (math.isfinite(value) and FLOAT32_TINY <= value <= FLOAT32_MAX):
        raise ValueError(
            f"{name} must be a finite float32 number >= {FLOAT32_TINY!r} (the smallest normal "
            f"float32), got {value!r}. Pick a power of two such as 2.0**16."
        )


@dataclass(frozen=True)
class ScaleConfig:
    """The static parameters of the dynamic loss-scale rule (see :func:`update_scale`).

    Args:
        growth_factor: multiplies the scale after ``growth_interval`` clean steps in a row (> 1).
        backoff_factor: multiplies the scale when a backoff is due (in (0, 1)).
        growth_interval: number of consecutive clean steps before the scale grows (>= 1).
        hysteresis: number of overflows tolerated before the scale backs off (>= 1; 1 = back off on
            every overflow, which is what ``torch.amp.GradScaler`` does).
        consecutive_hysteresis: refill the hysteresis budget after every clean step (DeepSpeed's
            ``consecutive_hysteresis``) instead of only when the scale grows (Megatron's rule).
        min_scale: lower bound of the scale (``None``: the smallest normal float32, 2**-126).
        max_scale: upper bound of the scale (``None``: the largest finite float32).

    Raises:
        ValueError: on an out-of-range value; the message says which and what is allowed.

    Example:
        >>> import dataclasses
        >>> cfg = ScaleConfig(hysteresis=2, min_scale=1.0)
        >>> dataclasses.replace(cfg, growth_interval=100).growth_interval
        100
    """

    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    consecutive_hysteresis: bool = False
    min_scale: float | None = None
    max_scale: float | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.growth_factor) and self.growth_factor > 1.0):
            raise ValueError(f"growth_factor must be a finite number > 1.0, got {self.growth_factor!r}.")
        if not (0.0 < self.backoff_factor < 1.0):
            raise ValueError(f"backoff_factor must be in (0, 1), got {self.backoff_factor!r}.")
        if isinstance(self.growth_interval, bool) or not isinstance(self.growth_interval, int):
            raise TypeError(f"growth_interval must be an int, got {type(self.growth_interval).__name__}.")
        if self.growth_interval < 1:
            raise ValueError(f"growth_interval must be >= 1, got {self.growth_interval}.")
        if isinstance(self.hysteresis, bool) or not isinstance(self.hysteresis, int):
            raise TypeError(f"hysteresis must be an int, got {type(self.hysteresis).__name__}.")
        if self.hysteresis < 1:
            raise ValueError(
                f"hysteresis must be >= 1 (1 backs off on every overflow), got {self.hysteresis}."
            )
        if self.min_scale is not None:
            _check_scale_value("min_scale", float(self.min_scale))
        if self.max_scale is not None:
            _check_scale_value("max_scale", float(self.max_scale))
        if self.lower > self.upper:
            raise ValueError(
                f"min_scale ({self.min_scale!r}) must not exceed max_scale ({self.max_scale!r})."
            )
        if self.float32_bounds[0] > self.float32_bounds[1]:
            raise ValueError(
                f"no float32 number lies in [min_scale, max_scale] = [{self.min_scale!r}, {self.max_scale!r}] "
                "(the scale is a float32): widen the range, e.g. to powers of two."
            )

    @property
    def lower(self) -> float:
        """The effective lower bound: ``min_scale``, or 2**-126 when it is ``None``."""
        return FLOAT32_TINY if self.min_scale is None else float(self.min_scale)

    @property
    def upper(self) -> float:
        """The effective upper bound: ``max_scale``, or the largest float32 when it is ``None``."""
        return FLOAT32_MAX if self.max_scale is None else float(self.max_scale)

    @cached_property
    def float32_bounds(self) -> tuple[float, float]:
        """``(lower, upper)`` rounded to float32 toward the inside of the range: what the scale (a
        float32) is clamped to. A bound float32 cannot hold (``max_scale=3e38``) would round to
        the nearest float32, which may lie outside ``[min_scale, max_scale]``."""
        return _float32_inside(self.lower, up=True), _float32_inside(self.upper, up=False)

    def clamp(self, scale: float) -> float:
        """``scale`` (a host float) clamped into ``[lower, upper]`` so that it stays inside once
        rounded to float32 (it is returned as given when it does)."""
        lo, hi = self.float32_bounds
        value = min(max(scale, lo), hi)
        nearest = float(torch.tensor(value, dtype=torch.float32))  # what the scale tensor will hold
        return hi if nearest > hi else lo if nearest < lo else value


def _float32_inside(value: float, up: bool) -> float:
    """``value`` as a float32, rounded up (``up``) or down where float32 cannot hold it (on the
    host, no device involved)."""
    rounded = torch.tensor(value, dtype=torch.float32)
    if float(rounded) < value if up else float(rounded) > value:
        rounded = torch.nextafter(rounded, torch.tensor(math.inf if up else -math.inf, dtype=torch.float32))
    return float(rounded)


class ScaleState(NamedTuple):
    """The changing part of the loss scaler: three 0-dim tensors on one device.

    Attributes:
        scale: ``float32``, the current loss scale.
        growth_tracker: ``int32``, clean steps since the last overflow or growth.
        hysteresis_left: ``int32``, overflows still tolerated before a backoff (in
            ``[0, hysteresis]``; unused, and left as it is, when ``hysteresis == 1``).
    """

    scale: torch.Tensor
    growth_tracker: torch.Tensor
    hysteresis_left: torch.Tensor


def init_state(
    init_scale: float,
    config: ScaleConfig,
    device: torch.device | str = "cpu",
    *,
    growth_tracker: int = 0,
    hysteresis_left: int | None = None,
) -> ScaleState:
    """A fresh :class:`ScaleState` on ``device`` (``hysteresis_left`` defaults to the full budget).

    Raises:
        ValueError: if ``init_scale`` is not a finite normal float32 number.
    """
    _check_scale_value("init_scale", float(init_scale))
    left = config.hysteresis if hysteresis_left is None else hysteresis_left
    return ScaleState(
        torch.full((), init_scale, dtype=torch.float32, device=device),
        torch.full((), growth_tracker, dtype=torch.int32, device=device),
        torch.full((), left, dtype=torch.int32, device=device),
    )


def update_scale(state: ScaleState, found_inf: torch.Tensor, config: ScaleConfig) -> ScaleState:
    """Returns the state after one optimizer iteration; ``found_inf != 0`` means it overflowed.

    The algorithm, with ``s`` the scale, ``t`` the growth tracker, ``h`` the hysteresis budget
    left, ``H = config.hysteresis``, ``lo = min_scale or 2**-126``, ``hi = max_scale or
    float32 max``, and float32 rounding written ``f32(.)`` (products are taken in float64 and
    rounded once, exactly as ``torch._amp_update_scale_`` does)::

        if found_inf:                       # overflow: the optimizer step was skipped
            t = 0
            h = max(h - 1, 0)
            if H == 1 or h == 0:            # hysteresis budget exhausted: back off
                s = f32(s * backoff_factor)
            # else: tolerated, the scale is kept
        else:                               # clean step
            t = t + 1
            if consecutive_hysteresis:
                h = H
            if t == growth_interval:
                t = 0
                h = H                       # growth refills the hysteresis budget
                if isfinite(f32(s * growth_factor)):
                    s = f32(s * growth_factor)
        s = min(max(s, lo), hi)             # bounds: never 0, subnormal or inf
                                            # (lo, hi rounded to float32 inward: float32_bounds)

    Once ``h`` reaches 0 every further overflow backs off until a growth (or, with
    ``consecutive_hysteresis``, a clean step) refills it. With the defaults (``hysteresis=1``,
    no bounds) this is bit for bit the rule of ``torch.amp.GradScaler``, except that the scale
    stops at 2**-126 where torch's would go on into subnormals after ~140 overflows in a row.

    Args:
        state: the current state; not modified.
        found_inf: a 0-dim float32 tensor on ``state.scale.device`` (any nonzero value counts as
            an overflow, e.g. a sum of per-optimizer flags).
        config: the rule's parameters.

    Returns:
        A new :class:`ScaleState`; no host synchronisation happens.

    Example:
        >>> cfg = ScaleConfig(growth_interval=1)
        >>> s = init_state(4.0, cfg)
        >>> update_scale(s, torch.tensor(0.0), cfg).scale.item()
        8.0
        >>> update_scale(s, torch.tensor(1.0), cfg).scale.item()
        2.0
    """
    found = found_inf.to(device=state.scale.device, dtype=torch.float32)
    scale = state.scale.clone()
    tracker = state.growth_tracker.clone()
    torch._amp_update_scale_(
        scale,
        tracker,
        found,
        config.growth_factor,
        config.backoff_factor,
        config.growth_interval,
    )
    left = state.hysteresis_left
    lo, hi = config.float32_bounds
    if config.hysteresis > 1:
        overflow = found != 0
        decremented = (left - 1).clamp_min(0)
        scale = torch.where(overflow & (decremented > 0), state.scale, scale)
        refill = ~overflow if config.consecutive_hysteresis else (~overflow) & (tracker == 0)
        left = torch.where(overflow, decremented, torch.where(refill, config.hysteresis, left))
    if config.max_scale is None:
        scale = scale.clamp_min(lo)
    else:
        scale = scale.clamp(lo, hi)
    return ScaleState(scale, tracker, left)


def backoff_blocked(state: ScaleState, found_inf: torch.Tensor, config: ScaleConfig) -> torch.Tensor:
    """A 0-dim bool tensor: this overflow is due a backoff but the scale is already at the floor.

    That is ``found_inf`` and the hysteresis budget is (or becomes) exhausted and ``state.scale
    <= lower bound``: lowering the scale cannot help any more. Evaluated on the device; reading
    it is the caller's host sync.
    """
    overflow = found_inf.to(device=state.scale.device) != 0
    due = overflow if config.hysteresis == 1 else overflow & (state.hysteresis_left <= 1)
    return due & (state.scale <= config.float32_bounds[0])
