"""Training loops shared by the GradScaler tests: both implementations (torch's and ours) run
the same loop, and the results are compared."""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
from torch import nn

from mixprec.scaling import GradScaler

IMPLS = ["torch", "mixprec"]
INF = float("inf")


def make_scaler(impl: str, **kwargs: Any) -> GradScaler | torch.amp.GradScaler:
    cls = torch.amp.GradScaler if impl == "torch" else GradScaler
    return cls("cpu", **kwargs)


def make_optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "plain":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=False)
    if kind == "foreach":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=True)
    if kind == "fused":
        return torch.optim.AdamW(params, lr=0.01, fused=True)
    raise ValueError(kind)


def per_impl(run: Callable[[str], Any]) -> tuple[Any, Any]:
    """``(run("torch"), run("mixprec"))``, each from the same seed."""
    results = []
    for impl in IMPLS:
        torch.manual_seed(0)
        results.append(run(impl))
    return results[0], results[1]


def same_tensors(a: Any, b: Any) -> bool:
    """Bitwise equality of two sequences of tensors (or of modules' parameters)."""
    a = list(a.parameters()) if isinstance(a, nn.Module) else list(a)
    b = list(b.parameters()) if isinstance(b, nn.Module) else list(b)
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def snapshot(params: Any) -> list[torch.Tensor]:
    return [p.detach().clone() for p in params]


def one_param_step(scaler: Any, optimizer: torch.optim.Optimizer, param: nn.Parameter, bad: bool) -> None:
    """One iteration on a parameter whose scaled gradient is ones (with an inf when ``bad``)."""
    scale = scaler.scale(torch.tensor(1.0))
    param.grad = torch.ones_like(param) * scale
    if bad:
        param.grad[0] = INF
    scaler.step(optimizer)
    scaler.update()


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: Any,
    batches: Any,
    *,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    spoil: Callable[[int], None] = lambda i: None,
    accumulate: int = 1,
) -> list[float]:
    """The scaled training loop: scale, backward, ``spoil(i)`` (inject an inf), step and update
    every ``accumulate`` batches; returns the scale after each update."""
    scales = []
    for i, batch in enumerate(batches):
        scaler.scale(loss_fn(model, batch)).backward()
        spoil(i)
        if (i + 1) % accumulate == 0:
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            scales.append(scaler.get_scale())
    return scales


def grads_trajectory(impl, grads_per_step, make_opt, scaler_kwargs=None, scaler=None, params=None):
    """Feeds precomputed gradients (inf where given) through scale/step/update; returns scales,
    whether each step moved the weights, and the scaler, params and optimizer."""
    if params is None:
        params = [nn.Parameter(torch.ones(3, 2)), nn.Parameter(torch.zeros(2))]
    optimizer = make_opt(params)
    scaler = scaler or make_scaler(impl, **(scaler_kwargs or {}))
    scales, moved = [], []
    for step_grads in grads_per_step:
        scale = scaler.scale(torch.tensor(1.0))
        for p, g in zip(params, step_grads):
            p.grad = g * scale
        before = params[0].detach().clone()
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
        moved.append(not torch.equal(before, params[0]))
    return scales, moved, scaler, params, optimizer


def gradient_sequence(n, seed=0, bad=(2, 5, 6)):
    gen = torch.Generator().manual_seed(seed)
    seq = []
    for i in range(n):
        g = [torch.randn(3, 2, generator=gen), torch.randn(2, generator=gen)]
        if i in bad:
            g[i % 2].view(-1)[0] = INF if i % 3 else float("nan")
        seq.append(g)
    return seq


# ---------------------------------------------------------------- torch's _run_scaling_case


def scaling_case(kind: str = "plain", seed: int = 0):
    """Twin fp32 models (control, scaled), their optimizers, data and the iteration to skip."""
    torch.manual_seed(seed)
    control = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    scaled = copy.deepcopy(control)
    data = [(torch.randn(4, 8), torch.randn(4, 8)) for _ in range(4)]
    return control, scaled, make_optimizer(kind, control.parameters()), make_optimizer(kind, scaled.parameters()), data, 2


def run_scaling_case(impl, run, unskipped, skipped, kind="plain", exact=True, models=1):
    """Port of torch's _run_scaling_case: a scaled run with an injected inf equals a control run
    that skips that iteration by hand; the final scale is 128 * 2**unskipped * 0.5**skipped."""
    scaler = make_scaler(impl, init_scale=128.0, growth_factor=2.0, growth_interval=1)
    cases = [scaling_case(kind, seed) for seed in range(models)]
    control = [c[0] for c in cases], [c[2] for c in cases]
    scaled = [c[1] for c in cases], [c[3] for c in cases]
    data, skip_iter = cases[0][4], cases[0][5]
    run(data, *control, scaler, skip_iter, False)
    run(data, *scaled, scaler, skip_iter, True)
    assert scaler.get_scale() == 128.0 * 2.0**unskipped * 0.5**skipped
    for m_control, m_scaled in zip(*[control[0], scaled[0]]):
        for p_c, p_s in zip(m_control.parameters(), m_scaled.parameters()):
            if exact:
                assert torch.equal(p_c, p_s)
            else:
                torch.testing.assert_close(p_c, p_s, atol=1e-5, rtol=1e-5)
    return [p.detach().clone() for m in scaled[0] for p in m.parameters()], scaler


def _mse(model, x, y, scaler):
    return nn.functional.mse_loss(model(x), y)


def _nothing(model, optimizer, scaler):
    pass


def one_model_run(loss_fn=_mse, after_backward=_nothing):
    """The ``run`` of torch's single-model scaling tests: the scaled run injects an inf into
    ``model[2].weight.grad`` at ``skip_iter`` and lets the scaler skip; the control skips that
    step by hand. ``loss_fn(model, x, y, scaler)`` and ``after_backward(model, optimizer,
    scaler)`` get ``scaler=None`` in the control run."""

    def run(data, models, optimizers, scaler, skip_iter, try_scaling_api):
        (model,), (optimizer,) = models, optimizers
        for i, (x, y) in enumerate(data):
            optimizer.zero_grad()
            if try_scaling_api:
                scaler.scale(loss_fn(model, x, y, scaler)).backward()
                if i == skip_iter:
                    model[2].weight.grad.fill_(INF)
                after_backward(model, optimizer, scaler)
                scaler.step(optimizer)
                scaler.update()
            else:
                loss_fn(model, x, y, None).backward()
                after_backward(model, optimizer, None)
                if i != skip_iter:
                    optimizer.step()

    return run


def both_agree(run, unskipped, skipped, **kwargs):
    """Runs the case with torch's scaler and with ours; checks the control and bitwise agreement."""
    theirs, _ = run_scaling_case("torch", run, unskipped, skipped, **kwargs)
    ours, scaler = run_scaling_case("mixprec", run, unskipped, skipped, **kwargs)
    assert same_tensors(theirs, ours)
    return scaler
