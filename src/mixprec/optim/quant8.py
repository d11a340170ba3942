"""Block-wise 8-bit optimizer state: the dynamic quantization of bitsandbytes' 8-bit Adam.

A moment of ``n`` elements is flattened, padded to whole blocks of :data:`BLOCK` elements, and
stored as one ``uint8`` code per element plus one float32 ``absmax`` per block (``1 + 4 / 256``
bytes per element). A code indexes a 256-entry *dynamic* map of values in ``[-1, 1]`` (``[0, 1]``
for the non-negative second moment): a decimal exponent and a fraction that shares the remaining
bits, so small values keep a relative precision where a linear map would flush them to zero
(Dettmers et al., *8-bit Optimizers via Block-wise Quantization*, 2022). A block's value is
``map[code] * absmax``; quantizing divides by the block's absmax and takes the nearest entry.

Plain eager ops (``amax``, bit shifts, table lookups): any shape, no compilation. Tensors
smaller than :data:`MIN_NUMEL` keep float32 moments (their 8-bit saving is negligible and the
per-block overhead is not), as bitsandbytes and torchao do.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor

__all__ = ["BLOCK", "MIN_NUMEL", "Quantized8", "dynamic_map", "new_quantized8"]

#: Elements per quantization block (torchao's default).
BLOCK = 256
#: Parameters with fewer elements keep float32 moments.
MIN_NUMEL = 4096


def _dynamic_map_list(signed: bool) -> list[float]:
    """The 256 values of the dynamic map (bitsandbytes ``create_dynamic_map(signed)``, 7 exponent bits)."""
    exponent_bits, non_sign_bits = 7, 7
    data: list[float] = []
    for i in range(exponent_bits):
        items = 2 ** (i + non_sign_bits - exponent_bits + (0 if signed else 1)) + 1
        bounds = torch.linspace(0.1, 1, items)  # float32, as bitsandbytes: the same 256 numbers
        means = (bounds[:-1] + bounds[1:]) / 2.0
        scale = 10.0 ** (-(exponent_bits - 1) + i)
        data += (scale * means).tolist()
        if signed:
            data += (-scale * means).tolist()
    data += [0.0, 1.0]
    return sorted(data)


@lru_cache(maxsize=None)
def _maps(signed: bool, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """``(values, base, midpoint)``: the map, and the lookup tables of :meth:`Quantized8.quantize_`.

    The nearest code of ``x`` is the number of midpoints between map entries below ``x``. Over
    the float32 numbers sharing ``x``'s top 16 bits (a bucket of relative width ``2**-7``, finer
    than the map) that count is ``base`` (midpoints below the bucket) plus ``x > midpoint``
    (the one midpoint inside the bucket, ``inf`` if none; never two: checked here).
    """
    values = torch.tensor(_dynamic_map_list(signed), dtype=torch.float32)
    mids = (values[1:] + values[:-1]) / 2
    patterns = torch.arange(1 << 16, dtype=torch.int32) << 16
    ends = torch.stack([patterns.view(torch.float32), (patterns | 0xFFFF).view(torch.float32)])
    low, high = ends.amin(0), ends.amax(0)
    base = torch.bucketize(low, mids)  # midpoints < low
    inside = torch.bucketize(high, mids, right=True) - base  # low <= midpoint <= high
    finite = torch.isfinite(low) & torch.isfinite(high)
    if int(inside[finite].max()) > 1:
        raise AssertionError("two midpoints of the dynamic map in one bucket")  # map design bug
    midpoint = torch.where(inside == 1, mids[base.clamp(max=mids.numel() - 1)], torch.tensor(float("inf")))
    return values.to(device), base.to(torch.uint8).to(device), midpoint.to(device)


def dynamic_map(signed: bool, device: torch.device | str = "cpu") -> Tensor:
    """The 256 float32 values a code stands for, sorted (``signed``: in ``[-1, 1]``, else ``[0, 1]``)."""
    return _maps(signed, torch.device(device))[0].clone()


@dataclass(frozen=True)
class Quantized8:
    """One 8-bit moment: ``codes`` (uint8, padded to whole blocks), ``absmax`` (float32 per
    block), ``signed`` (which map) and the ``shape`` it dequantizes to. ``codes``/``absmax``
    are the tensors kept in the optimizer state; :meth:`quantize_` writes them in place."""

    codes: Tensor
    absmax: Tensor
    signed: bool
    shape: torch.Size

    def part(self, sl: slice) -> "Quantized8":
        """The flat elements ``sl`` (``sl.start`` a multiple of :data:`BLOCK`), as a view."""
        blocks = slice(sl.start // BLOCK, -(-sl.stop // BLOCK))
        codes = self.codes[blocks.start * BLOCK : blocks.stop * BLOCK]
        return Quantized8(codes, self.absmax[blocks], self.signed, torch.Size([sl.stop - sl.start]))

    def dequantize(self) -> Tensor:
        """The float32 moment (a new tensor of ``shape``)."""
        values = _maps(self.signed, self.codes.device)[0]
        out = values.index_select(0, self.codes.int()).view(-1, BLOCK).mul_(self.absmax.unsqueeze(1))
        return out.view(-1)[: self.shape.numel()].view(self.shape)

    def quantize_(self, x: Tensor) -> None:
        """Store float32 ``x`` (of ``shape``): per-block absmax, then the nearest map entry (a
        tie goes to the lower one)."""
        flat = x.reshape(-1)
        pad = self.codes.numel() - flat.numel()
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        blocks = flat.view(-1, BLOCK)
        torch.amax(blocks.abs(), dim=1, out=self.absmax)
        scale = self.absmax.clamp(min=torch.finfo(torch.float32).tiny).reciprocal_()
        normalized = blocks * scale.unsqueeze(1)
        _, base, midpoint = _maps(self.signed, flat.device)
        bucket = torch.bitwise_right_shift(normalized.view(torch.int32).view(-1), 16).bitwise_and_(0xFFFF)
        above = midpoint.index_select(0, bucket) < normalized.view(-1)
        torch.add(base.index_select(0, bucket), above, out=self.codes)


def new_quantized8(like: Tensor, signed: bool) -> tuple[Tensor, Tensor]:
    """Zero ``(codes, absmax)`` state tensors for a moment of ``like``'s shape and device."""
    blocks = -(-like.numel() // BLOCK)
    codes = torch.empty(blocks * BLOCK, dtype=torch.uint8, device=like.device)
    absmax = torch.zeros(blocks, dtype=torch.float32, device=like.device)
    zero = int(torch.searchsorted(_maps(signed, torch.device("cpu"))[0], 0.0))  # the code of 0
    codes.fill_(zero)
    return codes, absmax
