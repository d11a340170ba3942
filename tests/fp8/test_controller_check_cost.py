"""What a Controller's checks cost: ``ctl.stats()`` (host seconds, no sync) and a one-time note on
the ``mixprec`` logger when a check takes longer than the training step it manages (issue 39)."""

from __future__ import annotations

import logging
import pickle

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
    assert ctl.stats() == {"checks": 0, "check_seconds": 0.0, "last_check_seconds": 0.0, "step_seconds": None}
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
