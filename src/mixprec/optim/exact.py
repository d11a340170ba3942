"""Exact compensation: a bfloat16 weight plus its int16 low bits *is* the float32 master.

bfloat16 is the top half of float32. A float32 master ``m`` (as its int32 bit pattern) is stored
as ``m = (hi << 16) + lo``: ``hi`` is ``m`` rounded to nearest bfloat16 (ties away from zero) and
is the parameter itself, ``lo`` the signed low 16 bits, in ``[-2**15, 2**15)``, kept in an int16
buffer. Reading back is ``p.float()`` (``hi << 16`` as a float32 bit pattern) plus ``lo`` on the
bits: exact, so every update that float32 represents reaches the weight, as with an fp32 master,
for 2 extra bytes per parameter instead of 4 (and no master gradient).

Writing takes ``lo`` as the low 16 bits of ``m`` read as a signed int16 (a wrapping int32 ->
int16 copy), and ``hi << 16 = m - lo``: the low bits cleared, plus one bfloat16 gap when they
were ``2**15`` or more, i.e. the magnitude rounded to nearest, ties away from zero (the int32
pattern of a float is its magnitude, offset by ``-2**31`` for a negative one, so the rule is the
same for both signs). A carry past bfloat16's largest finite value makes the parameter ``inf``
(as rounding to nearest does) while the master stays finite. Integer arithmetic only: no host
sync, same code on every device, and every step is a ``torch._foreach_*`` op too.

A parameter written from outside (``w.zero_()``, pruning ``w[mask] = 0``, ``nn.init``) keeps its
old low bits: the value read back is then the new weight moved by less than half a bfloat16 gap,
except where that is not a finite number while the weight is: the stale low bits of a zeroed
weight (``+-0.0``) below zero wrap its bit pattern into a NaN. Reading takes the weight alone
there (:func:`drop_stale_low_bits`), in the C++ kernel alike, so a zeroed weight trains on
from 0 instead of freezing at 0 over a NaN master. The optimizer itself never writes such a pair
(its ``+-0.0`` weights have low bits >= 0), so this changes nothing else.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["exact_value", "exact_write_", "check_exact_dtype", "drop_stale_low_bits"]


def exact_value(param: Tensor, low_bits: Tensor) -> Tensor:
    """The float32 master a bfloat16 ``param`` and its int16 ``low_bits`` stand for (a new tensor;
    ``param`` itself where it is finite and the sum is not: :func:`drop_stale_low_bits`)."""
    value = param.detach().to(torch.float32, copy=True)
    value.view(torch.int32).add_(low_bits)
    return drop_stale_low_bits(value, param)


def drop_stale_low_bits(value: Tensor, param: Tensor) -> Tensor:
    """``value`` (``param``'s bits plus its low bits), or ``param`` where ``param`` is finite and
    ``value`` is not: low bits left over from before ``param`` was written from outside (a zeroed
    weight), which would make the master a NaN. May return ``value`` itself."""
    return torch.where(torch.isfinite(value) | ~torch.isfinite(param), value, param.detach().to(torch.float32))


def exact_write_(param: Tensor, low_bits: Tensor, value: Tensor) -> None:
    """Split float32 ``value`` into ``param`` (bfloat16, nearest) and ``low_bits`` (int16).

    ``value`` is scratch: it is overwritten (pass a copy to keep it). Afterwards
    ``exact_value(param, low_bits)`` equals ``value`` bitwise.
    """
    bits = value.view(torch.int32)
    low_bits.copy_(bits)  # int32 -> int16 keeps the low 16 bits, as a signed number
    bits.sub_(low_bits)
    param.copy_(value)  # exact: ``value`` is now a bfloat16 number


def check_exact_dtype(dtype: torch.dtype) -> None:
    """Raise if a parameter of ``dtype`` cannot use ``compensation="exact"``."""
    if dtype == torch.float16:
        raise ValueError(
            "compensation='exact' splits a float32 master into a bfloat16 parameter and int16 low "
            "bits; float16 is not the top half of float32: use compensation='kahan' or "
            "mixprec.MasterWeights for float16 parameters"
        )
