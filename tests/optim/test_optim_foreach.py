"""The multi-tensor (foreach) paths of mixprec.optim: bitwise the per-tensor ones, for every recipe."""

import pytest
import torch

import mixprec.optim._chunks
from mixprec.optim import SGD, AdamW

from _optim_cases import assert_same, train


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """CPU chunks of 4096 elements: the tests' 40K-element tensor crosses 9 chunk boundaries."""
    monkeypatch.setattr(mixprec.optim._chunks, "CPU_CHUNK", 4096)

ADAMW_CASES = [
    dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
    dict(lr=3e-3, amsgrad=True, weight_decay=0.0, maximize=True),
]
SGD_CASES = [
    dict(lr=1e-2, momentum=0.9, dampening=0.3, weight_decay=1e-2),
    dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-2, maximize=True),
    dict(lr=1e-2),
]
# (param dtype, compensation, state_dtype): every recipe the optimizers offer
ADAMW_RECIPES = [
    (torch.float32, None, None),
    (torch.float64, None, torch.float32),
    (torch.float64, "exact", "8bit"),
    (torch.bfloat16, None, None),
    (torch.bfloat16, "kahan", None),
    (torch.bfloat16, "exact", None),
    (torch.bfloat16, "stochastic", None),
    (torch.bfloat16, "stochastic", torch.bfloat16),
    (torch.bfloat16, "stochastic", "8bit"),
    (torch.bfloat16, "exact", "8bit"),
    (torch.float16, "kahan", torch.bfloat16),
    (torch.float16, "stochastic", None),
]
SGD_RECIPES = [
    (torch.float32, None, None),
    (torch.bfloat16, "kahan", None),
    (torch.bfloat16, "exact", None),
    (torch.bfloat16, "stochastic", torch.bfloat16),
    (torch.float16, "stochastic", torch.float16),
]


def _params(dtype):
    g = torch.Generator().manual_seed(0)
    shapes = [(200, 201), (7, 5), (5,)]  # the first: 8-bit state, CPU chunks and a tail
    return [torch.randn(s, generator=g).to(dtype).requires_grad_() for s in shapes]


def _run(cls, dtype, foreach, steps=4, late=True, **kwargs):
    params = _params(dtype)
    return params, train(cls, params, steps=steps, late=late, foreach=foreach, **kwargs)


@pytest.mark.parametrize("dtype,compensation,state_dtype", ADAMW_RECIPES)
@pytest.mark.parametrize("kwargs", ADAMW_CASES)
def test_adamw_foreach_is_bitwise_per_tensor(kwargs, dtype, compensation, state_dtype):
    a, opt_a = _run(AdamW, dtype, False, compensation=compensation, state_dtype=state_dtype, **kwargs)
    b, opt_b = _run(AdamW, dtype, True, compensation=compensation, state_dtype=state_dtype, **kwargs)
    assert_same(a, opt_a, b, opt_b)
    if state_dtype == "8bit":
        assert opt_a.state[a[0]]["exp_avg"].dtype == torch.uint8  # the 8-bit path was exercised


@pytest.mark.parametrize("dtype,compensation,state_dtype", SGD_RECIPES)
@pytest.mark.parametrize("kwargs", SGD_CASES)
def test_sgd_foreach_is_bitwise_per_tensor(kwargs, dtype, compensation, state_dtype):
    a, opt_a = _run(SGD, dtype, False, compensation=compensation, state_dtype=state_dtype, **kwargs)
    b, opt_b = _run(SGD, dtype, True, compensation=compensation, state_dtype=state_dtype, **kwargs)
    assert_same(a, opt_a, b, opt_b)


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize(
    "ours,theirs,kwargs",
    [(AdamW, torch.optim.AdamW, c) for c in ADAMW_CASES] + [(SGD, torch.optim.SGD, c) for c in SGD_CASES],
)
def test_fp32_is_bitwise_torch(ours, theirs, kwargs, foreach):
    """Chunked or not, foreach or not: on fp32 parameters, torch's own results, bitwise."""
    a, opt_a = _run(ours, torch.float32, foreach, **kwargs)
    b = _params(torch.float32)
    opt_b = theirs([{"params": b[:1]}, {"params": b[1:], "lr": 3e-3}], foreach=foreach, **kwargs)
    for step in range(4):
        g = torch.Generator().manual_seed(100 + step)
        for i, p in enumerate(b):
            p.grad = None if (step == 0 and i == 2) else torch.randn(p.shape, generator=g)
        opt_b.step()
    for p, q in zip(a, b):
        assert torch.equal(p, q)
        for key, value in opt_b.state[q].items():
            assert torch.equal(opt_a.state[p][key], value)


def test_foreach_defaults_as_torch():
    """``foreach=None`` is torch's default (None, resolved per step: off on the CPU)."""
    p = [torch.randn(3, requires_grad=True)]
    assert AdamW(p).defaults["foreach"] is torch.optim.AdamW(p).defaults["foreach"] is None
    assert SGD(p).defaults["foreach"] is torch.optim.SGD(p).defaults["foreach"] is None
    assert not AdamW._uses_foreach(AdamW(p).param_groups[0])
    assert AdamW._uses_foreach(AdamW(p, foreach=True).param_groups[0])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compensation", [None, "kahan", "exact", "stochastic"])
def test_cuda_defaults_to_foreach_and_matches(compensation):
    def run(foreach):
        p = torch.randn(300, 7, device="cuda").bfloat16().requires_grad_()
        opt = AdamW([p], lr=1e-2, foreach=foreach, compensation=compensation,
                    generator=torch.Generator("cuda").manual_seed(0))
        for step in range(3):
            p.grad = torch.randn(300, 7, device="cuda", generator=torch.Generator("cuda").manual_seed(step)).bfloat16()
            opt.step()
        return p, opt

    assert AdamW._uses_foreach(run(None)[1].param_groups[0])
    assert torch.equal(run(None)[0], run(False)[0])


@pytest.mark.parametrize(
    "ours,theirs,kwargs",
    [(AdamW, torch.optim.AdamW, c) for c in ADAMW_CASES] + [(SGD, torch.optim.SGD, c) for c in SGD_CASES],
)
def test_fused_fp32_is_bitwise_torch_fused(ours, theirs, kwargs):
    late = ours is AdamW  # torch 2.13's fused SGD fails on a first gradient arriving late; ours does not
    a, opt_a = _run(ours, torch.float32, None, late=late, fused=True, **kwargs)
    b = _params(torch.float32)
    opt_b = theirs([{"params": b[:1]}, {"params": b[1:], "lr": 3e-3}], fused=True, **kwargs)
    for step in range(4):
        g = torch.Generator().manual_seed(100 + step)
        for i, p in enumerate(b):
            p.grad = None if (late and step == 0 and i == 2) else torch.randn(p.shape, generator=g)
        opt_b.step()
    for p, q in zip(a, b):
        assert torch.equal(p, q)
        for key, value in opt_b.state[q].items():
            assert torch.equal(opt_a.state[p][key], value)


@pytest.mark.parametrize("dtype,compensation,state_dtype", ADAMW_RECIPES)
def test_fused_recipes_track_foreach(dtype, compensation, state_dtype):
    """Every recipe runs fused: the last-bit differences of torch's fused kernel stay small."""
    kwargs = dict(compensation=compensation, state_dtype=state_dtype, **ADAMW_CASES[1])
    a, _ = _run(AdamW, dtype, None, fused=True, **kwargs)
    b, _ = _run(AdamW, dtype, True, **kwargs)
    for p, q in zip(a, b):
        assert p.dtype == q.dtype
        torch.testing.assert_close(p.double(), q.double(), rtol=0, atol=4 * torch.finfo(dtype).eps * q.abs().max().item())


@pytest.mark.parametrize("dtype,compensation,state_dtype", SGD_RECIPES)
@pytest.mark.parametrize("kwargs", SGD_CASES)
def test_fused_sgd_recipes_track_foreach(kwargs, dtype, compensation, state_dtype):
    a, _ = _run(SGD, dtype, None, fused=True, compensation=compensation, state_dtype=state_dtype, **kwargs)
    b, _ = _run(SGD, dtype, True, compensation=compensation, state_dtype=state_dtype, **kwargs)
    for p, q in zip(a, b):
        torch.testing.assert_close(p.double(), q.double(), rtol=0, atol=4 * torch.finfo(dtype).eps * q.abs().max().item())


@pytest.mark.parametrize("cls", [AdamW, SGD])
def test_fused_and_foreach_together_is_an_error(cls):
    with pytest.raises(ValueError, match="fused"):
        cls([torch.zeros(2, requires_grad=True)], fused=True, foreach=True)


@pytest.mark.parametrize("compensation,state_dtype", [(None, None), ("exact", "8bit"), ("stochastic", torch.bfloat16)])
def test_non_contiguous_parameters_are_walked_whole(compensation, state_dtype):
    """A transposed parameter (its gradient and state alike) is not chunked; results as above."""
    def run(foreach, dtype):
        p = torch.randn(120, 70, generator=torch.Generator().manual_seed(0)).to(dtype).t().requires_grad_()
        opt = AdamW([p], lr=1e-2, foreach=foreach, compensation=compensation, state_dtype=state_dtype,
                    generator=torch.Generator().manual_seed(1))
        for step in range(3):
            p.grad = torch.randn(120, 70, generator=torch.Generator().manual_seed(step)).to(dtype).t()
            opt.step()
        return p

    dtype = torch.float32 if compensation is None else torch.bfloat16
    a, b = run(False, dtype), run(True, dtype)
    assert not a.is_contiguous() and torch.equal(a, b)
    if compensation is None:
        ref = torch.randn(120, 70, generator=torch.Generator().manual_seed(0)).t().requires_grad_()
        opt = torch.optim.AdamW([ref], lr=1e-2)
        for step in range(3):
            ref.grad = torch.randn(120, 70, generator=torch.Generator().manual_seed(step)).t()
            opt.step()
        assert torch.equal(a, ref)


# (ours, torch's, options): the working-copy paths that batch units
ZERO_SIZE_CASES = [
    (AdamW, torch.optim.AdamW, dict(foreach=True)),
    (AdamW, torch.optim.AdamW, dict(fused=True)),
    (SGD, torch.optim.SGD, dict(foreach=True, momentum=0.9)),
    (SGD, torch.optim.SGD, dict(fused=True, momentum=0.9)),
]


@pytest.mark.parametrize("ours,theirs,kwargs", ZERO_SIZE_CASES)
def test_a_zero_element_parameter_first_in_a_group(ours, theirs, kwargs):
    """A zero-element first parameter left the first batch unopened (IndexError, after the step
    counters were incremented): now bitwise torch's, state included."""
    params = [torch.zeros(0, requires_grad=True), torch.ones(3, requires_grad=True), torch.ones(5, requires_grad=True)]
    ref = [p.detach().clone().requires_grad_() for p in params]
    opt, ref_opt = ours(params, lr=1e-2, **kwargs), theirs(ref, lr=1e-2, **kwargs)
    for step in range(3):
        for p, q in zip(params, ref):
            p.grad = torch.full_like(p, step - 0.5)
            q.grad = p.grad.clone()
        opt.step()
        ref_opt.step()
    for p, q in zip(params, ref):
        assert torch.equal(p, q)
        for key, value in ref_opt.state[q].items():
            assert torch.equal(opt.state[p][key], value), key
