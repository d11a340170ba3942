"""A forward GEMM whose own loss cost one check reads over ``max_loss_cost`` is promoted only
when that is not the first sign: the check before read it over too (``OVER_WINDOWS`` in a row),
or the windows measured since its last switch lie over the limit together, or this window lies
clear over it (COST_Z standard errors). A cost under the limit that one window reads over it by
chance is no switch (issue 39: the Llama's near-limit flips, each measured on every step of the
next windows and taken back a few windows later). The count is the record's, kept once a check
(``_decide.too_costly``), reset by a switch, left by a check without a reading, and resumed with
the controller's state_dict."""

from __future__ import annotations

import json

import pytest

from mixprec.control._check import Check
from mixprec.control._decide import OVER_WINDOWS, too_costly
from mixprec.control._ladder import CLEAR_STEPS
from mixprec.control._settings import ControllerSettings

from test_controller_cost_pool import _cost_row, _record
from test_controller_cost_steps import QUIET, _converted, _train

SETTINGS = ControllerSettings(max_loss_cost=1e-3, every=10, ladder=("nvfp4", "tensorwise", "compute"), per_gemm=True)

# per check: (the reading, or None: no reading; its window clear over the limit; the windows
# measured since the switch, as [steps, mean, mean square]), and the check that promotes (from 1)
_OVER, _UNDER = (2e-3, False), (5e-4, False)
READINGS = {
    "over at two checks in a row": ([_OVER, _OVER], 2),
    "over, under, over: no two in a row": ([_OVER, _UNDER, _OVER], None),
    "clear over at once": ([(5e-3, True)], 1),
    "a check without a reading leaves the count": ([_OVER, (None, False), _OVER], 3),
    "at the limit is not over": ([(1e-3, False)] * 3, None),
    "under at every check": ([_UNDER] * 4, None),
}
assert OVER_WINDOWS == 2


@pytest.mark.parametrize("case", READINGS.values(), ids=READINGS.keys())
def test_readings(case):
    readings, promoted = case
    at, rec, first = Check.of(SETTINGS), _record(), None
    for check, (value, clear) in enumerate(readings, 1):
        rec.cost_clear = clear
        cost = [value, 0.0, 1.0, 0.0] if value is not None else [0.0, 0.0, 0.0, 0.0]
        if too_costly(at, cost, rec) and first is None:
            first = check
    assert first == promoted


def test_no_measured_cost_is_no_promotion_and_no_count():
    at, rec = Check.of(SETTINGS), _record()
    rec.cost_over = 1
    assert not too_costly(at, None, rec) and rec.cost_over == 1


def test_a_noisy_cost_over_the_limit_promotes_when_its_windows_lie_over_it_together():
    """Windows that cross the limit (2e-3, 5e-4, 2e-3): no two checks in a row over it, but the
    three together (1.5e-3) lie over it: the third check promotes; so do two (5e-4, 2e-3: 1.25e-3
    together), the fewest a pool reads. Under it together (two windows of 5e-4 before), it does not."""
    at = Check.of(SETTINGS)
    for before, promoted in (([2e-3, 5e-4], True), ([5e-4], True), ([5e-4, 5e-4], False)):
        rec = _record()
        rec.cost_pool[0] = [[10.0, m, m * m] for m in (*before, 2e-3)]
        for m in before:
            too_costly(at, [m, 0.0, 1.0, 0.0], rec)
        assert too_costly(at, [2e-3, 0.0, 1.0, 0.0], rec) is promoted
    rec = _record()  # a first window since the switch: its pool is itself, no second sign
    rec.cost_pool[0] = [[10.0, 2e-3, 4e-6]]
    assert not too_costly(at, [2e-3, 0.0, 1.0, 0.0], rec)


def test_a_window_is_clear_over_the_limit_only_on_its_far_side_and_its_own_steps():
    """``LayerRecord.split`` marks this window's own mean clear over ``max_loss_cost`` where it
    lies COST_Z standard errors of its own steps' spread over it (a quiet one 20% over does): not
    a noisy one, not one far under it, not one of fewer than ``CLEAR_STEPS`` steps."""
    quiet = lambda mean, steps=10: (mean, mean * mean + 1e-9, steps)  # noqa: E731
    noisy = lambda mean: (mean, mean * mean + 1e-4, 10)  # noqa: E731
    for window, clear in ((quiet(5e-3), True), (noisy(5e-3), False), (quiet(-5e-3), False), (quiet(1.2e-3), True),
                          (quiet(5e-3, CLEAR_STEPS), True), (quiet(5e-3, CLEAR_STEPS - 1), False)):
        rec = _record()
        rec.split([0.0] * 4 + _cost_row(window, None), SETTINGS)
        assert rec.cost_clear is clear, window


def test_a_short_window_is_not_clear_by_a_stale_variance():
    """The Llama's ``q_proj`` (hidden 64, seed 0): quiet early (a plan of 2 steps, its cadence
    skipping windows), it read 1.3e-3 on 2 steps at step 150: the plan's variance, from windows
    long gone, called that clear over 1e-3. Its own 2 steps say nothing of the spread: no
    promotion at once, and its pool (the quiet windows with it) lies under the limit."""
    at, rec = Check.of(SETTINGS), _record()
    for window in ((3e-6, 3e-6 ** 2 + 1e-10, 10), (-2e-6, 4e-12 + 1e-10, 2), (2e-5, 4e-10 + 1e-10, 2)):
        _, cost = rec.split([0.0] * 4 + _cost_row(window, None), SETTINGS)
        assert not too_costly(at, cost, rec)
    _, cost = rec.split([0.0] * 4 + _cost_row((1.3e-3, 1.3e-3 ** 2 + 1e-10, 2), None), SETTINGS)
    assert cost[0] == 1.3e-3 and not rec.cost_clear and not too_costly(at, cost, rec) and rec.cost_over == 1
    _, cost = rec.split([0.0] * 4 + _cost_row((1.2e-3, 1.2e-3 ** 2 + 1e-6, 10), None), SETTINGS)
    assert too_costly(at, cost, rec)  # (over again at the next check: the second sign)
    quiet = _record()  # 5 noisy steps over the limit after quiet windows: their own spread, not the plan's median
    for window in ((3e-6, 3e-6 ** 2 + 1e-10, 10), (2e-6, 4e-12 + 1e-10, 10), (1.3e-3, 1.3e-3 ** 2 + 1e-5, 5)):
        _, cost = quiet.split([0.0] * 4 + _cost_row(window, None), SETTINGS)
    assert cost[0] == 1.3e-3 and not quiet.cost_clear and not too_costly(at, cost, quiet)


def test_the_count_starts_over_with_a_switch_and_resumes_with_the_state_dict():
    """The logits (layer "2", about 0.005 nats against 3e-3) read over the limit at the first
    check and are promoted at the second; a run resumed between the two promotes at the same step,
    bitwise as the uninterrupted run; a malformed count is refused, an old checkpoint counts 0."""
    model, ctl = _converted(max_loss_cost=3e-3, **QUIET)
    _train(model, ctl, 15)
    rec = ctl._layers["2"]
    assert rec.cost_over == 1 and rec.rungs[0] == 0
    state = json.loads(json.dumps(ctl.state_dict()))
    assert state["layers"]["2"]["loss_cost_plan"]["over"] == 1
    _train(model, ctl, 30, start=15)
    assert [(d.step, d.gemm) for d in ctl.log if d.layer == "2"] == [(20, "output")]
    assert rec.rungs[0] == 1 and rec.cost_over == 0  # (its new rung's cost reads under the limit)
    fresh, resumed = _converted(max_loss_cost=3e-3, **QUIET)
    resumed.load_state_dict(state)
    _train(fresh, resumed, 30, start=15)  # (no optimizer: the weights are the fresh model's)
    assert resumed.log == ctl.log and resumed.state_dict() == ctl.state_dict()
    for bad in (-1, 1.0, "1", None, True):
        state["layers"]["2"]["loss_cost_plan"]["over"] = bad
        _, refused = _converted(max_loss_cost=3e-3, **QUIET)
        with pytest.raises(ValueError, match="'over'"):
            refused.load_state_dict(state)
    del state["layers"]["2"]["loss_cost_plan"]["over"]  # saved before the count was
    _, old = _converted(max_loss_cost=3e-3, **QUIET)
    old.load_state_dict(state)
    assert old._layers["2"].cost_over == 0


def test_a_switch_starts_the_count_over():
    rec = _record()
    rec.cost_over = 1
    rec.rungs = [0, 0, 0]  # a switch of the forward GEMM (the record started one rung up)
    rec.cost_phase(20, 10)
    assert rec.cost_over == 0
