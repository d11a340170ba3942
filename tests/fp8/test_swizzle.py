"""The sm100 block-scale swizzle (formats/_swizzle.py): bitwise torchao's ``to_blocked`` (the
oracle), its inverse gives the scales back bitwise, padding included, and it runs on fake CUDA."""

from __future__ import annotations

import pytest
import torch

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
