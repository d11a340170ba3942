"""The low-precision paths on a CUDA device (skipped without one)."""

import math

import pytest
import torch

import mixprec
from mixprec.optim import SGD, AdamW, stochastic_round_

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_stochastic_round_on_device_matches_the_neighbours(dtype):
    x = torch.randn(100_000) * torch.logspace(-7, 4, 100_000)
    near = x.to(dtype)
    inf = torch.full_like(near, math.inf)
    up = torch.where(near.float() < x, torch.nextafter(near, inf), near).float()
    down = torch.where(near.float() > x, torch.nextafter(near, -inf), near).float()
    gen = torch.Generator("cuda").manual_seed(0)
    out = stochastic_round_(torch.empty(x.shape, dtype=dtype, device="cuda"), x.cuda(), gen).float().cpu()
    assert torch.all((out == down) | (out == up))
    value = torch.full((200_000,), 1.0 + 2.0**-12, device="cuda")
    mean = stochastic_round_(torch.empty_like(value, dtype=dtype), value, gen).float().mean().item()
    assert abs(mean - value[0].item()) < 2e-5


@pytest.mark.parametrize("ours,theirs,kwargs", [
    (AdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, amsgrad=True)),
    (SGD, torch.optim.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True)),
])
def test_fp32_on_device_matches_torch(ours, theirs, kwargs):
    torch.manual_seed(0)
    a = torch.randn(64, 32, device="cuda", requires_grad=True)
    b = a.detach().clone().requires_grad_()
    opt_a, opt_b = ours([a], **kwargs), theirs([b], foreach=False, **kwargs)
    for _ in range(5):
        g = torch.randn_like(a)
        a.grad, b.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("compensation", ["kahan", "stochastic"])
def test_fp16_on_device_with_scaler(compensation):
    torch.manual_seed(0)
    ref = torch.randn(64, 32, device="cuda", requires_grad=True)
    w = ref.detach().to(torch.float16).requires_grad_()
    gen = torch.Generator("cuda").manual_seed(0)
    opt = AdamW([w], lr=1e-4, compensation=compensation, generator=gen)
    ref_opt = torch.optim.AdamW([ref], lr=1e-4)
    scaler = mixprec.GradScaler("cuda", init_scale=2.0**10)
    for step in range(20):
        x = torch.randn(16, 64, device="cuda")
        (x @ ref).square().mean().backward()
        scaler.scale((x.half() @ w).float().square().mean()).backward()
        ref_opt.step()
        scaler.step(opt)
        scaler.update()
        ref_opt.zero_grad()
        opt.zero_grad()
    comp = opt.state[w].get("kahan_comp")
    value = w.float() + (comp.float() if comp is not None else 0)
    assert (value - ref).abs().max().item() < 3e-3


def test_master_weights_fused_fp16_on_device():
    model = mixprec.to_low_precision(
        torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4)).cuda(),
        torch.float16,
    )
    opt = mixprec.MasterWeights(torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True))
    scaler = mixprec.GradScaler("cuda")
    x, y = torch.randn(64, 32, device="cuda", dtype=torch.float16), torch.randn(64, 4, device="cuda")
    losses = []
    for _ in range(20):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        losses.append(loss.item())
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert losses[-1] < losses[0]
    assert all(m.device.type == "cuda" and m.dtype == torch.float32 for m in opt.masters)
    assert model[0].weight.dtype == torch.float16
    mem = mixprec.lowp.memory_bytes(model, opt)
    assert mem["params"] > 0 and mem["master"] > 0
