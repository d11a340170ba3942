"""The cast statistics' C++ kernel (``csrc/stats_kernel.cpp``) against its definition, the torch
code of :func:`mixprec.formats._quant.fold_cast_stats` (``MIXPREC_NATIVE_KERNELS=0``): the same
window row, bitwise (NaN as NaN), over fp8 and fp4 casts of float32/bfloat16/float16 operands,
strided samples, a previous amax that rounds in the operand's dtype, zeros, flushes, infinities
and NaNs; and the torch code where the kernel must not serve."""

from __future__ import annotations

from typing import Callable

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from mixprec.formats._fp4 import quantize
from mixprec.formats._quant import SAMPLE, cast_to_fp8, fold_cast_stats
from mixprec.formats._recipe import Cast

from _kernel_spy import both

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _plain(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, 32, generator=_gen(seed))


def _wide_range(n: int, seed: int) -> torch.Tensor:
    """Magnitudes over 20 decades: casts that flush many values, zeros among them."""
    x = torch.randn(n, 32, generator=_gen(seed)) * torch.logspace(-10, 10, n)[:, None]
    x[::3, ::5] = 0.0
    return x


def _non_finite(n: int, seed: int) -> torch.Tensor:
    x = torch.randn(n, 32, generator=_gen(seed))
    x[1, 3], x[n // 2, 7] = float("inf"), float("-inf")
    return x


def _nan(n: int, seed: int) -> torch.Tensor:
    x = torch.randn(n, 32, generator=_gen(seed))
    x[0, 0] = float("nan")
    return x


OPERANDS: dict[str, Callable[[int, int], torch.Tensor]] = {
    "plain": _plain, "wide range": _wide_range, "non-finite": _non_finite, "nan": _nan}
#: rows: a few (every element sampled) and past SAMPLE elements (every stride-th)
ROWS = (6, 2 * SAMPLE // 32 + 7)
CASTS = {"e4m3 tensor": Cast("e4m3fn", "tensor"), "e5m2 row": Cast("e5m2", "row"), "nvfp4": Cast("e2m1", "1x16")}


def _cast(x: torch.Tensor, cast: Cast) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, amax)`` as the GEMMs record them: fp8 codes, or an fp4 cast's magnitudes and block amaxes."""
    if cast.is_fp4:
        fp4 = quantize(x, cast)
        return fp4.magnitudes(), fp4.amax
    q, _, amax = cast_to_fp8(x, cast, -1, False)
    return q, amax


def _rows(seed: int) -> list[torch.Tensor]:
    """Window rows: empty, one whose previous amax rounds in a bfloat16/float16 operand's dtype,
    one with worse statistics than most casts, one holding a NaN."""
    gen = _gen(seed)
    return [torch.zeros(5), torch.tensor([0.5, 0.0, 0.0, 0.0, 1.005]),
            torch.cat([torch.rand(4, generator=gen), torch.tensor([0.9])]),
            torch.tensor([float("nan"), 0.1, 0.0, 0.0, 2.0])]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal but a NaN's payload (a NaN where the other has one)."""
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("cast", CASTS)
@pytest.mark.parametrize("operand", OPERANDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_kernel_folds_bitwise_what_the_torch_code_does(dtype, operand, cast, rows, kernel_spy, monkeypatch):
    x = OPERANDS[operand](rows, len(operand) + rows).to(dtype)
    if CASTS[cast].is_fp4 and dtype is torch.float16 and operand == "wide range":
        x = x.clamp(-6e4, 6e4)  # (float16 holds no larger value: torch and the kernel would both read inf)
    q, amax = _cast(x, CASTS[cast])
    for i, row in enumerate(_rows(rows)):
        def fold(row: torch.Tensor = row) -> torch.Tensor:
            out = row.clone()
            fold_cast_stats(out, x, q, amax)
            return out

        calls = kernel_spy.calls["record_cast"]
        ours, theirs = both(fold, monkeypatch)
        assert kernel_spy.calls["record_cast"] == calls + 1
        assert _same(ours, theirs), (i, ours.tolist(), theirs.tolist())


def test_a_previous_amax_is_judged_in_the_operands_dtype(kernel_spy, monkeypatch):
    """bfloat16 |x| = 1.0078125 against a previous amax of 1.005: torch compares in bfloat16,
    where 1.005 rounds to 1.0078125 (not above it)."""
    x = torch.full((4, 32), 1.0078125, dtype=torch.bfloat16)
    q, amax = _cast(x, CASTS["e4m3 tensor"])
    ours, theirs = both(lambda: _folded(torch.tensor([0.0, 0.0, 0.0, 0.0, 1.005]), x, q, amax), monkeypatch)
    assert ours[1] == theirs[1] == 0.0 and kernel_spy.calls["record_cast"] == 1


def _folded(row: torch.Tensor, x: torch.Tensor, q: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    out = row.clone()
    fold_cast_stats(out, x, q, amax)
    return out


def test_the_torch_code_serves_where_the_kernel_must_not(kernel_spy, monkeypatch):
    x = _plain(8, 0)
    q, amax = _cast(x, CASTS["e4m3 tensor"])
    row = torch.zeros(5)
    with FakeTensorMode() as mode:  # a subclass with its own dispatch
        fake = mode.from_tensor(x)
        fold_cast_stats(mode.from_tensor(row), fake, mode.from_tensor(q), mode.from_tensor(amax))
    fold_cast_stats(torch.zeros(5, dtype=torch.float64), x, q, amax)  # a row of another dtype
    fold_cast_stats(torch.zeros(5), x, q[:4], amax)  # codes of another size
    monkeypatch.setenv("MIXPREC_NATIVE_KERNELS", "0")
    fold_cast_stats(torch.zeros(5), x, q, amax)
    assert kernel_spy.calls["record_cast"] == 0


def test_a_strided_operand_and_a_gradient_are_folded_as_their_values(kernel_spy, monkeypatch):
    x = _plain(40, 3).t()  # (not contiguous)
    w = torch.randn(8, 32, requires_grad=True)
    for operand in (x, w):
        q, amax = _cast(operand.detach(), CASTS["e5m2 row"])
        ours, theirs = both(lambda: _folded(torch.zeros(5), operand, q, amax), monkeypatch)
        assert _same(ours, theirs)
    assert kernel_spy.calls["record_cast"] == 2


def test_a_fold_counts_as_an_in_place_write_of_the_window(kernel_spy):
    """The kernel writes the row in place as torch's ``copy_`` does: the window's version moves
    (what the non-finite tracer reads to know an fp8 layer recorded its casts)."""
    x = _plain(8, 0)
    q, amax = _cast(x, CASTS["e4m3 tensor"])
    window = torch.zeros(3, 5)
    before = window._version
    fold_cast_stats(window[1], x, q, amax)
    assert kernel_spy.calls["record_cast"] == 1 and window._version > before and window[1, 0] == amax
