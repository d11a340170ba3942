"""Stochastic rounding: neighbours only, unbiased, reproducible, right at the edges."""

import math

import pytest
import torch

from mixprec.optim import stochastic_round_
from mixprec.optim.rounding import round_into_

LOW = [torch.bfloat16, torch.float16]


def _neighbours(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The representable values of ``dtype`` just below and above each element of ``x``."""
    near = x.to(dtype)
    inf = torch.full_like(near, math.inf)
    up = torch.where(near.float() < x, torch.nextafter(near, inf), near)
    down = torch.where(near.float() > x, torch.nextafter(near, -inf), near)
    return down.float(), up.float()


def _samples(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4000, generator=g) * torch.logspace(-6, 4, 4000)
    if dtype == torch.float16:  # include the float16 subnormal range and its boundary
        x = torch.cat([x, torch.randn(2000, generator=g) * 2.0**-16, torch.tensor([2.0**-14, -(2.0**-14)])])
    return x


@pytest.mark.parametrize("dtype", LOW)
def test_result_is_one_of_the_two_neighbours(dtype):
    x = _samples(dtype)
    down, up = _neighbours(x, dtype)
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        out = stochastic_round_(torch.empty_like(x, dtype=dtype), x, g).float()
        assert torch.all((out == down) | (out == up))


@pytest.mark.parametrize("dtype", LOW)
def test_representable_values_are_unchanged(dtype):
    x = _samples(dtype).to(dtype).float()
    out = stochastic_round_(torch.empty_like(x, dtype=dtype), x)
    assert torch.equal(out.float(), x)


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("value", [1.0 + 2.0**-12, -3.3, 1e-3, 7.77e-6])
def test_unbiased(dtype, value):
    n = 200_000
    x = torch.full((n,), value)
    down, up = (t[0].item() for t in _neighbours(x[:1], dtype))
    out = stochastic_round_(torch.empty(n, dtype=dtype), x, torch.Generator().manual_seed(2)).float()
    p_up = (value - down) / (up - down)
    frac_up = (out == up).float().mean().item()
    assert abs(frac_up - p_up) < 5 * math.sqrt(p_up * (1 - p_up) / n) + 1e-9
    assert set(out.unique().tolist()) <= {down, up}


@pytest.mark.parametrize("dtype", LOW)
def test_generator_makes_it_reproducible(dtype):
    x = torch.randn(1000)
    a = stochastic_round_(torch.empty(1000, dtype=dtype), x, torch.Generator().manual_seed(3))
    b = stochastic_round_(torch.empty(1000, dtype=dtype), x, torch.Generator().manual_seed(3))
    c = stochastic_round_(torch.empty(1000, dtype=dtype), x, torch.Generator().manual_seed(4))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


@pytest.mark.parametrize("dtype", LOW)
def test_nan_and_inf(dtype):
    x = torch.tensor([math.nan, math.inf, -math.inf, -0.0, 0.0])
    x = torch.cat([x, torch.tensor([0x7F800001], dtype=torch.int32).view(torch.float32)])  # sNaN
    out = stochastic_round_(torch.empty(6, dtype=dtype), x)
    assert out[0].isnan() and out[5].isnan()
    assert out[1] == math.inf and out[2] == -math.inf
    assert out[3] == 0 and out[4] == 0


# (dtype, largest finite value, its gap: inf stands for the next neighbour, max + gap)
OVERFLOW_CASES = [(torch.float16, 65504.0, 32.0), (torch.bfloat16, 3.3895313892515355e38, 2.0**120)]


@pytest.mark.parametrize("dtype,top,gap", OVERFLOW_CASES)
def test_overflow_rounds_to_inf_with_probability_proportional_to_the_distance(dtype, top, gap):
    """Above the largest finite value, inf is the upper neighbour (max + one gap): 65514 becomes
    inf 31% of the time, where rounding to nearest gives 65504 (inf only from 65520 up)."""
    x = torch.full((100_000,), top + 0.3125 * gap)
    out = stochastic_round_(torch.empty(100_000, dtype=dtype), x, torch.Generator().manual_seed(0)).float()
    assert set(out.unique().tolist()) == {top, math.inf}
    assert abs((out == math.inf).float().mean().item() - 0.3125) < 0.01
    assert x.to(dtype).float()[0].item() == top  # to nearest: finite


@pytest.mark.parametrize("dtype", LOW)
def test_random_numbers_are_drawn_in_storage_order(dtype):
    """A channels-last destination draws one number per element in storage order, as mixprec's
    C++ kernel does: the same bits as rounding its storage, flattened, with the same generator."""
    x = torch.randn(4, 6, 5, 3).to(memory_format=torch.channels_last) * 1e-3 + 1
    dst = torch.empty_like(x, dtype=dtype)
    stochastic_round_(dst, x, torch.Generator().manual_seed(0))
    flat = torch.empty(x.numel(), dtype=dtype)
    stochastic_round_(flat, x.permute(0, 2, 3, 1).reshape(-1), torch.Generator().manual_seed(0))
    assert dst.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(dst.permute(0, 2, 3, 1).reshape(-1), flat)


def test_float32_target_is_a_copy_and_source_is_untouched():
    x = torch.randn(10)
    x0 = x.clone()
    dst = torch.empty(10)
    assert torch.equal(stochastic_round_(dst, x), x0)
    assert torch.equal(x, x0)


def test_round_into_nearest():
    x = torch.tensor([1.0 + 2.0**-12])
    assert round_into_(torch.empty(1, dtype=torch.bfloat16), x, stochastic=False).item() == 1.0


def test_errors():
    with pytest.raises(TypeError, match="float32 source"):
        stochastic_round_(torch.empty(2, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.float64))
    with pytest.raises(TypeError, match="bfloat16/float16"):
        stochastic_round_(torch.empty(2, dtype=torch.int32), torch.zeros(2))
    with pytest.raises(ValueError, match="shape"):
        stochastic_round_(torch.empty(3, dtype=torch.bfloat16), torch.zeros(2))


def test_optimizer_stochastic_updates_are_unbiased_and_seeded():
    """SGD moves bf16 ones by lr per step, 1/16 of a gap: nearest never moves, stochastic rounding
    moves the mean by exactly the fp32 amount (within 5 standard errors)."""
    from mixprec.optim import SGD

    def run(compensation, seed):
        w = torch.ones(20_000, dtype=torch.bfloat16, requires_grad=True)
        opt = SGD([w], lr=2.0**-12, compensation=compensation, generator=torch.Generator().manual_seed(seed))
        for _ in range(10):
            w.grad = torch.ones_like(w)
            opt.step()
        return w.detach()

    expected = 1.0 - 10 * 2.0**-12
    assert torch.all(run(None, 0) == 1.0)
    a = run("stochastic", 0)
    stderr = (10 * 2.0**-18) ** 0.5 / 20_000**0.5  # per-step variance <= (gap / 2) ** 2, gap 2**-8
    assert abs(a.float().mean().item() - expected) < 5 * stderr
    assert torch.equal(a, run("stochastic", 0))
    assert not torch.equal(a, run("stochastic", 1))
