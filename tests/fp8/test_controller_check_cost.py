"""What a Controller costs: ``ctl.stats()`` (host seconds, no sync) of its checks and of its
measurements inside the training steps (the probes around each GEMM, their gradient hooks), and
one-time notes on the ``mixprec`` logger when a check takes longer than the training step it
manages or the measurements take much of a window (issue 39)."""

from __future__ import annotations

import logging
import pickle
import time

import pytest
import torch
from torch import nn

import mixprec
from mixprec import Controller, Policy


def _tracked(every: int) -> tuple[Controller, nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)])
    ctl = Controller(every=every).attach(model)
    with mixprec.autocast("cpu", policy=Policy.fp8("tensorwise", first_last="fp8", controller=ctl.settings)):
        model(torch.randn(4, 32)).float().sum().backward()
    return ctl, model


def test_stats_count_the_checks_and_their_seconds():
    ctl, _ = _tracked(every=5)
    stats = ctl.stats()
    assert (stats["checks"], stats["check_seconds"], stats["last_check_seconds"], stats["step_seconds"]) == (0, 0.0, 0.0, None)
    assert stats["measure_seconds"] >= 0 and stats["measure_share"] is None  # (the probes of the first forward)
    for _ in range(10):
        ctl.step()
    stats = ctl.stats()
    assert stats["checks"] == 2 and stats["check_seconds"] >= stats["last_check_seconds"] > 0
    assert stats["step_seconds"] is not None and stats["step_seconds"] >= 0
    assert pickle.loads(pickle.dumps(ctl)).stats()["checks"] == 0  # host timings of this process only


def test_a_check_longer_than_the_step_is_noted_once(caplog):
    """Steps that do nothing but call ``step()`` take microseconds; a check of six layers (a stack,
    one read, the decisions) takes longer: the note comes once, with the figures."""
    ctl, _ = _tracked(every=2)
    with caplog.at_level(logging.WARNING, logger="mixprec"):
        for _ in range(12):
            ctl.step()
    notes = [r for r in caplog.records if "Controller check took" in r.getMessage()]
    assert len(notes) == 1 and "6 layer(s)" in notes[0].getMessage() and "every=2" in notes[0].getMessage()
    assert ctl.stats()["checks"] == 6


DELAY = 0.01


class _VirtualTime:
    """A host clock that only the measurements made slow on purpose move (exact figures)."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def _slowed(monkeypatch, where: str, clock: _VirtualTime) -> list:
    """Make one kind of measurement take :data:`DELAY` s of ``clock`` per call (the forward
    probe's loss cost, its gradient hook, the backward GEMMs' measurement, the step's own part);
    returns the list its calls go to."""
    from mixprec.control import _backward, _clock, _controller, _cost, _fold

    monkeypatch.setattr(_clock, "time", clock)
    monkeypatch.setattr(_controller, "time", clock)  # (the checks' seconds)
    target, name = {"forward": (_cost, "output_errors"), "hook": (_cost, "_accumulate_cost"),
                    "backward": (_backward.BackwardCost, "_measure"), "step": (_fold.StepWrites, "end_steps")}[where]
    original, calls = getattr(target, name), []

    def slow(*args):
        calls.append(1)
        clock.now += DELAY
        return original(*args)

    monkeypatch.setattr(target, name, slow)
    return calls


def _train_costed(steps: int) -> Controller:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 16))
    ctl = Controller(every=5, per_gemm=True, ladder=("nvfp4", "tensorwise", "rowwise", "compute"),
                     max_loss_cost=1e-3, max_backward_cost=1e-4).attach(model)
    policy = Policy.parse("compute=bf16").fp8("nvfp4", first_last="fp8", controller=ctl.settings, backend="emulate_fp32")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        with mixprec.autocast("cpu", policy=policy):
            loss = model(torch.randn(32, 32, generator=gen)).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        ctl.step()
    return ctl


@pytest.mark.parametrize("where", ["forward", "hook", "backward", "step"])
def test_the_measurements_inside_the_steps_are_counted(monkeypatch, where):
    """Each kind of measurement, made slow on purpose on a clock only it moves, is counted in
    ``measure_seconds`` exactly once per call (not missed, not counted twice by a wrapper around
    it), and is the whole ``measure_share``; the checks keep their own seconds."""
    clock = _VirtualTime()
    calls = _slowed(monkeypatch, where, clock)
    ctl = _train_costed(12)
    stats = ctl.stats()
    assert len(calls) >= 2
    assert stats["measure_seconds"] == pytest.approx(DELAY * len(calls))
    assert stats["checks"] == 2 and stats["check_seconds"] == 0.0  # (the clock moved only in the measurements)
    assert stats["measure_share"] == pytest.approx(1.0)


def test_measurements_that_take_much_of_a_window_are_noted_once(monkeypatch, caplog):
    _slowed(monkeypatch, "forward", _VirtualTime())  # a loss cost measured on every step of the first windows
    with caplog.at_level(logging.WARNING, logger="mixprec"):
        _train_costed(15)
    notes = [r.getMessage() for r in caplog.records if "measurements took" in r.getMessage()]
    assert len(notes) == 1 and "every=5" in notes[0] and "3 layer(s)" in notes[0]
