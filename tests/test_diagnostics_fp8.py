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


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(32, 32), nn.Tanh()]
    return nn.Sequential(*layers[:-1])  # Linear layers '0', '2', '4', '6'


def _routed(route: str) -> tuple[nn.Module, object]:
    """The model and the region in which its four Linear layers run in fp8."""
    model = _model()
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
    model = _model()
    fp8.layer_state(model[2])  # a state from an earlier fp8 run: this run is plain float32
    model[2].register_forward_pre_hook(_inf_input)
    event = _traced(model, torch.autocast("cpu", enabled=False), deferred=False)
    assert event.detail == "passed to '2'" and event.fp8_layer is None
