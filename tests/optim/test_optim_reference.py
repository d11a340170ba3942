"""mixprec.optim.AdamW/SGD against torch.optim, and their contract across dtypes and options."""

import io

import pytest
import torch

import mixprec
from mixprec.optim import SGD, AdamW

COMPENSATIONS = [None, "kahan", "exact", "stochastic"]

ADAMW_CASES = [
    {},
    dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
    dict(lr=3e-3, amsgrad=True, weight_decay=0.0),
    dict(lr=1e-2, maximize=True),
]
SGD_CASES = [
    {},
    dict(lr=1e-2, momentum=0.9),
    dict(lr=1e-2, momentum=0.9, dampening=0.3, weight_decay=1e-2),
    dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-2, maximize=True),
]
PAIRS = [(AdamW, torch.optim.AdamW, c) for c in ADAMW_CASES] + [(SGD, torch.optim.SGD, c) for c in SGD_CASES]
IDS = [f"{ours.__name__}-{i}" for i, (ours, _, _) in enumerate(PAIRS)]


def _params(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(7, 5, generator=g, dtype=dtype).requires_grad_(), torch.randn(5, generator=g, dtype=dtype).requires_grad_()]


def _grads(step, params):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g, dtype=p.dtype) for p in params]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("compensation", COMPENSATIONS)
@pytest.mark.parametrize("ours,theirs,kwargs", PAIRS, ids=IDS)
def test_matches_torch_on_wide_params(ours, theirs, kwargs, compensation, dtype):
    a, b = _params(dtype), _params(dtype)
    opt_a = ours(a, compensation=compensation, **kwargs)
    opt_b = theirs(b, **kwargs)
    for step in range(6):
        for p, q, g in zip(a, b, _grads(step, a)):
            p.grad, q.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
    for p, q in zip(a, b):
        torch.testing.assert_close(p, q, rtol=0, atol=0)  # same arithmetic, same order
    for p, q in zip(a, b):
        for key, value in opt_b.state[q].items():
            torch.testing.assert_close(opt_a.state[p][key], value, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("compensation", COMPENSATIONS)
@pytest.mark.parametrize("ours,theirs,kwargs", PAIRS, ids=IDS)
def test_low_precision_tracks_fp32(ours, theirs, kwargs, compensation, dtype):
    """Every option keeps low-precision params close to the fp32 run, dtypes and grads intact."""
    if compensation == "exact" and dtype == torch.float16:
        pytest.skip("exact is for bfloat16 (float16 raises: test_optim_exact.py)")
    ref = _params(torch.float32)
    low = [p.detach().to(dtype).requires_grad_() for p in ref]
    opt_ref = theirs(ref, **kwargs)
    opt = ours(low, compensation=compensation, generator=torch.Generator().manual_seed(0), **kwargs)
    for step in range(5):
        grads = _grads(step, ref)
        for p, q, g in zip(low, ref, grads):
            p.grad, q.grad = g.to(dtype), g.clone()
        kept = [p.grad.clone() for p in low]
        opt.step()
        opt_ref.step()
        for p, g in zip(low, kept):
            assert torch.equal(p.grad, g)  # gradients are never scratch space
    eps = torch.finfo(dtype).eps
    for p, q in zip(low, ref):
        assert p.dtype == dtype
        comp = opt.state[p].get("kahan_comp")
        value = p.float() + (comp.float() if comp is not None else 0)
        if compensation == "exact":
            value = p.float().view(torch.int32).add(opt.state[p]["low_bits"]).view(torch.float32)
        torch.testing.assert_close(value, q, rtol=4 * eps, atol=4 * eps * q.abs().max().item())
        state = opt.state[p]
        assert ("kahan_comp" in state) == (compensation == "kahan")
        assert ("low_bits" in state) == (compensation == "exact")
        if compensation == "kahan":
            assert state["kahan_comp"].dtype == dtype
        for key in ("exp_avg", "exp_avg_sq", "momentum_buffer"):
            if key in state:
                assert state[key].dtype == torch.float32


@pytest.mark.parametrize("cls,kwargs", [(AdamW, dict(amsgrad=True)), (SGD, dict(momentum=0.9))])
def test_state_dtype_is_respected(cls, kwargs):
    p = torch.randn(4, 4, dtype=torch.bfloat16, requires_grad=True)
    opt = cls([p], state_dtype=torch.bfloat16, compensation=None, **kwargs)  # moments only
    p.grad = torch.randn(4, 4, dtype=torch.bfloat16)
    opt.step()
    opt.step()
    tensors = {k: v for k, v in opt.state[p].items() if k != "step"}
    assert tensors and all(v.dtype == torch.bfloat16 for v in tensors.values())


ROUND_TRIP_CASES = [
    (AdamW, dict(lr=1e-2, amsgrad=True)),
    (AdamW, dict(lr=1e-2, amsgrad=True, state_dtype="8bit")),
    (AdamW, dict(lr=1e-2, state_dtype=torch.bfloat16)),
    (SGD, dict(lr=1e-2, momentum=0.9)),
]


@pytest.mark.parametrize("compensation", COMPENSATIONS)
@pytest.mark.parametrize("cls,kwargs", ROUND_TRIP_CASES)
def test_state_dict_round_trip(cls, kwargs, compensation):
    def make():
        params = [p.detach().to(torch.bfloat16).requires_grad_() for p in _params(torch.float32)]
        params.append(torch.randn(64, 70).bfloat16().requires_grad_())  # large enough for 8-bit
        return params, cls(
            [{"params": params[:1]}, {"params": params[1:], "lr": 3e-3}],
            compensation=compensation,
            generator=torch.Generator().manual_seed(0),
            **kwargs,
        )

    a, opt_a = make()
    for step in range(3):
        for p, g in zip(a, _grads(step, a)):
            p.grad = g
        opt_a.step()
    buf = io.BytesIO()
    torch.save({"params": [p.detach() for p in a], "opt": opt_a.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf)
    b, opt_b = make()
    with torch.no_grad():
        for p, s in zip(b, ckpt["params"]):
            p.copy_(s)
    assert "generator_state" in ckpt["opt"]
    opt_b.generator.manual_seed(123)  # the checkpoint restores the generator
    opt_b.load_state_dict(ckpt["opt"])
    assert opt_b.param_groups[1]["lr"] == 3e-3
    for p, q in zip(a, b):
        for key, value in opt_a.state[p].items():
            assert opt_b.state[q][key].dtype == value.dtype
            assert torch.equal(opt_b.state[q][key], value)
    for step in range(3, 5):
        for p, q, g in zip(a, b, _grads(step, a)):
            p.grad, q.grad = g, g.clone()
        opt_a.step()
        opt_b.step()
    for p, q in zip(a, b):
        assert torch.equal(p, q)


def test_loads_a_torch_checkpoint_keeping_fp32_moments():
    ref = _params(torch.float32)
    torch_opt = torch.optim.AdamW(ref, lr=1e-2)
    for step in range(3):
        for p, g in zip(ref, _grads(step, ref)):
            p.grad = g
        torch_opt.step()
    low = [p.detach().to(torch.bfloat16).requires_grad_() for p in ref]
    opt = AdamW(low, lr=1e-2, compensation="kahan")
    opt.load_state_dict(torch_opt.state_dict())
    assert opt.param_groups[0]["compensation"] == "kahan"
    for p, q in zip(low, ref):
        assert opt.state[p]["exp_avg"].dtype == torch.float32
        assert torch.equal(opt.state[p]["exp_avg"], torch_opt.state[q]["exp_avg"])


def test_closure_and_param_without_grad():
    p = torch.randn(3, requires_grad=True)
    frozen = torch.randn(3, requires_grad=True)
    frozen0 = frozen.detach().clone()
    opt = AdamW([p, frozen], lr=0.1)

    def closure():
        opt.zero_grad()
        loss = (p**2).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert loss.item() > 0
    assert torch.equal(frozen, frozen0)
    assert "step" not in opt.state[frozen]


def test_tensor_lr_and_scheduler():
    p = torch.randn(3, dtype=torch.bfloat16, requires_grad=True)
    opt = SGD([p], lr=torch.tensor(0.5), compensation="kahan")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.5**epoch)
    p.grad = torch.ones(3, dtype=torch.bfloat16)
    before = p.detach().clone()
    opt.step()
    sched.step()
    assert torch.allclose(p.float(), before.float() - 0.5, atol=1e-2)
    assert float(opt.param_groups[0]["lr"]) == 0.25


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda p: AdamW(p, compensation="kahn"), "compensation"),
        (lambda p: SGD(p, state_dtype=torch.int8), "state_dtype"),
        (lambda p: SGD(p, state_dtype="8bit"), "state_dtype"),
        (lambda p: AdamW(p, state_dtype=torch.float16), "exp_avg_sq.*bfloat16.*8bit"),
        (lambda p: AdamW(p, state_dtype=torch.float8_e4m3fn), "exp_avg_sq"),
        (lambda p: AdamW([{"params": p, "state_dtype": torch.float8_e5m2}]), "exp_avg_sq"),
        (lambda p: SGD(p, state_dtype=torch.float8_e4m3fn), "momentum"),
        (lambda p: AdamW(p, lr=-1.0), "learning rate"),
        (lambda p: AdamW(p, betas=(1.0, 0.9)), "beta"),
        (lambda p: SGD(p, nesterov=True), "Nesterov"),
        (lambda p: SGD([{"params": p, "compensation": "bogus"}]), "compensation"),
    ],
)
def test_invalid_options(make, match):
    with pytest.raises(ValueError, match=match):
        make([torch.randn(2, requires_grad=True)])


def test_invalid_generator_and_sparse_grad():
    with pytest.raises(TypeError, match="Generator"):
        AdamW([torch.randn(2, requires_grad=True)], generator=0)
    p = torch.randn(3, requires_grad=True)
    p.grad = torch.zeros(3).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        SGD([p]).step()


def test_exports():
    assert mixprec.optim.AdamW is AdamW and mixprec.optim.SGD is SGD
    assert set(mixprec.optim.__all__) == {"AdamW", "SGD", "stochastic_round_"}
    opt = AdamW([torch.randn(2, requires_grad=True)])
    ref = torch.optim.AdamW([torch.randn(2, requires_grad=True)])
    for key in ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize"):
        assert opt.defaults[key] == ref.defaults[key]
    sgd, ref = SGD([torch.randn(2, requires_grad=True)]), torch.optim.SGD([torch.randn(2, requires_grad=True)])
    for key in ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize"):
        assert sgd.defaults[key] == ref.defaults[key]


def test_torch_loads_our_state_dict():
    ours = _params(torch.float32)
    opt = AdamW(ours, lr=1e-2, compensation="stochastic", generator=torch.Generator().manual_seed(0))
    for p, g in zip(ours, _grads(0, ours)):
        p.grad = g
    opt.step()
    theirs = _params(torch.float32)
    torch_opt = torch.optim.AdamW(theirs, lr=1e-2)
    torch_opt.load_state_dict(opt.state_dict())
    for p, q in zip(ours, theirs):
        assert torch.equal(torch_opt.state[q]["exp_avg"], opt.state[p]["exp_avg"])
