"""A resume is bitwise where a layer is skipped on the step after the checkpoint, saved right after a
window's first shadow step: the gain of that step's update is added to the window at the layer's next
forward (after the check) in the live run and in the resumed one alike (``BackwardCost.settled_gain``).
Before, the saved state folded it into the open window, so the resumed check read another gain."""

from __future__ import annotations

import copy
import hashlib
import io
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mixprec
from mixprec import Controller, Policy

STEPS, SAVE_AT = 12, 7  # (every=4, shadow_steps=2: step 6 is the window's first shadow step, fc2 skips step 7)

# (tied head, fc called twice, cost_row_share)
CASES = {"tied-shared-quarter-rows": (True, True, 0.25), "untied-unshared-all-rows": (False, False, 1.0)}


class _LM(nn.Module):
    def __init__(self, seed: int, tied: bool, shared: bool) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb, self.fc, self.fc2 = nn.Embedding(64, 32), nn.Linear(32, 32), nn.Linear(32, 32)
        self.head = nn.Linear(32, 64, bias=False)
        if tied:
            self.head.weight = self.emb.weight
        self.shared, self.step = shared, 0

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        h = self.emb(t)
        h = h + self.fc(h).relu()
        if self.shared:
            h = h + self.fc(h).relu()
        if self.step % 3 != 1:  # fc2 skipped on steps 1, 4, 7, 10
            h = self.fc2(h)
        return self.head(h)


def _build(seed: int, case: tuple) -> tuple:
    tied, shared, share = case
    model = _LM(seed, tied, shared)
    ctl = Controller(every=4, ladder=("nvfp4", "tensorwise", "rowwise", "compute"), per_gemm=True, max_loss_cost=1e-3,
                     max_backward_cost=1e-3 / 12, min_dwell=4, demote_windows=1, trend_windows=1, cost_row_share=share,
                     shadow_steps=2).attach(model)
    policy = Policy.parse("compute=bf16").fp8("nvfp4", first_last="fp8", controller=ctl.settings,
                                              backend="emulate_fp32")
    return model, ctl, policy, torch.optim.AdamW(model.parameters(), lr=3e-3)


def _run(objects: tuple, steps: range) -> list[tuple]:
    model, ctl, policy, opt = objects
    seen = []
    for step in steps:
        g = torch.Generator().manual_seed(99 + step)
        t = torch.randint(0, 64, (8, 9), generator=g)
        model.step = step
        with mixprec.autocast("cpu", policy=policy):
            loss = F.cross_entropy(model(t[:, :-1]).reshape(-1, 64).float(), t[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        ctl.step()
        weights = b"".join(v.float().numpy().tobytes() for v in model.state_dict().values())
        seen.append((step, loss.item(), hashlib.sha256(weights).hexdigest()))
    return seen


def _log(ctl: Controller) -> list[tuple]:
    return [(d.step, d.layer, d.gemm, d.action, d.from_, d.to, d.value) for d in ctl.log]


@pytest.mark.parametrize("case", list(CASES))
def test_resume_after_first_shadow_step_with_a_skipped_layer_is_bitwise(case: str) -> None:
    warnings.simplefilter("ignore")
    straight = _build(0, CASES[case])
    expected = _run(straight, range(STEPS))
    first = _build(0, CASES[case])
    _run(first, range(SAVE_AT))
    buf = io.BytesIO()
    torch.save({"model": first[0].state_dict(), "opt": first[3].state_dict(), "ctl": first[1].state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    resumed = _build(7, CASES[case])  # fresh objects, another init: everything comes from the checkpoint
    resumed[0].load_state_dict(saved["model"])
    resumed[3].load_state_dict(copy.deepcopy(saved["opt"]))
    resumed[1].load_state_dict(saved["ctl"])
    assert _run(resumed, range(SAVE_AT, STEPS)) == expected[SAVE_AT:]
    assert _log(resumed[1]) == _log(straight[1])
