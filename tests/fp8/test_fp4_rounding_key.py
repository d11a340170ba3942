"""Stochastic rounding's draws (``RoundingKey``) as a function of ``(seed, step, stream)``: the
traced path (``step`` a 0-d int64 tensor: a layer's counter, read on the device) gives bitwise the
draws of the Python-int path, and each of seed, step and stream changes them. Found by mutation
testing (docs/mutants.md, ``nvfp4-rounding-ignores-stream``): a traced key that dropped the
stream drew the same numbers for every cast of a step, and every run alike, so the resume,
thread and rank comparisons passed."""

from __future__ import annotations

import pytest
import torch

from mixprec.formats._fp4 import RoundingKey

KEYS = [(0, 0, 0), (0, 5, 1), (7, 3, 2), (2**40 + 3, 2**33, 5), (123, 1, 0)]


@pytest.mark.parametrize("seed, step, stream", KEYS)
def test_the_traced_key_draws_as_the_python_key(seed: int, step: int, stream: int) -> None:
    for n in (1, 7, 64):
        ours = RoundingKey(seed, torch.tensor(step), stream).draws((n,), "cpu")
        assert torch.equal(ours, RoundingKey(seed, step, stream).draws((n,), "cpu")), (seed, step, stream, n)


@pytest.mark.parametrize("traced", [False, True])
def test_seed_step_and_stream_each_change_the_draws(traced: bool) -> None:
    def draws(seed: int, step: int, stream: int) -> torch.Tensor:
        return RoundingKey(seed, torch.tensor(step) if traced else step, stream).draws((256,), "cpu")

    base = draws(3, 4, 1)
    for other in (draws(4, 4, 1), draws(3, 5, 1), draws(3, 4, 2)):
        assert (other != base).float().mean() > 0.9  # independent streams, not shifted copies
    assert bool(((base >= 0) & (base < 1)).all())
