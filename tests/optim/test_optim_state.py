"""Optimizer state in fewer bytes: 8-bit block-wise moments, bf16 moments, the owned generator."""

import io

import pytest
import torch

from mixprec.lowp import memory_bytes
from mixprec.optim import SGD, AdamW
from mixprec.optim.quant8 import BLOCK, Quantized8, dynamic_map, new_quantized8

from _models import mlp


@pytest.mark.parametrize("signed", [True, False])
def test_dynamic_map_is_bitsandbytes_and_torchao(signed):
    quant_utils = pytest.importorskip("torchao.optim.quant_utils")
    theirs = torch.tensor(quant_utils.create_dynamic_map(signed=signed), dtype=torch.float32)
    assert torch.equal(dynamic_map(signed), theirs)


@pytest.mark.parametrize("signed", [True, False])
def test_quantize_picks_the_nearest_code_per_block(signed):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, BLOCK + 17, generator=g) * torch.logspace(-6, 0, BLOCK + 17)
    x = x if signed else x.square()
    codes, absmax = new_quantized8(x, signed)
    q = Quantized8(codes, absmax, signed, x.shape)
    assert torch.equal(q.dequantize(), torch.zeros_like(x))  # zero-initialised
    q.quantize_(x)
    flat = torch.cat([x.reshape(-1), x.new_zeros(codes.numel() - x.numel())]).view(-1, BLOCK)
    assert torch.equal(absmax, flat.abs().amax(1))
    normalized = flat * absmax.reciprocal().unsqueeze(1)
    nearest = (normalized.reshape(-1, 1) - dynamic_map(signed)).abs().argmin(1)
    table = dynamic_map(signed)
    assert torch.equal(table[codes.long()], table[nearest])  # the nearest value (ties aside)
    y = q.dequantize()
    assert y.shape == x.shape and y.dtype == torch.float32
    assert ((y - x).norm() / x.norm()).item() < 0.02


def test_bf16_weights_with_8bit_state_cost_4_bytes_per_param():
    model = mlp(32, 128, 32, act=torch.nn.Tanh).bfloat16()
    opt = AdamW(model.parameters(), compensation="stochastic", state_dtype="8bit")
    model(torch.randn(4, 32).bfloat16()).float().sum().backward()
    opt.step()
    mem = memory_bytes(model, opt)
    assert (mem["params"] + mem["optimizer_state"]) / mem["numel"] <= 4.5
    assert opt.state[model[0].weight]["exp_avg"].dtype == torch.uint8
    assert opt.state[model[0].bias]["exp_avg"].dtype == torch.float32  # small: float32 moments


@pytest.mark.parametrize(
    "kwargs,state_bytes",
    [(dict(compensation="exact"), 10), (dict(compensation="kahan"), 10), (dict(compensation="stochastic"), 8),
     (dict(compensation="stochastic", state_dtype=torch.bfloat16), 4)],
)
def test_state_bytes_per_param(kwargs, state_bytes):
    """fp32 moments 8 bytes, exact's int16 low bits and Kahan's bf16 buffer 2 more, bf16 moments 4."""
    model = mlp(32, 128, 32, act=torch.nn.Tanh).bfloat16()
    opt = AdamW(model.parameters(), **kwargs)
    model(torch.randn(4, 32).bfloat16()).float().sum().backward()
    opt.step()
    mem = memory_bytes(model, opt)
    steps = 4 * len(list(model.parameters()))  # one float32 step counter per parameter
    assert mem["optimizer_state"] == state_bytes * mem["numel"] + steps


@pytest.mark.parametrize("state_dtype", ["8bit", torch.bfloat16])
def test_low_precision_state_trains_like_fp32_state(state_dtype):
    """bf16 weights with exact updates: 8-bit or bf16 moments end no more than 2% above the loss
    of float32 moments (the same bf16 forward, so only the state differs)."""
    g = torch.Generator().manual_seed(1)
    x, teacher = torch.randn(256, 32, generator=g), torch.randn(32, 32, generator=g)
    y = torch.tanh(x @ teacher).bfloat16()

    def train(state_dtype):
        model = mlp(32, 128, 32, act=torch.nn.Tanh).bfloat16()
        opt = AdamW(model.parameters(), lr=2e-3, compensation="exact", state_dtype=state_dtype)
        for _ in range(150):
            loss = torch.nn.functional.mse_loss(model(x.bfloat16()).float(), y.float())
            loss.backward()
            opt.step()
            opt.zero_grad()
        return loss.item()

    fp32_state, ours = train(None), train(state_dtype)
    assert ours / fp32_state < 1.02, (ours, fp32_state)


def test_bf16_moments_do_not_over_step():
    """Constant gradient, lr 2**-12: bf16 moments rounded to nearest stop growing exp_avg_sq and
    over-step by ~47% after 2000 steps; rounded stochastically, they move as float32's do."""
    def run(state_dtype):
        p = torch.zeros(2048, dtype=torch.bfloat16, requires_grad=True)
        opt = AdamW([p], lr=2**-12, weight_decay=0, compensation="exact", state_dtype=state_dtype)
        for _ in range(1000):
            p.grad = torch.ones_like(p)
            opt.step()
        return p.float().mean().item()

    assert abs(run(torch.bfloat16) / run(None) - 1) < 0.01


def test_own_generator_is_seeded_from_the_global_rng_and_resumes():
    def make():
        p = torch.randn(50, generator=torch.Generator().manual_seed(0)).bfloat16().requires_grad_()
        return p, SGD([p], lr=1e-3, momentum=0.9, compensation="stochastic")

    def steps(p, opt, n):
        for i in range(n):
            p.grad = torch.randn(50, generator=torch.Generator().manual_seed(i)).bfloat16()
            opt.step()

    torch.manual_seed(0)
    a, opt_a = make()
    torch.manual_seed(0)
    b, opt_b = make()
    assert opt_a.generator is not None and opt_a.generator is not opt_b.generator
    steps(a, opt_a, 3)
    steps(b, opt_b, 3)
    assert torch.equal(a, b)  # reproducible under torch.manual_seed
    buf = io.BytesIO()
    torch.save(opt_a.state_dict(), buf)
    buf.seek(0)
    torch.manual_seed(1)
    c, opt_c = make()
    with torch.no_grad():
        c.copy_(a)
    opt_c.load_state_dict(torch.load(buf))
    steps(a, opt_a, 3)
    steps(c, opt_c, 3)
    assert torch.equal(a, c)  # resumes bitwise, whatever the global seed


def test_no_generator_and_no_draw_when_nothing_is_random():
    state = torch.random.get_rng_state()
    p = [torch.randn(3, dtype=torch.bfloat16, requires_grad=True)]
    torch.random.set_rng_state(state)
    for opt in (AdamW(p, compensation="kahan"), AdamW(p, compensation="exact", state_dtype="8bit"), SGD(p)):
        assert opt.generator is None
    assert torch.equal(torch.random.get_rng_state(), state)
    assert AdamW(p, state_dtype=torch.bfloat16).generator is not None  # bf16 moments round stochastically
    opt = AdamW(p)
    opt.add_param_group({"params": [torch.zeros(2, requires_grad=True)], "compensation": "stochastic"})
    assert opt.generator is not None
