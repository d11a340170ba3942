"""mixprec.optim with loss scalers: the fused protocol (unscale on the fly, skip on overflow)."""

import pytest
import torch

import mixprec
from mixprec.optim import SGD, AdamW

SCALERS = {
    "mixprec": lambda scale: mixprec.GradScaler("cpu", init_scale=scale),
    "torch": lambda scale: torch.amp.GradScaler("cpu", init_scale=scale),
}
OPTIMIZERS = {
    "adamw": lambda ps: AdamW(ps, lr=1e-2, compensation="kahan"),
    "sgd": lambda ps: SGD(ps, lr=1e-2, momentum=0.9, compensation="stochastic", generator=torch.Generator().manual_seed(0)),
}


def _setup(dtype, make_opt):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 4, generator=g).to(dtype).requires_grad_()
    return w, make_opt([w])


def _loss(w, step):
    g = torch.Generator().manual_seed(10 + step)
    x = torch.randn(16, 8, generator=g).to(w.dtype)
    return (x @ w).float().square().mean()


@pytest.mark.parametrize("scaler_name", SCALERS)
@pytest.mark.parametrize("opt_name", OPTIMIZERS)
def test_scaled_training_equals_unscaled(scaler_name, opt_name):
    """A power-of-two scale is exact: the scaled run is bitwise the unscaled one."""
    ref, ref_opt = _setup(torch.bfloat16, OPTIMIZERS[opt_name])
    w, opt = _setup(torch.bfloat16, OPTIMIZERS[opt_name])
    scaler = SCALERS[scaler_name](2.0**8)
    for step in range(4):
        _loss(ref, step).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        scaler.scale(_loss(w, step)).backward()
        scaled_grad = w.grad.clone()
        scaler.step(opt)
        scaler.update()
        assert torch.equal(w.grad, scaled_grad)  # unscaled on the fly, .grad untouched
        opt.zero_grad()
        assert torch.equal(w, ref)


@pytest.mark.parametrize("scaler_name", SCALERS)
@pytest.mark.parametrize("opt_name", OPTIMIZERS)
def test_fp16_params_train_and_skip_on_overflow(scaler_name, opt_name):
    w, opt = _setup(torch.float16, OPTIMIZERS[opt_name])
    scaler = SCALERS[scaler_name](2.0**12)
    losses = []
    for step in range(6):
        loss = _loss(w, 0)
        losses.append(loss.item())
        scaler.scale(loss).backward()
        if step == 2:
            w.grad[0, 0] = float("inf")
            before = w.detach().clone()
            state_before = {k: v.clone() for k, v in opt.state[w].items()}
        scaler.step(opt)  # no "Attempting to unscale FP16 gradients"
        if step == 2:
            assert torch.equal(w, before)
            for k, v in state_before.items():
                assert torch.equal(opt.state[w][k], v)
        scaler.update()
        opt.zero_grad()
    assert scaler.get_scale() == 2.0**11
    assert losses[-1] < losses[0]


def test_explicit_unscale_then_step():
    ref, ref_opt = _setup(torch.bfloat16, OPTIMIZERS["adamw"])
    w, opt = _setup(torch.bfloat16, OPTIMIZERS["adamw"])
    scaler = mixprec.GradScaler("cpu", init_scale=2.0**8)
    _loss(ref, 0).backward()
    ref_opt.step()
    scaler.scale(_loss(w, 0)).backward()
    scaler.unscale_(opt)  # bf16 grads unscaled in place by the scaler
    scaler.step(opt)  # grad_scale None: no second unscale
    scaler.update()
    assert torch.equal(w, ref)


def test_direct_step_ignores_the_protocol():
    w, opt = _setup(torch.bfloat16, OPTIMIZERS["adamw"])
    assert opt._step_supports_amp_scaling
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
    _loss(w, 0).backward()
    before = w.detach().clone()
    opt.step()
    assert not torch.equal(w, before)
