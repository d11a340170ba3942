"""A forward GEMM whose loss cost is measured (``Controller(max_loss_cost=..., per_gemm=True)``)
is judged by that cost, not by its operands' flush: an NVFP4 forward whose input flushes 85% but
costs the loss little stays in NVFP4 (it is promoted without ``max_loss_cost``), its casts are
not measured for a check that does not read them, and a forward promoted by its cost comes back
once the rung below costs little, however much the rung below's casts flush."""

from __future__ import annotations

import os
import sys

import pytest

from mixprec.control._ladder import LayerRecord

sys.path.insert(0, os.path.dirname(__file__))
from test_controller_early import EVERY, _batch, _converted, _train  # noqa: E402

LIMIT = 3e-3  # test_controller_early's: the hidden layer's cost under it


def _outlier_batch():
    """Every 8th input feature 100x: the hidden layer's NVFP4 forward flushes about 85% of its input."""
    x, y = _batch()
    x = x.clone()
    x[:, ::8] *= 100
    return x, y


def _name(ctl, rec: LayerRecord) -> str:
    return next(n for n, r in ctl._layers.items() if r is rec)


def _reads(monkeypatch, holder: dict) -> dict[str, list]:
    """The forward costs each check reads, per layer (``holder["ctl"]``'s)."""
    seen: dict[str, list] = {"0": [], "2": []}
    split = LayerRecord.split

    def spy(rec, row, settings=None):
        out = split(rec, row, settings)
        if settings is not None:
            seen[_name(holder["ctl"], rec)].append(out[1])
        return out

    monkeypatch.setattr(LayerRecord, "split", spy)
    return seen


@pytest.mark.parametrize("max_loss_cost", [LIMIT, None])
def test_a_flushing_forward_that_costs_little_stays_when_its_cost_is_measured(monkeypatch, max_loss_cost):
    holder: dict = {}
    seen = _reads(monkeypatch, holder)
    model, ctl = _converted(max_loss_cost=max_loss_cost)
    holder["ctl"] = ctl
    _train(model, ctl, 3 * EVERY, batch=_outlier_batch())
    hidden = [d for d in ctl.log if d.layer == "0" and d.gemm == "output"]
    if max_loss_cost is None:  # judged by its flush
        assert [(d.step, d.statistic) for d in hidden] == [(EVERY, "underflow_forecast")] and hidden[0].value > 0.5
        assert ctl._layers["0"].stats_read[0][0]
        return
    costs = seen["0"]
    assert len(costs) == 3 and all(c[2] > 0 and c[0] <= LIMIT for c in costs)  # measured, under the limit
    assert hidden == []
    assert ctl.precision("0") == "nvfp4"
    # the next window reads the cost, not the forward's own casts: not measured
    assert not ctl._layers["0"].stats_read[0][0]


def test_a_forward_promoted_by_its_cost_comes_back_when_the_rung_below_is_cheap_whatever_it_flushes(monkeypatch):
    """Costs scripted per check (the hidden layer's: 10x the limit at the first check, then its
    rung below at 1e-4); its shadow (NVFP4 casts of 100x outliers) flushes 85% throughout,
    above ``fp4_demote_underflow`` (0.4), which would keep it up if the flush decided."""
    split = LayerRecord.split
    checks, holder = [], {}
    monkeypatch.setattr("mixprec.control._decide.OVER_WINDOWS", 1)  # (one scripted reading over the limit promotes)

    def scripted(rec, row, settings=None):
        stats, cost = split(rec, row, settings)
        if settings is None or _name(holder["ctl"], rec) != "0":
            return stats, cost
        checks.append(cost)
        first = len(checks) == 1
        return stats, [10 * LIMIT if first else 1e-4, 1e-4, 1.0, 0.0 if first else 1.0]

    monkeypatch.setattr(LayerRecord, "split", scripted)
    model, ctl = _converted(max_loss_cost=LIMIT, min_dwell=EVERY, demote_windows=2)
    holder["ctl"] = ctl
    _train(model, ctl, 6 * EVERY, batch=_outlier_batch())
    hidden = [(d.step, d.action, d.statistic, d.to) for d in ctl.log if d.layer == "0" and d.gemm == "output"]
    assert hidden[0] == (EVERY, "promote", "loss_cost", "fp32")  # 10x over: past the fp8 rung (compute: float32)
    assert hidden[1][:3] == (3 * EVERY, "demote", "loss_cost")  # two cheap windows, the dwell
    assert hidden[1][3] == "fp8-tensorwise"
    assert len(checks) == 6
