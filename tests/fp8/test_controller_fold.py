"""A Controller step's loss-cost fold (``mixprec.control._fold.fold``): mixprec's C++ kernel
(``cost_fold``) against the torch code, bitwise, over windows and loss scales as data (ordinary
sums, steps without rows, non-finite and overflowing estimates, scales whose square rounds
differently in float32 and in double), and where the kernel must not serve."""

from __future__ import annotations

import math

import pytest
import torch

from _kernel_spy import both
from mixprec.control._fold import fold

SIGN = torch.tensor([-1.0, 1.0])  # (the own cost is taken at the error, the one below's without it)


def _windows() -> torch.Tensor:
    """Six layers' windows: per row the step's [sum(g * e), squares, rows], then the window's
    [sum, steps, sum of squares, index sum], the step sums of each layer a case of its own."""
    torch.manual_seed(0)
    c = torch.zeros(6, 2, 7)
    c[..., 3:] = torch.randn(6, 2, 4).abs() * torch.tensor([1e-3, 3.0, 1e-6, 1e-3])
    c[..., 4] = c[..., 4].round()
    c[0, :, :3] = torch.tensor([[2.5e-3, 4e-7, 512.0], [-1.25e-3, 9e-8, 128.0]])  # ordinary
    c[1, :, :3] = torch.tensor([[0.0, 0.0, 0.0], [1e-3, 1e-7, 64.0]])  # own row measured nothing
    c[2, :, :3] = torch.tensor([[math.inf, 1.0, 8.0], [math.nan, 1.0, 8.0]])  # overflowed gradients
    c[3, :, :3] = torch.tensor([[1e30, 3e38, 3e38], [-7e-4, 1e38, 1e3]])  # the estimate overflows
    c[4, :, :3] = torch.tensor([[1e-38, 1e-45, 1.0], [-0.0, 0.0, 2.0]])  # subnormal, signed zeros
    c[5, :, :3] = torch.randn(2, 3).abs() * torch.tensor([1e-3, 1e-6, 100.0])
    return c


SCALES = {
    "one": 1.0, "int": 7, "pow2": 65536.0, "odd": 3.7, "tiny": 3e-20, "huge": 1.3e19,
    "tensor": torch.tensor(4.0), "tensor-odd": torch.tensor(3.7), "tensor-tiny": torch.tensor(3e-20),
    "one-element": torch.tensor([1000.3]),
}


@pytest.mark.parametrize("scale", list(SCALES.values()), ids=list(SCALES))
def test_the_kernel_folds_bitwise_what_the_torch_code_does(scale, kernel_spy, monkeypatch):
    base = _windows()

    def run() -> torch.Tensor:
        c = base.clone()
        fold(c, scale, SIGN)
        return c

    served = kernel_spy.calls["cost_fold"]
    ours, torchs = both(run, monkeypatch)
    assert kernel_spy.calls["cost_fold"] == served + 1  # (the torch code's run takes no kernel)
    assert torch.equal(ours.view(torch.int32), torchs.view(torch.int32))
    assert ours[..., :3].eq(0).all() and torch.equal(ours[2, :, 4], base[2, :, 4])  # (non-finite: not counted)
    assert torch.equal(ours[1, 0, 3:], base[1, 0, 3:])  # (no rows: the window unchanged)


def test_the_squared_scale_rounds_as_torchs_scalar_or_tensor_arithmetic(kernel_spy, monkeypatch):
    """A Python scale is squared in double and rounded once (torch's scalar arithmetic), a scale
    tensor in float32: at 3.7 the two squares differ, and each fold keeps its own."""
    c = torch.zeros(1, 2, 7)
    c[0, :, :3] = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 1.0]])
    number, tensor = c.clone(), c.clone()
    fold(number, 3.7, SIGN)
    fold(tensor, torch.tensor(3.7), SIGN)
    assert kernel_spy.calls["cost_fold"] == 2
    assert torch.tensor(3.7) * torch.tensor(3.7) != torch.tensor(3.7 * 3.7)  # (the premise)
    assert not torch.equal(number, tensor)


@pytest.mark.parametrize("case", ["transposed", "float64-scale", "float64-windows"])
def test_where_the_kernel_does_not_serve_the_torch_code_folds(case, kernel_spy):
    base, scale = _windows(), 2.0
    if case == "transposed":
        base = base.transpose(0, 1).contiguous().transpose(0, 1)  # (the same values, not contiguous)
    elif case == "float64-scale":
        scale = torch.tensor(2.0, dtype=torch.float64)
    else:
        base = base.double()
    c, expected = base.clone(), base.clone()
    fold(c, scale, SIGN)
    assert kernel_spy.calls["cost_fold"] == 0
    with pytest.MonkeyPatch.context() as m:
        m.setenv("MIXPREC_NATIVE_KERNELS", "0")
        fold(expected, scale, SIGN)
    assert torch.equal(c, expected) and c.stride() == base.stride()
