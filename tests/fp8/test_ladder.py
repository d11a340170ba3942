"""The controller's ladder per GEMM (``Controller(per_gemm=True)``) and its rungs below fp8: a
layer whose grad_output underflows promotes only its backward GEMMs and demotes them once the
gradients calm down; each GEMM runs its rung's casts; checkpoints resume bitwise mid-run, a
whole-layer state_dict loads; two gloo ranks decide the same; the fp4 flush statistic."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
import torch

import mixprec
from mixprec import Controller, fp8
from mixprec.control._ladder import compose
from mixprec.control._measure import measure
from mixprec.formats._recipe import Cast, Float8Recipe
from mixprec.formats._state import new_window

from _distributed import gloo_group, spawn
from _train_cases import CASES, Case, Result, Trainer, WeightedLoss, train

#: results follow this CPU's bf16 rounding: scripts/cross_isa.py runs them under other caps
pytestmark = pytest.mark.cross_isa

HEAVY = 20  # steps whose loss weights one output element by 1e7 (grad_output underflows in e5m2)
CASE = CASES["ladder-heavy-grad"]  # the harness's case: tests/_train_cases.py


def _whole_layer(case: Case, **settings) -> Case:
    """``case`` with a whole-layer Controller (``per_gemm=False``)."""
    return replace(case, supervisor=case.supervisor.with_settings(per_gemm=False, **settings))


@pytest.fixture(scope="module")
def run() -> Result:
    return train(CASE)


def test_only_the_gemms_that_read_grad_output_promote_and_come_back(run):
    log = run.supervisor.log
    precisions = run.records["gemm_precisions"]
    promotions = [d for d in log if d.action == "promote"]
    assert {(d.layer, d.gemm) for d in promotions} == {(n, g) for n in ("0", "1") for g in ("grad_input", "grad_weight")}
    # layer 1 at the first check; layer 0 at the next: while layer 1's input gradient ran in fp8 it
    # flushed the small values itself, so layer 0 saw zeros (not counted) and the one large row
    assert all(d.step == (5 if d.layer == "1" else 10) and d.operand == "grad_output" and d.from_ == "fp8-tensorwise"
               and d.to == "bf16" and d.value > 0.3 for d in promotions)
    assert not [d for d in log if d.gemm == "output"]
    # promoted from step 5 on, the forward GEMM still in fp8
    assert precisions[6]["1"] == ("fp8-tensorwise", "bf16", "bf16")
    demotions = [d for d in log if d.action == "demote"]
    assert {(d.layer, d.gemm) for d in demotions} == {(d.layer, d.gemm) for d in promotions}
    assert all(HEAVY < d.step and d.to == "fp8-tensorwise" and d.value <= 0.01 for d in demotions)
    assert precisions[-1] == {n: ("fp8-tensorwise",) * 3 for n in ("0", "1")}


def test_the_whole_layer_controller_moves_all_three_together():
    run = train(replace(_whole_layer(CASE), steps=12))
    assert run.supervisor.log and all(d.gemm is None for d in run.supervisor.log)
    assert run.records["gemm_precisions"][6]["1"] == ("fp8-rowwise",) * 3  # the layer's next rung: all three GEMMs
    assert run.supervisor.write_csv().splitlines()[0].split(",")[-1] == "reason"


def test_log_and_csv_name_the_gemm(run):
    lines = run.supervisor.write_csv().splitlines()
    assert lines[0].split(",")[-1] == "gemm"
    assert lines[1].endswith(",grad_input") and "grad_input GEMM: grad_output underflow forecast" in lines[1]


def test_each_gemm_runs_its_rungs_casts():
    """Forward in fp8 tensorwise, input gradient in bf16: bitwise fp8.linear's output and the
    plain bf16 GEMM's input gradient."""
    t = Float8Recipe.tensorwise()
    recipe = compose((t, None, t))
    assert recipe.gemms()["grad_input"][0].format == "none" and recipe.gemms()["grad_weight"][0].format == "e5m2"
    torch.manual_seed(1)
    x = torch.randn(8, 32, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(16, 32, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(8, 16, dtype=torch.bfloat16)
    out = fp8.linear(x, w, recipe=recipe, backend="emulate")
    assert torch.equal(out, fp8.linear(x, w, recipe=t, backend="emulate"))
    gx, gw = torch.autograd.grad(out, (x, w), g)
    assert torch.equal(gx, g @ w.detach())
    _, gw_t = torch.autograd.grad(fp8.linear(x, w, recipe=t, backend="emulate"), (x, w), g)
    assert torch.equal(gw, gw_t)
    assert compose((t, Float8Recipe.rowwise(), t)) is None  # power-of-2 scales differ
    assert compose((Float8Recipe.mxfp8(), t, None)) is None  # blocks beside tensor scales


def test_resume_mid_run_is_bitwise(run):
    # at step 23: GEMMs promoted, windows open, clean counts running; a fresh controller
    # (Controller.from_config) and policy from the state_dict, as JSON
    resumed = train(replace(CASE, resume_at=23))
    assert resumed.rebuilt_at == 23
    assert resumed.supervisor.log == run.supervisor.log
    assert resumed.records["gemm_precisions"] == run.records["gemm_precisions"]
    assert len(resumed.records["grads"]) == len(run.records["grads"]) == CASE.steps
    assert all(torch.equal(a, b) for a, b in zip(resumed.records["grads"], run.records["grads"]))


def test_a_whole_layer_state_dict_loads_with_its_gemms_together():
    old = train(replace(_whole_layer(CASE), steps=12))
    state = json.loads(json.dumps(old.supervisor.state_dict()))
    assert "gemms" not in state["layers"]["1"] and all("gemm" not in d for d in state["log"])
    new = Trainer(CASE, seed=0)
    new.supervisor.load_state_dict(state)
    new.step(12)
    assert new.supervisor.precision("1", "output") == new.supervisor.precision("1", "grad_weight") == "bf16"
    assert new.supervisor.log == old.supervisor.log and new.supervisor.log[0].gemm is None


def test_precision_of_an_unknown_gemm_raises(run):
    with pytest.raises(ValueError, match="gemm must be one of"):
        run.supervisor.precision("1", "backward")
    with pytest.raises(ValueError, match="per_gemm must be a bool"):
        Controller(per_gemm="yes")


def test_fp4_flush_statistic_is_the_share_a_block_scale_zeroes():
    """An MXFP4 block of 32 with one 1000: its E8M0 scale 2**ceil(log2(1000 / 6)) = 256 puts the
    31 ones below a quarter of it, flushed; an NVFP4 block of 16 keeps ones beside a 6 (scale 1)."""
    x = torch.ones(4, 32)
    x[:, 0] = 1000.0
    x[1, :] = 0.0
    mx = Cast("e2m1", "1x32")
    window = new_window()
    measure(window, 0, x, mx, True, 4096)
    assert window[0, 2].item() == pytest.approx(3 * 31 / 128)
    nv = Cast("e2m1", "1x16")
    y = torch.ones(2, 16)
    y[:, 0] = 6.0
    window = new_window()
    measure(window, 1, y, nv, False, 4096)
    assert window[1, 0].item() == 6.0 and window[1, 2].item() == 0.0


# ----------------------------------------------------------------- fp4 rungs
FP4 = CASES["ladder-fp4"]  # inputs with every 8th feature 100x the others for 20 steps, N(0, 1) after


def test_heavy_tailed_inputs_move_an_nvfp4_layer_to_fp8_and_back():
    run = train(_whole_layer(FP4))
    precisions = run.records["gemm_precisions"]
    first = [d for d in run.supervisor.log if d.layer == "0"]
    assert [(d.action, d.from_, d.to) for d in first] == [
        ("promote", "nvfp4", "fp8-tensorwise"), ("demote", "fp8-tensorwise", "nvfp4")]
    assert first[0].step == 5 and first[0].operand == "input" and first[0].value > 0.8
    assert first[0].threshold == 0.15
    assert first[1].step > 20 and first[1].value <= 0.12 and first[1].threshold == 0.12
    assert precisions[6]["0"] == ("fp8-tensorwise",) * 3 and precisions[-1]["0"] == ("nvfp4",) * 3


def test_per_gemm_fp4_promotes_only_the_gemm_whose_blocks_hold_the_outliers():
    """The forward GEMM reads the input in blocks of 16 features (two of them 100x: 14 flushed);
    the weight-gradient GEMM reads it in blocks of 16 tokens of one feature (nothing flushed),
    the input-gradient GEMM not at all: those two stay in NVFP4 beside an fp8 forward (one fp4
    recipe with an fp8 GEMM), and the forward comes back after the heavy steps."""
    run = train(FP4)
    precisions = run.records["gemm_precisions"]
    assert [(d.step, d.layer, d.gemm, d.action, d.operand) for d in run.supervisor.log] == [
        (5, "0", "output", "promote", "input"), (30, "0", "output", "demote", "input")]
    assert precisions[6]["0"] == ("fp8-tensorwise", "nvfp4", "nvfp4")
    recipe = mixprec.fp8.layer_state(run.model[0]).recipe
    assert recipe is not None and recipe.fp4  # back on the nvfp4 rung's own recipe
    assert precisions[-1]["0"] == ("nvfp4",) * 3


# ----------------------------------------------------------------- distributed
def _rank_worker(rank: int, port: int, out_dir: str) -> None:
    data = WeightedLoss(steps=40) if rank == 0 else WeightedLoss(steps=40, heavy=0, seed=4)
    with gloo_group(rank, port):
        run = train(replace(CASE, data=data, steps=40))
        torch.save({"log": run.supervisor.log, "precisions": run.records["gemm_precisions"]},
                   os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.distributed
@pytest.mark.slow
def test_ranks_decide_the_same_per_gemm_when_only_one_sees_the_heavy_gradients(tmp_path):
    spawn(_rank_worker, str(tmp_path), timeout=600)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2))
    assert r0["log"] == r1["log"] and r0["precisions"] == r1["precisions"]
    assert {d.gemm for d in r0["log"]} == {"grad_input", "grad_weight"}
