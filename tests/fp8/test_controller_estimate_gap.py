"""A forward GEMM that flipped (demoted for its below estimate, promoted back for its own one)
keeps the gap between the two (:mod:`mixprec.control._estimate_gap`): its next demotion compares
the below estimate plus that gap with ``demote_loss_cost``. Costs are scripted per check (the
hidden layer's, through ``LayerRecord.split``), the layer trains for real."""

from __future__ import annotations

import json
import os
import sys

import pytest

from mixprec.control._ladder import LayerRecord, output_roundoff
from mixprec.formats._recipe import Float8Recipe

sys.path.insert(0, os.path.dirname(__file__))
from test_controller_early import EVERY, _batch, _converted, _train  # noqa: E402

LIMIT = 3e-3  # test_controller_early's max_loss_cost (demote_loss_cost: half of it)
SQ = {"nvfp4": output_roundoff(Float8Recipe.nvfp4(), None) ** 2,
      "tensorwise": output_roundoff(Float8Recipe.tensorwise(), None) ** 2}


def _script(monkeypatch, holder: dict, costs: list[tuple[float, float]]) -> list:
    """Layer "0"'s forward costs ``(own, below)`` at its checks, in turn (the last one repeats);
    each measured where its rung measures it (own on a low rung, below while a rung below exists).
    One reading over the limit promotes here (``OVER_WINDOWS`` 1: the gap is what is tested)."""
    split, seen = LayerRecord.split, []
    monkeypatch.setattr("mixprec.control._decide.OVER_WINDOWS", 1)  # (one scripted reading over the limit promotes)

    def scripted(rec, row, settings=None):
        stats, cost = split(rec, row, settings)
        if settings is None or holder["ctl"]._layers.get("0") is not rec:
            return stats, cost
        own, below = costs[min(len(seen), len(costs) - 1)]
        seen.append((own, below))
        return stats, [own, below, 1.0 if rec.forward_low else 0.0, 1.0 if rec.forward_below is not None else 0.0]

    monkeypatch.setattr(LayerRecord, "split", scripted)
    return seen


def _hidden(ctl) -> list[tuple]:
    return [(d.step, d.action, d.from_, d.to, round(d.value, 7)) for d in ctl.log if d.layer == "0" and d.gemm == "output"]


CASES = {
    # promoted for 1.5x the limit (to fp8: a quarter of it there), down on a below estimate of
    # 1e-4 (2 windows), back up for 2x the limit: a gap of 2x the limit less 1e-4 at NVFP4's
    # roundoff, so the same below estimate of 1e-4 reads 2x the limit from then on: it stays up
    "flip-then-stays": ([(1.5 * LIMIT, 0)] + [(0, 1e-4)] * 2 + [(2 * LIMIT, 0)] + [(0, 1e-4)] * 6,
                        [(1, "promote"), (3, "demote"), (4, "promote")]),
    # the same flip, then a below estimate the gap brings just under demote_loss_cost: down again
    "flip-then-cheaper": ([(1.5 * LIMIT, 0)] + [(0, 1e-4)] * 2 + [(2 * LIMIT, 0)] + [(0, LIMIT / 2 - 2 * LIMIT + 1e-4 - 1e-5)] * 6,
                          [(1, "promote"), (3, "demote"), (4, "promote"), (8, "demote")]),  # (4 windows: a round trip doubles them)
    # no flip (the own estimate after the demotion is under the limit): no gap, the below estimate alone
    "no-flip": ([(1.5 * LIMIT, 0)] + [(0, 1e-4)] * 2 + [(0.9 * LIMIT, 0)] * 7,
                [(1, "promote"), (3, "demote")]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_flip_keeps_the_gap_and_the_next_demotion_reads_the_below_estimate_plus_it(monkeypatch, case):
    costs, expected = CASES[case]
    holder: dict = {}
    _script(monkeypatch, holder, costs)
    model, ctl = _converted(min_dwell=EVERY, demote_windows=2)
    holder["ctl"] = ctl
    _train(model, ctl, 10 * EVERY, batch=_batch())
    assert [(s // EVERY, a) for s, a, *_ in _hidden(ctl)] == expected
    rec = ctl._layers["0"]
    if case == "no-flip":
        assert rec.cost_gap == 0 and rec.demoted_below == (0, 1e-4)
        return
    assert rec.cost_gap == pytest.approx((2 * LIMIT - 1e-4) / SQ["nvfp4"])
    if case == "flip-then-cheaper":  # the decision names the cost it compared: below plus the gap
        value = _hidden(ctl)[-1][4]
        assert value == pytest.approx(LIMIT / 2 - 1e-5, abs=1e-9) and value <= LIMIT / 2


def test_the_gap_moves_between_rungs_by_their_squared_roundoff(monkeypatch):
    """Learned from a flip at an fp8 rung (ladder nvfp4, tensorwise, rowwise, compute: promoted
    from NVFP4 to bf16... here to float32 compute, demoted to rowwise, back up), the gap applies at
    the rung below as the ratio of squared roundoffs says: the same at tensorwise (e4m3 both)."""
    from mixprec.control._check import Check
    from mixprec.control._estimate_gap import expected_own
    from mixprec.control._settings import ControllerSettings
    from mixprec.formats._state import LayerState
    at = Check.of(ControllerSettings(ladder=("nvfp4", "tensorwise", "rowwise", "compute"), max_loss_cost=1e-3))
    rec = LayerRecord(None, LayerState(), 0, 0, (True,) * 4, cost=True)
    rec.cost_gap = 1e-3 / SQ["tensorwise"]
    assert expected_own(at, rec, 1, 0.0) == pytest.approx(1e-3)
    assert expected_own(at, rec, 2, 0.0) == pytest.approx(1e-3)  # rowwise: e4m3 elements, the same roundoff
    assert expected_own(at, rec, 0, 0.0) == pytest.approx(1e-3 * SQ["nvfp4"] / SQ["tensorwise"]) == pytest.approx(16e-3)


def test_the_gap_resumes_from_the_state_dict_and_a_hostile_entry_is_refused(monkeypatch):
    costs = CASES["flip-then-stays"][0]
    holder: dict = {}
    _script(monkeypatch, holder, costs)
    model, ctl = _converted(min_dwell=EVERY, demote_windows=2)
    holder["ctl"] = ctl
    _train(model, ctl, 5 * EVERY, batch=_batch())
    state = json.loads(json.dumps(ctl.state_dict()))  # plain data, through JSON
    gap = ctl._layers["0"].cost_gap
    assert gap > 0 and state["layers"]["0"]["cost_gap"] == [gap, None]
    model2, fresh = _converted(min_dwell=EVERY, demote_windows=2)  # (fp8.convert tracks its layers: loaded now)
    fresh.load_state_dict(state)
    assert (fresh._layers["0"].cost_gap, fresh._layers["0"].demoted_below) == (gap, None)
    for bad in ([-1.0, None], [float("nan"), None], [1.0, [9, 0.0]], [1.0, [0, "x"]], "gap", [True, None]):
        hostile = json.loads(json.dumps(state))
        hostile["layers"]["0"]["cost_gap"] = bad
        _, other = _converted(min_dwell=EVERY, demote_windows=2)
        with pytest.raises(ValueError, match="cost_gap"):
            other.load_state_dict(hostile)
