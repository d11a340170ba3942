"""FSDP2's fp8 all-gather with a Controller (2 gloo ranks): the gathered weight is cast for the
layer's first recipe (tensorwise); a layer the controller promotes casts the dequantized gathered
weight for its rung (rowwise) or runs the compute dtype on it, and comes back down. 30 steps run,
the decisions are the same on both ranks, and bitwise those of the run without the fp8
all-gather while every layer is tensorwise (the same arithmetic)."""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mixprec import Controller, fp8

from _distributed import gloo_group, spawn

pytestmark = [pytest.mark.slow, pytest.mark.distributed,
              pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")]

STEPS = 30


def _run(rank: int, gathered: bool) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
    ctl = Controller(every=2, trend_windows=1, min_dwell=2, demote_windows=1)
    model = fp8.convert(model, "tensorwise", filter_fn=lambda m, fqn: True, fsdp_fp8_all_gather=gathered,
                        controller=ctl)
    for i in (0, 2, 4):
        fully_shard(model[i])
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    outputs, precisions, shadow_weight = [], [], []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(16, 64, generator=g), torch.randint(0, 64, (16,), generator=g)
        if step < 16:
            x[:, 0] *= 1.6 ** step  # a drifting input feature, then calm
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        F.cross_entropy(out.float(), y).backward()
        opt.step()
        opt.zero_grad()
        precisions.append(ctl.precisions())
        layers = ctl.state_dict()["layers"]  # before the check: the windows of this step
        shadow_weight.append({n: d["shadow"][1][0] for n, d in layers.items() if d["rung"] != "tensorwise"})
        ctl.step()
        outputs.append(out.detach())
    return {"log": [(d.step, d.layer, d.operand, d.action, d.from_, d.to) for d in ctl.log],
            "precisions": precisions, "outputs": outputs, "shadow_weight": shadow_weight}


def _worker(rank: int, port: int, out_dir: str) -> None:
    with gloo_group(rank, port):
        torch.set_num_threads(1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = {"gathered": _run(rank, True), "plain": _run(rank, False)}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def test_controller_promotes_and_demotes_with_the_fp8_all_gather(tmp_path) -> None:
    spawn(_worker, str(tmp_path), timeout=540)  # a hang fails sooner: gloo times out at 120 s
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2))
    gathered = r0["gathered"]
    assert gathered["log"] == r1["gathered"]["log"] and gathered["precisions"] == r1["gathered"]["precisions"]
    actions = {(a, to) for _, _, _, a, _, to in gathered["log"]}
    assert ("promote", "fp8-rowwise") in actions and any(a == "demote" for a, _ in actions), gathered["log"]
    assert len(gathered["outputs"]) == STEPS
    # while every layer is tensorwise, bitwise the run without the fp8 all-gather
    first = next(s for s, *_ in gathered["log"])
    assert r0["plain"]["log"][0][0] == first
    for rank in (r0, r1):
        for a, b in zip(rank["gathered"]["outputs"][:first], rank["plain"]["outputs"][:first], strict=True):
            assert torch.equal(a, b)
    # a promoted layer's weight shadow is measured (on the dequantized gathered weight)
    assert any(v > 0 for step in gathered["shadow_weight"] for v in step.values())
