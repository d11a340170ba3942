"""A per-GEMM Controller resumed between a promotion and the demotion that follows it decides
as the straight run does: its state_dict carries every counter a decision reads (the per-GEMM
clean-window counts, which differ between the GEMMs of one layer). Found by mutation testing
(docs/mutants.md, ``controller-state-drops-gemm-clean``): with the counts dropped, the load fell
back to the layer's and the resumed run demoted a step late, while the 12 resume, state, JSON and
pickle tests passed."""

from __future__ import annotations

from dataclasses import replace

import pytest

from _train_cases import CASES, Trainer, train

CASE = CASES["controller-gemm-counters"]  # tests/_train_cases.py


def _log(ctl) -> list[tuple]:
    return [(d.step, d.layer, d.gemm, d.action, d.to) for d in ctl.log]


@pytest.mark.parametrize("resume_at", [4, 5])
def test_resumed_between_promotion_and_demotion_decides_as_straight(resume_at: int) -> None:
    straight = _log(train(CASE).supervisor)
    actions = {(a, g) for _, _, g, a, _ in straight}
    assert {("promote", "output"), ("demote", "output")} <= actions, straight  # the scenario happens
    first = Trainer(CASE, seed=0)
    first.run(0, resume_at)
    clean = first.supervisor.state_dict()["layers"]["1"]["gemm_clean"]
    assert len(set(clean)) > 1, clean  # the GEMMs' counts differ: the layer's one cannot stand in
    # through torch.save/torch.load(weights_only=True) into objects rebuilt with other weights
    resumed = train(replace(CASE, resume_at=resume_at))
    assert resumed.rebuilt_at == resume_at
    assert _log(resumed.supervisor) == straight
