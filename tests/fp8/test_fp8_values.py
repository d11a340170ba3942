"""formats._blocks.fp8_values: an fp8 tensor's values, bitwise PyTorch's conversion, on every
code, at every size (small ones convert as PyTorch does, large e4m3 ones on CPU through float16's
bits), into float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch

from mixprec.formats._blocks import _BITS_CONVERSION, fp8_values

CASES = [  # (fp8 dtype, target dtype, repeats of the 256 codes)
    (torch.float8_e4m3fn, torch.float32, 1),
    (torch.float8_e4m3fn, torch.float32, _BITS_CONVERSION // 256 + 3),
    (torch.float8_e4m3fn, torch.bfloat16, _BITS_CONVERSION // 256 + 3),
    (torch.float8_e5m2, torch.float32, _BITS_CONVERSION // 256 + 3),
]


@pytest.mark.parametrize("fp8,dtype,repeats", CASES)
def test_every_code_converts_bitwise(fp8: torch.dtype, dtype: torch.dtype, repeats: int) -> None:
    codes = torch.arange(256, dtype=torch.uint8).view(fp8).repeat(repeats).reshape(-1, 128)
    ours, ref = fp8_values(codes, dtype), codes.to(dtype)
    assert ours.dtype == dtype and ours.shape == ref.shape
    nan = ref.isnan()
    assert torch.equal(ours.isnan(), nan)  # the NaN codes stay NaN (a step's overflow must reach the scaler)
    assert torch.equal(ours[~nan], ref[~nan]) and torch.equal(ours.signbit()[~nan], ref.signbit()[~nan])


def test_a_strided_view_converts_as_its_values() -> None:
    x = torch.randn(256, 160).to(torch.float8_e4m3fn).t()  # not contiguous
    assert torch.equal(fp8_values(x), x.float())
