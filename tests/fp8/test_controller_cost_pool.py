"""A loss cost too noisy for one window to tell from its threshold is still measured in fewer
windows once the windows measured since its GEMM's last switch, taken together, lie clear of it
(issue 39: tiny's head, promoted to bf16, measured the recipe below's cost on every step of every
window for the rest of the run; backward GEMMs whose one-step costs sit within a factor of 2 of
their limit were measured in every window). The pool is arithmetic on a check's all-reduced
figures (:func:`~mixprec.control._cost.pool`, :func:`~mixprec.control._cost.clear`,
:func:`~mixprec.control._cost.clear_pooled`), starts over with a switch, and resumes with the
controller's state_dict."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from mixprec.control._backward import BackwardCost, far_by_factor
from mixprec.control._cost import (COST_Z, MAX_PERIOD, POOL_LEAST, POOL_WINDOWS, UNRESOLVED_WINDOWS, clear, clear_pooled,
                                   far, pool, unresolved)
from mixprec.control._decide import switch_gemms
from mixprec.control._ladder import LayerRecord
from mixprec.control._settings import ControllerSettings
from mixprec.formats._recipe import Float8Recipe
from mixprec.formats._state import LayerState

from test_controller_cost_steps import BATCHES, QUIET, _converted, _train


def _window(values: list[float]) -> list[float]:
    """A measured window as a check reads it: ``[steps, mean, mean square]`` of its per-step estimates."""
    t = torch.tensor(values, dtype=torch.float64)
    return [float(len(values)), float(t.mean()), float(t.square().mean())]


# ------------------------------------------------------------------ the arithmetic, as data
POOLS = {  # windows of per-step estimates
    "one window": [[1.0, 2.0, 4.0]],
    "two steady windows": [[1e-3, 2e-3, 1.5e-3], [1.2e-3, 1.4e-3]],
    "a cost that moved": [[0.0, 1e-4, -1e-4], [2e-3, 2.1e-3, 1.9e-3]],
}


@pytest.mark.parametrize("windows", POOLS.values(), ids=POOLS.keys())
def test_pool_is_the_moments_of_every_measured_step_taken_together(windows):
    mean, var, steps = pool([_window(w) for w in windows])
    every = torch.tensor([v for w in windows for v in w], dtype=torch.float64)
    assert steps == every.numel() and mean == pytest.approx(float(every.mean()))
    assert var == pytest.approx(float(every.var()))  # about the pooled mean: a moved cost reads noisier


def test_pool_of_nothing_measured_is_no_evidence():
    assert pool([]) == (-math.inf, None, 0) and not clear(-math.inf, None, 0, 1e-3, [])


NOISY = 9e-4 ** 2 + 1e-6  # mean square of steps of mean 9e-4 and standard deviation 1e-3
CLEAR = {  # (window mean, its per-step variance, threshold, the pooled windows): clear?
    "one window far from it": ((0.0, 1e-8, 1e-3, [[10, 0.0, 1e-8]]), True),
    "one noisy window": ((9e-4, 1.1e-6, 5e-4, [[10, 9e-4, NOISY]]), False),
    "noisy windows on one side, pooled": ((9e-4, 1.1e-6, 5e-4, [[10, 9e-4, NOISY]] * 8), True),
    "the window on the other side of the pool": ((4e-4, 1.1e-6, 5e-4, [[10, 9e-4, NOISY]] * 8 + [[10, 4e-4, 1e-6]]),
                                                 False),
    "windows that straddle the threshold": ((9e-4, 1.1e-6, 5e-4, [[10, 9e-4, NOISY], [10, 1e-4, 1e-4 ** 2 + 1e-6]] * 6),
                                            False),
}


@pytest.mark.parametrize("case", CLEAR.values(), ids=CLEAR.keys())
def test_clear(case):
    (mean, variance, threshold, windows), expected = case
    assert clear(mean, variance, windows[-1][0], threshold, windows) is expected


def test_a_pool_clears_at_the_steps_one_window_would_need():
    """COST_Z pooled standard errors: a cost 0.4e-3 from its threshold with a per-step deviation of
    1e-3 needs 57 steps, six windows of ten."""
    window = [10, 9e-4, NOISY]
    needed = math.ceil(COST_Z ** 2 * 1e-6 / 4e-4 ** 2)
    assert 50 < needed <= 60
    reads = [clear(9e-4, 1.1e-6, 10, 5e-4, [window] * k) for k in range(1, POOL_WINDOWS + 1)]
    assert reads.index(True) == 5 and all(reads[5:])
    assert not far(9e-4, 1.1e-6, 5e-4, 10)  # (each window alone: never)


# ------------------------------------------------------------------ on a record
def _cost_row(own: tuple[float, float, float] | None, below: tuple[float, float, float] | None) -> list[float]:
    """The loss-cost part of a check's row (``_windows.stacked_windows``): per row the mean (-inf: not
    measured), whether measured, the mean square and the steps."""
    rows = [own, below]
    return ([r[0] if r else -math.inf for r in rows] + [1.0 if r else 0.0 for r in rows]
            + [r[1] if r else 0.0 for r in rows] + [r[2] if r else 0.0 for r in rows])


def _record() -> LayerRecord:
    return LayerRecord(None, LayerState(), 1, 0, (True, True, True), True, True)


def test_a_noisy_cost_on_one_side_of_its_threshold_is_measured_in_fewer_windows():
    """The rung below's cost (threshold: the demotion limit, 5e-4) reads 9e-4 with a per-step
    deviation of 1e-3: measured in every window until the pooled windows lie clear, then in
    fewer and fewer, its last figure standing for the skipped ones (as before a demotion)."""
    settings = ControllerSettings(max_loss_cost=1e-3, every=10, ladder=("nvfp4", "tensorwise", "compute"), per_gemm=True)
    assert settings.demote_cost == 5e-4
    rec, measured, periods = _record(), [], []
    for window in range(40):
        due = rec.cost_cadence[1].due
        measured.append(due)
        _, cost = rec.split([0.0] * 4 + _cost_row(None, (9e-4, NOISY, 10) if due else None), settings)
        periods.append(rec.cost_cadence[1].period)
        assert cost[1] == 9e-4 and cost[3] == 1.0  # (a skipped window: the last measured figure)
    assert measured[:6] == [True] * 6 and periods[:6] == [1] * 5 + [2]
    assert max(periods) == MAX_PERIOD and sum(measured) < 14
    assert len(rec.cost_pool[1]) <= POOL_WINDOWS and rec.cost_pool[0] == []


def test_a_window_on_the_other_side_brings_the_cost_back_to_every_window():
    settings = ControllerSettings(max_loss_cost=1e-3, every=10, ladder=("nvfp4", "tensorwise", "compute"), per_gemm=True)
    rec = _record()
    for _ in range(8):
        rec.split([0.0] * 4 + _cost_row(None, (9e-4, NOISY, 10)), settings)
    assert rec.cost_cadence[1].period > 1
    rec.cost_cadence[1].wait = 0  # its next measured window
    rec.split([0.0] * 4 + _cost_row(None, (4e-4, 4e-4 ** 2 + 1e-6, 10)), settings)  # cheap: it would count clean
    assert rec.cost_cadence[1].period == 1


def test_a_forward_switch_empties_the_pool():
    model, ctl = _converted(max_loss_cost=1.0, **QUIET)
    _train(model, ctl, 20)
    rec = ctl._layers["0"]
    assert len(rec.cost_pool[0]) >= 1
    rec.rungs = [1, 0, 0]  # as a promotion of the forward GEMM leaves it
    rec.cost_phase(ctl.steps, 10)
    assert rec.cost_pool == [[], []]


UNRESOLVED = {  # (window mean, steps, variances, threshold, pooled): no window resolves it?
    "far below": ((0.0, 10, [1e-8], 1e-3, 1), False),
    "near, one window resolves it": ((9e-4, 10, [1e-6], 1e-3, 1), False),
    "near and far too noisy": ((9e-4, 10, [1e-5], 1e-3, 1), True),
    "far over, noisier still": ((5e-3, 10, [1e-2], 1e-3, 1), True),
    "one window's noise against the demotion limit": ((9e-4, 10, [1e-6], 5e-4, 1), True),
    "a demotion's windows in a row share it": ((9e-4, 10, [1e-6], 5e-4, 3), False),
    "no variance yet": ((9e-4, 10, None, 1e-3, 1), False),
    "nothing measured": ((-math.inf, 0, [1e-5], 1e-3, 1), False),
}


@pytest.mark.parametrize("case", UNRESOLVED.values(), ids=UNRESOLVED.keys())
def test_unresolved(case):
    (mean, steps, variances, threshold, pooled), expected = case
    assert unresolved(mean, steps, variances, threshold, 10, pooled) is expected


def test_a_cost_no_window_resolves_is_measured_on_half_the_steps_and_decided_on_its_pool():
    """The own cost (limit 1e-3) with a per-step deviation of about 3e-3: its first window, every
    step; then half the steps, and each check's figure is the pooled mean of the windows since
    the switch (this one's included), not the window's own; a switch starts over, deciding on the
    window again. A cost one window resolves is decided on its window as before."""
    settings = ControllerSettings(max_loss_cost=1e-3, every=10, ladder=("nvfp4", "tensorwise", "compute"), per_gemm=True)
    rec = _record()
    noisy = lambda mean, steps: (mean, mean * mean + 1e-5, steps)  # noqa: E731
    _, cost = rec.split([0.0] * 4 + _cost_row(noisy(9e-4, 10), None), settings)
    assert cost[0] == 9e-4 and rec.cost_plan[0] == 5 and rec.cost_unresolved == [True, False]
    _, cost = rec.split([0.0] * 4 + _cost_row(noisy(1.5e-3, 5), None), settings)
    assert cost[0] == pytest.approx((10 * 9e-4 + 5 * 1.5e-3) / 15) and rec.cost_plan[0] == 5  # the pool's, not 1.5e-3
    _, cost = rec.split([0.0] * 4 + _cost_row(noisy(-1e-3, 5), None), settings)
    assert cost[0] == pytest.approx((10 * 9e-4 + 5 * 1.5e-3 - 5e-3) / 20)  # still the pool's
    assert rec.cost_unresolved == [False, False] and rec.cost_plan[0] == 10  # -1e-3 lies far enough: one window
    rec.split([0.0] * 4 + _cost_row(noisy(1.2e-3, 10), None), settings)
    assert rec.cost_unresolved == [True, False]
    rec.rungs = [0, 0, 0]  # a switch of the forward GEMM (the record started one rung up)
    rec.cost_phase(40, 10)
    assert rec.cost_unresolved == [False, False] and rec.cost_pool == [[], []] and rec.cost_plan == [None, None]
    _, cost = rec.split([0.0] * 4 + _cost_row(noisy(3e-3, 10), None), settings)
    assert cost[0] == 3e-3  # the first window after it: its own
    quiet = _record()
    for mean in (9e-4, 3e-3):
        _, cost = quiet.split([0.0] * 4 + _cost_row((mean, mean * mean + 1e-7, 10), None), settings)
        assert cost[0] == mean and quiet.cost_unresolved == [False, False]
    assert UNRESOLVED_WINDOWS * 10 < COST_Z ** 2 * 1e-5 * 10 / 9 / 5e-4 ** 2


def test_an_unresolved_cost_whose_cadence_skips_windows_is_still_decided_on_its_pool():
    """A cost no window resolves (3e-3 against 1e-3, per-step deviation 4.5e-3), whose pooled
    windows come to lie clear of the limit: its cadence skips windows, and a skipped window keeps
    the plan and its pooled reading with it: the next measured window is decided on the pool."""
    settings = ControllerSettings(max_loss_cost=1e-3, every=10, ladder=("nvfp4", "tensorwise", "compute"), per_gemm=True)
    rec, window = _record(), (3e-3, 3e-3 ** 2 + 2e-5, 10)
    for _ in range(POOL_WINDOWS):
        if not rec.cost_cadence[0].due:
            break
        rec.split([0.0] * 4 + _cost_row(window, None), settings)
        window = (3e-3, 3e-3 ** 2 + 2e-5, 5)
    assert not rec.cost_cadence[0].due and rec.cost_unresolved[0] and rec.cost_plan[0] == 5
    rec.split([0.0] * 4 + _cost_row(None, None), settings)  # the skipped window
    assert rec.cost_unresolved[0] and rec.cost_plan[0] == 5
    rec.cost_cadence[0].wait = 0
    _, cost = rec.split([0.0] * 4 + _cost_row((2e-3, 2e-3 ** 2 + 2e-5, 5), None), settings)
    assert cost[0] == pytest.approx(pool(rec.cost_pool[0])[0]) and cost[0] != 2e-3


def test_the_pool_resumes_with_the_state_dict_and_a_malformed_one_is_refused():
    model, ctl = _converted(max_loss_cost=1.0, **QUIET)
    _train(model, ctl, 20)
    state = json.loads(json.dumps(ctl.state_dict()))
    assert state["layers"]["0"]["loss_cost_plan"]["pool"] == ctl._layers["0"].cost_pool != [[], []]
    _, resumed = _converted(max_loss_cost=1.0, **QUIET)
    resumed.load_state_dict(state)
    assert resumed._layers["0"].cost_pool == ctl._layers["0"].cost_pool
    ctl._layers["0"].cost_unresolved = [True, False]
    flagged = json.loads(json.dumps(ctl.state_dict()))
    assert flagged["layers"]["0"]["loss_cost_plan"]["unresolved"] == [True, False]
    resumed.load_state_dict(flagged)
    assert resumed._layers["0"].cost_unresolved == [True, False]
    old = json.loads(json.dumps(state))
    for data in old["layers"].values():  # saved before the pool was: none yet
        del data["loss_cost_plan"]["pool"]
    _, before = _converted(max_loss_cost=1.0, **QUIET)
    before.load_state_dict(old)
    assert before._layers["0"].cost_pool == [[], []]
    for data in old["layers"].values():  # saved before the unresolved flags were: none
        del data["loss_cost_plan"]["unresolved"]
    _, before = _converted(max_loss_cost=1.0, **QUIET)
    before.load_state_dict(old)
    assert before._layers["0"].cost_unresolved == [False, False]
    for bad in ([True], "yes", [1, 0], None):
        state["layers"]["0"]["loss_cost_plan"]["unresolved"] = bad
        _, refused = _converted(max_loss_cost=1.0, **QUIET)
        with pytest.raises(ValueError, match="unresolved"):
            refused.load_state_dict(state)
    state["layers"]["0"]["loss_cost_plan"]["unresolved"] = [False, False]
    for bad in ([[[10, 0.0]]], [[["ten", 0.0, 0.0]], []], [[], [], []], [[[-1, 0.0, 0.0]], []], 5):
        state["layers"]["0"]["loss_cost_plan"]["pool"] = bad
        _, refused = _converted(max_loss_cost=1.0, **QUIET)
        with pytest.raises(ValueError, match="loss-cost pool"):
            refused.load_state_dict(state)



def test_the_pool_keeps_the_last_measured_windows():
    """Costs move over a run: the pool holds the last POOL_WINDOWS measured windows, not the run's."""
    settings = ControllerSettings(max_loss_cost=1e-3, every=10, ladder=("nvfp4", "tensorwise", "compute"), per_gemm=True)
    rec = _record()
    sides = [(9e-4, NOISY, 10), (1e-4, 1e-4 ** 2 + 1e-6, 10)]  # straddling the threshold: every window measured
    for window in range(POOL_WINDOWS + 5):
        assert rec.cost_cadence[1].due
        rec.split([0.0] * 4 + _cost_row(None, sides[window % 2]), settings)
    last = sides[(POOL_WINDOWS + 4) % 2]
    assert len(rec.cost_pool[1]) == POOL_WINDOWS and rec.cost_pool[1][-1] == [last[2], last[0], last[1]]


# ------------------------------------------------------------------ the backward GEMMs' costs
def _backward_record() -> LayerRecord:
    rec = _record()
    rec.backward = BackwardCost(torch.device("cpu"))
    return rec


BACKWARD_SETTINGS = ControllerSettings(max_loss_cost=1e-3, max_backward_cost=1e-4, every=10, per_gemm=True,
                                       ladder=("nvfp4", "tensorwise", "compute"))


def _back(own_gi: float | None = None, below_gi: float | None = None) -> list[float]:
    """A check's backward costs of a layer (``_backward.peel``): the input-gradient GEMM's, own and below."""
    costs = [own_gi, None, below_gi, None]
    return [c if c is not None else 0.0 for c in costs] + [float(c is not None) for c in costs]


def _windows_measured(rec: LayerRecord, kind: int, costs: list[float]) -> list[bool]:
    """Which of the windows (one cost each, read in turn) the kind's cadence measured."""
    out = []
    for cost in costs:
        due = rec.backward.cadence[kind].due
        out.append(due)
        rec.carry_backward(_back(**{("own_gi", "below_gi")[kind]: cost}) if due else _back(), BACKWARD_SETTINGS)
    return out


STEADY = [6e-5, 8e-5, 7e-5, 7.5e-5, 6.5e-5, 7e-5] * 6  # each within FAR of the limit (1e-4), together clear of it


def test_a_backward_cost_near_its_limit_but_below_it_window_after_window_is_measured_in_fewer_windows():
    rec = _backward_record()
    measured = _windows_measured(rec, 0, STEADY)
    assert measured[:POOL_LEAST] == [True] * POOL_LEAST  # (one estimate a window: POOL_LEAST windows)
    assert sum(measured) < len(STEADY) // 2 and rec.backward.cadence[0].period == MAX_PERIOD
    # without the pool: every window (each alone lies within a factor FAR of the limit)
    assert all(not far_by_factor(c, 1e-4) for c in STEADY)


def test_an_own_backward_cost_over_its_limit_is_measured_in_every_window_however_steady():
    rec = _backward_record()
    assert all(_windows_measured(rec, 0, [1.5e-4, 1.4e-4, 1.6e-4, 1.5e-4] * 5))


def test_the_rung_below_backward_cost_pools_on_either_side_of_its_limit():
    limit = BACKWARD_SETTINGS.demote_backward
    for side in (0.6, 1.6):  # within FAR of the limit, below it or over it
        rec = _backward_record()
        costs = [limit * side * f for f in (0.9, 1.1, 1.0, 0.95, 1.05, 1.0)] * 5
        assert sum(_windows_measured(rec, 1, costs)) < len(costs) // 2


def test_a_nonfinite_backward_cost_is_no_evidence_and_a_switch_empties_the_pools():
    rec = _backward_record()
    rec.carry_backward(_back(own_gi=math.inf), BACKWARD_SETTINGS)
    assert rec.backward.pool[0] == []
    measured = _windows_measured(rec, 0, STEADY[:8])
    assert len(rec.backward.pool[0]) == sum(measured) > POOL_LEAST
    rec.backward.recipes = [(0, Float8Recipe.from_name("nvfp4"), (True, True))]  # (a switch: apply_gemms)
    assert rec.backward.pool == [[], [], [], []] and rec.backward.cadence[0].due


def _train_stepping(model, ctl, steps: int, start: int = 0) -> None:
    """Train with an optimizer (a backward cost reads the gain of the weight's update)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in BATCHES[start:steps]:
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        ctl.step()


def test_the_backward_pools_resume_with_the_state_dict_and_a_malformed_one_is_refused():
    model, ctl = _converted(max_loss_cost=1.0, max_backward_cost=1e-4, **QUIET)
    _train_stepping(model, ctl, 5)
    switch_gemms(ctl._check(), ctl._layers["0"], (2,), 1)  # (a switched layer, whatever this CPU's rounding decides)
    _train_stepping(model, ctl, 30, start=5)
    state = json.loads(json.dumps(ctl.state_dict()))
    assert state["layers"]["0"]["gemms"]["grad_weight"] != "nvfp4" and any(state["layers"]["0"]["backward_cost"][3])
    _, resumed = _converted(max_loss_cost=1.0, max_backward_cost=1e-4, **QUIET)
    resumed.load_state_dict(state)
    # the routing for the loaded rungs is no switch: cadences and pools as saved (a switched layer's were reset)
    for name, rec in resumed._layers.items():
        assert rec.backward.pool == ctl._layers[name].backward.pool
        assert [c.state() for c in rec.backward.cadence] == [c.state() for c in ctl._layers[name].backward.cadence]
        assert rec.backward.recipes == ctl._layers[name].backward.recipes
        assert rec.backward.reach.state() == ctl._layers[name].backward.reach.state()  # (_reach: gain, reach)
    assert all(data["backward_cost"][4][2] is not None for data in state["layers"].values())  # (gains measured)
    old = json.loads(json.dumps(state))
    for data in old["layers"].values():  # saved before the pools were
        data["backward_cost"] = data["backward_cost"][:3]
    _, before = _converted(max_loss_cost=1.0, max_backward_cost=1e-4, **QUIET)
    before.load_state_dict(old)
    assert all(r.backward.pool == [[], [], [], []] for r in before._layers.values())
    state["layers"]["0"]["backward_cost"][3] = [[], []]
    _, refused = _converted(max_loss_cost=1.0, max_backward_cost=1e-4, **QUIET)
    with pytest.raises(ValueError, match="loss-cost pool must be 4 lists"):
        refused.load_state_dict(state)


def test_a_window_whose_cadences_skip_every_emulated_kind_measures_nothing():
    """A layer on its floor has no rung below to emulate: that kind's cadence never measures and
    stays due, which must not make every window pay for the shadow step (the reference GEMMs,
    the gain) while the own casts' cadence skips it."""
    cost = BackwardCost(torch.device("cpu"))
    cost.recipes = [(0, Float8Recipe.from_name("nvfp4"), (True, True))]
    assert cost.due
    cost.cadence[0].checked([0.0, 0.0, 1.0, 1.0], True, True)  # far below: the next window skipped
    assert cost.cadence[1].due and not cost.due
    x, w = torch.randn(4, 32, requires_grad=True), torch.randn(16, 32, requires_grad=True)
    assert cost.tap(x, w) == (x, w)
    out = x @ w.t()
    cost.observe(x, w, out, measuring=cost.due)
    out.sum().backward()
    assert cost.pending is None and cost.window.abs().sum() == 0
