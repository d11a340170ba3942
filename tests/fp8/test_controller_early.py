"""Early promotions (``mixprec.control._early``): under ``max_loss_cost``, a forward GEMM whose
loss cost is :data:`COST_Z` standard errors over the limit is promoted within the first steps of
a window that measures it on every step, not at the window's check; a cost under the limit
waits; ranks decide alike, a resumed run and a compiled model as an uninterrupted eager one."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from mixprec import Controller, fp8
from mixprec.control._decide import switch_gemms
from mixprec.control._early import EARLY_STEPS, early_window, lower_bounds, with_forward
from mixprec.control._ladder import Decision

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from _distributed import gloo_group, spawn  # noqa: E402

CROSS_ISA = pytest.mark.cross_isa
LADDER = ("nvfp4", "tensorwise", "compute")
EVERY = 10


def _model() -> nn.Sequential:
    """A classifier whose logits (layer "2") are sharp: their NVFP4 error costs about 0.005 nats a
    step, the hidden layer's at most about 0.0014 on any rung (test_controller_loss_cost)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64))
    with torch.no_grad():
        model[2].weight.mul_(4)
    return model


def _batch(seed: int = 1, rows: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 32, generator=g)
    with torch.no_grad():
        y = (_model()(x) + 0.5 * torch.randn(rows, 64, generator=g)).argmax(-1)
    return x, y


BATCH = _batch()
#: no promotion on NVFP4's flush; the logits' cost (about 0.005) far over the limit, the hidden layer's under it
SETTINGS = dict(every=EVERY, ladder=LADDER, per_gemm=True, floor="nvfp4", max_loss_cost=3e-3,
                fp4_max_underflow=0.5, fp4_demote_underflow=0.4)


def _converted(**changes) -> tuple[nn.Module, Controller]:
    ctl = Controller(**{**SETTINGS, **changes})
    model = fp8.convert(_model(), "nvfp4", filter_fn=lambda m, n: True, controller=ctl, backend="emulate_fp32")
    return model, ctl


def _train(model, ctl, steps: int, start: int = 0, batch=BATCH, forward=None) -> None:
    x, y = batch
    for _ in range(start, steps):
        F.cross_entropy((forward or model)(x), y).backward()
        model.zero_grad()
        ctl.step()


def _decision(step: int, gemm: str | None = "output") -> Decision:
    return Decision(step, "2", "output", "promote", "nvfp4", "fp8-tensorwise", "loss_cost", 1.0, 1.0, "", gemm)


def test_the_windows_read_early_are_the_first_and_those_after_a_forward_switch():
    assert [s for s in range(1, 31) if early_window(s, EVERY, [])] == list(range(EARLY_STEPS, EVERY))
    for switched, window in ((10, range(13, 20)), (14, range(23, 30))):  # at a check; early in a window
        assert [s for s in range(11, 31) if early_window(s, EVERY, [_decision(switched)])] == list(window)
    assert not any(early_window(s, EVERY, [_decision(14, "grad_weight")]) for s in range(11, 31))
    assert [s for s in range(11, 21) if early_window(s, EVERY, [_decision(8, None)])] == list(range(13, 20))


@CROSS_ISA
@pytest.mark.parametrize("per_gemm", [True, False])
def test_a_forward_far_over_its_limit_is_promoted_before_the_first_check(per_gemm):
    """The logits' NVFP4 forward is promoted at the first step its window's mean lies COST_Z
    standard errors over the limit (the same batch each step: a steady cost), not at step
    ``every``; the hidden layer's, under the limit, is not. Its window starts over on the rung
    above. Per GEMM its backward GEMMs keep their rungs; a whole layer moves as one."""
    model, ctl = _converted(per_gemm=per_gemm)
    _train(model, ctl, EVERY - 1)
    (d,) = ctl.log
    assert (d.step, d.layer, d.gemm, d.action, d.from_, d.to, d.statistic) == (
        EARLY_STEPS, "2", "output" if per_gemm else None, "promote", "nvfp4", "fp8-tensorwise", "loss_cost")
    assert d.value > d.threshold == 3e-3 and "early: 3 steps" in d.reason
    backward = "nvfp4" if per_gemm else "fp8-tensorwise"
    assert [ctl.precision("2", g) for g in ("output", "grad_input", "grad_weight")] == ["fp8-tensorwise", backward, backward]
    assert ctl.precision("0") == "nvfp4"
    # the new rung's window holds only its own steps (no mean of two rungs)
    assert lower_bounds([ctl._layers["2"]])[0, 2].item() == EVERY - 1 - EARLY_STEPS


@CROSS_ISA
def test_before_the_first_check_its_backward_gemms_go_up_with_an_early_forward():
    """Under ``max_backward_cost`` (whose costs only checks read), the logits' forward promoted
    early takes its backward GEMMs to its rung, a decision each naming why; they come down as any
    promoted GEMM (no optimizer here: no gain, no cost, the flush rule decides them). After the
    first check an early forward promotion moves the forward alone."""
    model, ctl = _converted(max_backward_cost=1e-2)
    _train(model, ctl, EVERY - 1)
    assert [(d.step, d.gemm, d.from_, d.to, d.statistic) for d in ctl.log] == [
        (EARLY_STEPS, g, "nvfp4", "fp8-tensorwise", "loss_cost") for g in ("output", "grad_input", "grad_weight")]
    forward, *backward = ctl.log
    said = (f"up with its forward GEMM, before any check of its own cost (forward loss cost {forward.value:.4g} "
            f"> 0.003, early: 3 steps)")
    assert all(d.value == forward.value and d.reason.endswith(said) for d in backward)
    assert [ctl.precision("2", g) for g in ("output", "grad_input", "grad_weight")] == ["fp8-tensorwise"] * 3
    _train(model, ctl, 8 * EVERY, EVERY - 1)
    assert {d.gemm for d in ctl.log if d.action == "demote" and d.layer == "2"} >= {"grad_input", "grad_weight"}
    hidden = ctl._layers["0"]
    switch_gemms(ctl._check(), hidden, (0,), 1)  # (its forward up a rung, as an early promotion would)
    for steps, moved in ((EVERY - 1, 2), (EVERY, 0)):
        at = dataclasses.replace(ctl._check(), steps=steps)
        rungs = list(hidden.rungs)
        assert len(with_forward(at, "0", hidden, forward, EARLY_STEPS)) == moved
        hidden.rungs[:] = rungs


@CROSS_ISA
def test_a_noisy_cost_waits_for_more_steps_and_no_cost_no_early_read(monkeypatch):
    """Batches that change every step: a noisier cost; promoted early only once its bound passes.
    Without max_loss_cost nothing is read early (no early call at all)."""
    batches = [_batch(seed, 128) for seed in range(EVERY)]
    model, ctl = _converted()
    seen = []
    for step in range(EVERY):
        _train(model, ctl, step + 1, step, batches[step])
        bound, mean, n = lower_bounds([ctl._layers["2"]])[0].tolist()
        seen.append((ctl.steps, bound, n))
    early = [d for d in ctl.log if "early" in d.reason]
    for step, bound, n in seen:
        if early and step >= early[0].step:
            break
        assert n < EARLY_STEPS or bound <= 3e-3  # no early decision before its bound passed
    import mixprec.control._controller as shell

    calls = []
    monkeypatch.setattr(shell, "promote_early", lambda *a: calls.append(a) or [])
    model, ctl = _converted(max_loss_cost=None, max_backward_cost=None)
    _train(model, ctl, EVERY - 1)
    assert not calls


@CROSS_ISA
@pytest.mark.parametrize("resume_at", [2, 5, 12])
def test_a_resumed_run_promotes_early_as_an_uninterrupted_one(resume_at):
    """The early windows follow the step count and the log, both in the state dict: saved before
    the early promotion, mid-window after it, and in the window after it (read early too)."""
    model, ctl = _converted()
    _train(model, ctl, resume_at)
    state = json.loads(json.dumps(ctl.state_dict()))
    _train(model, ctl, 2 * EVERY + 5, resume_at)
    fresh, resumed = _converted()  # (no optimizer: the weights are the same)
    resumed.load_state_dict(state)
    _train(fresh, resumed, 2 * EVERY + 5, resume_at)
    assert ctl.log[0].step == EARLY_STEPS
    assert resumed.log == ctl.log and resumed.state_dict() == ctl.state_dict()


def test_a_compiled_model_is_promoted_early_as_eager_without_a_recompile_per_step():
    """Traced code reads the device flags: the same decisions as eager, and compiles only at a
    switch (the reroute), not at the early reads."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    runs = []
    for compiled in (False, True):
        torch._dynamo.reset()
        counters.clear()
        model, ctl = _converted()
        forward = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
        _train(model, ctl, EVERY + 2, forward=forward)
        runs.append((ctl.log, counters["stats"]["unique_graphs"]))
    (eager_log, _), (compiled_log, graphs) = runs
    assert eager_log and eager_log[0].step == EARLY_STEPS and compiled_log == eager_log
    assert graphs <= 1 + len(compiled_log)  # the first compile, one per switch


def _rank_worker(rank: int, port: int, out_dir: str) -> None:
    """Each rank its own batches; only rank 0's logits are sharp enough to pass the limit early
    (under ``max_backward_cost``: the backward GEMMs go up with the forward on both ranks)."""
    with gloo_group(rank, port):
        model, ctl = _converted(max_backward_cost=1e-2)
        if rank == 1:
            with torch.no_grad():
                model[2].weight.div_(4)
        _train(model, ctl, EVERY + 5, batch=_batch(1 + rank))
        gemms = ("output", "grad_input", "grad_weight")
        torch.save({"log": ctl.log, "state": {n: [ctl.precision(n, g) for g in gemms] for n in ("0", "2")}},
                   os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.distributed
@pytest.mark.slow
def test_ranks_promote_early_alike_from_the_all_reduced_bounds(tmp_path):
    spawn(_rank_worker, str(tmp_path), timeout=300)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2))
    assert r0 == r1
    assert r0["log"][0].step == EARLY_STEPS and r0["log"][0].layer == "2" and "early" in r0["log"][0].reason
    assert [(d.step, d.gemm) for d in r0["log"][1:3]] == [(EARLY_STEPS, "grad_input"), (EARLY_STEPS, "grad_weight")]


# the early bound's two estimates, checked against a least-squares fit (numpy) of the same steps
BOUND_CASES = {
    "flat, noisy": [0.004, 0.006, 0.005, 0.003, 0.007, 0.005, 0.004],
    "rising": [0.0, 0.001, 0.003, 0.004, 0.007, 0.008, 0.011, 0.012],
    "falling": [0.012, 0.010, 0.007, 0.006, 0.004, 0.002],
    "four steps (no line)": [0.0, 0.002, 0.004, 0.006],
    "on a line": [1.0, 2.0, 3.0, 4.0, 5.0],
    "two steps": [0.01, 0.02],
}


@pytest.mark.parametrize("name", list(BOUND_CASES))
def test_the_bound_is_the_larger_of_the_mean_s_and_the_line_s(name):
    import numpy as np

    from mixprec.control._cost import COST_Z
    from mixprec.control._early import TREND_STEPS, cost_bound

    c = np.array(BOUND_CASES[name], dtype=np.float64)
    n = len(c)
    at = np.arange(n, dtype=np.float64)
    sums = [torch.tensor(v, dtype=torch.float64) for v in (c.sum(), float(n), (c * c).sum(), (c * at).sum())]
    bound, estimate = (float(t) for t in cost_bound(*sums))
    if n < EARLY_STEPS:
        assert bound == -float("inf")
        return
    mean_bound = c.mean() - COST_Z * c.std(ddof=1) / np.sqrt(n)
    expected, value = mean_bound, c.mean()
    if n >= TREND_STEPS:
        design = np.stack([np.ones(n), at], 1)
        (a, b), *_ = np.linalg.lstsq(design, c, rcond=None)
        level = a + b * (n - 1)
        residual = ((c - design @ [a, b]) ** 2).sum() / (n - 2)
        x = np.array([1.0, n - 1.0])
        line = level - COST_Z * np.sqrt(residual * x @ np.linalg.inv(design.T @ design) @ x)
        if line > mean_bound:
            expected, value = line, level
    assert bound == pytest.approx(expected, abs=1e-9) and estimate == pytest.approx(value, abs=1e-9)
    if name == "rising":  # the mean lags a rising cost: the line's bound is the one read
        assert estimate > c.mean() and bound > mean_bound
    if name in ("flat, noisy", "falling"):
        assert estimate == pytest.approx(c.mean())


def test_a_rising_cost_is_promoted_on_its_line_before_its_mean_passes(monkeypatch):
    """The logits' weight grows each step (their cost with it, from under the limit): the early
    read promotes once the line's bound passes, at a step where the mean's bound had not: the
    decision's cost is the line's level, above the window's mean."""
    import mixprec.control._controller as shell
    from mixprec.control._cost import COST_Z

    reads = []
    promote = shell.promote_early

    def spy(at, names, recs, reduce):
        rec = recs[names.index("2")]
        total, n, squares = (rec.cost[0, k].item() for k in (3, 4, 5))
        reads.append((at.steps, total / max(n, 1), n, squares))
        return promote(at, names, recs, reduce)

    monkeypatch.setattr(shell, "promote_early", spy)
    model, ctl = _converted()
    with torch.no_grad():
        model[2].weight.mul_(0.25)
    x, y = BATCH
    sums = []  # (sum, sum of index * estimate) after each step
    for step in range(EVERY - 1):
        F.cross_entropy(model(x), y).backward()
        model.zero_grad()
        with torch.no_grad():
            model[2].weight.mul_(1.35)
        ctl.step()
        sums.append((ctl._layers["2"].cost[0, 3].item(), ctl._layers["2"].cost[0, 6].item()))
    early = [d for d in ctl.log if d.layer == "2" and d.gemm == "output"]
    assert early and "early" in early[0].reason
    kept = sums[:early[0].step - 1]  # (the promotion starts the window over)
    steps = [b[0] - a[0] for a, b in zip([(0.0, 0.0)] + kept, kept)]
    assert kept[-1][1] == pytest.approx(sum(i * c for i, c in enumerate(steps)), rel=1e-5)
    step, mean, n, squares = next(r for r in reads if r[0] == early[0].step)
    sd = max(squares / n - mean * mean, 0.0) * n / (n - 1)
    assert mean - COST_Z * (sd / n) ** 0.5 <= 3e-3  # the mean's bound alone would have waited
    assert early[0].value > mean


@CROSS_ISA
@pytest.mark.parametrize("per_gemm", [True, False])
def test_an_early_promotion_the_check_does_not_confirm_is_taken_back_at_once(per_gemm):
    """An early promotion reads a few steps: it stands only if the check's window (its rung
    below measured on each step since) confirms it. The logits' cost, far over the limit over
    the first steps, drops under half of it once their weights shrink after the promotion: the
    check at ``every`` takes the promotion back (not 3 clean windows and ``min_dwell`` steps
    later, as a check's own promotion); a promotion it confirms stays. A whole layer alike."""
    model, ctl = _converted(per_gemm=per_gemm)
    _train(model, ctl, EARLY_STEPS)
    (up,) = ctl.log
    assert (up.step, up.action, up.to) == (EARLY_STEPS, "promote", "fp8-tensorwise")
    with torch.no_grad():
        model[2].weight.div_(4)  # (its cost now about 1/16: the hidden layer's, under the limit)
    _train(model, ctl, EVERY, EARLY_STEPS)
    down = [d for d in ctl.log if d.action == "demote"]
    assert [(d.step, d.layer, d.gemm, d.from_, d.to) for d in down] == [
        (EVERY, "2", "output" if per_gemm else None, "fp8-tensorwise", "nvfp4")]
    assert ctl.precision("2", "output") == "nvfp4"
    if per_gemm:  # (a whole layer's decision names its worst flush; its loss cost gates it alike)
        assert down[0].statistic == "loss_cost" and down[0].value <= ctl.settings.demote_cost

    if per_gemm:  # the backward GEMMs it took up (under max_backward_cost) come down with it
        model, ctl = _converted(max_backward_cost=1e-2)
        _train(model, ctl, EARLY_STEPS)
        assert [d.step for d in ctl.log] == [EARLY_STEPS] * 3
        with torch.no_grad():
            model[2].weight.div_(4)
        _train(model, ctl, EVERY, EARLY_STEPS)
        assert sorted((d.step, d.gemm, d.to) for d in ctl.log if d.action == "demote") == [
            (EVERY, g, "nvfp4") for g in ("grad_input", "grad_weight", "output")]
    confirmed, ctl2 = _converted(per_gemm=per_gemm)  # the same cost all along: the check confirms it
    _train(confirmed, ctl2, 4 * EVERY)
    assert [d.action for d in ctl2.log] == ["promote"] and ctl2.precision("2", "output") == "fp8-tensorwise"


@CROSS_ISA
def test_a_run_resumed_between_an_early_promotion_and_its_check_takes_it_back_alike():
    """Saved at step 5 (promoted early at 3, its cost dropped since), loaded into a fresh model
    and controller: the check at ``every`` takes the promotion back at the same step, and every
    later decision and the controller's state are the uninterrupted run's."""
    model, ctl = _converted()
    _train(model, ctl, EARLY_STEPS)
    with torch.no_grad():
        model[2].weight.div_(4)
    _train(model, ctl, 5, EARLY_STEPS)
    state = json.loads(json.dumps(ctl.state_dict()))
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    _train(model, ctl, 3 * EVERY, 5)
    fresh, resumed = _converted()
    fresh.load_state_dict(weights)
    resumed.load_state_dict(state)
    _train(fresh, resumed, 3 * EVERY, 5)
    assert [(d.step, d.action) for d in ctl.log[:2]] == [(EARLY_STEPS, "promote"), (EVERY, "demote")]
    assert resumed.log == ctl.log and resumed.state_dict() == ctl.state_dict()


def test_only_a_switch_since_the_last_check_is_provisional():
    """``_may_demote``: one clean window takes back a forward's switch made since the last check,
    not one a check made (that waits for ``demote_windows`` and ``min_dwell``), nor a backward
    GEMM's (taken up with its forward), nor one past the switch budget."""
    from mixprec.control._check import Check
    from mixprec.control._decide import _may_demote

    settings = Controller(**SETTINGS).settings
    at = Check.of(settings, steps=20)
    assert _may_demote(at, 1, [13], False, forward=True)
    assert not _may_demote(at, 1, [13], False)  # a backward GEMM's
    assert not _may_demote(at, 0, [13], False, forward=True)
    assert not _may_demote(at, 1, [10], False, forward=True)  # the check's own switch
    assert not _may_demote(at, 3, [10], False, forward=True)  # (min_dwell 30)
    assert _may_demote(dataclasses.replace(at, steps=40), 3, [10], False)
    assert not _may_demote(at, 1, [13] * settings.max_switches, False, forward=True)


def test_the_bounds_of_many_records_are_each_records_own():
    """``lower_bounds`` bounds all the records' costs in one call: each row is what its record's
    sums give alone (bitwise), a record without a measurable forward cost (none, no casts on its
    forward, blind) reads ``[-inf, 0, 0]`` wherever it stands among them."""
    from mixprec.control._early import cost_bound
    from mixprec.control._ladder import LayerRecord
    from mixprec.formats._state import LayerState

    def record(sums: tuple[float, ...] | None, low: bool = True, blind: bool = False) -> LayerRecord:
        rec = LayerRecord(None, LayerState(), 0, 0, (True,) * 3, cost=sums is not None)
        rec.forward_low, rec.cost_blind = low, blind
        if sums is not None:
            rec.cost[0, 3:7] = torch.tensor(sums)
        return rec

    live = [(6.0e-3, 5.0, 9.0e-6, 1.3e-2), (2.0e-4, 3.0, 2.0e-8, 3.0e-4), (1.0e-3, 2.0, 6.0e-7, 5.0e-4)]
    recs = [record(None), record(live[0]), record(live[0], low=False), record(live[1]),
            record(live[1], blind=True), record(live[2])]
    rows = lower_bounds(recs)
    dead = torch.tensor([-torch.inf, 0.0, 0.0])
    assert [torch.equal(rows[i], dead) for i in range(len(recs))] == [True, False, True, False, True, False]
    for i, sums in ((1, live[0]), (3, live[1]), (5, live[2])):
        t = torch.tensor(sums)
        bound, estimate = cost_bound(t[0], t[1], t[2], t[3])
        assert torch.equal(rows[i], torch.stack([bound, estimate, t[1]])), i
    assert lower_bounds([]).shape == (0, 3) and torch.equal(lower_bounds([record(None)]), dead[None])
