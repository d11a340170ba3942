"""The native-layout GEMMs compute the emulation's math, bit for bit (on the CPU).

Each recipe's three GEMMs run through the native code path (``backend="scaled_mm"``: operands
padded, fp4 packed as ``float4_e2m1fn_x2``, scales swizzled or laid out outer-dim-major) with
torch's scaled GEMMs replaced by a reference that reads that layout back by its own code
(``from_blocked``, the blockwise scale strides, the padding cut at the GEMM's true K), rebuilds
each operand's cast and dequantizes and multiplies it as the plain emulation does. The result
equals the plain emulation (``backend="emulate"``) bitwise: output, input gradient, weight
gradient. So a wrong swizzle, a wrong scale axis or a wrong re-quantization of a transposed
operand in a backward GEMM shows here, long before a GPU does.

The block-scaled kernels write bfloat16, so the comparison runs in bfloat16 (an fp32 model's
native result is the bf16 one, cast).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from mixprec import fp8
from mixprec.formats._blocks import block_gemm
from mixprec.formats._fp4 import Fp4Tensor
from mixprec.formats._fp4_linear import Fp4Matmul
from mixprec.formats._linear import _Float8Matmul
from mixprec.formats._recipe import Cast
from mixprec.formats._swizzle import from_blocked

RECIPES = {
    "blockwise": fp8.Float8Recipe.blockwise(),
    "mxfp8": fp8.Float8Recipe.mxfp8(),
    "mxfp4": fp8.Float8Recipe.mxfp4(),
    "nvfp4": fp8.Float8Recipe.nvfp4(),  # 16x16 weight blocks, Hadamard, stochastic rounding
    "nvfp4_1x16_plain": fp8.Float8Recipe.nvfp4(hadamard=False, stochastic_rounding=False, weight_block=(1, 16)),
}
#: (M, K, N): M off every block (the weight-gradient GEMM pads it), a single row, K = 48 (NVFP4
#: pads it to 64 for the packed kernel)
SHAPES = [(200, 256, 128), (1, 128, 256), (33, 128, 128), (200, 48, 64)]
CASES = [(name, s) for name in RECIPES for s in SHAPES if s[1] % RECIPES[name].block_multiple == 0]
_NAMES = {int(getattr(F.ScalingType, n).value): n for n in dir(F.ScalingType) if n[0].isupper()}


class Reference:
    """torch's scaled GEMMs as the emulation computes them, reading the native layout.

    ``ks``: the true contracted length of each call in order (forward, input gradient, weight
    gradient); what lies beyond it is the padding, which must be zero codes."""

    def __init__(self, ks: list[int]) -> None:
        self.ks = list(ks)
        self.calls: list[str] = []

    def _k(self, packed: int) -> int:
        k = self.ks.pop(0)
        assert packed >= k
        return k

    def scaled_mm(self, mat_a, mat_b, scale_a, scale_recipe_a, scale_b, scale_recipe_b, swizzle_a=None,
                  swizzle_b=None, bias=None, output_dtype=None, contraction_dim=(), use_fast_accum=False):
        assert bias is None and output_dtype == torch.bfloat16
        kind_a = [scale_recipe_a] if not isinstance(scale_recipe_a, list) else scale_recipe_a
        kind_a = [_NAMES[int(r.value)] for r in kind_a]
        kind_b = scale_recipe_b if isinstance(scale_recipe_b, list) else [scale_recipe_b]
        kind_b = [_NAMES[int(r.value)] for r in kind_b]
        self.calls.append(f"{kind_a[0]}x{kind_b[0]}")
        a, b = mat_a, mat_b.t()  # (M, K), (N, K)
        if kind_a == ["BlockWise1x16", "TensorWise"]:
            k = self._k(a.shape[1] * 2)
            return self._fp4(a, scale_a[0], scale_a[1], b, scale_b[0], scale_b[1], 16, k)
        if kind_a == ["BlockWise1x32"]:
            k = self._k(a.shape[1])
            cast = Cast(str(a.dtype).split("_", 1)[1], "1x32")
            blocks = -(-k // 32)
            sa = from_blocked(scale_a, a.shape[0], -(-a.shape[1] // 32)).narrow(1, 0, blocks).float()
            sb = from_blocked(scale_b, b.shape[0], -(-b.shape[1] // 32)).narrow(1, 0, blocks).float()
            return self._blocks((a, sa), cast, (b, sb), cast, k)
        k = self._k(a.shape[1])
        blocks = -(-k // 128)
        casts, scales = [], []
        for t, s, kind in ((a, scale_a, kind_a[0]), (b, scale_b, kind_b[0])):
            s = s[0] if isinstance(s, list) else s
            if kind == "BlockWise1x128":  # [rows, K/128], stride [1, rows]
                assert s.shape == (t.shape[0], t.shape[1] // 128) and (s.stride(0) == 1 or s.shape[0] == 1)
                scales.append(s.narrow(1, 0, blocks))
                casts.append(Cast("e4m3fn", "1x128"))
            else:  # [round_up(K/128, 4), rows/128], stride [1, round_up(K/128, 4)]
                assert s.shape[1] == t.shape[0] // 128 and s.shape[0] % 4 == 0 and s.stride(0) == 1
                scales.append(s.t().narrow(1, 0, blocks))
                casts.append(Cast("e4m3fn", "128x128"))
        return self._blocks((a, scales[0]), casts[0], (b, scales[1]), casts[1], k)

    def _scaled_mm_v1(self, a, b, *, scale_a, scale_b, out_dtype=None, use_fast_accum=False, **kwargs):
        assert a.dtype == torch.float4_e2m1fn_x2 and scale_a.dtype == torch.float8_e8m0fnu
        self.calls.append("mxfp4")
        k = self._k(a.shape[1] * 2)
        return self._fp4(a, scale_a, None, b.t(), scale_b, None, 32, k)

    def _blocks(self, a, ca, b, cb, k):
        (qa, sa), (qb, sb) = a, b
        for q in (qa, qb):  # the padding: zero codes only
            assert not q.narrow(1, k, q.shape[1] - k).view(torch.uint8).any()
        qa, qb = qa.narrow(1, 0, k).contiguous(), qb.narrow(1, 0, k).contiguous()
        return block_gemm((qa, sa), ca, (qb, sb), cb, torch.bfloat16)

    def _fp4(self, a, sa, ta, b, sb, tb, cols, k):
        ops = []
        for codes, s, ts in ((a, sa, ta), (b, sb, tb)):
            codes = codes.view(torch.uint8)
            rows, packed = codes.shape
            assert not codes.narrow(1, -(-k // cols) * cols // 2, packed - -(-k // cols) * cols // 2).any()
            scales = from_blocked(s, rows, packed * 2 // cols).narrow(1, 0, -(-k // cols))
            keep = -(-k // cols) * cols // 2
            cast = Cast("e2m1", f"1x{cols}")
            if cols == 32:
                scales = scales.view(torch.uint8)
            ops.append(Fp4Tensor(codes.narrow(1, 0, keep).contiguous(), scales.contiguous(), ts,
                                 scales.new_empty(0), torch.Size([rows, k]), cast))
        out = torch.mm(ops[0].dequantize(torch.bfloat16), ops[1].dequantize(torch.bfloat16).t())
        return out.to(torch.bfloat16)


class _Ctx(SimpleNamespace):
    needs_input_grad = (True, True, True)

    def save_for_backward(self, *tensors: torch.Tensor) -> None:
        self.saved_tensors = tensors


def _run(recipe, x, w, go, backend):
    ctx = _Ctx()
    with torch.no_grad():
        if recipe.fp4:
            step = torch.full((), 3, dtype=torch.int64)
            out = Fp4Matmul.forward(ctx, x, w, None, recipe, None, None, step, backend)
            return [out, *Fp4Matmul.backward(ctx, go)[:2]]
        out = _Float8Matmul.forward(ctx, x, w, recipe, backend, None, None)
        return [out, *_Float8Matmul.backward(ctx, go)[:2]]


def _data(m, k, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * torch.logspace(-3, 3, k)[torch.randperm(k, generator=g)]).bfloat16()
    w = (torch.randn(n, k, generator=g) / k ** 0.5).bfloat16()
    go = (torch.randn(m, n, generator=g) * 1e-4).bfloat16()
    return x, w, go


@pytest.mark.parametrize("name,shape", CASES, ids=[f"{c[0]}-{'x'.join(map(str, c[1]))}" for c in CASES])
def test_native_layout_emulated_is_the_emulation_bitwise(monkeypatch, name, shape):
    m, k, n = shape
    recipe = RECIPES[name]
    x, w, go = _data(m, k, n)
    expected = _run(recipe, x, w, go, "emulate")
    # (the Hadamard transform pads the weight-gradient GEMM's tokens to a multiple of 16 itself)
    ref = Reference([k, n, -(-m // 16) * 16 if recipe.hadamard else m])
    monkeypatch.setattr(F, "scaled_mm", ref.scaled_mm)
    monkeypatch.setattr(torch, "_scaled_mm", ref._scaled_mm_v1)
    got = _run(recipe, x, w, go, "scaled_mm")
    assert len(ref.calls) == 3 and ref.ks == []
    for what, e, g in zip(("output", "grad_input", "grad_weight"), expected, got):
        assert g.dtype == e.dtype == torch.bfloat16 and g.shape == e.shape
        assert torch.equal(g, e), f"{name} {what}: {(g.float() - e.float()).abs().max()}"
