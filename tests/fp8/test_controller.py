"""The fp8 Controller: promotes a layer before its input underflow crosses 5% (a drifting input),
demotes it once the drift is over, never moves on stationary data, decides the same on every rank
(gloo, one rank drifting), resumes bit for bit, and moves an fp16 layer to fp32 before it
overflows where the plain fp8 policy skips steps."""

from __future__ import annotations

import os
import warnings
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec import Controller, Policy

from _distributed import gloo_group, spawn
from _models import mlp
from _train_cases import CASES, Drift, Result, Trainer, controller, differing_weights, train

DRIFT_END = 200
DRIFT = CASES["controller-drift"]  # the harness's case: tests/_train_cases.py


def _underflow(x: torch.Tensor) -> float:
    """The fraction of nonzero elements of x (as bf16) a tensorwise e4m3 cast flushes to zero:
    plain torch, the scale of torchao's ``amax_to_scale``."""
    x = x.bfloat16().float()
    fmax = torch.finfo(torch.float8_e4m3fn).max
    scale = (fmax / x.abs().max().double().clamp(min=1e-12)).float()
    q = (x * scale).clamp(-fmax, fmax).to(torch.float8_e4m3fn).float()
    return ((q == 0) & (x != 0)).sum().item() / x.numel()


def _windows(run: Result) -> dict[int, dict]:
    """The windows each check judged, by the Controller's step count at that check."""
    return {t + 1: w for t, w in enumerate(run.records["windows"]) if w is not None}


@pytest.fixture(scope="module")
def drift_data() -> list:
    return list(DRIFT.data.batches())


@pytest.fixture(scope="module")
def drift_run() -> Result:
    return train(DRIFT)


def test_the_drift_crosses_5_percent_underflow_at_step_190(drift_data):
    underflow = [_underflow(x) for x, _ in drift_data]
    assert next(t for t, u in enumerate(underflow) if u > 0.05) == 190
    assert max(underflow[DRIFT_END:]) < 0.001


def test_drift_promotes_before_trouble_and_demotes_after(drift_run, drift_data):
    """Expectations from the run's own measurements, not one machine's counts: where bf16
    rounds differently (no native bf16, e.g. an AVX2 EPYC) layer 0's grad_output may reach e5m2's
    floor and be promoted for it early; that promotion must then be justified by its statistics."""
    underflow = [_underflow(x) for x, _ in drift_data]
    crossing = next(t for t, u in enumerate(underflow) if u > 0.05)
    first = [p["0"] for p in drift_run.records["precisions"]]
    in_fp8 = [p.startswith("fp8-") for p in first]
    bad = [t for t, u in enumerate(underflow) if u > 0.05 and in_fp8[t]]
    assert not bad, f"layer 0 ran fp8 at steps {bad} with input underflow above 5%"
    log = drift_run.supervisor.log
    assert all(d.step % drift_run.supervisor.every == 0 for d in log)
    windows = _windows(drift_run)
    for d in log:  # every promotion justified by its operand's window, measured by the run itself
        measured = windows[d.step][(d.layer, d.operand)]
        if d.action == "promote":
            assert d.statistic == "underflow_forecast" and d.value > d.threshold == 0.05, d
            assert 0 < measured["underflow"] <= d.value, (d, measured)
            assert d.reason == f"{d.operand} underflow forecast {d.value:.4g} > 0.05"
        else:
            assert d.statistic == "underflow_forecast" and d.value <= d.threshold == 0.01, d
    log0 = [d for d in log if d.layer == "0"]
    # layer 0 promoted before its input's crossing (for the input, or on a machine whose bf16
    # rounding brings its grad_output to e5m2's floor first, for that): out of fp8 by then
    up = [d for d in log0 if d.action == "promote"]
    assert up and up[0].step <= crossing and not in_fp8[crossing], log0
    assert first[0] == "fp8-tensorwise" and all(in_fp8[:log0[0].step])
    # demoted after the drift: back to tensorwise by the end
    assert any(d.action == "demote" and d.step > DRIFT_END for d in log0)
    assert first[-1] == "fp8-tensorwise"
    # the precision changes exactly at the decisions' steps
    for d in log0:
        assert first[d.step - 1] == d.from_ and first[d.step] == d.to
    changes = {t for t in range(1, len(first)) if first[t] != first[t - 1]}
    assert changes == {d.step for d in log0}


def test_stationary_data_moves_nothing():
    run = train(replace(DRIFT, data=Drift(drift=False)))
    assert run.supervisor.log == []
    assert all(p == "fp8-tensorwise" for step in run.records["precisions"] for p in step.values())


def test_resume_is_bitwise_and_runs_are_deterministic(drift_run):
    # a second run, resumed mid-window at step 195 (layer 0 promoted, windows open, trends warm)
    # in fresh objects (model, optimizer, controller and policy), the controller's state as JSON
    resumed = train(replace(DRIFT, resume_at=195))
    assert resumed.rebuilt_at == 195 and drift_run.rebuilt_at is None
    assert resumed.supervisor.log == drift_run.supervisor.log
    assert resumed.records["precisions"] == drift_run.records["precisions"]
    for a, b in zip(resumed.model.state_dict().values(), drift_run.model.state_dict().values()):
        assert torch.equal(a, b)
    assert resumed.supervisor.state_dict() == drift_run.supervisor.state_dict()


def test_log_as_csv(drift_run, tmp_path):
    path = tmp_path / "log.csv"
    text = drift_run.supervisor.write_csv(path)
    lines = path.read_text().splitlines()
    assert lines[0] == "step,layer,operand,action,from,to,statistic,value,threshold,reason"
    assert len(lines) == 1 + len(drift_run.supervisor.log) and text == path.read_text()
    first = drift_run.supervisor.log[0]
    assert lines[1].startswith(f"{first.step},{first.layer},{first.operand},promote,fp8-tensorwise,")


def test_no_host_read_between_checks(syncs):
    run = Trainer(replace(DRIFT, data=Drift(steps=10, drift=False), steps=10, supervisor=controller(every=5),
                          record=("precisions",)), seed=0)
    run.step(0)
    counter = syncs.start()
    for t in (1, 2, 3):  # ctl.step() counts 2, 3, 4: no check
        run.step(t)
    counts = counter.stop()
    assert counts == 0
    run_check = syncs.start()
    run.step(4)  # the check at 5: one read of all the windows
    assert run_check.stop() == 1


# ----------------------------------------------------------------- fp16: the range rung
def _skipped(run: Result) -> list[int]:
    """The steps whose update the GradScaler skipped (its scale backed off)."""
    return [t for t, skipped in enumerate(run.records["skipped"]) if skipped]


def test_fp16_layer_goes_to_fp32_before_it_overflows():
    plain = _skipped(train(CASES["plain-fp16"]))
    assert plain, "the plain fp8 policy under fp16 compute should overflow"
    run = train(CASES["controller-fp16"])
    assert _skipped(run) == []
    promotions = [d for d in run.supervisor.log if d.layer == "2" and d.to == "fp32"]
    assert promotions and promotions[0].step < plain[0]
    assert promotions[0].operand == "output" and promotions[0].statistic == "amax_forecast"
    assert run.supervisor.precision("2") == "fp32"
    assert all(run.supervisor.precision(n) != "fp32" for n in ("0", "4", "6"))


# ----------------------------------------------------------------- distributed
def _rank_worker(rank: int, port: int, out_dir: str) -> None:
    case = replace(DRIFT, data=Drift(steps=200, drift=rank == 0, start=110, end=80), steps=200, record=("precisions",))
    with gloo_group(rank, port):
        run = train(case)
        torch.save({"log": run.supervisor.log, "precisions": run.records["precisions"]},
                   os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.distributed
@pytest.mark.slow
def test_ranks_decide_the_same_when_only_one_drifts(tmp_path):
    spawn(_rank_worker, str(tmp_path), timeout=600)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2))
    assert r0["log"], "rank 0's drift should promote layer 0"
    assert r0["log"] == r1["log"] and r0["precisions"] == r1["precisions"]
    assert {d.action for d in r0["log"]} == {"promote", "demote"}


# ----------------------------------------------------------------- interface
def test_policy_attaches_round_trips_and_refuses_bad_settings():
    ctl = Controller(every=5, ladder=("tensorwise", "compute"))
    policy = Policy.parse("compute=bf16").fp8("tensorwise", controller=ctl)
    assert "controlled" in str(policy)
    back = Policy.from_json(policy.to_json())
    assert back.fp8_rule.live is None and back.fp8_rule.controller == ctl.settings and back == policy
    with pytest.raises(ValueError, match="guard= or controller="):
        Policy.fp8(controller=Controller(), guard=mixprec.fp8.Guard())
    with pytest.raises(ValueError, match="must be a mixprec.Controller"):
        Policy.fp8(controller=object())
    with pytest.raises(ValueError, match="ladder"):
        Controller(ladder=("compute", "tensorwise"))
    with pytest.raises(ValueError, match="every"):
        Controller(every=0)
    with pytest.raises(ValueError, match="demote_underflow"):
        Controller(demote_underflow=0.5)
    with pytest.raises(ValueError, match="unknown Controller setting"):
        Controller.from_config({"often": 3})
    with pytest.raises(ValueError, match="Controller.load_state_dict"):
        Controller().load_state_dict({"steps": 1})


def test_recipe_off_the_ladder_and_unknown_layer_say_what_to_do():
    ctl = Controller(ladder=("tensorwise", "compute"))
    policy = Policy.parse("compute=bf16").fp8("rowwise", controller=ctl, first_last="fp8")
    with pytest.raises(ValueError, match=r"on its ladder .* pass Controller\(ladder="):
        with mixprec.autocast("cpu", policy=policy):
            mlp(64, 64, 64, 64, 64)(torch.randn(2, 64))
    with pytest.raises(KeyError, match="no fp8 layer"):
        Controller().precision("0")


def test_step_without_layers_and_forwards_without_step_warn():
    with pytest.warns(UserWarning, match="tracks no fp8 layer"):
        Controller().step()
    ctl = Controller()
    policy = Policy.parse("compute=bf16").fp8("tensorwise", controller=ctl, first_last="fp8")
    model = mlp(64, 64, 64, 64, 64)
    with pytest.warns(UserWarning, match="no ctl.step"):
        for _ in range(100):
            with mixprec.autocast("cpu", policy=policy):
                model(torch.randn(2, 64))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ctl.step()


def test_rungs_run_what_they_say():
    """A layer set to each rung computes as that format: bitwise fp8.linear with the rung's
    recipe, the compute dtype's F.linear, or fp32 (on the input as the region gives it)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64))
    ctl = Controller()
    policy = Policy.parse("compute=bf16").fp8("tensorwise", controller=ctl, first_last="fp8")
    x = torch.randn(8, 64)
    with mixprec.autocast("cpu", policy=policy):
        model(x)
    layer = model[0]
    rec = ctl._layers["0"]
    for rung, expect in [(1, lambda: mixprec.fp8.linear(x.bfloat16(), layer.weight, layer.bias,
                                                         mixprec.fp8.Float8Recipe.rowwise())),
                         (2, lambda: F.linear(x.bfloat16(), layer.weight.bfloat16(), layer.bias.bfloat16())),
                         (3, lambda: F.linear(x.bfloat16().float(), layer.weight, layer.bias))]:
        rec.rung = rung
        ctl._apply(rec)
        with mixprec.autocast("cpu", policy=policy):
            out = model(x)
        ref = expect()
        assert out.dtype == ref.dtype and torch.equal(out, ref), ctl.precision("0")


def test_hysteresis_dwell_and_switch_budget():
    """An outlier of 1e6 flushes a layer's other inputs (underflow about 1): promote at the next
    check; demote after ``demote_windows`` clean windows and ``min_dwell`` steps; once the layer
    has used its ``max_switches``, it stays promoted."""
    run = train(CASES["controller-switch-budget"])  # outliers at steps 0 and 4
    ctl, ran = run.supervisor, [p["0"] for p in run.records["precisions"]]
    assert [(d.step, d.action) for d in ctl.log] == [(1, "promote"), (4, "demote"), (5, "promote")]
    assert ctl.log[0].statistic == "underflow_forecast" and ctl.log[0].value > 0.9
    # steps 2, 3 clean (2 windows) but the dwell since step 1 is 3 steps only at step 4
    assert ran[:6] == ["fp8-tensorwise", "bf16", "bf16", "bf16", "fp8-tensorwise", "bf16"]
    assert set(ran[5:]) == {"bf16"}  # 3 switches in the budget: no demotion


@pytest.mark.parametrize("resume_at", [2, 5, 6, 9])
def test_the_switch_budget_and_dwell_survive_a_resume(resume_at):
    """Resumed between the switches or after the budget is spent (into fresh objects, the state
    through torch.save), the run decides as the straight one: a checkpoint that dropped the
    layer's switch history would let it demote again."""
    case = CASES["controller-switch-budget"]
    straight, resumed = train(case), train(replace(case, resume_at=resume_at))
    assert resumed.rebuilt_at == resume_at
    assert resumed.supervisor.log == straight.supervisor.log
    assert resumed.records["precisions"] == straight.records["precisions"]
    assert resumed.state == straight.state


def test_shadow_measures_the_last_steps_of_each_window():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16))
    ctl = Controller(every=4, shadow_steps=1, ladder=("tensorwise", "compute"))
    policy = Policy.parse("compute=bf16").fp8("tensorwise", controller=ctl, first_last="fp8")
    seen = []
    for t in range(8):
        with mixprec.autocast("cpu", policy=policy):
            model(torch.randn(8, 16)).sum().backward()
        if t == 0:  # promote the layer by hand: its shadow measures tensorwise from now on
            rec = ctl._layers["0"]
            rec.rung = 1
            ctl._apply(rec)
        seen.append(bool(ctl._layers["0"].shadow[:, 0].gt(0).all()))  # input, weight, grad amax
        ctl.step()
    assert seen == [False, False, False, True, False, False, False, True]
    with pytest.raises(ValueError, match="shadow_steps"):
        Controller(shadow_steps=0)


def test_resume_at_any_step_is_bitwise():
    """A 2-layer fp8 model whose layer "0" gets an outlier at steps 1 and 9 (promote, demote,
    promote again), resumed from a checkpoint at every step into fresh objects."""
    case = CASES["controller-outlier"]
    straight = train(case)
    log, ran = straight.supervisor.log, straight.records["precisions"]
    assert {d.action for d in log} == {"promote", "demote"} and "fp8-rowwise" in [p["0"] for p in ran]
    for k in range(1, 14):
        resumed = train(replace(case, resume_at=k))
        assert resumed.rebuilt_at == k
        assert resumed.supervisor.log == log and resumed.records["precisions"] == ran, k
        assert resumed.state == straight.state, k
        assert not differing_weights(resumed, straight), k


def test_windows_without_forwards_demote_nothing():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16))
    ctl = Controller(every=1, horizon=1, demote_windows=1, min_dwell=0, ladder=("tensorwise", "compute"))
    policy = Policy.parse("compute=bf16").fp8("tensorwise", controller=ctl, first_last="fp8")
    x = torch.randn(8, 16)
    x[0, 0] = 1e6
    with mixprec.autocast("cpu", policy=policy):
        model(x).sum().backward()
    ctl.step()
    assert ctl.precision("0") == "bf16"
    for _ in range(5):  # no data: no evidence that the rung below is safe
        ctl.step()
    assert ctl.precision("0") == "bf16"
    with mixprec.autocast("cpu", policy=policy):
        model(torch.randn(8, 16)).sum().backward()
    ctl.step()
    assert ctl.precision("0") == "fp8-tensorwise"
