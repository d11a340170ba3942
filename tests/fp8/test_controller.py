"""The fp8 Controller: promotes a layer before its input underflow crosses 5% (a drifting input),
demotes it once the drift is over, never moves on stationary data, decides the same on every rank
(gloo, one rank drifting), resumes bit for bit, and moves an fp16 layer to fp32 before it
overflows where the plain fp8 policy skips steps."""

from __future__ import annotations

import copy
import io
import json
import os
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec import Controller, Policy

from _distributed import gloo_group, spawn
from _models import mlp

STEPS, DRIFT_END, SEED = 380, 200, 7


def _drift_data(steps: int = STEPS, drift: bool = True, start: int = 0, end: int = DRIFT_END,
                seed: int = SEED) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Batches of 32 x 64; feature 0 times 1.05**(t + start) while t < end (drift)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in range(steps):
        x = torch.randn(32, 64, generator=g)
        if drift and t < end:
            x[:, 0] *= 1.05 ** (t + start)
        out.append((x, torch.randint(0, 64, (32,), generator=g)))
    return out


def _underflow(x: torch.Tensor) -> float:
    """The fraction of nonzero elements of x (as bf16) a tensorwise e4m3 cast flushes to zero:
    plain torch, the scale of torchao's ``amax_to_scale``."""
    x = x.bfloat16().float()
    fmax = torch.finfo(torch.float8_e4m3fn).max
    scale = (fmax / x.abs().max().double().clamp(min=1e-12)).float()
    q = (x * scale).clamp(-fmax, fmax).to(torch.float8_e4m3fn).float()
    return ((q == 0) & (x != 0)).sum().item() / x.numel()


class _Run:
    """A training run under ``Policy.parse(compute).fp8("tensorwise", controller=...)``."""

    def __init__(self, ctl: Controller | None = None, compute: str = "bf16", model: nn.Module | None = None,
                 lr: float = 1e-3) -> None:
        self.model = mlp(64, 64, 64, 64, 64) if model is None else model
        self.ctl = Controller() if ctl is None else ctl
        self.policy = Policy.parse(f"compute={compute}").fp8("tensorwise", controller=self.ctl, first_last="fp8")
        self.opt = torch.optim.SGD(self.model.parameters(), lr=lr)
        self.precisions: list[dict[str, str]] = []

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        with mixprec.autocast("cpu", policy=self.policy):
            loss = F.cross_entropy(self.model(x).float(), y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        self.precisions.append(self.ctl.precisions())  # what this step ran in
        self.ctl.step()

    def state_dict(self) -> bytes:
        buf = io.BytesIO()
        torch.save({"model": self.model.state_dict(), "opt": self.opt.state_dict(),
                    "ctl": json.loads(json.dumps(self.ctl.state_dict()))}, buf)  # plain JSON data
        return buf.getvalue()

    def load(self, blob: bytes) -> None:
        sd = torch.load(io.BytesIO(blob))
        self.model.load_state_dict(sd["model"])
        self.opt.load_state_dict(sd["opt"])
        self.ctl.load_state_dict(sd["ctl"])


def _train(data: list, resume_at: int | None = None) -> _Run:
    run, windows = _Run(), {}
    for t, (x, y) in enumerate(data):
        if t == resume_at:  # a fresh process: new model, optimizer, controller and policy
            fresh = _Run()
            fresh.load(run.state_dict())
            fresh.precisions = run.precisions
            run = fresh
        run.step(x, y)
        if run.ctl.steps % run.ctl.every == 0:  # right after a check: the window it judged
            rows = mixprec.fp8.stats(run.model).to_list()
            assert {r["window"] for r in rows} == {"last"}
            windows[run.ctl.steps] = {(r["layer"], r["operand"]): r for r in rows}
    run.windows = windows
    return run


@pytest.fixture(scope="module")
def drift_data() -> list:
    return _drift_data()


@pytest.fixture(scope="module")
def drift_run(drift_data) -> _Run:
    return _train(drift_data)


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
    first = [p["0"] for p in drift_run.precisions]
    in_fp8 = [p.startswith("fp8-") for p in first]
    bad = [t for t, u in enumerate(underflow) if u > 0.05 and in_fp8[t]]
    assert not bad, f"layer 0 ran fp8 at steps {bad} with input underflow above 5%"
    log = drift_run.ctl.log
    assert all(d.step % drift_run.ctl.every == 0 for d in log)
    for d in log:  # every promotion justified by its operand's window, measured by the run itself
        measured = drift_run.windows[d.step][(d.layer, d.operand)]
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
    run = _train(_drift_data(drift=False))
    assert run.ctl.log == []
    assert all(p == "fp8-tensorwise" for step in run.precisions for p in step.values())


def test_resume_is_bitwise_and_runs_are_deterministic(drift_run, drift_data):
    # a second run, resumed mid-window at step 195 (layer 0 promoted, windows open, trends warm)
    resumed = _train(drift_data, resume_at=195)
    assert resumed.ctl.log == drift_run.ctl.log
    assert resumed.precisions == drift_run.precisions
    for a, b in zip(resumed.model.state_dict().values(), drift_run.model.state_dict().values()):
        assert torch.equal(a, b)
    assert resumed.ctl.state_dict() == drift_run.ctl.state_dict()


def test_log_as_csv(drift_run, tmp_path):
    path = tmp_path / "log.csv"
    text = drift_run.ctl.write_csv(path)
    lines = path.read_text().splitlines()
    assert lines[0] == "step,layer,operand,action,from,to,statistic,value,threshold,reason"
    assert len(lines) == 1 + len(drift_run.ctl.log) and text == path.read_text()
    first = drift_run.ctl.log[0]
    assert lines[1].startswith(f"{first.step},{first.layer},{first.operand},promote,fp8-tensorwise,")


def test_no_host_read_between_checks(syncs):
    run = _Run(Controller(every=5))
    data = _drift_data(steps=10, drift=False)
    run.step(*data[0])
    counter = syncs.start()
    for x, y in data[1:4]:  # ctl.step() counts 2, 3, 4: no check
        run.step(x, y)
    counts = counter.stop()
    assert counts == 0
    run_check = syncs.start()
    run.step(*data[4])  # the check at 5: one read of all the windows
    assert run_check.stop() == 1


# ----------------------------------------------------------------- fp16: the range rung
def _fp16_model() -> nn.Sequential:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 64),
                      nn.GELU(), nn.Linear(64, 64))
    with torch.no_grad():
        m[2].weight.mul_(300)  # layer "2"'s output grows toward 65504 as the input grows
    return m


def _fp16_train(ctl: Controller | None, steps: int = 230) -> tuple[list[int], _Run]:
    run = _Run(ctl if ctl is not None else Controller(), compute="fp16", model=_fp16_model())
    if ctl is None:  # the plain fp8 policy
        run.policy = Policy.parse("compute=fp16").fp8("tensorwise", first_last="fp8")
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=10 ** 6)
    g = torch.Generator().manual_seed(0)
    skipped = []
    for t in range(steps):
        x, y = torch.randn(32, 64, generator=g) * 1.03 ** t, torch.randint(0, 64, (32,), generator=g)
        with mixprec.autocast("cpu", policy=run.policy):
            loss = F.cross_entropy(run.model(x).float(), y)
        scaler.scale(loss).backward()
        scale = scaler.get_scale()
        scaler.step(run.opt)
        scaler.update()
        if scaler.get_scale() < scale:
            skipped.append(t)
        run.opt.zero_grad()
        if ctl is not None:
            run.precisions.append(ctl.precisions())
            ctl.step()
    return skipped, run


def test_fp16_layer_goes_to_fp32_before_it_overflows():
    plain, _ = _fp16_train(None)
    assert plain, "the plain fp8 policy under fp16 compute should overflow"
    skipped, run = _fp16_train(Controller())
    assert skipped == []
    promotions = [d for d in run.ctl.log if d.layer == "2" and d.to == "fp32"]
    assert promotions and promotions[0].step < plain[0]
    assert promotions[0].operand == "output" and promotions[0].statistic == "amax_forecast"
    assert run.ctl.precision("2") == "fp32"
    assert all(run.ctl.precision(n) != "fp32" for n in ("0", "4", "6"))


# ----------------------------------------------------------------- distributed
def _rank_worker(rank: int, port: int, out_dir: str) -> None:
    data = _drift_data(steps=200, drift=rank == 0, start=110, end=80)
    with gloo_group(rank, port):
        run = _Run()
        for x, y in data:
            run.step(x, y)
        torch.save({"log": run.ctl.log, "precisions": run.precisions},
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
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16))
    ctl = Controller(every=1, horizon=1, demote_windows=2, min_dwell=3, max_switches=3,
                     ladder=("tensorwise", "compute"))
    policy = Policy.parse("compute=bf16").fp8("tensorwise", controller=ctl, first_last="fp8")
    g = torch.Generator().manual_seed(0)
    ran = []
    for t in range(20):
        x = torch.randn(8, 16, generator=g)
        if t in (0, 4):
            x[0, 0] = 1e6
        with mixprec.autocast("cpu", policy=policy):
            model(x).sum().backward()
        ran.append(ctl.precision("0"))
        ctl.step()
    assert [(d.step, d.action) for d in ctl.log] == [(1, "promote"), (4, "demote"), (5, "promote")]
    assert ctl.log[0].statistic == "underflow_forecast" and ctl.log[0].value > 0.9
    # steps 2, 3 clean (2 windows) but the dwell since step 1 is 3 steps only at step 4
    assert ran[:6] == ["fp8-tensorwise", "bf16", "bf16", "bf16", "fp8-tensorwise", "bf16"]
    assert set(ran[5:]) == {"bf16"}  # 3 switches in the budget: no demotion


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


def _outlier_run(steps: int, resume_at: int | None = None) -> tuple[list, list[str], dict, list[torch.Tensor]]:
    """A 2-layer fp8 model whose layer "0" gets an outlier at steps 1 and 9 (promote, demote,
    promote again), resumed from a checkpoint at ``resume_at`` into fresh objects."""
    def fresh() -> tuple[nn.Module, Controller, Policy, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16))
        ctl = Controller(every=2, horizon=1, demote_windows=1, min_dwell=2)
        policy = Policy.parse("compute=bf16").fp8("tensorwise", controller=ctl, first_last="fp8")
        return model, ctl, policy, torch.optim.SGD(model.parameters(), lr=1e-7)  # the outliers stay small

    model, ctl, policy, opt = fresh()
    g = torch.Generator().manual_seed(1)
    ran = []
    for t in range(steps):
        if t == resume_at:
            blob = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "ctl": ctl.state_dict()}, blob)
            model, ctl, policy, opt = fresh()
            sd = torch.load(io.BytesIO(blob.getvalue()))
            ctl.load_state_dict(sd["ctl"])  # before the first forward: applied when the layers are tracked
            model.load_state_dict(sd["model"])
            opt.load_state_dict(sd["opt"])
        x = torch.randn(8, 16, generator=g)
        if t in (1, 9):
            x[0, 0] = 1e6
        with mixprec.autocast("cpu", policy=policy):
            model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        ran.append(ctl.precision("0"))
        ctl.step()
    return ctl.log, ran, ctl.state_dict(), [p.detach().clone() for p in model.parameters()]


def test_resume_at_any_step_is_bitwise():
    log, ran, state, params = _outlier_run(14)
    assert {d.action for d in log} == {"promote", "demote"} and "fp8-rowwise" in ran
    for k in range(1, 14):
        log_k, ran_k, state_k, params_k = _outlier_run(14, resume_at=k)
        assert log_k == log and ran_k == ran and state_k == state, k
        assert all(torch.equal(a, b) for a, b in zip(params_k, params)), k


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
