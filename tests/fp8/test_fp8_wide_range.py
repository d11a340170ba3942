"""fp8.linear against torchao's emulated Float8Linear on operands of a wide dynamic range, where a
cast's scale must use its own format's maximum: a gradient spanning 1e-12 to 1e3 in e5m2 (57344)
keeps its small values only with e5m2's scale; with e4m3's 448 they fall 128x lower, into e5m2's
subnormals and zero. Found by mutation testing (docs/mutants.md,
``fp8-scale-e4m3-max-for-every-format``): on Gaussian data the two scales differ by an exact
power of two and give the same bits, so the bitwise tests over ordinary data passed."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from mixprec import fp8
from mixprec.fp8 import Float8Recipe

torchao_float8 = pytest.importorskip("torchao.float8")


def _wide(shape: tuple[int, int], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * torch.logspace(-12, 3, shape[1])


@pytest.mark.parametrize("name", ["tensorwise", "rowwise"])
def test_wide_range_gradients_bitwise_torchao(name: str) -> None:
    lin = nn.Linear(64, 32)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    grad = _wide((16, 32), 2)
    config = dataclasses.replace(torchao_float8.Float8LinearConfig.from_recipe_name(name), emulate=True)
    results = []
    for run in ("ours", "torchao"):
        layer = copy.deepcopy(lin)
        xi = x.clone().requires_grad_()
        if run == "ours":
            y = fp8.linear(xi, layer.weight, layer.bias, Float8Recipe.from_name(name))
        else:
            y = torchao_float8.convert_to_float8_training(nn.Sequential(layer), config=config)[0](xi)
        y.backward(grad)
        results.append((y, xi.grad, layer.weight.grad))
    for what, a, b in zip(("output", "grad_input", "grad_weight"), *results):
        assert torch.equal(a, b), f"{what} differs from torchao ({name})"
    # the data reach e5m2's subnormals: the test would not tell the scales apart otherwise
    small = grad.abs()[grad != 0].min() / grad.abs().max()
    assert small < 2.0 ** -14 / 57344 * 448
