"""A per-GEMM Controller resumed between a promotion and the demotion that follows it decides
as the straight run does: its state_dict carries every counter a decision reads (the per-GEMM
clean-window counts, which differ between the GEMMs of one layer). Found by mutation testing
(docs/mutants.md, ``controller-state-drops-gemm-clean``): with the counts dropped, the load fell
back to the layer's and the resumed run demoted a step late, while the 12 resume, state, JSON and
pickle tests passed."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

import mixprec
from mixprec import fp8

STEPS = 12
OUTLIER_STEP = 2


def _build(seed: int) -> tuple[nn.Module, mixprec.Controller, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    # no activation: the outlier of the input reaches the converted middle layers
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 1))
    ctl = mixprec.Controller(every=1, per_gemm=True, trend_windows=1, min_dwell=2, demote_windows=3)
    fp8.convert(model, "tensorwise", controller=ctl)
    return model, ctl, torch.optim.SGD(model.parameters(), lr=1e-6)


def _run(model: nn.Module, ctl: mixprec.Controller, opt: torch.optim.Optimizer, start: int, stop: int) -> None:
    for t in range(start, stop):
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(t))
        if t == OUTLIER_STEP:
            x[0, 1] = 1e5  # the middle layers' input GEMMs underflow: promoted, then demoted when calm
        with mixprec.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        ctl.step()


def _log(ctl: mixprec.Controller) -> list[tuple]:
    return [(d.step, d.layer, d.gemm, d.action, d.to) for d in ctl.log]


@pytest.mark.parametrize("resume_at", [4, 5])
def test_resumed_between_promotion_and_demotion_decides_as_straight(resume_at: int) -> None:
    model, ctl, opt = _build(0)
    _run(model, ctl, opt, 0, STEPS)
    straight = _log(ctl)
    actions = {(a, g) for _, _, g, a, _ in straight}
    assert {("promote", "output"), ("demote", "output")} <= actions, straight  # the scenario happens
    first, first_ctl, first_opt = _build(0)
    _run(first, first_ctl, first_opt, 0, resume_at)
    clean = first_ctl.state_dict()["layers"]["1"]["gemm_clean"]
    assert len(set(clean)) > 1, clean  # the GEMMs' counts differ: the layer's one cannot stand in
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": first_opt.state_dict(), "ctl": first_ctl.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    model2, ctl2, opt2 = _build(5)
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    ctl2.load_state_dict(saved["ctl"])
    _run(model2, ctl2, opt2, resume_at, STEPS)
    assert _log(ctl2) == straight
