"""``linear_grads``: the backward GEMMs of :func:`mixprec.fp8.linear` without its forward GEMM
(a Controller's shadow step), bitwise ``torch.autograd.grad`` through ``linear`` itself, for
every named recipe, both emulations, compute dtypes and each subset of the gradients."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mixprec.formats._linear import linear_grads
from mixprec.fp8 import Float8Recipe, linear

RECIPES = {name: Float8Recipe.from_name(name) for name in
           ("tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8", "blockwise", "mxfp4", "nvfp4")}
RECIPES["nvfp4-plain"] = Float8Recipe.nvfp4(hadamard=False, stochastic_rounding=False, weight_block=(1, 16))
RECIPES["tensorwise-unsaved-pow2"] = dataclasses.replace(Float8Recipe.tensorwise(), save_fp8=False, pow2_scales=True)
WANTED = [(True, True), (True, False), (False, True)]


def _autograd(x, w, g, recipe, wanted, backend):
    with torch.enable_grad():
        xr, wr = x.detach().requires_grad_(wanted[0]), w.detach().requires_grad_(wanted[1])
        y = linear(xr, wr, None, recipe, backend=backend)
        grads = iter(torch.autograd.grad(y, [t for t, m in zip((xr, wr), wanted) if m], g))
        return tuple(next(grads) if m else None for m in wanted)


@pytest.mark.parametrize("wanted", WANTED, ids=["both", "input", "weight"])
@pytest.mark.parametrize("dtype,weight_dtype,backend", [
    (torch.float32, torch.float32, "emulate"), (torch.float32, torch.float32, "emulate_fp32"),
    (torch.bfloat16, torch.bfloat16, "emulate_fp32"), (torch.bfloat16, torch.float32, "emulate_fp32"),
    (torch.float32, torch.bfloat16, "emulate_fp32")],
    ids=["fp32-emulate", "fp32", "bf16", "bf16-fp32-weight", "fp32-bf16-weight"])
@pytest.mark.parametrize("name", list(RECIPES))
def test_linear_grads_are_the_backward_of_linear_bitwise(name, dtype, weight_dtype, backend, wanted) -> None:
    recipe = RECIPES[name]
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(2, 128, 128, generator=gen) * 3).to(dtype)  # (blockwise: 128-blocks on every operand)
    w = (torch.randn(128, 128, generator=gen) * 0.1).to(weight_dtype)
    g = (torch.randn(2, 128, 128, generator=gen) * 1e-3).to(dtype)
    want = _autograd(x, w, g, recipe, wanted, backend)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # (off inside, as in linear)
        got = linear_grads(x, w, g, recipe, wanted, backend)
    for a, b in zip(got, want):
        assert (a is None) == (b is None)
        if b is not None:
            assert a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(a, b), (name, (a - b).abs().max())


@pytest.mark.parametrize("wanted", WANTED, ids=["both", "input", "weight"])
@pytest.mark.parametrize("name", ["nvfp4", "tensorwise", "rowwise"])
def test_linear_grads_runs_only_the_wanted_backward_gemms(name, wanted) -> None:
    """The point of it: the forward's product (16x64 by 64x32) is never formed, and only the
    wanted backward GEMMs run: the input gradient's 16x32 by 32x64, the weight gradient's 32x16
    by 16x64 (NVFP4's Hadamard transforms are 16x16 products, left out)."""
    x, w, g = torch.randn(16, 64), torch.randn(32, 64), torch.randn(16, 32)
    products = []

    class Watch(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") in ("mm", "matmul", "addmm", "__matmul__", "linear", "bmm"):
                shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
                if shapes[-1] != (16, 16):
                    products.append(shapes)
            return func(*args, **(kwargs or {}))

    with Watch():
        linear_grads(x, w, g, Float8Recipe.from_name(name), wanted)
    expected = [[(16, 32), (32, 64)]] * wanted[0] + [[(32, 16), (16, 64)]] * wanted[1]
    assert products == expected
