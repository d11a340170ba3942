"""How long the demo will take: a first guess before training, corrected as it runs.

The first guess of a mode's time per step is, when the speed panel timed the trained size here,
the panel's step time of the mode's kind (:attr:`Mode.speed_kind
<mixprec.demo.modes.Mode.speed_kind>`, measured under this machine's load), scaled by the batch
and by the mode's cost within its kind; otherwise the time per step of ``fp32`` at the ``tiny``
size measured on this project's CPUs (2 AVX2 cores, no native fp16/bf16), scaled by the model's
floating-point work, by each mode's :attr:`Mode.cpu_cost <mixprec.demo.modes.Mode.cpu_cost>` and
by the machine's load (:func:`load_factor`: a thread shares its core with the load's other
work). Once a mode has run a few steps its measured time per step replaces the guess for its
remaining steps, and each finished run replaces it with that run's whole time (evaluation and
set-up included) for the mode's later seeds; the ratio measured/guessed corrects the modes not yet
started. A new estimate is announced whenever it moves by more than 20%. On CUDA there is no
first guess.

Example:
    >>> _words(95.0), _words(400.0)
    ('1.6 min', '6.7 min')
    >>> load_factor(threads=1, cores=2, load=4.6)
    2.8
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

__all__ = ["Estimate", "guess_seconds", "load_factor", "step_work"]

# fp32 seconds per step at "tiny" (batch 8), measured on 2 AVX2 cores with one intra-op thread
_FP32_TINY_STEP_S = 0.012
# model setup, evaluation and reporting per run, seconds
_PER_RUN_S = 0.5


def step_work(cfg: ModelConfig, batch_size: int) -> float:
    """Multiply-adds of a training step, up to a constant: 6 x weights x tokens plus attention."""
    weights = cfg.n_layers * (4 * cfg.d_model**2 + 2 * cfg.d_model * cfg.hidden) + cfg.d_model * cfg.vocab_size
    tokens = batch_size * cfg.seq_len
    return tokens * (6 * weights + 6 * cfg.n_layers * cfg.seq_len * cfg.d_model)


def load_factor(threads: int, cores: int, load: float) -> float:
    """How much slower than on an idle machine ``threads`` threads run on ``cores`` cores busy
    with ``load`` (the 1-minute load average, taken before the run, i.e. other work): the
    runnable threads over the cores, at least 1.

    Example:
        >>> load_factor(1, 2, 0.3), load_factor(1, 2, 7.0)
        (1.0, 4.0)
    """
    if cores < 1 or threads < 1 or load < 0:
        raise ValueError(f"expected threads >= 1, cores >= 1, load >= 0; got {threads}, {cores}, {load}")
    return round(max(1.0, (load + threads) / cores), 2)


def _kind_cost(kind: str) -> float:
    """The cheapest :attr:`Mode.cpu_cost` among the modes of a speed-panel kind: the panel's
    plain autocast step of that kind."""
    return min(m.cpu_cost for m in MODES.values() if m.speed_kind == kind)


def guess_seconds(settings: Settings, mode: str, panel: dict[str, Any] | None = None, load: float = 1.0) -> float:
    """The first guess of one run of ``mode`` (see module doc): from ``panel`` (the speed
    panel, :func:`mixprec.demo.speed.measure`) when it timed ``settings.size``, else from this
    project's CPU multiplied by ``load`` (:func:`load_factor`)."""
    m = MODES[mode]
    entry = next((e for e in (panel or {}).get("sizes", []) if e["size"] == settings.size), None)
    if entry is not None and m.speed_kind in entry["seconds"]:
        step = (entry["seconds"][m.speed_kind] * settings.batch_size / panel["batch_size"]
                * m.cpu_cost / _kind_cost(m.speed_kind))
        return _PER_RUN_S + settings.steps * step
    tiny = step_work(SIZES["tiny"], 8)
    step = _FP32_TINY_STEP_S * step_work(settings.model, settings.batch_size) / tiny
    return (_PER_RUN_S + settings.steps * step * m.cpu_cost) * load


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
    measured: dict[str, float] = field(default_factory=dict)  # seconds per step by mode (first steps)
    run_seconds: dict[str, float] = field(default_factory=dict)  # seconds of the last finished run by mode
    finished: int = 0
    started: float = field(default_factory=lambda: time.perf_counter())
    announced: float | None = None  # the total last announced

    @classmethod
    def start(cls, settings: Settings, planned: list[str], device: torch.device,
              progress: Progress | None, env: dict[str, Any] | None = None,
              panel: dict[str, Any] | None = None) -> Estimate:
        """Announce the first guess of the ``planned`` runs. ``env`` (the run's
        :func:`~mixprec.demo.environment.environment`) gives the load the guess scales by
        (``cores``, ``load``, ``threads``) and whether this CPU's fp16/bf16 is native; ``panel``
        (the speed panel) gives measured step times when it timed ``settings.size``."""
        if device.type == "cuda":
            est = cls(progress, settings.steps, planned, None)
            est._note(f"{len(planned)} runs; the time they take is estimated after the first steps")
            return est
        env = env or {}
        from_panel = any(e["size"] == settings.size for e in (panel or {}).get("sizes", []))
        if from_panel:
            load, source = 1.0, f"from the speed panel's steps at `{settings.size}` on this machine, under its load"
        elif "load" in env and "cores" in env:
            load = load_factor(env.get("threads", 1), env["cores"], env["load"])
            source = (f"from a 2-core CPU without native fp16/bf16, x{load:g} for load {env['load']:.1f} on "
                      f"{env['cores']} core{'s' if env['cores'] > 1 else ''}")
        else:
            load, source = 1.0, "from a 2-core CPU without native fp16/bf16, load unknown"
        guesses = {m: guess_seconds(settings, m, panel, load) for m in planned}
        est = cls(progress, settings.steps, planned, guesses)
        est.announced = sum(guesses[m] for m in planned)
        here = f"; this CPU: {capability(env)}" if "cpu_lowp" in env else ""
        est._note(f"expected duration: about {_words(est.announced)} for {len(planned)} runs (first guess "
                  f"{source}{here}; corrected as it runs)")
        return est

    def plan(self, modes: list[str]) -> None:
        """Add runs of ``modes`` (a further seed of the modes planned already) to the plan."""
        self.planned.extend(modes)

    def watch(self, mode: str) -> _Watch:
        """The progress for the next run, which reports its first steps' timing and its whole
        time back here."""
        return _Watch(self, mode)

    def _factor(self) -> float:
        """Measured over guessed, the median over the modes measured so far (1 without either)."""
        if self.guesses is None:
            return 1.0
        ratios = [self.run_seconds[m] / self.guesses[m] if m in self.run_seconds
                  else self.measured[m] * self.steps / self._guess_steps(m)
                  for m in dict.fromkeys([*self.run_seconds, *self.measured]) if self._guess_steps(m) > 0]
        return statistics.median(ratios) if ratios else 1.0

    def _run(self, mode: str, factor: float) -> float:
        """Seconds of a whole run of ``mode``, as well as known now."""
        if mode in self.run_seconds:
            return self.run_seconds[mode]
        if mode in self.measured:
            return self.steps * self.measured[mode] + _PER_RUN_S
        if self.guesses is not None:
            return self.guesses[mode] * factor
        known = [self._run(m, factor) for m in dict.fromkeys([*self.run_seconds, *self.measured])]
        return statistics.fmean(known)  # CUDA, a mode not measured yet: the measured modes' mean

    def left(self, current: str | None = None, current_done: int = 0) -> float | None:
        """Seconds left: the rest of the current run (``current_done`` of its steps done) and
        every run not started; None before anything was measured on CUDA."""
        if self.guesses is None and not self.measured and not self.run_seconds:
            return None
        factor = self._factor()
        rest = self.planned[self.finished + (current is not None):]
        total = sum(self._run(m, factor) for m in rest)
        if current is not None:
            per_step = self.measured.get(current, (self._run(current, factor) - _PER_RUN_S) / self.steps)
            total += (self.steps - current_done) * per_step + _PER_RUN_S
        return total

    def _guess_steps(self, mode: str) -> float:
        return 0.0 if self.guesses is None else self.guesses[mode] - _PER_RUN_S

    def _announce(self, why: str, left: float | None) -> None:
        """Say the new estimate when it moved by more than 20% from the one announced."""
        if left is None:
            return
        total = time.perf_counter() - self.started + left
        if self.announced is None or abs(total - self.announced) > 0.2 * self.announced:
            self._note(f"estimate {why}: about {_words(left)} left ({_words(total)} in all)")
            self.announced = total

    def _step_time(self, mode: str, seconds_per_step: float, step: int) -> None:
        if mode in self.measured:
            return
        self.measured[mode] = seconds_per_step
        self._announce(f"from the first steps of {mode}", self.left(mode, step))

    def _finished(self, mode: str, seconds: float) -> None:
        self.finished += 1
        self.run_seconds[mode] = seconds
        self.measured.pop(mode, None)  # the whole run replaces its first steps
        if self.finished < len(self.planned):
            self._announce(f"after {self.finished} of {len(self.planned)} runs ({mode}: {_words(seconds)})",
                           self.left())

    def done(self) -> None:
        self._note(f"trained {len(self.planned)} runs in {_words(time.perf_counter() - self.started)}")

    def _note(self, text: str) -> None:
        if self.progress is not None:
            self.progress.note(text)


class _Watch:
    """The progress of one run: forwards everything, times the steps between the first report
    after the warm-up step and one at least three steps later, and the whole run."""

    def __init__(self, estimate: Estimate, mode: str) -> None:
        self._est, self._mode = estimate, mode
        self._first: tuple[int, float] | None = None
        self._created = time.perf_counter()

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
        if self._est.progress is not None:
            self._est.progress.finish(result)
        self._est._finished(self._mode, time.perf_counter() - self._created)

    def note(self, text: str) -> None:
        self._est._note(text)
