"""fused=True on the CPU: mixprec's one-pass C++ kernel against torch's fused kernels.

The kernel is the working-copy path (torch's ``_fused_adamw_``/``_fused_sgd_`` on float32 copies
of the parameters) in one pass. It reproduces torch's vectorized arithmetic; torch rounds the
last ``numel % 16`` elements of a tensor (its scalar tail) slightly differently, so the working
copies compute a tail as a vector of its own, and the two agree bitwise on every size.
"""

import pytest
import torch

import mixprec
import mixprec.optim._fused as fused
from mixprec import _native
from mixprec.optim import SGD, AdamW
from mixprec.optim.exact import exact_value

from _optim_cases import assert_same, train

WHOLE = [(48, 32), (64,), (16, 3)]  # numel % 16 == 0
TAILS = [(37, 5), (9,), (3,)]


@pytest.fixture(scope="module")
def ops(request):
    if _native.cpu_capability() not in ("AVX512", "AVX2"):
        pytest.skip(f"the kernel serves x86 AVX2/AVX-512 CPUs; this one is {_native.cpu_capability()}")
    request.getfixturevalue("native_ops")  # skips without the C++ kernels (fails in CI)
    ops = fused.native_ops()
    assert ops is not None, "the kernel disagrees with this torch build's fused kernels"
    return ops


class Counting:
    """The kernels, counting the parameters each step hands them."""

    def __init__(self, ops):
        self.ops, self.params = ops, 0

    def adamw_step(self, params, *args):
        self.params += len(params)
        return self.ops.adamw_step(params, *args)

    def sgd_step(self, params, *args):
        self.params += len(params)
        return self.ops.sgd_step(params, *args)


@pytest.fixture
def counted(ops, monkeypatch):
    """The kernels, through a counter: tests check that the kernel did the work."""
    counter = Counting(ops)
    monkeypatch.setattr(fused, "native_ops", lambda: counter)
    return counter


@pytest.fixture
def working_copies(monkeypatch):
    """Run the reference: the working-copy path (torch's fused kernels on float32 copies)."""
    def use():
        monkeypatch.setattr(fused, "native_ops", lambda: None)
    return use


ADAMW_CASES = [
    dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
    dict(lr=3e-3, amsgrad=True, weight_decay=0.0, maximize=True),
    dict(lr=1e-3, betas=(0.3, 0.9)),  # lerp weight above 0.5: the other lerp formula
]
SGD_CASES = [
    dict(lr=1e-2, momentum=0.9, dampening=0.3, weight_decay=1e-2),
    dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-2, maximize=True),
    dict(lr=1e-2, weight_decay=1e-2),
    dict(lr=1e-2),
]
# (parameter dtype, gradient dtype, compensation): what the kernel takes
RECIPES = [
    (torch.bfloat16, torch.bfloat16, "exact"),
    (torch.bfloat16, torch.float32, "exact"),
    (torch.bfloat16, torch.bfloat16, "kahan"),
    (torch.bfloat16, torch.bfloat16, None),
    (torch.float16, torch.float16, "kahan"),
    (torch.float16, torch.float32, None),
    (torch.bfloat16, torch.bfloat16, "stochastic"),
    (torch.bfloat16, torch.float32, "stochastic"),
]


def _run(cls, dtype, grad_dtype, shapes, steps=4, **kwargs):
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=g).to(dtype).requires_grad_() for s in shapes]
    return params, train(cls, params, grad_dtype=grad_dtype, steps=steps, fused=True, **kwargs)


def test_the_kernel_serves_this_machine(ops):
    assert fused._agrees_with_torch(ops)


@pytest.mark.parametrize("dtype,grad_dtype,compensation", RECIPES)
@pytest.mark.parametrize("kwargs", ADAMW_CASES)
def test_adamw_kernel_is_bitwise_the_working_copies(counted, working_copies, kwargs, dtype, grad_dtype, compensation):
    a, opt_a = _run(AdamW, dtype, grad_dtype, WHOLE, compensation=compensation, **kwargs)
    assert counted.params == 3 * 4 - 1  # every parameter, every step (one skips its first)
    working_copies()
    b, opt_b = _run(AdamW, dtype, grad_dtype, WHOLE, compensation=compensation, **kwargs)
    assert_same(a, opt_a, b, opt_b)


@pytest.mark.parametrize("compensation", ["exact", "stochastic", "kahan"])
@pytest.mark.parametrize("kwargs", ADAMW_CASES[:2])
def test_adamw_kernel_with_8bit_moments_is_bitwise_the_working_copies(counted, working_copies, kwargs, compensation):
    """8-bit moments (a 5,184-element parameter: 20 whole blocks and a partial one) dequantized,
    updated and quantized in the kernel, block by block: the working copies' codes and absmaxes."""
    shapes = [(81, 64), (48, 32), (64,)]  # the first has 8-bit moments, the others float32 ones
    a, opt_a = _run(AdamW, torch.bfloat16, torch.bfloat16, shapes, compensation=compensation,
                    state_dtype="8bit", **kwargs)
    assert opt_a.state[a[0]]["exp_avg"].dtype == torch.uint8
    assert counted.params == 3 * 4 - 1
    working_copies()
    b, opt_b = _run(AdamW, torch.bfloat16, torch.bfloat16, shapes, compensation=compensation,
                    state_dtype="8bit", **kwargs)
    assert_same(a, opt_a, b, opt_b)


@pytest.mark.parametrize("dtype,grad_dtype,compensation", RECIPES)
@pytest.mark.parametrize("kwargs", SGD_CASES)
def test_sgd_kernel_is_bitwise_the_working_copies(counted, working_copies, kwargs, dtype, grad_dtype, compensation):
    a, opt_a = _run(SGD, dtype, grad_dtype, WHOLE, compensation=compensation, **kwargs)
    assert counted.params == 3 * 4 - 1
    working_copies()
    b, opt_b = _run(SGD, dtype, grad_dtype, WHOLE, compensation=compensation, **kwargs)
    assert_same(a, opt_a, b, opt_b)


@pytest.mark.parametrize("cls,kwargs", [(AdamW, ADAMW_CASES[0]), (AdamW, ADAMW_CASES[1]), (SGD, SGD_CASES[0]),
                                        (SGD, SGD_CASES[1])])
def test_tails_are_bitwise_the_working_copies_too(ops, working_copies, cls, kwargs):
    """torch's scalar tail rounds the moments a little otherwise: the working copies compute the
    tail as a vector of its own (_fused.on_whole_vectors), so every bit agrees."""
    a, opt_a = _run(cls, torch.bfloat16, torch.bfloat16, TAILS, compensation="exact", **kwargs)
    working_copies()
    b, opt_b = _run(cls, torch.bfloat16, torch.bfloat16, TAILS, compensation="exact", **kwargs)
    assert_same(a, opt_a, b, opt_b)


@pytest.mark.parametrize("cls", [AdamW, SGD])
def test_loss_scaler_unscales_inside_the_kernel(counted, working_copies, cls):
    """torch.amp.GradScaler's fused protocol: the kernel unscales (and skips) as the working copies do."""
    def train():
        torch.manual_seed(0)
        model = mixprec.to_low_precision(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)))
        extra = dict(momentum=0.9) if cls is SGD else {}
        opt = cls(model.parameters(), lr=1e-2, compensation="exact", fused=True, **extra)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        for step in range(5):
            x = torch.randn(8, 16).bfloat16()
            loss = model(x).float().square().mean() * (float("inf") if step == 2 else 1.0)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()], scaler.get_scale()

    ours, scale = train()
    assert counted.params == 4 * 4  # 4 parameters, 4 steps not skipped
    working_copies()
    theirs, their_scale = train()
    assert scale == their_scale == 2.0**9  # the overflow step was skipped and the scale halved
    for p, q in zip(ours, theirs):
        assert torch.equal(p, q)


def test_what_the_kernel_cannot_take_keeps_the_working_copies(counted, working_copies):
    """fp32 and non-contiguous parameters, bf16 state, float16 stochastic rounding in one
    optimizer with parameters the kernel takes: each gets its own path, the random numbers come
    in the working-copy path's order, and the results are those of the working copies alone."""
    def run():
        g = torch.Generator().manual_seed(0)
        eligible = torch.randn(32, 16, generator=g).bfloat16().requires_grad_()
        strided = torch.randn(16, 32, generator=g).bfloat16().t().requires_grad_()
        full = torch.randn(64, generator=g).requires_grad_()
        rounded16 = torch.randn(64, generator=g).half().requires_grad_()
        rounded = torch.randn(64, generator=g).bfloat16().requires_grad_()  # draws after rounded16
        narrow = torch.randn(64, generator=g).bfloat16().requires_grad_()
        alone = torch.randn(64, generator=g).bfloat16().requires_grad_()
        opt = AdamW([{"params": [eligible, strided, full]},
                     {"params": [rounded16, rounded], "compensation": "stochastic"},
                     {"params": [narrow], "state_dtype": torch.bfloat16},
                     {"params": [alone], "compensation": "stochastic"}],
                    lr=1e-2, compensation="exact", fused=True, generator=torch.Generator().manual_seed(1))
        params = [eligible, strided, full, rounded16, rounded, narrow, alone]
        for step in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
            opt.step()
        return params, opt

    a, opt_a = run()
    assert not a[1].is_contiguous()
    assert counted.params == 2 * 3  # the contiguous bf16 exact parameter and the lone stochastic one
    working_copies()
    b, opt_b = run()
    assert_same(a, opt_a, b, opt_b)


def test_a_kernel_that_disagrees_with_torch_is_not_used(ops, monkeypatch):
    said = []
    monkeypatch.setattr(fused, "_checked", {})
    monkeypatch.setattr(fused, "_agrees_with_torch", lambda ops: False)
    monkeypatch.setattr(fused._log, "warning", lambda msg, *args: said.append(msg % args))
    assert fused.native_ops() is None
    assert len(said) == 1 and "float32 copies" in said[0]
    p = torch.randn(32).bfloat16().requires_grad_()
    p.grad = torch.ones(32).bfloat16()
    AdamW([p], compensation="exact", fused=True).step()  # still trains, through the working copies
    assert not torch.equal(p, torch.zeros(32).bfloat16())


def test_kernel_checks_its_inputs(ops):
    p = torch.zeros(32, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="dense CPU tensor laid out as the parameter"):
        ops.sgd_step([p], [torch.zeros(16)], [], [], [], 0.1, 0.0, 0.0, 0.0, False, False, None, 0, None)
    with pytest.raises(RuntimeError, match="need bfloat16 parameters"):
        ops.sgd_step([p.half()], [torch.zeros(32)], [], [torch.zeros(32, dtype=torch.int16)], [], 0.1, 0.0,
                     0.0, 0.0, False, False, None, 2, None)
    with pytest.raises(RuntimeError, match="moments must be float32"):
        ops.adamw_step([p], [p], [p], [p], [], [], [torch.tensor(1.0)], [], [], 1e-3, 0.9, 0.999, 1e-8, 0.0, False, False, None, 0, None)


@pytest.mark.parametrize("cls,kwargs", [(AdamW, ADAMW_CASES[0]), (SGD, SGD_CASES[0]), (SGD, SGD_CASES[1])])
def test_default_runs_the_kernel_for_low_precision_and_torch_for_fp32(counted, cls, kwargs):
    """fused=None, foreach=None: the kernel steps bf16 CPU parameters (as fused=True does, bitwise)
    and leaves float32 ones to torch's default arithmetic (bitwise torch.optim's)."""
    def run(**flags):
        g = torch.Generator().manual_seed(0)
        low = [torch.randn(s, generator=g).bfloat16().requires_grad_() for s in WHOLE]
        full = torch.randn(40, 3, generator=g).requires_grad_()
        opt = cls(low + [full], compensation="exact", **flags, **kwargs)
        for step in range(4):
            for p in low + [full]:
                p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
            opt.step()
        return low, full, opt

    low, full, opt = run()
    assert counted.params == 3 * 4
    fused_low, _, fused_opt = run(fused=True)
    for p, q in zip(low, fused_low):
        assert torch.equal(p, q) and torch.equal(opt.state[p]["low_bits"], fused_opt.state[q]["low_bits"])
    g = torch.Generator().manual_seed(0)
    [torch.randn(s, generator=g) for s in WHOLE]
    ref = torch.randn(40, 3, generator=g).requires_grad_()
    ref_opt = (torch.optim.AdamW if cls is AdamW else torch.optim.SGD)([ref], **kwargs)
    for step in range(4):
        for s in WHOLE:
            torch.randn(s, generator=g)
        ref.grad = torch.randn(ref.shape, generator=g)
        ref_opt.step()
    assert torch.equal(full, ref)


@pytest.mark.parametrize("flags", [dict(fused=False), dict(foreach=False), dict(foreach=True)])
def test_explicit_flags_keep_torch_arithmetic(counted, flags):
    p = torch.randn(64).bfloat16().requires_grad_()
    p.grad = torch.randn(64).bfloat16()
    AdamW([p], compensation="exact", **flags).step()
    SGD([p], momentum=0.9, compensation="exact", **flags).step()
    assert counted.params == 0


def test_default_sgd_creates_momentum_buffers_like_the_other_paths(counted):
    """The kernel's first step starts the buffer from the gradient; a bf16-state group in the same
    optimizer keeps torch's path and its own buffer dtype."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, generator=g).bfloat16().requires_grad_()
    b = torch.randn(64, generator=g).bfloat16().requires_grad_()
    opt = SGD([{"params": [a]}, {"params": [b], "state_dtype": torch.bfloat16}], lr=0.1, momentum=0.9,
              compensation="exact", generator=torch.Generator().manual_seed(1))
    a.grad, b.grad = torch.ones(64).bfloat16(), torch.ones(64).bfloat16()
    opt.step()
    assert counted.params == 1
    assert opt.state[a]["momentum_buffer"].dtype == torch.float32
    assert torch.equal(opt.state[a]["momentum_buffer"], torch.ones(64))
    assert opt.state[b]["momentum_buffer"].dtype == torch.bfloat16


@pytest.mark.parametrize("compensation", ["exact", "kahan", "stochastic"])
def test_threads_split_large_tensors_without_changing_a_bit(counted, working_copies, compensation):
    """A 200K-element tensor spans several parallel chunks (and two random-bit chunks): two
    threads give the working copies' bits."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        a, opt_a = _run(AdamW, torch.bfloat16, torch.bfloat16, [(400, 512), (64,)], steps=2,
                        compensation=compensation, lr=1e-2, weight_decay=0.1)
        assert counted.params == 2 * 2 - 1
        working_copies()
        b, opt_b = _run(AdamW, torch.bfloat16, torch.bfloat16, [(400, 512), (64,)], steps=2,
                        compensation=compensation, lr=1e-2, weight_decay=0.1)
    finally:
        torch.set_num_threads(threads)
    assert_same(a, opt_a, b, opt_b)


@pytest.mark.parametrize("compensation", ["exact", "stochastic"])
@pytest.mark.parametrize("cls", [AdamW, SGD])
def test_channels_last_weights_run_the_kernel(counted, working_copies, cls, compensation):
    """A convolution's channels-last weight and its gradient are walked in storage order; the
    working copies draw stochastic rounding's random numbers in that order too."""
    def run():
        torch.manual_seed(0)
        conv = torch.nn.Conv2d(8, 16, 3).to(memory_format=torch.channels_last)
        model = mixprec.to_low_precision(conv)
        assert model.weight.is_contiguous(memory_format=torch.channels_last)
        assert not model.weight.is_contiguous()
        opt = cls(model.parameters(), lr=1e-2, compensation=compensation, fused=True,
                  **({"momentum": 0.9} if cls is SGD else {}))
        for _ in range(3):
            x = torch.randn(2, 8, 10, 10).bfloat16().to(memory_format=torch.channels_last)
            model(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        return list(model.parameters()), opt

    a, opt_a = run()
    assert counted.params == 2 * 3
    working_copies()
    b, opt_b = run()
    assert_same(a, opt_a, b, opt_b)


# (what is in a param group besides bf16 weights, AdamW options): stochastic rounding with
# parameters the kernel does not write (float32) or writes with other moments (8-bit, float32)
DRAW_ORDER_CASES = [
    ("a float32 parameter", dict(lr=1e-2)),
    ("8-bit and float32 moments interleaved", dict(lr=1e-2, state_dtype="8bit")),
    ("both, amsgrad", dict(lr=1e-2, state_dtype="8bit", amsgrad=True)),
]


@pytest.mark.parametrize("what,kwargs", DRAW_ORDER_CASES, ids=[c[0] for c in DRAW_ORDER_CASES])
@pytest.mark.parametrize("fused_flag", [None, True])
def test_stochastic_rounding_keeps_the_kernel_and_the_draw_order(counted, working_copies, what, kwargs, fused_flag):
    """A float32 parameter (a norm kept by to_low_precision) draws nothing: the bf16 weights of
    its group stay on the kernel (before: all went to the for-loop, 3x slower), and the kernel
    draws in parameter order where 8-bit (>= 4096 elements) and float32 moments alternate, as
    the working copies do (before: grouped by kind, other bits)."""
    def run():
        g = torch.Generator().manual_seed(0)
        dtypes = [torch.bfloat16, torch.bfloat16, torch.float32, torch.bfloat16, torch.bfloat16]
        shapes = [(16,), (48, 32), (8,), (81, 64), (64,)]
        params = [torch.randn(s, generator=g).to(d).requires_grad_() for s, d in zip(shapes, dtypes)]
        return params, train(AdamW, params, compensation="stochastic", fused=fused_flag, **kwargs)

    a, opt_a = run()
    assert counted.params == 4 * 4 - 1  # every bf16 parameter, every step
    working_copies()
    b, opt_b = run()
    assert_same(a, opt_a, b, opt_b)


def _transposed(dtype):
    return torch.randn(32, 8, generator=torch.Generator().manual_seed(0)).to(dtype).t()


def _strided(dtype):
    return torch.randn(8, 64, generator=torch.Generator().manual_seed(0)).to(dtype)[:, ::2]


# (parameter, how it is laid out): torch's fused kernel walks storage order
LAYOUT_CASES = [
    ("bf16 transposed, contiguous grad", lambda: _transposed(torch.bfloat16)),
    ("fp32 transposed, contiguous grad", lambda: _transposed(torch.float32)),
    ("fp32 non-dense (a strided view)", lambda: _strided(torch.float32)),
    ("bf16 non-dense (a strided view)", lambda: _strided(torch.bfloat16)),
]


@pytest.mark.parametrize("what,make", LAYOUT_CASES, ids=[c[0] for c in LAYOUT_CASES])
@pytest.mark.parametrize("cls,torch_cls,kwargs", [
    (AdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    (SGD, torch.optim.SGD, dict(lr=1e-2, momentum=0.9, weight_decay=1e-2)),
])
def test_fused_walks_gradients_laid_out_unlike_the_parameter(what, make, cls, torch_cls, kwargs):
    """fused=True with a gradient whose strides are not the parameter's (or a non-dense
    parameter): bitwise torch's fused optimizer on contiguous float32 copies (torch's own
    fused=True mixes up the elements there: 2.3 off after one SGD step)."""
    p = make().requires_grad_()
    ref = p.detach().float().contiguous().requires_grad_()
    opt = cls([p], compensation="exact", fused=True, **kwargs)
    ref_opt = torch_cls([ref], fused=True, **kwargs)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)  # contiguous
        ref.grad = p.grad.float()
        opt.step()
        ref_opt.step()
    value = exact_value(p, opt.state[p]["low_bits"]) if p.dtype == torch.bfloat16 else p.detach()
    assert torch.equal(value, ref.detach())


@pytest.mark.slow
def test_float32_training_never_builds_the_kernel():
    """Only low-precision CPU parameters need the kernel: fp32 training does not build or load it."""
    import subprocess
    import sys

    code = (
        "import torch, mixprec\n"
        "from mixprec import _native\n"
        "p = torch.randn(8, requires_grad=True); p.grad = torch.randn(8)\n"
        "for opt in (mixprec.optim.AdamW([p]), mixprec.optim.SGD([p], momentum=0.9), mixprec.optim.AdamW([p], fused=True)):\n"
        "    opt.step()\n"
        "print(sorted(_native._state))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
