"""Under ``max_loss_cost`` a promoted forward comes down only on a measured loss cost: windows in
which the layer ran forwards but no backward reached it (evaluation under ``torch.no_grad``)
measure its casts, not the loss cost of the recipe below, and are no evidence that it is cheap.
Found by mutation testing (docs/mutants.md, ``controller-demotes-on-unmeasured-cost``): a
Controller that took an unmeasured cost of 0 for cheap demoted the layer onto NVFP4 after two
evaluation windows, and no test saw it."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from mixprec import Controller, fp8

LADDER = ("nvfp4", "tensorwise", "compute")


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64))
    with torch.no_grad():
        model[2].weight.mul_(4)  # sharp logits: their NVFP4 error costs about 0.005 nats
    return model


def _run(demote_loss_cost: float, train: bool) -> Controller:
    ctl = Controller(every=2, ladder=LADDER, per_gemm=True, floor="nvfp4", max_loss_cost=1.0,
                     demote_loss_cost=demote_loss_cost, demote_windows=2, min_dwell=0)
    model = fp8.convert(_model(), "tensorwise", filter_fn=lambda m, n: n == "2", controller=ctl,
                        backend="emulate_fp32")
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(256, 32, generator=g), torch.randint(0, 64, (256,), generator=g)
    for _ in range(10):
        if train:
            F.cross_entropy(model(x), y).backward()
            model.zero_grad()
        else:
            with torch.no_grad():
                model(x)
        ctl.step()
    return ctl


def test_unmeasured_windows_do_not_demote() -> None:
    # the setting that demotes on measured windows (the recipe below is cheap enough) ...
    assert any(d.action == "demote" and d.gemm == "output" for d in _run(1.0, train=True).log)
    # ... keeps a forward whose loss cost was never measured where it is
    evaluated = _run(1e-4, train=False)
    assert not [d for d in evaluated.log if d.action == "demote"], evaluated.log
    assert evaluated.precision("2", "output") == "fp8-tensorwise"
