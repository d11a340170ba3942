"""The controller's forecast rules, pure functions of plain floats: a statistic's trend (the EMA
of its per-step slope and its last windows' slopes), the slope a forecast may extrapolate, the
underflow forecast, and the check/shadow calendar."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["MAX_HORIZON", "Trend", "demote_windows", "grow", "log2", "ratio", "shadow_phase", "sustained_slope",
           "underflow_forecast"]

#: the largest ``Controller.horizon`` (windows ahead): a forecast further out is no forecast.
MAX_HORIZON = 100


@dataclass
class Trend:
    """One statistic's last window value (log2 of an amax, or a fraction), the EMA of its
    per-step slope, and the per-step slopes of the last windows (``recent``, newest last).

    Example:
        >>> t = Trend()
        >>> t.update(1.0, 10, 0.5, 3); t.update(2.0, 10, 0.5, 3)
        >>> t.last, t.slope, t.recent
        (2.0, 0.05, (0.1,))
    """

    last: float | None = None
    slope: float = 0.0
    recent: tuple[float, ...] = ()

    def update(self, value: float, steps: int, weight: float, keep: int) -> None:
        """Take a window's ``value`` ``steps`` steps after the last one (EMA weight ``weight``,
        keeping the last ``keep`` slopes). A non-finite value (no data: an amax of 0) is skipped."""
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


def underflow_forecast(underflow: float, amax: Trend, share: Trend, ahead: int, windows: int,
                       scale_free: bool = False) -> float:
    """The underflow fraction forecast ``ahead`` steps on: a current scale flushes a share about
    proportional to the amax (``underflow * 2**(amax rise)``), or the share follows its own trend
    (``underflow + share rise``), the larger, at most 1. ``scale_free``: a cast whose flush does
    not depend on the tensor's scale (e2m1 blocks: each block is scaled by its own amax, NVFP4's
    tensor scale is the amax itself, so ``c * x`` flushes what ``x`` does): the share's own trend
    only, a growing amax forecasts nothing.

    Example:
        >>> underflow_forecast(0.02, Trend(3.0, 0.1, (0.1, 0.1)), Trend(), 10, 2)
        0.04
        >>> underflow_forecast(0.02, Trend(3.0, 0.1, (0.1, 0.1)), Trend(), 10, 2, scale_free=True)
        0.02
    """
    share_rise = underflow + share.rise(ahead, windows)
    if scale_free:
        return min(1.0, share_rise)
    return min(1.0, max(grow(underflow, amax.rise(ahead, windows)), share_rise))


def demote_windows(windows: int, recent_switches: int, to_fp4: bool) -> int:
    """The clean windows in a row a demotion needs: ``windows``; to an fp4 rung, doubled for each
    round trip (two switches) among the ``recent_switches`` of the layer or GEMM (those within
    ``Controller.budget_steps``). An e2m1 cast's flush is a share of ordinary data (about 7-13%),
    close to its limits, and noisy from window to window: a demotion that a promotion had to undo
    says the shadow's clean windows were noise, so the next one waits longer (1, 2, 4, ... times).

    Example:
        >>> [demote_windows(3, n, True) for n in range(6)], demote_windows(3, 5, False)
        ([3, 3, 6, 6, 12, 12], 3)
    """
    return windows << (recent_switches // 2) if to_fp4 else windows


def shadow_phase(step: int, every: int, shadow_steps: int) -> bool:
    """Whether the step after ``step`` :meth:`Controller.step` calls is one of the last
    ``shadow_steps`` of its window of ``every`` (the steps a promoted layer's shadow measures).

    Example:
        >>> [shadow_phase(s, 5, 2) for s in range(6)]
        [False, False, False, True, True, False]
    """
    return every - 1 - step % every < shadow_steps


def grow(value: float, exponent: float) -> float:
    """``value * 2 ** exponent``: inf beyond float64's range (not OverflowError), 0 for a value of 0.

    Example:
        >>> grow(3.0, 2), grow(0.0, 5000), grow(1.0, 5000)
        (12.0, 0.0, inf)
    """
    if value == 0:
        return 0.0
    return value * 2.0 ** exponent if exponent < 1024 else math.copysign(math.inf, value)


def log2(amax: float) -> float:
    """``log2(amax)``, -inf for an amax of 0 (no data)."""
    return math.log2(amax) if amax > 0 else -math.inf


def ratio(value: float, limit: float) -> float:
    """``value / limit``, 0 for a limit of 0 (how close a value is to its limit)."""
    return value / limit if limit > 0 else 0.0
