"""A training step's CUDA paths over fake CUDA tensors, its host reads counted against the
docstrings: GradScaler (foreach and fused optimizers), per-layer scaling, the low-precision
optimizers, the fp8 Guard and Controller and their statistics. Gradients are assigned (backward
cannot be faked, see _fake_cuda.py); a read a fake tensor refuses is counted by ``HostReads`` and
answered with zeros ("no overflow"), so each count is the number of host syncs on a GPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mixprec
from mixprec import fp8

from _fake_cuda import HostReads, cuda_module, fake_cuda, fake_mode  # noqa: F401

# (torch's fused SGD has no meta kernel: it cannot run over fake tensors)
OPTIMIZERS = {
    # name: (factory, host syncs of GradScaler.step per its docstring)
    "sgd-foreach": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True), 1),
    "adamw-foreach-capturable": (lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True, capturable=True), 1),
    "adamw-fused": (lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True), 0),
}


def _mlp(width=32, depth=4):
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _assign_grads(model, dtype=None):
    for p in model.parameters():
        p.grad = torch.randn(p.shape, device="cuda", dtype=dtype or p.dtype)


def _step_counts(make_scaler, make_opt, iterations=3):
    """Host reads of (scale, unscale_, step, update) in each of ``iterations`` steps, and the scaler."""
    counts = []
    with fake_mode(), torch.no_grad(), HostReads() as reads:
        model = cuda_module(_mlp)
        opt = make_opt(list(model.parameters()))
        scaler = make_scaler()
        for _ in range(iterations):
            loss = model(torch.randn(8, 32, device="cuda")).float().square().mean()
            scaled = scaler.scale(loss)
            _assign_grads(model)
            c_scale = reads.take()
            scaler.unscale_(opt)
            c_unscale = reads.take()
            scaler.step(opt)
            c_step = reads.take()
            scaler.update()
            counts.append((c_scale, c_unscale, c_step, reads.take()))
    assert scaled.device.type == "cuda"
    return counts, scaler


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_grad_scaler_step_on_cuda_syncs_as_documented(fake_cuda, name):
    """mixprec's scaler reads the host as its docstring says, and as torch.amp.GradScaler does."""
    make, step_syncs = OPTIMIZERS[name]
    counts, scaler = _step_counts(lambda: mixprec.GradScaler("cuda", init_scale=2.0**16, growth_interval=2), make)
    assert counts == [(0, 0, step_syncs, 0)] * 3
    skipped = scaler.last_step_skipped
    assert skipped.device.type == "cuda" and skipped.dtype == torch.bool
    assert scaler._state.scale.device.type == "cuda"
    torch_counts, _ = _step_counts(lambda: torch.amp.GradScaler("cuda", growth_interval=2), make)
    assert [c[2] for c in torch_counts] == [c[2] for c in counts]  # the peer's step: the same reads


def test_grad_scaler_documented_reads_on_cuda(fake_cuda):
    """get_scale and state_dict read once each; on_min_scale="raise" and history add one per update."""
    with fake_mode(), torch.no_grad(), HostReads() as reads:
        model = cuda_module(_mlp)
        opt = torch.optim.AdamW(model.parameters(), fused=True)
        scaler = mixprec.GradScaler("cuda", min_scale=1.0, on_min_scale="raise")
        scaler.scale(model(torch.randn(8, 32, device="cuda")).sum())
        _assign_grads(model)
        scaler.step(opt)
        assert reads.take() == 0
        scaler.update()
        assert reads.take() == 1  # the min_scale check
        scaler.get_scale()
        assert reads.take() == 1
        scaler.state_dict()
        assert reads.take() == 1


def test_per_layer_scaling_unscale_on_cuda(fake_cuda):
    """per_layer=True (which watches the model): the cut points' factors live on the device;
    the fused step and update read nothing on the host, unscale_ reads watch()'s overflow flag."""
    with fake_mode(), torch.no_grad(), HostReads() as reads:
        model = cuda_module(_mlp)
        opt = torch.optim.AdamW(model.parameters(), fused=True)
        scaler = mixprec.GradScaler("cuda", per_layer=True, cut_points=["2", "4"]).watch(model)
        assert reads.take() == 0
        counts, sites = [], set()
        for _ in range(2):
            scaler.scale(model(torch.randn(8, 32, device="cuda")).float().sum())
            _assign_grads(model)
            counts.append(reads.take())
            scaler.unscale_(opt)
            sites |= set(reads.sites)
            counts.append(reads.take())
            scaler.step(opt)
            counts.append(reads.take())
            scaler.update()
            counts.append(reads.take())
        factors = scaler.layer_scales_async()
    # the one read is watch()'s overflow flag (class docstring: on the fused path, one extra)
    assert counts == [0, 1, 0, 0] * 2
    assert sites == {"mixprec/scaling/grad_scaler.py:_attribute"}
    assert factors is not None and factors.device.type == "cuda"


@pytest.mark.parametrize("opt_name", ["AdamW", "SGD"])
@pytest.mark.parametrize("with_scaler", [False, True], ids=["alone", "scaler"])
def test_low_precision_optimizers_on_cuda(fake_cuda, opt_name, with_scaler):
    """mixprec.optim on bf16 CUDA parameters (Kahan compensation): no host read alone; with a
    scaler, the fused protocol's one found_inf read per step (AdamW/SGD docstrings)."""
    with fake_mode(), torch.no_grad(), HostReads() as reads:
        model = cuda_module(_mlp, torch.bfloat16)
        opt = getattr(mixprec.optim, opt_name)(model.parameters(), lr=1e-3, compensation="kahan")
        scaler = mixprec.GradScaler("cuda") if with_scaler else None
        counts = []
        for _ in range(2):
            out = model(torch.randn(8, 32, device="cuda", dtype=torch.bfloat16)).float().sum()
            if scaler is not None:
                scaler.scale(out)
            _assign_grads(model)
            reads.take()
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            counts.append(reads.take())
        state = next(iter(opt.state.values()))
    assert counts == [1 if with_scaler else 0] * 2, reads.sites
    assert all(t.device.type == "cuda" for t in state.values() if isinstance(t, torch.Tensor) and t.dim())


def test_fp8_guard_and_controller_on_cuda(fake_cuda):
    """fp8 statistics accumulate on the device with no read; Guard(every=2) and
    Controller(every=2) read once on their check steps, never in between."""
    with fake_mode(), torch.no_grad(), HostReads() as reads:
        model = fp8.convert(cuda_module(_mlp), "tensorwise")
        guard, counts = fp8.Guard(every=2), []
        for _ in range(4):
            model(torch.randn(16, 32, device="cuda"))
            counts.append(reads.take())
            guard.step(model)
            counts.append(reads.take())
        assert counts == [0, 0, 0, 1, 0, 0, 0, 1], reads.sites
        ctl = mixprec.Controller(every=2)
        policy = mixprec.Policy.parse("compute=bf16").fp8("tensorwise", controller=ctl)
        plain = cuda_module(_mlp)
        counts = []
        for _ in range(4):
            with mixprec.autocast("cuda", policy=policy):
                plain(torch.randn(16, 32, device="cuda"))
            counts.append(reads.take())
            ctl.step()
            counts.append(reads.take())
    assert counts == [0, 0, 0, 1, 0, 0, 0, 1], reads.sites
