"""A Controller divides its loss costs only by the scale of a loss whose backward reached its layers:
another model trained in the same thread with a ``mixprec.GradScaler`` (its scale noted for the
thread, :mod:`mixprec._scaled`) before or after this model's step leaves its costs as they are.
Before, a model without loss scaling read the other model's 2**16 as its own (costs 2**16 too small,
its costly head never promoted)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mixprec
from mixprec import Controller, Policy

STEPS = 8
SETTINGS = dict(every=4, ladder=("nvfp4", "tensorwise", "rowwise", "compute"), per_gemm=True, max_loss_cost=1e-3)

# where another model's scaled step runs in each step (None: no other model), whether this one has its own scaler
CASES = {
    "other model scaled before": ("before", False),
    "other model scaled after": ("after", False),
    "own scaler beside another model's": ("before", True),
}


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))
    with torch.no_grad():
        m[2].weight.mul_(8)  # sharp logits: the head's NVFP4 error costs the loss
    return m


def _other_step(other: tuple, x: torch.Tensor, y: torch.Tensor) -> None:
    model, opt, scaler = other
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x).float(), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()


def _log(where: str | None, own_scaler: bool) -> list[tuple]:
    warnings.simplefilter("ignore")
    model = _net(0)
    ctl = Controller(**SETTINGS).attach(model)
    policy = Policy.parse("compute=bf16").fp8("nvfp4", first_last="fp8", controller=ctl.settings,
                                              backend="emulate_fp32")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = mixprec.GradScaler("cpu", init_scale=2.0 ** 10) if own_scaler else None
    other = None
    if where is not None:
        other_model = _net(1)
        other = (other_model, torch.optim.AdamW(other_model.parameters(), lr=1e-3),
                 mixprec.GradScaler("cpu", init_scale=2.0 ** 16))
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x, y = torch.randn(128, 32, generator=g), torch.randint(0, 16, (128,), generator=g)
        if where == "before":
            _other_step(other, x, y)
        with mixprec.autocast("cpu", policy=policy):
            loss = F.cross_entropy(model(x).float(), y)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
        if where == "after":
            _other_step(other, x, y)
        ctl.step()
    return [(d.step, d.layer, d.gemm, d.action, d.from_, d.to, d.statistic, d.value) for d in ctl.log]


@pytest.mark.parametrize("case", list(CASES))
def test_loss_costs_divide_only_the_scale_of_their_own_backward(case: str) -> None:
    where, own_scaler = CASES[case]
    alone = _log(None, False)
    assert any(entry[6] == "loss_cost" for entry in alone)  # (the head's cost promotes it: what a foreign scale hid)
    beside = _log(where, own_scaler)
    assert [e[:7] for e in beside] == [e[:7] for e in alone]
    for got, want in zip(beside, alone):
        assert math.isclose(got[7], want[7], rel_tol=1e-2), (got, want)
