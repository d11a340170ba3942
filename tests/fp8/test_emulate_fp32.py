"""The ``"emulate_fp32"`` backend: every emulated GEMM dequantized and multiplied in float32,
the product rounded once (as a tensor core accumulates). Its reference: the ``"emulate"``
backend run on the same values in float32 (where fp4 and MX recipes multiply in float32 too),
its output and gradients rounded to the low-precision dtype: bitwise."""

from __future__ import annotations

import pytest
import torch

from mixprec import Policy
from mixprec.fp8 import Float8Recipe, linear

RECIPES = {
    "nvfp4": Float8Recipe.nvfp4(),
    "nvfp4-plain": Float8Recipe.nvfp4(hadamard=False, stochastic_rounding=False, weight_block=(1, 16)),
    "mxfp4": Float8Recipe.mxfp4(),
    "mxfp8": Float8Recipe.mxfp8(),
    "blockwise": Float8Recipe.blockwise(),
    "tensorwise": Float8Recipe.tensorwise(),
    "rowwise": Float8Recipe.rowwise(),
}


def _run(recipe, backend, x, w, b, go):
    x, w, b = (t.detach().clone().requires_grad_() for t in (x, w, b))
    out = linear(x, w, b, recipe, backend=backend)
    out.backward(go)
    return out, x.grad, w.grad, b.grad


@pytest.mark.parametrize("name", sorted(RECIPES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_emulate_fp32_is_the_float32_emulation_rounded_once(name, dtype):
    recipe = RECIPES[name]
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(3, 48, 128, generator=g) * 3).to(dtype)
    x[0, 0, :5] = 0.0  # a few zeros, one outlier row
    x[1, 2] *= 50
    w = (torch.randn(256, 128, generator=g) * 0.05).to(dtype)
    b = torch.randn(256, generator=g).to(dtype)
    go = torch.randn(3, 48, 256, generator=g).to(dtype)
    got = _run(recipe, "emulate_fp32", x, w, b, go)
    ref = _run(recipe, "emulate", x.float(), w.float(), b.float(), go.float())
    names = ("output", "grad_input", "grad_weight", "grad_bias")
    ref = list(ref)
    if not recipe.fp4:  # fp8 recipes add the bias after the GEMM, in the output's dtype
        ref[0] = linear(x.float(), w.float(), None, recipe, backend="emulate").to(dtype) + b
    for label, a, r in zip(names, got, ref):
        assert a.dtype == dtype, label
        if label == "grad_bias":
            r = go.sum((0, 1))  # the bias gradient is summed in the gradient's own dtype
        assert torch.equal(a, r.to(dtype)), f"{name} {label}: {(a != r.to(dtype)).float().mean():.2e} differ"


@pytest.mark.parametrize("name", ["tensorwise", "rowwise"])
def test_emulate_fp32_is_emulate_for_float32_scaled_fp8(name):
    g = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(64, 32, generator=g).bfloat16(), torch.randn(48, 32, generator=g).bfloat16(), None
    xs = [t.clone().requires_grad_() for t in (x, x)]
    ws = [t.clone().requires_grad_() for t in (w, w)]
    outs = [linear(xi, wi, b, RECIPES[name], backend=be) for xi, wi, be in zip(xs, ws, ("emulate", "emulate_fp32"))]
    for o in outs:
        o.float().square().sum().backward()
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(xs[0].grad, xs[1].grad) and torch.equal(ws[0].grad, ws[1].grad)


def test_emulate_fp32_differs_from_the_input_dtype_emulation_where_bf16_rounds():
    """On bf16 inputs, ``"emulate"`` (torchao's: dequantized to bf16, multiplied in bf16) and
    ``"emulate_fp32"`` are different computations: the backend takes effect."""
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(64, 256, generator=g).bfloat16(), torch.randn(64, 256, generator=g).bfloat16()
    a = linear(x, w, None, Float8Recipe.nvfp4(), backend="emulate")
    b = linear(x, w, None, Float8Recipe.nvfp4(), backend="emulate_fp32")
    assert not torch.equal(a, b)


def test_the_policy_carries_emulate_fp32_through_json_and_text():
    policy = Policy(compute=torch.bfloat16).fp8("nvfp4", backend="emulate_fp32")
    assert Policy.from_json(policy.to_json()) == policy
    assert "backend=emulate_fp32" in str(policy)
    assert Policy.parse(str(policy)) == policy
    with pytest.raises(ValueError, match="emulate_fp32"):
        Policy(compute=torch.bfloat16).fp8("nvfp4", backend="emulate32")
