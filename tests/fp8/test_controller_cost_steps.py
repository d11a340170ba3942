"""On which steps ``Controller(max_loss_cost=...)`` measures a loss cost (issue 39): each costs a
float32 GEMM, so after a window that measured every step, a cost whose window mean lies
``COST_Z`` standard errors from its threshold is measured only on the last steps of the next
windows (at least the shadow steps and 2), and one near its threshold on every step; a forward
GEMM that switched starts over on every step. The window's mean is of the measured steps alone,
the plan resumes bitwise, and compiled code measures on the steps eager code does."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from mixprec import Controller, fp8
from mixprec.control import _cost, _ladder
from mixprec.control._decide import OVER_WINDOWS
from mixprec.control._cost import (COST_Z, COST_ZONE, MAX_PERIOD, UNRESOLVED_SHARE, UNRESOLVED_WINDOWS, VARIANCES, Cadence,
                                   cost_steps, far, variance)

from _models import sharp_classifier, sharp_classifier_batch

LADDER = ("nvfp4", "tensorwise", "compute")


_model = sharp_classifier  # (its logits, layer "2", are sharp: their NVFP4 error costs about 0.005 nats)


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [sharp_classifier_batch(128, g) for _ in range(n)]


BATCHES = _batches(50)
QUIET = dict(fp4_max_underflow=0.5, fp4_demote_underflow=0.4)  # no promotion on NVFP4's flush


def _converted(recipe: str = "nvfp4", **settings) -> tuple[nn.Module, Controller]:
    ctl = Controller(**{"every": 10, "ladder": LADDER, "per_gemm": True, "floor": "nvfp4", **settings})
    model = fp8.convert(_model(), recipe, filter_fn=lambda m, n: True, controller=ctl, backend="emulate_fp32")
    return model, ctl


@pytest.fixture
def measured(monkeypatch) -> list[tuple[int, str, tuple[int, ...]]]:
    """``(ctl.steps, layer, rows of rec.cost)`` of every output-error measurement that ran (a
    float32 reference GEMM each), in order."""
    seen: list[tuple[int, str, tuple[int, ...]]] = []
    original = _cost.output_errors

    def spy(rec, *args):
        errors = original(rec, *args)
        if errors and spy.ctl is not None:
            name = next(n for n, r in spy.ctl._layers.items() if r is rec)
            seen.append((spy.ctl.steps, name, tuple(r for r, _ in errors)))
        return errors

    spy.ctl = None

    monkeypatch.setattr(_cost, "output_errors", spy)
    return seen, spy


def _train(model, ctl, steps: int, start: int = 0, spy=None) -> None:
    if spy is not None:
        spy.ctl = ctl
    for step in range(start, steps):
        x, y = BATCHES[step]
        F.cross_entropy(model(x), y).backward()
        model.zero_grad()
        ctl.step()


def _steps(seen, layer: str, row: int = 0) -> list[int]:
    return [s for s, name, rows in seen if name == layer and row in rows]


# ------------------------------------------------------------------ the plan, as arithmetic
def test_a_cost_far_from_its_threshold_is_planned_on_few_steps_a_near_one_on_all():
    var = 1e-8  # a standard deviation of 1e-4 per step
    far_ = cost_steps(0.0, var, 10, None, 1e-3, 10, 2)
    assert far_[0] == 2 and far_[1] == [pytest.approx(var * 10 / 9)]
    # the steps needed: COST_Z**2 * variance / distance**2, at least `least`, at most `every`
    noisy = 1e-7
    steps = cost_steps(4e-4, 4e-4 ** 2 + noisy, 10, None, 1e-3, 10, 2)[0]
    assert 2 < steps == math.ceil(COST_Z ** 2 * noisy * 10 / 9 / 6e-4 ** 2) < 10
    # a mean nearer than COST_ZONE of the threshold takes the steps that resolve that distance
    zone = COST_ZONE * 1e-3
    assert cost_steps(9e-4, 9e-4 ** 2 + noisy, 10, None, 1e-3, 10, 2)[0] == math.ceil(
        COST_Z ** 2 * noisy * 10 / 9 / zone ** 2) < 10
    assert 2 < cost_steps(1e-3, 1e-6 + noisy, 10, None, 1e-3, 10, 2)[0] < 10  # on the threshold
    assert cost_steps(9e-4, 9e-4 ** 2 + 9e-7, 10, None, 1e-3, 10, 2)[0] == 10  # near and noisy: every step
    # a cost no window resolves (more than UNRESOLVED_WINDOWS windows' steps needed, even a whole
    # window's mean a toss about the threshold): UNRESOLVED_SHARE of the steps, at least `least`
    # (its windows decide together: test_controller_cost_pool). At the bound's edge still every
    # step, just past it the share
    edge = UNRESOLVED_WINDOWS * 10 * zone ** 2 / COST_Z ** 2 * 0.9  # a sample variance (10 steps) on the edge
    assert cost_steps(9e-4, 9e-4 ** 2 + edge * 0.999, 10, None, 1e-3, 10, 2)[0] == 10
    assert cost_steps(9e-4, 9e-4 ** 2 + edge * 1.001, 10, None, 1e-3, 10, 2)[0] == math.ceil(UNRESOLVED_SHARE * 10) == 5
    assert cost_steps(9e-4, 9e-4 ** 2 + 1e-4, 10, None, 1e-3, 10, 7)[0] == 7
    assert cost_steps(5e-3, 5e-3 ** 2 + 1e-2, 10, None, 1e-3, 10, 2)[0] == 5  # far over, yet noisier still
    assert cost_steps(9e-4, 9e-4 ** 2 + 1e-4, 1, None, 1e-3, 10, 2)[0] == 10  # no variance yet: every step
    # a decision that takes 3 windows in a row (a demotion) takes a third of the steps
    assert cost_steps(4e-4, 4e-4 ** 2 + 3 * noisy, 10, None, 1e-3, 10, 2, pooled=3)[0] == steps
    # no variance yet (one step measured), or nothing measured: every step
    assert cost_steps(0.0, 0.0, 1, None, 1e-3, 10, 2) == (10, None)
    assert cost_steps(-math.inf, 0.0, 0, [4e-8], 1e-3, 10, 2) == (10, [4e-8])
    # the plan reads the median of the last VARIANCES windows' variances: one quiet window does
    # not forget a noisy past, and one window's outlier (a loss spike) does not make every later
    # window measure every step
    assert cost_steps(0.0, 0.0, 10, [4e-6, 4e-6], 1e-3, 10, 2) == (10, [4e-6, 4e-6, 0.0])
    spike = cost_steps(0.0, var, 10, [1e-2, var], 1e-3, 10, 2)
    assert spike[0] == 2 and len(spike[1]) == VARIANCES and variance(spike[1]) == pytest.approx(var * 10 / 9)


def test_a_cost_far_from_its_threshold_is_measured_in_fewer_windows_and_its_last_figure_stands():
    """The cadence: a measured window whose mean lies COST_Z standard errors from its threshold
    doubles the period (at most MAX_PERIOD), one near it measures every window again; the
    windows it skips read the last measured figure; a due window without a measurement (the
    layer did not run) is no evidence; a reset (a switch) measures every window."""
    c = Cadence()
    assert far(0.0, 1e-8, 1e-3, 2) and not far(9e-4, 1e-8, 1e-3, 2) and far(9e-4, 1e-8, 1e-3, 10)
    periods, read = [], []
    for window in range(12):
        if c.due:
            read.append(c.checked([float(window)], True, clear=window < 9))
        else:
            read.append(c.checked([-1.0], False, False))
        periods.append(c.period)
    assert periods[:4] == [2, 2, 4, 4] and max(periods) == MAX_PERIOD
    assert all(r == [float(w)] or r == read[w - 1] for w, r in enumerate(read))  # skipped: the last measured
    assert [-1.0] not in read
    c.reset()
    assert c.due and c.period == 1 and c.checked([5.0], False, False) == [5.0]  # due, unmeasured: as it came
    c.load(Cadence().state())
    assert c.state() == [1, 0, None]


# ------------------------------------------------------------------ in a run
def test_after_the_first_window_a_far_cost_is_measured_only_on_the_last_steps(measured):
    """The hidden layer's NVFP4 cost (about 1e-4 a step) against max_loss_cost=1: its first
    window measures every step, the next measured ones their last 2 (the shadow steps); the
    logits' own cost likewise. The first window lay far from the threshold: the cadence skips
    the second window (the first's figure stands) and measures the third. Nothing is measured
    on the other steps."""
    seen, spy = measured
    model, ctl = _converted(max_loss_cost=1.0, **QUIET)
    _train(model, ctl, 30, spy=spy)
    for layer in ("0", "2"):
        assert _steps(seen, layer) == list(range(10)) + [28, 29]
        assert ctl._layers[layer].cost_cadence[0].period == 4
        assert ctl._layers[layer].cost_plan == [2, 10]  # the row below: never measured (the floor)
    assert not ctl.log


@pytest.mark.parametrize("planned", [3, 7, 10])
def test_a_plan_of_n_steps_measures_the_last_n_of_each_window(measured, monkeypatch, planned):
    """Whatever the plan says (here: ``planned`` steps for every cost; a cost near its threshold
    is planned on all 10), the costs are measured on the last ``planned`` steps of each window
    after the first, and on no other."""
    seen, spy = measured
    monkeypatch.setattr(_ladder, "cost_steps", lambda *args: (planned, [1e3]))
    monkeypatch.setattr(_ladder, "clear", lambda *args: False)  # (near: every window)
    model, ctl = _converted(max_loss_cost=1.0, **QUIET)
    _train(model, ctl, 30, spy=spy)
    tail = [s for start in (10, 20) for s in range(start + 10 - planned, start + 10)]
    assert _steps(seen, "0") == _steps(seen, "2") == list(range(10)) + tail


def test_the_window_mean_is_of_the_measured_steps_alone():
    model, ctl = _converted(max_loss_cost=1.0, **QUIET)
    _train(model, ctl, 20)
    rec = ctl._layers["2"]
    estimates = []
    for step in range(20, 29):  # steps 20..28: 28 is measured, 20..27 are not
        x, y = BATCHES[step]
        F.cross_entropy(model(x), y).backward()
        model.zero_grad()
        c = rec.cost
        estimates.append(_cost.loss_cost(*c[0, :3], at_error=True).item() if c[0, 2] > 0 else None)
        ctl.step()
    assert estimates[:8] == [None] * 8 and estimates[8] is not None
    assert rec.cost[0, 4].item() == 1 and rec.cost[0, 3].item() == pytest.approx(estimates[8])


def test_a_switched_forward_is_measured_on_every_step_again(measured):
    """The logits' NVFP4 forward costs about 0.005 nats: over the limit at the first two checks,
    promoted at the second (``OVER_WINDOWS``); its new rung's cost (tensorwise, own) and the
    recipe below's (NVFP4) are measured on every step of the next window, whatever the plan of
    the old rung said."""
    seen, spy = measured
    model, ctl = _converted(max_loss_cost=3e-3, **QUIET)
    _train(model, ctl, 30, spy=spy)
    (d,) = [d for d in ctl.log if d.layer == "2"]
    assert (d.step, d.gemm, d.to) == (OVER_WINDOWS * 10, "output", "fp8-tensorwise")
    assert _steps(seen, "2", 0)[-10:] == list(range(20, 30)) and _steps(seen, "2", 1) == list(range(20, 30))


def test_the_rung_below_is_measured_only_where_its_cost_would_decide(measured):
    """A promoted forward's way back is paid for only while nothing but its cost keeps it up: on
    the whole-layer controller, with its shadow's NVFP4 operands over the demotion limit (every
    e2m1 cast flushes some), the recipe below's cost is measured in the window after the switch
    and no more; with the operands clean it is measured again in later windows. Per GEMM the
    forward's way back is its cost alone (test_controller_forward_by_cost): measured on, whatever
    the shadow flushes."""
    seen, spy = measured
    for per_gemm in (False, True):
        seen.clear()
        model, ctl = _converted(max_loss_cost=3e-3, fp4_max_underflow=0.5, fp4_demote_underflow=0.0, per_gemm=per_gemm)
        _train(model, ctl, 50, spy=spy)
        assert [(d.step, d.to) for d in ctl.log if d.layer == "2"] == [(20, "fp8-tensorwise")]
        if per_gemm:
            assert _steps(seen, "2", 1)[-1] >= 30 and ctl._layers["2"].cost_below
        else:
            assert _steps(seen, "2", 1) == list(range(20, 30)) and not ctl._layers["2"].cost_below
    seen.clear()
    model, ctl = _converted(max_loss_cost=3e-3, per_gemm=False, **QUIET)
    _train(model, ctl, 50, spy=spy)
    assert [s for s in _steps(seen, "2", 1) if s >= 30] and ctl._layers["2"].cost_below


def test_a_run_resumed_mid_window_measures_and_decides_bitwise_as_an_uninterrupted_one():
    settings = dict(max_loss_cost=0.05, every=5, demote_windows=2, min_dwell=0)
    model, ctl = _converted(**settings)
    _train(model, ctl, 13)
    state = json.loads(json.dumps(ctl.state_dict()))
    assert state["layers"]["0"]["loss_cost_plan"]["steps"][0] == 2  # a plan of fewer steps than every
    _train(model, ctl, 30, start=13)
    fresh, resumed = _converted(**settings)  # (no optimizer: the weights are the fresh model's)
    resumed.load_state_dict(state)
    _train(fresh, resumed, 30, start=13)
    assert resumed.log == ctl.log and resumed.state_dict() == ctl.state_dict()


def test_a_checkpoint_saved_before_the_plan_loads_measuring_every_step():
    model, ctl = _converted(max_loss_cost=1.0, **QUIET)
    _train(model, ctl, 3)
    state = ctl.state_dict()
    for data in state["layers"].values():  # as the code before the plan saved it
        del data["loss_cost_plan"]
        data["loss_cost"] = [row[:5] for row in data["loss_cost"]]
    fresh, resumed = _converted(max_loss_cost=1.0, **QUIET)
    resumed.load_state_dict(state)
    _train(fresh, resumed, 6, start=3)
    _train(model, ctl, 6, start=3)
    rec, straight = resumed._layers["0"], ctl._layers["0"]
    assert rec.cost_plan == [None, None] and rec.cost_now == [True, True]
    assert torch.equal(rec.cost[:, :5], straight.cost[:, :5]) and rec.cost[0, 4].item() == 6


def test_a_checkpoint_saved_before_the_index_sums_loads_its_window_as_flat():
    """A window saved without the sums of each estimate times its index (6 columns) loads as if
    its steps so far lay on a flat line: the early line's level is their mean (no rise read into
    them), and the steps after add to it as in an uninterrupted run."""
    model, ctl = _converted(max_loss_cost=1.0, **QUIET)
    _train(model, ctl, 5)
    state = ctl.state_dict()
    for data in state["layers"].values():
        data["loss_cost"] = [row[:6] for row in data["loss_cost"]]
    fresh, resumed = _converted(max_loss_cost=1.0, **QUIET)
    resumed.load_state_dict(state)
    c = resumed._layers["0"].cost[0]
    assert torch.equal(c[:6], ctl._layers["0"].cost[0, :6])
    assert c[4].item() == 5 and c[6].item() == pytest.approx(2 * c[3].item(), rel=1e-6)  # sum of index * mean: slope 0
    _train(fresh, resumed, 8, start=5)
    _train(model, ctl, 8, start=5)
    assert torch.equal(resumed._layers["0"].cost[:, :6], ctl._layers["0"].cost[:, :6])


def test_a_compiled_model_keeps_the_costs_of_the_steps_eager_code_measures():
    """Traced code measures on every step and keeps the sums where the record's device flags say:
    bitwise the window eager code keeps, with no recompile as the plan's steps come and go."""
    import torch._dynamo

    torch._dynamo.reset()
    runs = []
    for compiled in (False, True):
        model, ctl = _converted(max_loss_cost=1.0, every=4, **QUIET)
        forward = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
        sums = []
        for step in range(12):
            x, y = BATCHES[step]
            F.cross_entropy(forward(x), y).backward()
            model.zero_grad()
            sums.append(ctl._layers["2"].cost[:, :3].clone())
            ctl.step()
        runs.append((ctl.log, sums, ctl._layers["2"].cost_plan))
    (eager_log, eager_sums, eager_plan), (compiled_log, compiled_sums, compiled_plan) = runs
    assert eager_plan == compiled_plan == [2, 4]
    # the first window measured every step; far from its threshold, the cadence skips the second
    assert [bool(s[0, 2] > 0) for s in eager_sums] == [True] * 4 + [False] * 4 + [False, False, True, True]
    assert compiled_log == eager_log
    assert all(torch.equal(a, b) for a, b in zip(eager_sums, compiled_sums))


def test_a_forward_switch_starts_the_plan_over():
    """A plan made for one rung's casts says nothing of another's: once the forward GEMM's rung
    changes, both costs are measured on every step again (whatever the plan said)."""
    model, ctl = _converted(max_loss_cost=1.0, **QUIET)
    _train(model, ctl, 20)
    rec = ctl._layers["0"]
    assert rec.cost_plan[0] == 2 and rec.cost_now == [False, True]
    rec.rungs = [1, 0, 0]  # as a promotion of the forward GEMM leaves it
    rec.cost_phase(ctl.steps, 10)
    assert rec.cost_plan == [None, None] and rec.cost_var == [None, None] and rec.cost_now == [True, True]
    assert rec.cost_gate.tolist() == [True, True]


def test_a_cost_wanted_only_of_a_rung_below_that_is_not_there_costs_nothing(monkeypatch):
    """A forward GEMM on the ladder's lowest rung has no rung below: on a step whose plan skips
    its own cost the probe does not call the measurement (nor draws rows), and the step's fold
    passes it over (its sums are empty): its window is what it was."""
    model, ctl = _converted(max_loss_cost=1.0, **QUIET)
    _train(model, ctl, 20)
    rec = ctl._layers["0"]
    assert rec.rung == 0 and rec.forward_below is None and rec.cost_now == [False, True]
    assert rec.cost_rows_now() == (False, False)
    calls: list = []
    original = _cost.measure_cost
    monkeypatch.setattr("mixprec.control._probe.measure_cost",
                        lambda r, *a, **k: (calls.append(r), original(r, *a, **k))[1])
    before = rec.cost.clone()
    _train(model, ctl, 21, start=20)
    assert rec not in calls and torch.equal(rec.cost, before)
