"""How long the demo will take: a first guess before training, corrected from the first steps.

The first guess is the time per step of ``fp32`` at the ``tiny`` size measured on this project's
CPUs (2 AVX2 cores, no native fp16/bf16), scaled by the model's floating-point work per step and by
each mode's :attr:`Mode.cpu_cost <mixprec.demo.modes.Mode.cpu_cost>`. Once a mode has run a few
steps its measured time per step replaces the guess for its remaining steps and seeds, and the
ratio measured/guessed corrects the modes not yet started. On CUDA there is no first guess.

Example:
    >>> _words(95.0), _words(400.0)
    ('1.6 min', '6.7 min')
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from mixprec.demo.environment import capability
from mixprec.demo.model import SIZES, ModelConfig
from mixprec.demo.modes import MODES
from mixprec.demo.results import ModeResult, Progress
from mixprec.demo.settings import Settings

__all__ = ["Estimate", "guess_seconds", "step_work"]

# fp32 seconds per step at "tiny" (batch 8), measured on 2 AVX2 cores with one intra-op thread
_FP32_TINY_STEP_S = 0.012
# model setup, evaluation and reporting per run, seconds
_PER_RUN_S = 0.5


def step_work(cfg: ModelConfig, batch_size: int) -> float:
    """Multiply-adds of a training step, up to a constant: 6 x weights x tokens plus attention."""
    weights = cfg.n_layers * (4 * cfg.d_model**2 + 2 * cfg.d_model * cfg.hidden) + cfg.d_model * cfg.vocab_size
    tokens = batch_size * cfg.seq_len
    return tokens * (6 * weights + 6 * cfg.n_layers * cfg.seq_len * cfg.d_model)


def guess_seconds(settings: Settings, mode: str) -> float:
    """The first guess of one run of ``mode`` on a CPU like this project's (see module doc)."""
    tiny = step_work(SIZES["tiny"], 8)
    step = _FP32_TINY_STEP_S * step_work(settings.model, settings.batch_size) / tiny
    return _PER_RUN_S + settings.steps * step * MODES[mode].cpu_cost


def _words(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


@dataclass
class Estimate:
    """Tracks the runs of a demo in order and tells ``progress`` (via ``note``) how long is left.

    Use :meth:`start`, then :meth:`watch` around each run (it returns the progress to give
    :func:`~mixprec.demo.train.run_mode`), then :meth:`done`.
    """

    progress: Progress | None
    steps: int
    planned: list[str]  # mode of every run, in order
    guesses: dict[str, float] | None  # seconds per run by mode; None: no first guess (CUDA)
    measured: dict[str, float] = field(default_factory=dict)  # seconds per step by mode
    finished: int = 0
    started: float = field(default_factory=time.perf_counter)
    announced: float | None = None  # the total last announced

    @classmethod
    def start(cls, settings: Settings, planned: list[str], device: torch.device,
              progress: Progress | None, env: dict[str, Any] | None = None) -> Estimate:
        """Announce the first guess of the ``planned`` runs; ``env`` (the run's
        :func:`~mixprec.demo.environment.environment`) says whether this CPU's fp16/bf16 is native,
        unlike the CPU the guess was measured on."""
        guesses = None if device.type == "cuda" else {m: guess_seconds(settings, m) for m in planned}
        est = cls(progress, settings.steps, planned, guesses)
        if guesses is None:
            est._note(f"{len(planned)} runs; the time they take is estimated after the first steps")
        else:
            est.announced = sum(guesses[m] for m in planned)
            here = f"this CPU: {capability(env)}; " if env is not None else ""
            est._note(f"expected duration: about {_words(est.announced)} for {len(planned)} runs (first guess "
                      f"from a 2-core CPU without native fp16/bf16; {here}corrected after the first steps)")
        return est

    def plan(self, modes: list[str]) -> None:
        """Add runs of ``modes`` (a further seed of the modes planned already) to the plan."""
        self.planned.extend(modes)

    def watch(self, mode: str) -> _Watch:
        """The progress for the next run, which reports its first steps' timing back here."""
        return _Watch(self, mode)

    def left(self, current: str | None = None, current_done: int = 0) -> float | None:
        """Seconds left: the rest of the current run and every run not started."""
        rest = self.planned[self.finished + (current is not None):]
        runs = ([(current, self.steps - current_done)] if current is not None else []) + [(m, self.steps) for m in rest]
        factors = [self.measured[m] * self.steps / self._guess_steps(m) for m in self.measured if self._guess_steps(m)]
        if self.guesses is None and not self.measured:
            return None
        factor = statistics.median(factors) if factors else 1.0
        total = 0.0
        for mode, steps in runs:
            if mode in self.measured:
                total += steps * self.measured[mode] + _PER_RUN_S
            elif self.guesses is not None:
                total += self.guesses[mode] * factor * steps / self.steps
            else:  # CUDA, a mode not measured yet: the measured modes' mean time per step
                total += steps * statistics.fmean(self.measured.values()) + _PER_RUN_S
        return total

    def _guess_steps(self, mode: str) -> float:
        return 0.0 if self.guesses is None else self.guesses[mode] - _PER_RUN_S

    def _step_time(self, mode: str, seconds_per_step: float, step: int) -> None:
        if mode in self.measured:
            return
        self.measured[mode] = seconds_per_step
        left = self.left(mode, step)
        if left is None:
            return
        elapsed = time.perf_counter() - self.started
        total = elapsed + left
        if self.announced is None or abs(total - self.announced) > 0.2 * self.announced:
            self._note(f"estimate from the first steps of {mode}: about {_words(left)} left "
                       f"({_words(total)} in all)")
            self.announced = total

    def _finished(self) -> None:
        self.finished += 1

    def done(self) -> None:
        self._note(f"trained {len(self.planned)} runs in {_words(time.perf_counter() - self.started)}")

    def _note(self, text: str) -> None:
        if self.progress is not None:
            self.progress.note(text)


class _Watch:
    """The progress of one run: forwards everything, and times the steps between the first
    report after the warm-up step and one at least three steps later."""

    def __init__(self, estimate: Estimate, mode: str) -> None:
        self._est, self._mode = estimate, mode
        self._first: tuple[int, float] | None = None

    def start(self, mode: str, total: int) -> None:
        if self._est.progress is not None:
            self._est.progress.start(mode, total)

    def update(self, step: int, loss: float, scale: float | None) -> None:
        now = time.perf_counter()
        if step >= 2 and self._first is None:
            self._first = (step, now)
        elif self._first is not None and step - self._first[0] >= 3:
            self._est._step_time(self._mode, (now - self._first[1]) / (step - self._first[0]), step)
        if self._est.progress is not None:
            self._est.progress.update(step, loss, scale)

    def finish(self, result: ModeResult) -> None:
        self._est._finished()
        if self._est.progress is not None:
            self._est.progress.finish(result)

    def note(self, text: str) -> None:
        self._est._note(text)

