"""The sm100 block-scale swizzle (formats/_swizzle.py): bitwise torchao's ``to_blocked`` (the
oracle), its inverse gives the scales back bitwise, padding included, and it runs on fake CUDA."""

from __future__ import annotations

import pytest
import torch

from mixprec import fp8
from mixprec.formats._blocks import quantize as block_quantize
from mixprec.formats._fp4 import quantize as fp4_quantize
from mixprec.formats._swizzle import blocked_numel, from_blocked, to_blocked

from _fake_cuda import fake_cuda, fake_mode  # noqa: F401

#: (rows, cols) of block scales: whole tiles, rows and cols off the 128x4 tiles, a single row
#: (one token), a single column (K = 32 in MX), several tiles each way
SHAPES = [(128, 4), (256, 8), (200, 7), (1, 4), (1, 1), (129, 5), (127, 3), (384, 12), (33, 64)]
DTYPES = [torch.float8_e8m0fnu, torch.float8_e4m3fn, torch.uint8]


def _scales(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """Every byte value but 0 (the padding's), so a misplaced scale or pad shows."""
    g = torch.Generator().manual_seed(rows * 1000 + cols)
    return torch.randint(1, 255, (rows, cols), generator=g, dtype=torch.uint8).view(dtype)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,cols", SHAPES, ids=lambda v: str(v))
def test_to_blocked_is_torchao_bitwise(rows, cols, dtype):
    utils = pytest.importorskip("torchao.prototype.mx_formats.utils")
    s = _scales(rows, cols, dtype)
    expected = utils.to_blocked(s)
    got = to_blocked(s)
    assert got.dtype == dtype and got.shape == (blocked_numel(rows, cols),) == expected.shape
    assert torch.equal(_bytes(got), _bytes(expected))
    assert torch.equal(_bytes(from_blocked(got, rows, cols)), _bytes(utils.from_blocked(expected, rows, cols)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,cols", SHAPES, ids=lambda v: str(v))
def test_unswizzle_gives_the_scales_back(rows, cols, dtype):
    s = _scales(rows, cols, dtype)
    b = to_blocked(s)
    back = from_blocked(b, rows, cols)
    assert back.dtype == dtype and back.shape == (rows, cols) and back.is_contiguous()
    assert torch.equal(_bytes(back), _bytes(s))
    # the padding is zero bytes, and only padding: every scale appears once
    padding = blocked_numel(rows, cols) - rows * cols
    assert int((_bytes(b) == 0).sum()) == padding


def test_tile_layout():
    """cuBLAS's layout stated directly: in a 128x4 tile, element (32 i + j, c) sits at (j, 4 i + c)
    of the 32x16 tile; tiles follow row-major over the tile grid."""
    s = torch.arange(256 * 8, dtype=torch.int64).reshape(256, 8) % 251 + 1
    s = s.to(torch.uint8)
    b = to_blocked(s).reshape(2, 2, 32, 16)
    for r, c in [(0, 0), (1, 0), (31, 3), (32, 0), (97, 2), (127, 3), (128, 4), (255, 7), (130, 1)]:
        i, j = (r % 128) // 32, r % 32
        assert int(b[r // 128, c // 4, j, 4 * i + c % 4]) == int(s[r, c]), (r, c)


def test_bad_input():
    with pytest.raises(ValueError, match="1-byte"):
        to_blocked(torch.ones(128, 4))
    with pytest.raises(ValueError, match="2-D"):
        to_blocked(torch.ones(4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="whole 128x4 tiles"):
        from_blocked(torch.ones(500, dtype=torch.uint8), 2, 4)


@pytest.mark.parametrize("rows,cols", [(200, 7), (1, 4), (256, 8)])
def test_swizzle_on_fake_cuda(fake_cuda, rows, cols):
    """No indexing (refused by a CPU-only build's device guard on a fake CUDA tensor, outside the
    fixture's routes): aten ops only."""
    fake_cuda.monkeypatch.setattr(torch.Tensor, "__getitem__", torch._C.TensorBase.__getitem__)
    fake_cuda.monkeypatch.setattr(torch.Tensor, "__setitem__", torch._C.TensorBase.__setitem__)
    with fake_mode():
        s = torch.empty(rows, cols, dtype=torch.float8_e8m0fnu, device="cuda")
        b = to_blocked(s)
        back = from_blocked(b, rows, cols)
    assert (b.shape, b.dtype, b.device.type) == ((blocked_numel(rows, cols),), torch.float8_e8m0fnu, "cuda")
    assert (back.shape, back.dtype, back.device.type) == ((rows, cols), torch.float8_e8m0fnu, "cuda")


def _native_operand(t: torch.Tensor, recipe: fp8.Float8Recipe) -> tuple[torch.Tensor, torch.Tensor]:
    """mixprec's cast of ``t`` (contracted dimension last) as a block-scaled GEMM reads it: the
    data (fp8, or fp4 packed as ``float4_e2m1fn_x2``) and the swizzled 1-byte block scales."""
    cast = recipe.input
    if cast.is_fp4:
        q = fp4_quantize(t, cast)
        scales = q.scales.view(torch.float8_e8m0fnu) if q.scales.dtype == torch.uint8 else q.scales
        return q.codes.view(torch.float4_e2m1fn_x2), to_blocked(scales)
    q, deq, _ = block_quantize(t, cast, recipe.pow2_scales)
    return q, to_blocked(deq.to(torch.float8_e8m0fnu))  # powers of 2: exact


#: recipe -> its scaling type. Not mxfp4: torch 2.13's meta check counts an fp4 operand's K in packed
#: bytes for 1x32 scales (it asks half mixprec's, and torchao's, scale count; 1x16 counts K unpacked).
NATIVE = {"mxfp8": "BlockWise1x32", "nvfp4_1x16": "BlockWise1x16"}


@pytest.mark.parametrize("m,k,n", [(200, 256, 128), (1, 256, 128), (33, 96, 256)], ids=lambda v: str(v))
@pytest.mark.parametrize("name", list(NATIVE))
def test_block_scaled_operands_fit_scaled_mm_at_sm100(fake_cuda, name, m, k, n):
    """What a native sm100 forward GEMM would take (no caller yet): mixprec's block casts of x and
    W with swizzled scales are accepted by ``F.scaled_mm``'s meta checks (scale counts per 128x4
    tile, dtypes, swizzle), awkward M included; unswizzled scales are refused, so the check looks."""
    F = torch.nn.functional
    recipe = fp8.Float8Recipe.nvfp4(weight_block=(1, 16)) if name == "nvfp4_1x16" else fp8.as_recipe(name)
    scaling = getattr(F.ScalingType, NATIVE[name])
    swizzle = F.SwizzleType.SWIZZLE_32_4_4
    fake_cuda.set_capability((10, 0))
    with fake_mode():
        (a, sa), (b, sb) = (_native_operand(torch.randn(rows, k, device="cuda"), recipe) for rows in (m, n))
        out = F.scaled_mm(a, b.t(), sa, scaling, sb, scaling, swizzle_a=swizzle, swizzle_b=swizzle,
                          output_dtype=torch.bfloat16)
        assert (out.shape, out.dtype, out.device.type) == ((m, n), torch.bfloat16, "cuda")
        with pytest.raises(RuntimeError, match="must have"):
            F.scaled_mm(a, b.t(), sa, scaling, sb, scaling, output_dtype=torch.bfloat16)
