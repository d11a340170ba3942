"""The block-scale layout of sm100's block-scaled GEMMs (cuBLAS's ``SWIZZLE_32_4_4``).

A block-scaled GEMM on sm100 (MXFP8, MXFP4: E8M0 scales per 1x32 block; NVFP4: e4m3 scales per
1x16 block) reads the operand's scales, a ``(rows, cols)`` matrix (``cols``: blocks along the
contracted dimension), not row-major but in tiles of 128 rows x 4 columns, each tile stored as
32x16: element ``(r, c)`` of a tile (``r = 32 * i + j``) lands at ``(j, 4 * i + c)``, the tiles
themselves row-major over the ``ceil(rows / 128) x ceil(cols / 4)`` grid, zero-padded (byte 0)
to whole tiles. See https://docs.nvidia.com/cuda/cublas/index.html#d-block-scaling-factors-layout.

Bitwise torchao 0.18's ``mx_formats.utils.to_blocked`` and ``from_blocked`` (flattened output),
through aten ops only (``pad``, ``view``, ``permute``, ``narrow``: no indexing), so it runs on any
device, fake CUDA tensors included.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["to_blocked", "from_blocked", "blocked_numel"]

#: a swizzle tile: 128 rows of 4 scales, stored as 32 x 16
TILE_ROWS, TILE_COLS = 128, 4


def _tiles(rows: int, cols: int) -> tuple[int, int]:
    return -(-rows // TILE_ROWS), -(-cols // TILE_COLS)


def blocked_numel(rows: int, cols: int) -> int:
    """The elements :func:`to_blocked` gives for ``(rows, cols)`` scales: both padded to whole tiles."""
    tr, tc = _tiles(rows, cols)
    return tr * TILE_ROWS * tc * TILE_COLS


def _check(scales: torch.Tensor, name: str) -> None:
    if scales.element_size() != 1:
        raise ValueError(f"{name}: block scales are 1-byte (E8M0 or e4m3), got {scales.dtype}; cast the "
                         f"scales first (e.g. to torch.float8_e8m0fnu)")


def to_blocked(scales: torch.Tensor) -> torch.Tensor:
    """``scales`` (2-D, ``(rows, cols)``, 1-byte dtype) in the swizzled layout, flattened
    (:func:`blocked_numel` elements, ``scales``' dtype and device).

    Raises ValueError on a tensor that is not 2-D or whose dtype is not 1 byte.

    Example:
        >>> s = torch.arange(8, dtype=torch.uint8).reshape(2, 4)
        >>> b = to_blocked(s)
        >>> b.shape, b[:20].tolist()
        (torch.Size([512]), [0, 1, 2, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4, 5, 6, 7])
        >>> torch.equal(from_blocked(b, 2, 4), s)
        True
    """
    if scales.dim() != 2:
        raise ValueError(f"to_blocked: scales must be 2-D (rows, blocks along K), got shape {tuple(scales.shape)}")
    _check(scales, "to_blocked")
    rows, cols = scales.shape
    tr, tc = _tiles(rows, cols)
    raw = scales.view(torch.uint8)  # zero bytes pad (F.pad refuses E8M0, which has no 0)
    padded = F.pad(raw, (0, tc * TILE_COLS - cols, 0, tr * TILE_ROWS - rows))
    tiles = padded.view(tr, TILE_ROWS, tc, TILE_COLS).permute(0, 2, 1, 3)   # [tr, tc, 128, 4]
    swizzled = tiles.reshape(tr * tc, 4, 32, TILE_COLS).transpose(1, 2)     # r = 32 i + j -> (j, i)
    return swizzled.reshape(-1).view(scales.dtype)


def from_blocked(blocked: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The inverse of :func:`to_blocked`: the ``(rows, cols)`` scales (contiguous), padding dropped.

    Raises ValueError when ``blocked`` does not hold :func:`blocked_numel` ``(rows, cols)``
    elements of a 1-byte dtype.
    """
    _check(blocked, "from_blocked")
    if blocked.numel() != blocked_numel(rows, cols):
        raise ValueError(f"from_blocked: {blocked.numel()} elements, but ({rows}, {cols}) scales swizzle to "
                         f"{blocked_numel(rows, cols)} (whole 128x4 tiles)")
    tr, tc = _tiles(rows, cols)
    raw = blocked.reshape(-1).view(torch.uint8)
    tiles = raw.view(tr * tc, 32, 4, TILE_COLS).transpose(1, 2).reshape(tr, tc, TILE_ROWS, TILE_COLS)
    padded = tiles.permute(0, 2, 1, 3).reshape(tr * TILE_ROWS, tc * TILE_COLS)
    return padded.narrow(0, 0, rows).narrow(1, 0, cols).contiguous().view(blocked.dtype)
