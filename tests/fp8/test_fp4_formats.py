"""MXFP4 and NVFP4 casts and forwards: bitwise torchao 0.18 on CPU.

Oracles: ``torchao.prototype.mx_formats.kernels`` (the e2m1 codec and the nibble packing),
``MXTensor.to_mx(..., torch.float4_e2m1fn_x2, 32, RCEIL, EMULATED)``, the QAT layer
``torchao.prototype.qat.mx.MXFakeQuantizedLinear(MXFakeQuantizeConfig())``,
``NVFP4Tensor.to_nvfp4(t, per_tensor_scale=per_tensor_amax_to_scale(amax))``; Transformer
Engine's subnormal block scales against a plain-Python rendering of its formula.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mixprec import fp8
from mixprec.formats._fp4 import E2M1_VALUES, decode_e2m1, encode_e2m1, pack, quantize, unpack

pytest.importorskip("torchao.prototype.qat.mx")
from torchao.prototype.mx_formats.config import ScaleCalculationMode  # noqa: E402
from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, f32_to_f4_unpacked, pack_uint4  # noqa: E402
from torchao.prototype.mx_formats.mx_tensor import MXTensor  # noqa: E402
from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale  # noqa: E402
from torchao.prototype.qat.mx import MXFakeQuantizeConfig, MXFakeQuantizedLinear  # noqa: E402
from torchao.quantization.quantize_.common.kernel_preference import KernelPreference  # noqa: E402

MX, NV = fp8.Cast("e2m1", "1x32"), fp8.Cast("e2m1", "1x16")
#: TE's switches off: the recipe whose forward is torchao's NVFP4 dequantize + F.linear
NV_PLAIN = fp8.Float8Recipe.nvfp4(hadamard=False, stochastic_rounding=False, weight_block=(1, 16))


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _hard_blocks(rows: int = 8, cols: int = 256) -> torch.Tensor:
    """Normal data plus blocks of zeros, tiny, huge, log-spread magnitudes and exact e2m1 ties."""
    x = torch.randn(rows, cols, generator=_gen(3)) * 5
    x[0, :32] = 0
    x[1, :32] *= 1e-30
    x[2, :32] *= 1e30
    x[3, 32:64] *= torch.logspace(-20, 20, 32)
    x[4, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2) * torch.tensor([1.0, -1.0]).repeat(8)
    return x


def test_e2m1_codec_bitwise_torchao():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.0, 0.0, 1e-30, -1e-30])
    x = torch.cat([torch.randn(100_000, generator=_gen(0)) * 3, torch.arange(-700, 701) / 100, ties, -ties])
    x = x.clamp(-6, 6)
    codes = encode_e2m1(x)
    assert codes.dtype == torch.uint8 and torch.equal(codes, f32_to_f4_unpacked(x))
    every = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(decode_e2m1(every), f4_unpacked_to_f32(every))
    assert decode_e2m1(every).tolist() == list(E2M1_VALUES)
    assert encode_e2m1(torch.tensor([7.0, -100.0])).tolist() == [7, 15]  # saturates at +-6


def test_pack_two_codes_per_byte_bitwise_torchao():
    codes = torch.randint(0, 16, (6, 64), generator=_gen(1), dtype=torch.uint8)
    packed = pack(codes)
    assert packed.shape == (6, 32) and torch.equal(packed, pack_uint4(codes))
    assert torch.equal(unpack(packed), codes)
    assert pack(torch.tensor([[1, 2]], dtype=torch.uint8)).tolist() == [[0x21]]  # even element: low nibble


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_cast_bitwise_torchao_to_mx(dtype):
    x = _hard_blocks().to(dtype)
    ref = MXTensor.to_mx(x, torch.float4_e2m1fn_x2, 32, scaling_mode=ScaleCalculationMode.RCEIL,
                         kernel_preference=KernelPreference.EMULATED)
    ours = quantize(x, MX)
    assert ours.tensor_scale is None and ours.codes.shape == (8, 128) and ours.scales.shape == (8, 8)
    assert torch.equal(ours.codes, ref.qdata)
    assert torch.equal(ours.scales, ref.scale.view(torch.uint8))
    for out in (torch.float32, torch.bfloat16):
        assert torch.equal(ours.dequantize(out), ref.dequantize(out))
    assert torch.equal(ours.amax, x.float().abs().reshape(8, 8, 32).amax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_cast_bitwise_torchao_to_nvfp4(dtype):
    x = _hard_blocks(16, 128)[:, :128].to(dtype)
    x[2] = x[5]  # the 1e30 row would dwarf every other block: keep the data finite in e4m3 terms
    ref = NVFP4Tensor.to_nvfp4(x, per_tensor_scale=per_tensor_amax_to_scale(torch.max(torch.abs(x))))
    ours = quantize(x, NV)
    assert torch.equal(ours.codes, ref.qdata)
    assert ours.scales.dtype == torch.float8_e4m3fn and torch.equal(ours.scales.view(torch.uint8),
                                                                   ref.scale.view(torch.uint8))
    assert torch.equal(ours.tensor_scale, ref.per_tensor_scale)
    for out in (torch.float32, torch.bfloat16):
        assert torch.equal(ours.dequantize(out), ref.dequantize(out))


def test_nvfp4_all_zero_tensor_is_zero_not_nan():
    """torchao divides by a tensor scale of 0 there (NaN); mixprec takes a tensor scale of 1."""
    t = quantize(torch.zeros(2, 32), NV)
    assert float(t.tensor_scale) == 1.0 and torch.equal(t.dequantize(torch.float32), torch.zeros(2, 32))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("block", [(1, 16), (16, 16)])
def test_nvfp4_non_finite_element_makes_the_whole_tensor_nan(bad, block):
    """One NaN or infinity: the tensor scale is not finite and every element dequantizes to NaN,
    as torchao's (a NaN took a tensor scale of 1, silently clipping or flushing every other
    block: a row of 1e4 values came back at 2688)."""
    x = torch.randn(32, 64, generator=_gen(5)) * 1e4
    x[0, 0] = bad
    ours = quantize(x, fp8.Cast("e2m1", f"{block[0]}x{block[1]}"))
    assert not torch.isfinite(ours.tensor_scale)
    assert ours.dequantize(torch.float32).isnan().all()
    ref = NVFP4Tensor.to_nvfp4(x, per_tensor_scale=per_tensor_amax_to_scale(torch.max(torch.abs(x))))
    assert ref.dequantize(torch.float32).isnan().all()


def test_nvfp4_linear_with_one_nan_sample_is_nan_everywhere():
    """A batch where one sample holds a NaN: the GEMM is NaN, as under a tensorwise fp8 cast,
    not finite rows computed at a wrong scale."""
    x = torch.randn(4, 64, generator=_gen(6)) * 1e4
    x[0, 0] = float("nan")
    w = torch.randn(16, 64, generator=_gen(7))
    assert fp8.linear(x, w, None, NV_PLAIN).isnan().all()


def _mx_qat(k: int, n: int, dtype: torch.dtype, bias: bool) -> MXFakeQuantizedLinear:
    torch.manual_seed(0)
    return MXFakeQuantizedLinear(k, n, bias=bias, activation_config=MXFakeQuantizeConfig(),
                                 weight_config=MXFakeQuantizeConfig()).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("lead", [(16,), (3, 5)])
def test_mxfp4_forward_bitwise_torchao_qat_linear(dtype, bias, lead):
    ref = _mx_qat(64, 32, dtype, bias)
    x = (torch.randn(*lead, 64, generator=_gen(1)) * 3).to(dtype)
    ours = fp8.linear(x, ref.weight, ref.bias, fp8.Float8Recipe.mxfp4())
    expected = ref(x)
    assert ours.dtype == dtype and ours.shape == expected.shape
    assert torch.equal(ours, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
def test_nvfp4_forward_bitwise_torchao_dequantize_then_linear(dtype, bias):
    gen = _gen(2)
    x, w = (torch.randn(3, 10, 64, generator=gen) * 2).to(dtype), torch.randn(32, 64, generator=gen).to(dtype)
    b = torch.randn(32, generator=gen).to(dtype) if bias else None

    def dq(t):
        t2 = t.reshape(-1, t.shape[-1])
        amax = torch.max(torch.abs(t2))
        return NVFP4Tensor.to_nvfp4(t2, per_tensor_scale=per_tensor_amax_to_scale(amax)).dequantize(dtype)

    expected = F.linear(dq(x), dq(w), b).reshape(3, 10, 32)
    assert torch.equal(fp8.linear(x, w, b, NV_PLAIN), expected)


def test_nvfp4_2d_weight_blocks_agree_transposed():
    """16x16 weight blocks: the forward's cast of W and the input-gradient GEMM's cast of W.t()
    dequantize to the same values; 1x16 blocks do not (the reason for TE's 2-D weight scaling)."""
    w = torch.randn(48, 64, generator=_gen(4)) * torch.logspace(-2, 2, 64)
    for block, agree in (("16x16", True), ("1x16", False)):
        c = fp8.Cast("e2m1", block)
        rows, cols = quantize(w, c).dequantize(torch.float32), quantize(w.t().contiguous(), c).dequantize(torch.float32)
        assert torch.equal(rows, cols.t()) is agree


def _te_scales(x: torch.Tensor) -> torch.Tensor:
    """Transformer Engine's NVFP4 block scales (``quantize_transpose_vector_blockwise_fp4``),
    written out: global encode scale ``448 * 6 / amax``, block decode scale
    ``fp8(block_amax / 6 * global_encode)`` with e4m3's subnormals, no lower clamp."""
    amax = x.abs().max()
    enc = (448.0 * 6.0) / amax
    block_amax = x.abs().reshape(x.shape[0], -1, 16).amax(-1)
    return torch.clamp(block_amax / 6.0 * enc, max=448.0).to(torch.float8_e4m3fn)


def test_nvfp4_block_scales_clamped_by_default_subnormal_on_request():
    """Row-scaled heavy-tailed data: the default (torchao) clamps block scales at 2**-6; with
    ``subnormal_scales`` they follow TE's formula. Both encode the data; the difference is
    measured (the docs quote it)."""
    gen = _gen(5)
    z, chi2 = torch.randn(64, 256, generator=gen), torch.randn(64, 256, 2, generator=gen).square().mean(-1)
    x = z / chi2.sqrt() * torch.logspace(-4, 0, 64)[:, None]  # Student's t (2 dof), rows over 4 decades
    clamped, sub = quantize(x, NV), quantize(x, NV, subnormal_scales=True)
    tiny = torch.finfo(torch.float8_e4m3fn).tiny
    assert clamped.scales.float().min() >= tiny
    assert sub.scales.float().min() < tiny
    differ = (clamped.scales.view(torch.uint8) != sub.scales.view(torch.uint8)).float().mean().item()
    assert 0.01 < differ < 0.2, differ
    te = _te_scales(x)
    agree = (sub.scales.view(torch.uint8) == te.view(torch.uint8)).float().mean().item()
    assert agree > 0.995, agree  # TE multiplies by the encode scale, torchao divides by the tensor scale
    row_err = [((t.dequantize(torch.float32) - x).norm(dim=1) / x.norm(dim=1)) for t in (clamped, sub)]
    assert row_err[1][:8].mean() < row_err[0][:8].mean() - 0.01  # the smallest rows: finer scales
    assert torch.equal(row_err[0][-8:], row_err[1][-8:])  # the largest: the same normal scales


def test_subnormal_scale_of_zero_gives_zero_block_not_nan():
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 16] = 1e6, 1e-6  # the second block's scale rounds to 0 in e4m3
    t = quantize(x, NV, subnormal_scales=True)
    assert t.scales.float()[0, 1] == 0
    out = t.dequantize(torch.float32)
    assert not out.isnan().any() and out[0, 16] == 0 and abs(out[0, 0].item() - 1e6) < 1
