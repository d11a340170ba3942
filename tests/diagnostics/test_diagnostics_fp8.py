"""Diagnostics for fp8 layers: trace_nonfinite names the fp8 layer and the operand whose amax is
non-finite (policy route and fp8.convert, eager and deferred); audit(..., fp8=...) recommends
which Linear layers go to fp8."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import mixprec
from mixprec import Policy, fp8
from mixprec.diagnostics import trace_nonfinite

from _models import fp8_stack


def _routed(route: str) -> tuple[nn.Module, object]:
    """The model and the region in which its four Linear layers run in fp8."""
    model = fp8_stack()[:-1]  # Linear layers '0', '2', '4', '6'
    if route == "convert":
        return fp8.convert(model, filter_fn=lambda m, fqn: True), torch.autocast("cpu", enabled=False)
    return model, mixprec.autocast("cpu", policy=Policy.parse("compute=bf16").fp8(first_last="fp8"))


def _inf_input(module: nn.Module, args: tuple) -> tuple:
    (h,) = args
    h = h.clone()
    h[0, 0] = float("inf")
    return (h,)


def _traced(model: nn.Module, region: object, deferred: bool, grad_weight: torch.Tensor | None = None):
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))
    with trace_nonfinite(model, deferred=deferred) as tracer:
        with region:
            out = model(x)
        loss = out.float() if grad_weight is None else out.float() * grad_weight
        loss.sum().backward()
        return tracer.resolve() if deferred else tracer.first


@pytest.mark.parametrize("deferred", [False, True], ids=["eager", "deferred"])
@pytest.mark.parametrize("route", ["policy", "convert"])
def test_inf_in_an_fp8_layers_input_names_the_layer_and_the_operand(route: str, deferred: bool) -> None:
    model, region = _routed(route)
    model[2].register_forward_pre_hook(_inf_input)  # before the tracer's hooks: it sees the inf
    event = _traced(model, region, deferred)
    assert (event.module, event.phase, event.tensor, event.detail) == ("", "forward", "intermediate", "passed to '2'")
    assert (event.fp8_layer, event.fp8_operand) == ("2", "input")
    assert "fp8 layer '2' took it as its input: non-finite amax" in str(event)
    assert event.to_dict()["fp8_operand"] == "input"
    assert fp8.layer_state(model[2]).read()["input"]["amax"] == float("inf")  # what the layer saw


@pytest.mark.parametrize("deferred", [False, True], ids=["eager", "deferred"])
@pytest.mark.parametrize("route", ["policy", "convert"])
def test_inf_in_grad_output_names_the_layer_and_the_operand(route: str, deferred: bool) -> None:
    model, region = _routed(route)
    w = torch.ones(8, 32)
    w[3, 5] = float("inf")  # the loss's gradient: the last layer's grad_output
    event = _traced(model, region, deferred, grad_weight=w)
    assert (event.phase, event.tensor, event.fp8_layer, event.fp8_operand) == (
        "backward", "grad_output", "6", "grad_output")
    stats = fp8.layer_state(model[6]).read()
    assert stats["grad_output"]["amax"] == float("inf") and stats["grad_output"]["nonfinite"] >= 1


@pytest.mark.parametrize("route", ["policy", "convert"])
def test_inf_weight_names_the_layer_and_a_fallen_back_layer_is_not_fp8(route: str) -> None:
    model, region = _routed(route)
    with torch.no_grad():
        model[4].weight[1, 1] = float("inf")
    event = _traced(model, region, deferred=False)
    assert (event.module, event.tensor, event.kind) == ("4", "output", "nan")  # one inf: all NaN
    assert (event.fp8_layer, event.fp8_operand) == ("4", "weight")
    fp8.layer_state(model[4]).fallback = True  # runs in the compute dtype now: not an fp8 event
    event = _traced(model, region, deferred=False)
    assert event.module == "4" and event.fp8_layer is None and event.fp8_operand is None


def test_no_fp8_without_an_fp8_region() -> None:
    model = fp8_stack()[:-1]
    fp8.layer_state(model[2])  # a state from an earlier fp8 run: this run is plain float32
    model[2].register_forward_pre_hook(_inf_input)
    event = _traced(model, torch.autocast("cpu", enabled=False), deferred=False)
    assert event.detail == "passed to '2'" and event.fp8_layer is None


# --- audit(..., fp8=...) -------------------------------------------------------------------------

class Outlier(nn.Module):
    """Multiplies feature 0 by 1e5: the next Linear's input has an outlier feature."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.tensor([1e5] + [1.0] * (x.shape[-1] - 1), dtype=x.dtype)


HOSTILE = "5"


def _audit_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 64), nn.GELU(),
                         nn.Linear(64, 32), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32),
                         nn.GELU(), nn.Linear(32, 16), nn.Linear(16, 10))


def _audit_inputs(model: nn.Sequential):
    model.get_submodule(HOSTILE).register_forward_pre_hook(lambda m, args: (Outlier()(args[0]),))
    x, y = torch.randn(16, 32), torch.randn(16, 10)
    return (x, y), lambda m, b: nn.functional.mse_loss(m(b[0]).float(), b[1])


def test_audit_recommends_fp8_layers_and_leaves_the_outlier_layer_out(tmp_path) -> None:
    model = _audit_model()
    batch, loss_fn = _audit_inputs(model)
    kept_state = fp8.layer_state(model[2])  # a state from earlier fp8 training: left as it was
    kept_state.fallback = True
    report = mixprec.audit(model, batch, loss_fn, dtypes=(torch.bfloat16,), fp8="tensorwise")
    advice = report.fp8
    assert advice.recipe == "tensorwise" and advice.verified
    assert advice.layers == ("2", "4", "7", "9")  # '9' is not the last matmul layer: the 10-class head is
    assert advice.stay[HOSTILE].startswith("input underflow = ") and advice.stats[HOSTILE]["input"]["underflow"] > 0.05
    assert advice.stay["0"].startswith("first or last") and "9" not in advice.stay
    assert advice.stay["10"] == "out_features=10 is not a multiple of 16"
    assert all(advice.stats[n]["output_sqnr_db"] > 20 for n in advice.layers)
    # the model as found: no new fp8 statistics, the old one untouched
    assert fp8.layer_states(model) == {"2": kept_state} and kept_state.fallback
    kept_state.fallback = False

    rule = report.policy.fp8_rule
    assert rule.recipe == "tensorwise" and report.policy.compute == torch.bfloat16
    report.save(tmp_path)
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["fp8"]["layers"] == ["2", "4", "7", "9"] and HOSTILE in data["fp8"]["stay"]
    assert data["ranges"]["float32"]["4"]["activation"]["fp8_scaled"]["view"].startswith("after a per-tensor")
    assert set(data["range_views"]) == {"overflow, underflow, subnormal", "fp8_scaled"}
    policy = Policy.load(tmp_path / "report.json")
    assert policy == report.policy and policy.fp8_rule.names == rule.names
    assert "stays '5': input underflow" in report.summary_text()
    assert "<h2>fp8 layers (tensorwise" in (tmp_path / "index.html").read_text()

    with mixprec.autocast("cpu", policy=policy):  # the recommendation, applied
        loss_fn(model, batch).backward()
    assert sorted(fp8.layer_states(model)) == ["2", "4", "7", "9"]
    assert all(st.read()["input"]["amax"] > 0 for st in fp8.layer_states(model).values())


def test_audit_fp8_arguments() -> None:
    model = _audit_model()
    batch, loss_fn = _audit_inputs(model)
    with pytest.raises(ValueError, match="fp8 is not a compute dtype: pass fp8='tensorwise'"):
        mixprec.audit(model, batch, loss_fn, dtypes=(torch.float8_e4m3fn,))
    with pytest.raises(ValueError, match="unknown fp8 recipe 'fp2'"):
        mixprec.audit(model, batch, loss_fn, fp8="fp2")
    with pytest.raises(ValueError, match="fp8_min_sqnr_db"):
        mixprec.audit(model, batch, loss_fn, fp8=True, fp8_min_sqnr_db="high")
    report = mixprec.audit(model, batch, loss_fn, dtypes=("bf16",))
    assert report.fp8 is None and report.policy.fp8_rule is None and report.to_dict()["fp8"] is None


def test_audit_sqnr_floor_moves_a_layer_out() -> None:
    model = _audit_model()
    batch, loss_fn = _audit_inputs(model)
    report = mixprec.audit(model, batch, loss_fn, dtypes=(torch.bfloat16,), fp8="rowwise",
                           fp8_min_sqnr_db=60.0)  # above what fp8 reaches (about 29 dB)
    assert report.fp8.layers == () and report.policy.fp8_rule is None
    stay = report.fp8.stay
    assert stay["2"].startswith("output sqnr_db = ") and stay["2"].endswith(" < 60")
    assert stay["7"].startswith("output sqnr_db = ") and stay["7"].endswith(" < 60")
    # rowwise casts grad_output to e4m3 per row: the outlier feature's gradient (x 1e5) sets the
    # row scales of the layer before it, whose other gradients flush (e5m2 in tensorwise does not)
    assert stay["4"].startswith("grad_output underflow = ")
