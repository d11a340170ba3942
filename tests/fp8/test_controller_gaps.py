"""The fp8 Controller's edges: a layer's floor is the recipe the policy gave it (lower only with
``floor=``), no forecast from a trend seen in too few windows, one record per layer however the
model is called, and the layers it governs under ``torch.compile`` and ``fp8.convert``."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch import nn

import mixprec
from mixprec import Controller, Policy
from mixprec.control._controller import sustained_slope

from _models import mlp

#: marked cross_isa: results follow this CPU's rounding (scripts/cross_isa.py runs them under other caps);
#: the compiled variants compare with eager in one process and are left out of that subset
CROSS_ISA = pytest.mark.cross_isa


def _steps(model: nn.Module, policy: Policy, ctl: Controller, batches: list[torch.Tensor]) -> list[dict[str, str]]:
    """A forward and backward per batch under ``policy``, then ``ctl.step()``; the precisions run."""
    ran = []
    for x in batches:
        with mixprec.autocast("cpu", policy=policy):
            model(x).float().square().mean().backward()
        ran.append(ctl.precisions())
        ctl.step()
    return ran


def _batches(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(16, 64, generator=g) for _ in range(n)]


# ----------------------------------------------------------------- the floor
def _eager_demoter(**kw) -> Controller:
    return Controller(every=2, demote_windows=1, min_dwell=0, shadow_steps=1, **kw)


@CROSS_ISA
def test_a_rowwise_policy_is_never_demoted_below_rowwise():
    """Stationary data: the tensorwise shadow of a rowwise layer is safe, yet the layer stays in
    the recipe the policy gave it (the default ladder starts at tensorwise)."""
    ctl = _eager_demoter()
    policy = Policy.parse("compute=bf16").fp8("rowwise", controller=ctl, first_last="fp8")
    ran = _steps(mlp(64, 64, 64), policy, ctl, _batches(12))
    assert ctl.log == []
    assert all(p == {"0": "fp8-rowwise", "2": "fp8-rowwise"} for p in ran)


@CROSS_ISA
def test_per_layer_recipes_are_each_layers_floor():
    ctl = _eager_demoter()
    policy = Policy.parse("compute=bf16").fp8("tensorwise", controller=ctl, first_last="fp8",
                                              recipes={"2": "rowwise"})
    ran = _steps(mlp(64, 64, 64), policy, ctl, _batches(12))
    assert ctl.log == [] and ran[-1] == {"0": "fp8-tensorwise", "2": "fp8-rowwise"}


@CROSS_ISA
def test_floor_lets_the_controller_go_below_the_recipe_when_asked():
    ctl = _eager_demoter(floor="tensorwise")
    policy = Policy.parse("compute=bf16").fp8("rowwise", controller=ctl, first_last="fp8")
    ran = _steps(mlp(64, 64, 64), policy, ctl, _batches(12))
    assert ran[0] == {"0": "fp8-rowwise", "2": "fp8-rowwise"}
    assert ran[-1] == {"0": "fp8-tensorwise", "2": "fp8-tensorwise"}
    assert [(d.action, d.from_, d.to) for d in ctl.log] == [("demote", "fp8-rowwise", "fp8-tensorwise")] * 2
    assert Controller.from_config(ctl.config()).floor == "tensorwise"


@CROSS_ISA
def test_floor_settings_that_cannot_take_effect_raise():
    with pytest.raises(ValueError, match="floor must be None"):
        Controller(floor="compute")
    with pytest.raises(ValueError, match="floor must be None"):
        Controller(floor="rowwise", ladder=("tensorwise", "compute"))
    ctl = Controller(floor="rowwise")
    policy = Policy.parse("compute=bf16").fp8("tensorwise", controller=ctl, first_last="fp8")
    with pytest.raises(ValueError, match="below the controller's floor 'rowwise'"):
        with mixprec.autocast("cpu", policy=policy):
            mlp(64, 64, 64)(torch.randn(2, 64))
    # a checkpoint with a layer below its floor
    low = Controller(floor="tensorwise", every=1, demote_windows=1, min_dwell=0, shadow_steps=1)
    model = mlp(64, 64, 64)
    rowwise = Policy.parse("compute=bf16").fp8("rowwise", first_last="fp8")
    _steps(model, rowwise.fp8("rowwise", controller=low, first_last="fp8"), low, _batches(3))
    assert low.precision("0") == "fp8-tensorwise"
    strict = Controller(every=1)
    _steps(model, rowwise.fp8("rowwise", controller=strict, first_last="fp8"), strict, _batches(1))
    with pytest.raises(ValueError, match="below its floor 'rowwise'"):
        strict.load_state_dict(low.state_dict())


# ----------------------------------------------------------------- the forecast
@CROSS_ISA
def test_sustained_slope_needs_a_rise_in_each_recent_window():
    assert sustained_slope(0.2, (0.1, 0.3, 0.25), 3) == 0.1
    assert sustained_slope(0.05, (0.1, 0.3, 0.25), 3) == 0.05
    assert sustained_slope(0.2, (0.5, -0.1, 0.4), 3) == 0.0
    assert sustained_slope(0.3, (0.6,), 3) == 0.0
    assert sustained_slope(0.3, (0.6,), 1) == 0.3


@CROSS_ISA
def test_one_jump_after_warm_up_is_not_a_trend():
    """Input feature 0 jumps 100x at step 10 and stays: the measured underflow is small (0.05%),
    and one window's rise extrapolated 3 windows ahead would forecast it above 5%; a trend
    needs ``trend_windows`` windows of rise, so nothing is promoted (one window suffices with
    ``trend_windows=1``)."""
    batches = _batches(60, seed=1)
    for t, x in enumerate(batches):
        if t >= 10:
            x[:, 0] *= 100
    runs = {}
    for windows in (3, 1):
        ctl = Controller(trend_windows=windows)
        policy = Policy.parse("compute=bf16").fp8("tensorwise", controller=ctl, first_last="fp8")
        torch.manual_seed(0)
        _steps(nn.Sequential(nn.Linear(64, 64)), policy, ctl, batches)
        runs[windows] = ctl.log
    assert runs[3] == []
    jump = runs[1][0]
    assert (jump.step, jump.layer, jump.action, jump.statistic) == (20, "0", "promote", "underflow_forecast")
    assert jump.value > 0.05
    with pytest.raises(ValueError, match="trend_windows"):
        Controller(trend_windows=0)


# ----------------------------------------------------------------- one record per layer
class _Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64)) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


_FULL = ["blocks.0.0", "blocks.0.2", "blocks.1.0", "blocks.1.2"]


@CROSS_ISA
def test_a_submodule_called_directly_keeps_its_layers_records():
    ctl = Controller()
    policy = Policy.parse("compute=bf16").fp8("tensorwise", controller=ctl, first_last="fp8")
    model, x = _Blocks(), torch.randn(4, 64)
    with mixprec.autocast("cpu", policy=policy):
        model(x)
        model.blocks[0](x)
    assert sorted(ctl.precisions()) == _FULL
    assert sorted(ctl.state_dict()["layers"]) == _FULL
    assert mixprec.fp8.layer_state(model.blocks[0][0]).probe.rec is ctl._layers["blocks.0.0"]


@CROSS_ISA
def test_the_model_called_after_a_submodule_qualifies_the_names_and_the_log():
    ctl = _eager_demoter(floor="tensorwise")
    policy = Policy.parse("compute=bf16").fp8("rowwise", controller=ctl, first_last="fp8")
    model = _Blocks()
    _steps(model.blocks[0], policy, ctl, _batches(2))  # demotes "0" and "2" at step 2
    assert ctl.precisions() == {"0": "fp8-tensorwise", "2": "fp8-tensorwise"}
    _steps(model, policy, ctl, _batches(1))
    assert ctl.precisions() == {"blocks.0.0": "fp8-tensorwise", "blocks.0.2": "fp8-tensorwise",
                                "blocks.1.0": "fp8-rowwise", "blocks.1.2": "fp8-rowwise"}
    assert [d.layer for d in ctl.log] == ["blocks.0.0", "blocks.0.2"]


# ----------------------------------------------------------------- torch.compile and fp8.convert
def _outlier_batches(n: int = 14) -> list[torch.Tensor]:
    """16 x 64 batches; feature 0 of steps 0 and 1 is 1e6: it flushes layer 0's other inputs
    (tensorwise and rowwise)."""
    batches = _batches(n, seed=2)
    for x in batches[:2]:
        x[:, 0] = 1e6
    return batches


def _switching() -> Controller:
    """Promotes at the first check, demotes two rungs back over the next steps."""
    return Controller(every=1, horizon=1, trend_windows=1, demote_windows=2, min_dwell=3, shadow_steps=1)


def _region(call: Any, policy: Policy, x: torch.Tensor) -> torch.Tensor:
    with mixprec.autocast("cpu", policy=policy):
        return call(x)


def _trajectory(run: Any, batches: list[torch.Tensor]) -> tuple[list, list, list]:
    """``run(x) -> output`` per batch (forward, backward, ``ctl.step()`` inside): outputs and grads."""
    outs, grads = [], []
    for x in batches:
        out, grad = run(x)
        outs.append(out)
        grads.append(grad)
    return outs, grads


def _in(region, model, x):
    with region():
        return model(x)


def _controlled_run(forward, model, ctl):
    """``(outputs, layer 0's weight gradients, layer 0's precision per step, ctl.log)`` of the
    outlier batches through ``forward(x)``, with ``ctl.step()`` after each step."""
    ran = []

    def run(x):
        out = forward(x)
        out.float().square().mean().backward()
        grad = model[0].weight.grad.clone()
        model.zero_grad()
        ran.append(ctl.precision("0"))
        ctl.step()
        return out.detach(), grad

    outs, grads = _trajectory(run, _outlier_batches())
    return outs, grads, ran, ctl.log


@pytest.mark.parametrize("where, fullgraph", [("around", True), ("around", False), ("inside", True)])
def test_compiled_model_runs_each_rung_bitwise_eager(where, fullgraph):
    """The same decisions, outputs and gradients, step by step, eager and under torch.compile
    (around the model, inside the region): a promotion (to rowwise, then bf16) and the demotions
    back, decided on statistics and shadows measured by the compiled graphs."""
    import torch._dynamo

    torch._dynamo.reset()
    runs = {}
    for compiled in (False, True):
        ctl = _switching()
        policy = Policy.parse("compute=bf16").fp8("tensorwise", controller=ctl, first_last="fp8")
        model = mlp(64, 64, 64)
        if not compiled:
            region = functools.partial(_region, model, policy)
        elif where == "inside":
            region = torch.compile(functools.partial(_region, model, policy), backend="aot_eager",
                                   fullgraph=fullgraph)
        else:
            region = functools.partial(_region, torch.compile(model, backend="aot_eager", fullgraph=fullgraph), policy)
        runs[compiled] = _controlled_run(region, model, ctl)
    (eo, eg, er, elog), (co, cg, cr, clog) = runs[False], runs[True]
    assert "fp8-rowwise" in er and "bf16" in er and er[-1] == "fp8-tensorwise"
    assert cr == er and clog == elog
    for a, b in zip(eo + eg, co + cg):
        assert a.dtype == b.dtype and torch.equal(a, b)


@CROSS_ISA
def test_converted_layers_are_controlled_as_the_policys():
    """fp8.convert(..., controller=ctl): the same decisions, outputs and gradients as the policy
    route under torch.autocast's bf16."""
    runs = {}
    for route in ("policy", "convert"):
        ctl = _switching()
        model = mlp(64, 64, 64)
        if route == "convert":
            model = mixprec.fp8.convert(model, "tensorwise", controller=ctl,
                                        filter_fn=lambda mod, fqn: isinstance(mod, nn.Linear))
            region = lambda: torch.autocast("cpu", torch.bfloat16)  # noqa: E731
        else:
            policy = Policy.parse("compute=bf16").fp8("tensorwise", controller=ctl, first_last="fp8")
            region = lambda policy=policy: mixprec.autocast("cpu", policy=policy)  # noqa: E731
        runs[route] = _controlled_run(lambda x, region=region, model=model: _in(region, model, x), model, ctl)
    (po, pg, pr, plog), (co, cg, cr, clog) = runs["policy"], runs["convert"]
    assert "bf16" in pr and cr == pr and clog == plog
    for a, b in zip(po + pg, co + cg):
        assert a.dtype == b.dtype and torch.equal(a, b)


@CROSS_ISA
def test_track_and_convert_refuse_what_cannot_take_effect():
    with pytest.raises(ValueError, match="no layer converted by fp8.convert"):
        Controller().track(mlp(64, 64, 64))
    with pytest.raises(ValueError, match="without guard="):
        mixprec.fp8.convert(mlp(64, 64, 64), controller=Controller(), guard=mixprec.fp8.Guard())
    with pytest.raises(ValueError, match="on its ladder"):
        mixprec.fp8.convert(mlp(64, 64, 64), "rowwise", controller=Controller(ladder=("tensorwise", "compute")),
                            filter_fn=lambda mod, fqn: True)


@pytest.mark.parametrize("fullgraph", [True, False])
def test_compiled_fp32_rung_runs_float32(fullgraph):
    """Under fp16 compute, layer 0 set to each rung (fp8, fp32, fp16, fp32, fp8): the compiled
    model's outputs are the eager model's, bitwise, and the fp32 rung's GEMM is float32's.
    (Gradients are not compared: the policy's own fp32 ``keep`` rule differs there too, compiled.)"""
    import torch._dynamo

    torch._dynamo.reset()
    outs = {}
    for compiled in (False, True):
        ctl = Controller()
        policy = Policy.parse("compute=fp16").fp8("tensorwise", controller=ctl, first_last="fp8")
        model = mlp(64, 64, 64)
        call = torch.compile(model, backend="aot_eager", fullgraph=fullgraph) if compiled else model
        got, hidden = [], []
        if not compiled:  # layer 0's output, eager
            model[0].register_forward_hook(lambda mod, args, out: hidden.append(out))
        for step, rung in enumerate(("tensorwise", "fp32", "compute", "fp32", "tensorwise")):
            x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step))
            if ctl._layers:
                rec = ctl._layers["0"]
                rec.rung = ctl.ladder.index(rung)
                ctl._apply(rec)
            with mixprec.autocast("cpu", policy=policy):
                out = call(x)
            got.append((ctl.precision("0"), out))
            if hidden and rung == "fp32":
                ref = torch.nn.functional.linear(x.half().float(), model[0].weight, model[0].bias)
                assert hidden[-1].dtype == torch.float32 and torch.equal(hidden[-1], ref)
        outs[compiled] = got
    assert [p for p, _ in outs[False]] == ["fp8-tensorwise", "fp32", "fp16", "fp32", "fp8-tensorwise"]
    for (pe, e), (pc, c) in zip(outs[False], outs[True]):
        assert pe == pc and e.dtype == c.dtype and torch.equal(e, c)


@CROSS_ISA
def test_a_copy_of_the_model_runs_its_rungs_without_the_controller():
    import copy

    ctl = Controller()
    policy = Policy.parse("compute=bf16").fp8("tensorwise", controller=ctl, first_last="fp8")
    model = mlp(64, 64, 64)
    with mixprec.autocast("cpu", policy=policy):
        model(torch.randn(2, 64))
    twin = copy.deepcopy(model)
    assert mixprec.fp8.layer_state(twin[0]).probe is None
    assert mixprec.fp8.layer_state(model[0]).probe.rec is ctl._layers["0"] and ctl.precisions() == {
        "0": "fp8-tensorwise", "2": "fp8-tensorwise"}
