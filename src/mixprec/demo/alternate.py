"""Timing two modes that run the same kernels, step by step in alternation, with a noise band.

A demo trains its modes one after the other, so a change of load between two runs shows as a
speed difference (``mixprec-fp16`` once took 1.32x ``torch-amp``'s time per token, although both
run the same kernels and train bitwise alike). For a mode and its bitwise reference,
:func:`time_pair` builds both and times one training step of each in turn, round after round
(the order alternating: AB, BA, ...), on one fixed batch; :func:`pair_ratio` turns the step
times into the median of the per-round ratios and their interquartile range, the noise band, and
:func:`pair_words` says whether the two are the same within it.

Example:
    >>> timing = pair_ratio([1.0, 1.1, 0.9, 1.0, 1.2], [1.0, 1.0, 1.0, 1.0, 1.0])
    >>> timing["ratio"], timing["low"], timing["high"], timing["rounds"]
    (1.0, 1.0, 1.1, 5)
    >>> pair_words(timing, "torch-amp")
    "1.00x torch-amp's time (noise band 1.00-1.10x, quartiles of 5 alternated rounds): the same within the noise"
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

from mixprec.demo.corpus import batch_offsets, make_batch
from mixprec.demo.model import TransformerLM, lm_loss
from mixprec.demo.modes import MODES
from mixprec.demo.settings import Settings

__all__ = ["time_pair", "pair_ratio", "pair_words", "PAIR_ROUNDS", "PAIR_BUDGET_S"]

#: The most alternated rounds :func:`time_pair` times, and the seconds after which it stops (at
#: least :data:`_MIN_ROUNDS` rounds).
PAIR_ROUNDS = 9
PAIR_BUDGET_S = 20.0
_MIN_ROUNDS = 3


def pair_ratio(mode_s: list[float], reference_s: list[float]) -> dict[str, Any]:
    """The per-round ratios ``mode_s[i] / reference_s[i]`` of two alternated timings: their
    median (``ratio``), lower and upper quartiles (``low``, ``high``: the noise band, the range
    from one round) and count (``rounds``).

    Raises:
        ValueError: no rounds, or lists of different lengths, or a time that is not positive.
    """
    if not mode_s or len(mode_s) != len(reference_s) or min(mode_s + reference_s) <= 0:
        raise ValueError(f"expected two equally long lists of positive step times, got {mode_s}, {reference_s}")
    ratios = [a / b for a, b in zip(mode_s, reference_s)]
    low, _, high = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
    return {"ratio": statistics.median(ratios), "low": low, "high": high, "rounds": len(ratios),
            "mode_s": statistics.median(mode_s), "reference_s": statistics.median(reference_s)}


def pair_words(timing: dict[str, Any], reference: str) -> str:
    """:func:`pair_ratio`'s result in words: the ratio, its noise band, and whether the two are
    the same within it (the band holds 1) or not: a difference beyond it is measured, not noise."""
    same = timing["low"] <= 1.0 <= timing["high"]
    return (f"{timing['ratio']:.2f}x {reference}'s time (noise band {timing['low']:.2f}-{timing['high']:.2f}x, "
            f"quartiles of {timing['rounds']} alternated rounds): "
            + ("the same within the noise" if same else "different beyond the noise"))


def _stepper(name: str, settings: Settings, device: torch.device) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """One training step of a fresh model in mode ``name`` (as :func:`mixprec.demo.train.run_mode`
    takes it, without the recording)."""
    torch.manual_seed(settings.seed)
    model = TransformerLM(settings.model).to(device)
    setup = MODES[name].setup(model, settings, device)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        setup.optimizer.zero_grad(set_to_none=True)
        with setup.autocast():
            loss = lm_loss(model(x), y)
        if setup.scaler is None:
            loss.backward()
            setup.optimizer.step()
        else:
            setup.scaler.scale(loss).backward()
            setup.scaler.step(setup.optimizer)
            setup.scaler.update()
        if setup.fp8_controller is not None:
            setup.fp8_controller.step()
        if setup.fp8_guard is not None:
            setup.fp8_guard.step(model)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return step


def time_pair(mode: str, reference: str, settings: Settings, device: torch.device, train: torch.Tensor,
              rounds: int = PAIR_ROUNDS, budget_s: float = PAIR_BUDGET_S) -> dict[str, Any]:
    """Time one training step of ``mode`` and one of ``reference`` in turn (after one untimed
    step each), ``rounds`` times or until ``budget_s`` seconds have passed (at least 3 rounds),
    on the first batch of ``settings``' run drawn from ``train``; returns :func:`pair_ratio`'s
    result. Host syncs every step (the loss scaler's, and CUDA's).

    Raises:
        ValueError: ``rounds`` below 3, or an unknown mode.
    """
    if rounds < _MIN_ROUNDS or mode not in MODES or reference not in MODES:
        raise ValueError(f"expected rounds >= {_MIN_ROUNDS} and modes among {', '.join(MODES)}, "
                         f"got {rounds}, {mode!r}, {reference!r}")
    offsets = batch_offsets(len(train), 1, settings.batch_size, settings.model.seq_len, settings.seed)
    x, y = make_batch(train, offsets[0], settings.model.seq_len, device)
    steps = {mode: _stepper(mode, settings, device), reference: _stepper(reference, settings, device)}
    for step in steps.values():
        step(x, y)
    times: dict[str, list[float]] = {mode: [], reference: []}
    start = time.perf_counter()
    for round_ in range(rounds):
        for name in ((mode, reference) if round_ % 2 == 0 else (reference, mode)):
            begin = time.perf_counter()
            steps[name](x, y)
            times[name].append(time.perf_counter() - begin)
        if round_ + 1 >= _MIN_ROUNDS and time.perf_counter() - start > budget_s:
            break
    return pair_ratio(times[mode], times[reference])
