"""``Controller(cost_scope="model")``: the loss-cost limits bound the whole model, shared out by
each layer's GEMM work per row (``in_features * out_features``): a forward GEMM's limit is its
share of ``max_loss_cost``, a backward GEMM's half its share of ``max_backward_cost``. Costs are
scripted per check (``LayerRecord.split``), the layers train for real."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import pytest

from mixprec import Controller
from mixprec.control._check import Check
from mixprec.control._ladder import LayerRecord
from mixprec.control._records import detached_record, flop_shares, metadata
from mixprec.control._settings import ControllerSettings

sys.path.insert(0, os.path.dirname(__file__))
from test_controller_early import EVERY, _batch, _converted, _train  # noqa: E402

LIMIT = 3e-3  # test_controller_early's max_loss_cost; its layers: "0" Linear(32, 64), "2" Linear(64, 64)
SHARES = {"0": 32 * 64 / (32 * 64 + 64 * 64), "2": 64 * 64 / (32 * 64 + 64 * 64)}  # 1/3, 2/3


@pytest.mark.parametrize("bad, match", [
    (dict(max_loss_cost=1e-3, cost_scope="layer"), "cost_scope must be one of"),
    (dict(cost_scope="model"), "takes effect with max_loss_cost or max_backward_cost"),
])
def test_a_bad_scope_is_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        ControllerSettings(**bad)


def test_the_scope_round_trips_through_the_config():
    ctl = Controller(max_loss_cost=1e-3, per_gemm=True, cost_scope="model")
    again = Controller.from_config(json.loads(json.dumps(ctl.config())))
    assert again.settings == ctl.settings and again.settings.cost_scope == "model"


def test_a_layer_s_check_takes_its_share_of_every_limit():
    settings = ControllerSettings(max_loss_cost=1e-3, demote_loss_cost=4e-4, max_backward_cost=6e-5, per_gemm=True,
                                  cost_scope="model", late_start=5, late_factor=0.5)
    at = Check.of(settings, steps=3)
    at = Check(at.settings, at.steps, at.compute, at.recipes, {"a": 0.25, "b": 0.75})
    a = at.for_layer("a").settings
    assert (a.max_loss_cost, a.demote_cost, a.max_backward_cost, a.demote_backward) == pytest.approx(
        (2.5e-4, 1e-4, 7.5e-6, 3.75e-6))
    late = Check(settings, 7, None, at.recipes, {"a": 0.25}).for_layer("a").settings  # the late phase, then the share
    assert (late.max_loss_cost, late.max_backward_cost) == pytest.approx((1.25e-4, 3.75e-6))
    assert at.for_layer("unknown").settings.max_loss_cost == 0  # (no share: a layer the shares do not name)
    whole = Check(dataclasses.replace(settings, cost_scope="gemm"), 3, None, at.recipes, {"a": 0.25})
    assert whole.for_layer("a") is whole


def test_a_peer_s_record_of_a_layer_carries_its_size():
    model, ctl = _converted(cost_scope="model")
    rec = ctl._layers["0"]
    assert rec.size == 32 * 64
    peer = detached_record(ctl.settings, metadata(ctl.settings, rec), metadata(ctl.settings, rec))
    assert peer.size == rec.size and peer.module() is None
    assert flop_shares(ctl.settings, ctl._layers) == pytest.approx(SHARES)
    assert flop_shares(dataclasses.replace(ctl.settings, cost_scope="gemm"), ctl._layers) == {}


def _script_hidden(monkeypatch, holder: dict, own: float) -> None:
    split = LayerRecord.split
    monkeypatch.setattr("mixprec.control._decide.OVER_WINDOWS", 1)  # (one scripted reading over the limit promotes)

    def scripted(rec, row, settings=None):
        stats, cost = split(rec, row, settings)
        if settings is None or holder["ctl"]._layers.get("0") is not rec:
            return stats, cost
        return stats, [own, 0.0, 1.0 if rec.forward_low else 0.0, 0.0]

    monkeypatch.setattr(LayerRecord, "split", scripted)


@pytest.mark.parametrize("scope", ["gemm", "model"])
def test_a_cost_under_the_gemm_s_limit_but_over_its_share_of_the_model_s_is_promoted_by_the_share(monkeypatch, scope):
    """Layer "0" costs 1.5e-3 a step at every check: under the per-GEMM limit (3e-3), over its
    third of the model's (1e-3)."""
    holder: dict = {}
    _script_hidden(monkeypatch, holder, 1.5e-3)
    model, ctl = _converted(cost_scope=scope)
    holder["ctl"] = ctl
    _train(model, ctl, 2 * EVERY, batch=_batch())
    hidden = [d for d in ctl.log if d.layer == "0" and d.gemm == "output"]
    if scope == "gemm":
        assert hidden == []
        return
    assert (hidden[0].step, hidden[0].action, hidden[0].statistic) == (EVERY, "promote", "loss_cost")
    assert hidden[0].value == pytest.approx(1.5e-3)
    # every promotion of its forward (the early one after it reads its real cost, about 1.4e-3) by its share
    assert all(d.threshold == pytest.approx(LIMIT * SHARES["0"]) for d in hidden if d.action == "promote")
