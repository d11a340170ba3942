"""Guard and Controller checks on ranks whose forwards differ (2 gloo processes): a rank that skips
its first micro-batches (it knows no fp8 layer at the first checks) and runs fewer micro-batches
per optimizer step than the other issues the same collectives, takes the same decisions at the
same steps, and those are the decisions of one process that saw every micro-batch (the weights
stay fixed, so the lagging rank's statistics are a subset of the other's and the MAX is the
other's). Before, the lagging rank skipped the check's all-reduce: every later check paired with
the peer's previous one, decisions moved, and a rank waited for a collective that never came."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec import Controller, Policy, fp8

from _distributed import gloo_group, spawn
from _models import fp8_stack

pytestmark = [pytest.mark.slow, pytest.mark.distributed,
              pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")]

GUARD_STEPS, CTL_STEPS, SKIP = 12, 80, 7  # rank 1 runs no forward before step SKIP
OUTLIERS = {(3, "a"): "2", (5, "b"): "4", (8, "a"): "6"}  # (step, micro-batch) -> layer whose input gets one


def _inject(module: nn.Module, args: tuple) -> tuple:
    h = args[0].clone()
    h[0, 0] = 1e6
    return (h,)


def _micro_batches(rank: int | None, step: int) -> tuple[str, ...]:
    """Rank 0 (and the single process, None) runs micro-batches a and b each step; rank 1 none
    before step SKIP, then only a."""
    if rank == 1:
        return () if step < SKIP else ("a",)
    return ("a", "b")


def _run_guard(rank: int | None) -> dict[str, Any]:
    model = fp8_stack()
    guard = fp8.Guard(every=1)
    policy = Policy.parse("compute=bf16").fp8(first_last="fp8", guard=guard)
    for step in range(GUARD_STEPS):
        for mb in _micro_batches(rank, step):
            x = torch.randn(16, 32, generator=torch.Generator().manual_seed(2 * step + (mb == "b")))
            layer = OUTLIERS.get((step, mb))
            handle = layer and model.get_submodule(layer).register_forward_pre_hook(_inject)
            with mixprec.autocast("cpu", policy=policy):
                model(x).float().square().mean().backward()
            if handle:
                handle.remove()
        model.zero_grad()  # the weights stay fixed: the statistics of every rank agree
        guard.step()
    return {"decisions": sorted((d.step, d.layer, d.operand, d.statistic) for d in guard.decisions.values()),
            "flags": {n: s.fallback for n, s in fp8.layer_states(model).items()}, "steps": guard.steps}


def _run_controller(rank: int | None) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
    ctl = Controller(every=5, min_dwell=10, demote_windows=2)
    policy = Policy.parse("compute=bf16").fp8("tensorwise", controller=ctl, first_last="fp8")
    precisions = []
    for step in range(CTL_STEPS):
        for mb in _micro_batches(rank, step):
            g = torch.Generator().manual_seed(2 * step + (mb == "b"))
            x, y = torch.randn(32, 64, generator=g), torch.randint(0, 64, (32,), generator=g)
            if step < 40 and mb == "a":
                x[:, 0] *= 1.25 ** step  # one input feature drifts up, then returns
            with mixprec.autocast("cpu", policy=policy):
                F.cross_entropy(model(x).float(), y).backward()
        model.zero_grad()
        ctl.step()
        precisions.append(ctl.precisions())
    return {"log": [(d.step, d.layer, d.operand, d.action, d.from_, d.to, d.value) for d in ctl.log],
            "precisions": precisions[SKIP:]}


def _run_shares(rank: int | None) -> list[dict[str, float]]:
    """Each check's shares of the loss-cost limits (``cost_scope="model"``) of layers of unequal
    size: the lagging rank takes its first checks' from its peer's metadata (it ran no layer yet)."""
    from mixprec.control import _controller

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 32))
    ctl = Controller(every=5, per_gemm=True, ladder=("nvfp4", "tensorwise", "compute"), max_loss_cost=1.0,
                     cost_scope="model")
    policy = Policy.parse("compute=bf16").fp8("nvfp4", controller=ctl, first_last="fp8", backend="emulate_fp32")
    seen, shares = [], _controller.flop_shares
    _controller.flop_shares = lambda settings, records: (seen.append(out := shares(settings, records)), out)[1]
    try:
        for step in range(2 * SKIP):
            for mb in _micro_batches(rank, step):
                g = torch.Generator().manual_seed(2 * step + (mb == "b"))
                x, y = torch.randn(32, 64, generator=g), torch.randint(0, 32, (32,), generator=g)
                with mixprec.autocast("cpu", policy=policy):
                    F.cross_entropy(model(x).float(), y).backward()
            model.zero_grad()
            ctl.step()
    finally:
        _controller.flop_shares = shares
    return [s for s in seen if s]


def _worker(rank: int, port: int, out_dir: str) -> None:
    with gloo_group(rank, port):
        result = {"guard": _run_guard(rank), "controller": _run_controller(rank), "shares": _run_shares(rank)}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def test_a_lagging_rank_with_fewer_micro_batches_decides_as_one_process_that_saw_all(tmp_path) -> None:
    try:
        spawn(_worker, str(tmp_path), timeout=420)  # a hang fails sooner: gloo times out at 120 s
    except TimeoutError:
        pytest.fail("the ranks hung: they issued different collectives")
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    guard_ref, ctl_ref = _run_guard(None), _run_controller(None)  # one process, every micro-batch

    assert [layer for _, layer, _, _ in guard_ref["decisions"]] == ["2", "4", "6"]
    assert [step for step, _, _, _ in guard_ref["decisions"]] == [4, 6, 9]  # guard.step() counts from 1
    assert {d[3] for d in ctl_ref["log"]} == {"promote", "demote"}
    shares_ref = _run_shares(None)
    assert shares_ref and all(s == {"0": 2 / 3, "2": 1 / 3} for s in shares_ref)
    for result in ranks:
        assert result["shares"] == shares_ref
        assert result["guard"] == guard_ref
        assert result["controller"]["log"] == ctl_ref["log"]
        assert result["controller"]["precisions"] == ctl_ref["precisions"]
