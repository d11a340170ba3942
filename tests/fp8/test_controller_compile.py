"""A compiled controlled model recompiles only when a rung changes: traced code reads no
controller state that changes between switches (the compute dtype a first call learns, the
shadow phase of each window), so Dynamo's guards fail only on a new combination of rungs."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from mixprec import Controller, fp8


def test_a_compiled_controlled_model_recompiles_only_when_a_rung_changes():
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 32))
    # every=5, shadow_steps=2: the shadows feed the window on 2 steps of 5 (a phase that changes 8 times)
    ctl = Controller(every=5, shadow_steps=2, ladder=("nvfp4", "tensorwise", "rowwise", "compute"), per_gemm=True,
                     max_loss_cost=1e-3)
    model = fp8.convert(model, "nvfp4", filter_fn=lambda m, n: True, controller=ctl, backend="emulate_fp32")
    forward = torch.compile(model, backend="aot_eager", fullgraph=True)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    x, y = torch.randn(64, 32, generator=torch.Generator().manual_seed(1)), torch.arange(64) % 32
    seen = []
    for _ in range(20):
        rungs = tuple(tuple(rec.rungs) for _, rec in sorted(ctl._layers.items()))
        if rungs not in seen:
            seen.append(rungs)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            F.cross_entropy(forward(x).float(), y).backward()
        opt.step()
        opt.zero_grad()
        ctl.step()
    assert len(seen) >= 2 and ctl.log  # the rungs changed (a recompile each)
    assert counters["stats"]["unique_graphs"] == len(seen)  # and nothing else recompiled
    assert ctl.precision("0", "output") == "nvfp4" and ctl._compute is torch.bfloat16
