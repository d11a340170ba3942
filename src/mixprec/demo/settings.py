"""What the demo trains and for how long: :class:`Settings` and the size presets.

Example:
    >>> settings = Settings.for_size("tiny", steps=5)
    >>> settings.steps, settings.batch_size
    (5, 8)
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from mixprec.demo.model import SIZES, ModelConfig

__all__ = ["Settings", "MAX_SEED", "lr_factor"]


#: how the fp8/fp4 modes' emulated GEMMs may accumulate (:attr:`Settings.fp8_accumulate`)
FP8_ACCUMULATE = ("float32", "tensor_core")


@dataclass(frozen=True)
class Settings:
    """What to train and how long.

    Attributes:
        model: the model's shape.
        steps: optimizer steps per mode (>= 1).
        batch_size: sequences per batch.
        lr: peak learning rate (linear warm-up over the first 10% of steps, then cosine to 10%).
        seed: seeds the weights, the batches and the evaluation windows (``0 <= seed < 2**63``).
        eval_batches: validation batches for the final evaluation loss.
        size: the name of the size preset these settings came from ("custom" otherwise).
        untimed_steps: first steps left out of the throughput (warm-up: allocations, kernel
            selection, lazily created optimizer state); all steps are timed when there are no
            more than this many.
        fused: use ``torch.optim.AdamW(fused=True)`` (one kernel per step; the loss scalers then
            unscale and skip inside it) wherever the mode's optimizer is torch's AdamW.
        fp8_accumulate: how the fp8 and fp4 modes' emulated GEMMs accumulate: ``"float32"`` (their
            default backends) or ``"tensor_core"`` (``backend="emulate_tc"``: as an fp8 tensor core,
            about 14 bits kept, promoted to float32 every 128 elements of K; docs/cuda.md).
    """

    model: ModelConfig
    steps: int
    batch_size: int
    lr: float
    seed: int = 0
    eval_batches: int = 4
    size: str = "custom"
    untimed_steps: int = 1
    fused: bool = False
    fp8_accumulate: str = "float32"

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.eval_batches < 1:
            raise ValueError(f"eval_batches must be >= 1, got {self.eval_batches}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral) or not 0 <= self.seed < MAX_SEED:
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        object.__setattr__(self, "seed", int(self.seed))  # e.g. numpy.int64 -> int, for torch
        if self.untimed_steps < 0:
            raise ValueError(f"untimed_steps must be >= 0, got {self.untimed_steps}")
        if self.fp8_accumulate not in FP8_ACCUMULATE:
            raise ValueError(f"fp8_accumulate must be one of {', '.join(FP8_ACCUMULATE)}, got {self.fp8_accumulate!r}")

    @classmethod
    def for_size(cls, size: str, *, steps: int | None = None, seed: int = 0) -> Settings:
        """The preset for ``size`` ("tiny", "small" or "base"), optionally with other steps/seed.

        Raises:
            ValueError: for an unknown size.
        """
        if size not in SIZES:
            raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
        default_steps, batch_size, lr = _TRAIN_PRESETS[size]
        return cls(
            model=SIZES[size],
            steps=default_steps if steps is None else steps,
            batch_size=batch_size,
            lr=lr,
            seed=seed,
            size=size,
        )

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.model.seq_len

    @property
    def timed_steps(self) -> range:
        """The steps whose time makes the throughput: all but the first ``untimed_steps``, or
        every step when that would leave none."""
        return range(self.untimed_steps if self.steps > self.untimed_steps else 0, self.steps)


#: Seeds are integers in ``[0, MAX_SEED)`` (torch takes 64-bit seeds; evaluation uses ``seed + 1``).
MAX_SEED = 2**63


# size -> (steps, batch_size, lr); "tiny" trains the ten default modes from one seed in 0.6 to 1.7 min
# on 2 CPU cores (docs/demo.md). Its peak lr is where a run stops being chaotic: at 3e-3 (and
# 2e-3) rounding the initial weights to bf16 once, then training in fp32, moved seed 2's validation
# loss by +0.12 nats, so modes were ranked by chance; at 1.25e-3 it moves no seed by more than
# 0.0001 and every mode's seed-by-seed difference to fp32 is systematic (docs/demo.md, "A preset
# that is not chaotic"). "small" at 2e-3 passes the same test (at most 0.0002).
_TRAIN_PRESETS: dict[str, tuple[int, int, float]] = {
    "tiny": (120, 8, 1.25e-3),
    "small": (300, 16, 2e-3),
    "base": (600, 32, 1e-3),
}


def lr_factor(step: int, steps: int) -> float:
    """Learning-rate multiplier of ``step``: linear warm-up over 10% of ``steps``, then cosine to 0.1."""
    warmup = max(1, steps // 10)
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))
