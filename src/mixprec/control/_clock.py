"""What a Controller costs the steps it manages, in host time (:class:`CheckClock`): its checks,
its measurements inside the steps, and the one-time notes when either grows past the step."""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from typing import Any, Callable, Mapping

__all__ = ["CheckClock", "NOTE_MEASURE_SHARE"]

#: the share of a window's host time its measurements may take before a one-time note (:class:`CheckClock`)
NOTE_MEASURE_SHARE = 0.25


class CheckClock:
    """What a Controller costs the training steps it manages, in host time (no device sync: on
    an accelerator a check's time includes waiting for the steps queued before its one read, and
    a measurement's is the time to queue its work): its checks, and its measurements inside the
    steps (the probes around each controlled GEMM, their gradient hooks, the per-step part of
    ``Controller.step()``: :meth:`timed`). A step's time runs from one ``Controller.step()``
    call's end to the next one's start.

    Example:
        >>> clock = CheckClock()
        >>> clock.stats()["checks"], clock.timed(abs)(-2), clock.stats()["measure_seconds"] > 0
        (0, 2, True)
    """

    def __init__(self) -> None:
        self.checks = 0
        self.check_seconds = 0.0
        self.last_check_seconds = 0.0
        self.measure_seconds = 0.0  # host seconds of measurements inside the steps (timed)
        self._steps: deque[float] = deque(maxlen=32)  # the latest training steps' seconds
        self._left: float | None = None  # when the last step() call returned
        self._first: float | None = None  # when the first measurement or step() call began
        self._window = (0.0, 0.0)  # (time, measure_seconds) at the last check
        self._entered, self._checking = 0.0, 0.0  # the step() call under way: its start, its check's seconds
        self._noted = self._noted_measure = False

    def __getstate__(self) -> dict[str, Any]:
        return {}  # host timings of this process: a pickled or copied controller measures afresh

    def __setstate__(self, state: Mapping[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]

    def timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn``, its host seconds added to the measurements' (eager code: traced code is not timed)."""
        def run(*args: Any) -> Any:
            start = time.perf_counter()
            self._begin(start)
            try:
                return fn(*args)
            finally:
                self.measure_seconds += time.perf_counter() - start
        return run

    def entered(self) -> None:
        """A ``step()`` call begins: the training step since the last one ended is over."""
        now = time.perf_counter()
        if self._left is not None:
            self._steps.append(now - self._left)
        self._begin(now)
        self._entered = now

    def _begin(self, now: float) -> None:
        """The clock's span starts at its first measurement or ``step()`` call."""
        if self._first is None:
            self._first, self._window = now, (now, self.measure_seconds)

    def left(self) -> None:
        """A ``step()`` call ends: its seconds but a check's were the step's measurements."""
        self._left = time.perf_counter()
        self.measure_seconds += max(self._left - self._entered - self._checking, 0.0)
        self._checking = 0.0

    def checked(self, seconds: float, layers: int, every: int) -> None:
        """A check took ``seconds``; the first one longer than the median training step is noted
        once (on the ``mixprec`` logger: a note, not a warning), with what it costs the run; so
        are, once, measurements that took more than :data:`NOTE_MEASURE_SHARE` of the window's time."""
        self.checks += 1
        self.check_seconds += seconds
        self.last_check_seconds = self._checking = seconds
        now, (since, measured) = time.perf_counter(), self._window
        self._window = (now, self.measure_seconds)
        share = (self.measure_seconds - measured) / max(now - since, 1e-9)
        if not self._noted_measure and share > NOTE_MEASURE_SHARE:
            self._noted_measure = True
            logging.getLogger("mixprec").warning(
                "mixprec fp8: a Controller's measurements took %.0f%% of the last window's host time (%.3g s of "
                "%.3g s, %d layer(s), every=%d): a loss cost near its limit is measured in every window, a far one "
                "less often; a larger every=, a smaller sample= or no max_backward_cost= costs less (ctl.stats() "
                "keeps the figures)", 100 * share, self.measure_seconds - measured, now - since, layers, every)
        step = self.step_seconds()
        if self._noted or step is None or seconds <= step:
            return
        self._noted = True
        share = seconds / (seconds + every * step)
        logging.getLogger("mixprec").warning(
            "mixprec fp8: a Controller check took %.3g s over %d layer(s), longer than the %.3g s training step "
            "it manages: about %.0f%% of the run at every=%d; a larger every= or a smaller sample= costs less "
            "(ctl.stats() keeps the figures)", seconds, layers, step, 100 * share, every)

    def step_seconds(self) -> float | None:
        """The median of the latest training steps' seconds, or None before two ``step()`` calls."""
        return statistics.median(self._steps) if self._steps else None

    def stats(self) -> dict[str, Any]:
        """``checks``, ``check_seconds`` (total), ``last_check_seconds``, ``step_seconds`` (median),
        ``measure_seconds`` (total) and ``measure_share``: the measurements' share of the host time
        since the first of them (None before a ``step()`` call ended)."""
        elapsed = None if self._first is None or self._left is None else self._left - self._first
        return {"checks": self.checks, "check_seconds": self.check_seconds,
                "last_check_seconds": self.last_check_seconds, "step_seconds": self.step_seconds(),
                "measure_seconds": self.measure_seconds,
                "measure_share": None if not elapsed else self.measure_seconds / elapsed}
