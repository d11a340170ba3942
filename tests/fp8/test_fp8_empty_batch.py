"""An empty batch (0 rows) through fp8 layers that record statistics: output of shape (0, out)
in the input's dtype, backward gives empty input gradients and zero weight gradients, and the
statistics stay as they were, for every recipe, on the policy route and converted layers, fp32
and bf16 inputs."""

from __future__ import annotations

import pytest
import torch

import mixprec
from mixprec import Policy, fp8

from _models import mlp

RECIPES = ("tensorwise", "rowwise", "mxfp8", "blockwise")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("route", ["policy", "convert"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_an_empty_batch_passes_through_and_records_nothing(recipe, route, dtype):
    model = mlp(128, 128, 256)
    if route == "convert":
        model = fp8.convert(model, recipe, filter_fn=lambda m, fqn: True).to(dtype)
        region = torch.autocast("cpu", enabled=False)
        run = lambda x: model(x)  # noqa: E731
    else:
        model = model.to(dtype)
        policy = Policy.parse("compute=bf16").fp8(recipe, first_last="fp8", guard=fp8.Guard())

        def run(x):
            with mixprec.autocast("cpu", policy=policy):
                return model(x)
    with region if route == "convert" else torch.autocast("cpu", enabled=False):
        run(torch.randn(8, 128, dtype=dtype)).float().square().mean().backward()  # statistics to keep
    states = fp8.layer_states(model)
    assert sorted(states) == ["0", "2"]
    before = {n: st._data.clone() for n, st in states.items()}
    model.zero_grad()

    x = torch.randn(0, 128, dtype=dtype, requires_grad=True)
    y = run(x)
    expected_dtype = torch.bfloat16 if route == "policy" else dtype
    assert y.shape == (0, 256) and y.dtype == expected_dtype
    y.float().sum().backward()
    assert x.grad.shape == (0, 128)
    for p in model.parameters():
        assert p.grad is not None and p.grad.dtype == p.dtype and not p.grad.any()
    for n, st in states.items():
        assert torch.equal(st._data, before[n]), n


def test_an_empty_3d_batch_through_fp8_linear():
    x, w = torch.randn(2, 0, 64, requires_grad=True), torch.randn(32, 64, requires_grad=True)
    st = fp8.LayerState()
    y = fp8.linear(x, w, state=st)
    assert y.shape == (2, 0, 32)
    y.sum().backward()
    assert x.grad.shape == x.shape and not w.grad.any() and not st.stats.any()
