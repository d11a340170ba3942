"""The Guard's schedule: ``guard.step()`` once per optimizer step (never a forward), resumed bit
for bit from ``state_dict()`` at any step, the same all-reduces on ranks that run different
numbers of forwards (2 processes, gloo), and a warning when a policy's guard is never stepped."""

from __future__ import annotations

import os
import warnings
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

import mixprec
from mixprec import Policy, fp8
from mixprec.control._guard import NO_STEP_FORWARDS

from _distributed import gloo_group, spawn
from _models import fp8_stack
from _train_cases import CASES, Trainer, inject_outlier, train

STEPS = 12  # the cases guard-outliers-*: tests/_train_cases.py (outliers into '2' at step 6, '4' at 10)


@pytest.mark.parametrize("route", ["policy", "convert"])
@pytest.mark.parametrize("resume_at", [3, 7, 8, 10])
def test_resume_at_any_step_is_bitwise_the_uninterrupted_run(route: str, resume_at: int) -> None:
    case = CASES[f"guard-outliers-{route}"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fp8.Float8FallbackWarning)
        full = train(case)
        # saved through torch.save/torch.load(weights_only=True) into a fresh model, optimizer
        # and guard, which count resume_at steps (the runner asserts it)
        resumed = train(replace(case, resume_at=resume_at))
    assert resumed.rebuilt_at == resume_at
    # the outlier of step 6 is decided at step 8 (its window 5..8), that of step 10 at step 12
    assert [(d.layer, d.operand, d.statistic, d.step) for d in full.supervisor.decisions.values()] == [
        ("2", "input", "underflow", 8), ("4", "input", "underflow", 12)]
    assert resumed.supervisor.decisions == full.supervisor.decisions
    assert len(full.records["losses"]) == STEPS
    assert resumed.records["losses"][resume_at:] == full.records["losses"][resume_at:]
    for (name, a), b in zip(full.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name
    assert resumed.supervisor.state_dict() == full.supervisor.state_dict()


def test_state_dict_holds_steps_decisions_and_windows() -> None:
    run = Trainer(CASES["guard-outliers-convert"], seed=0)
    run.run(0, 2)
    sd = run.supervisor.state_dict()
    assert sd["steps"] == 2 and sd["decisions"] == {}
    assert sorted(sd["windows"]) == ["0", "2", "4", "6"]
    data = fp8.layer_state(run.model[2])._data
    assert torch.equal(torch.tensor(sd["windows"]["2"]["stats"]), data)  # window and last amax
    assert data[0, 0] > 0  # the window is open: steps 1 and 2 of 4
    with pytest.raises(ValueError, match=r"expects the dict of Guard.state_dict\(\) \(steps, decisions"):
        fp8.Guard().load_state_dict({"decisions": {}})  # a checkpoint without the schedule
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        run.supervisor.check(run.model, step=-1)


def test_forwards_never_check_and_a_policy_guard_never_stepped_warns_once() -> None:
    model = fp8_stack()
    guard = fp8.Guard(every=1)
    policy = Policy.parse("compute=bf16").fp8(first_last="fp8", guard=guard)
    model[2].register_forward_pre_hook(inject_outlier)
    x = torch.randn(4, 32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(NO_STEP_FORWARDS + 5):
            with mixprec.autocast("cpu", policy=policy):
                model(x).float().sum().backward()
        with torch.no_grad(), mixprec.autocast("cpu", policy=policy):
            model(x)
    messages = [str(w.message) for w in caught if "guard.step()" in str(w.message)]
    assert len(messages) == 1 and f"{NO_STEP_FORWARDS} training forwards" in messages[0]
    assert guard.decisions == {} and guard.steps == 0  # the outlier is seen, no forward decided
    with pytest.warns(fp8.Float8FallbackWarning, match="'2' falls back to the compute dtype at step 1"):
        guard.step()


# --- two processes: rank 0 runs extra forwards (an evaluation, a micro-batch more) -----------------

def _worker(rank: int, port: int, out_dir: str) -> None:
    case = CASES["guard-ranks"]  # rank 0 runs 2 evaluations a step; rank 1 an outlier at step 2
    data = replace(case.data, rank=rank, evals=0, outliers=((2, "2"),)) if rank == 1 else case.data
    with gloo_group(rank, port):
        torch.set_num_threads(1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", fp8.Float8FallbackWarning)
            run = train(replace(case, data=data))
        guard, model = run.supervisor, run.model
        torch.save({"decisions": [(d.layer, d.operand, d.statistic, d.step) for d in guard.decisions.values()],
                    "steps": guard.steps, "flags": {n: s.fallback for n, s in fp8.layer_states(model).items()}},
                   os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_ranks_with_different_forwards_take_the_same_decisions_without_hanging(tmp_path) -> None:
    try:
        spawn(_worker, str(tmp_path), timeout=120)
    except TimeoutError:  # mismatched all-reduces: the ranks wait on each other
        pytest.fail("the two ranks hung: they issued different collectives")
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for res in results:  # rank 1's outlier of step 2 (0-based), decided at the check of step 4
        assert res["decisions"] == [("2", "input", "underflow", 4)]
        assert res["steps"] == 6
        assert res["flags"] == {"0": False, "2": True, "4": False, "6": False}


def test_a_guard_stepped_without_layers_warns_once() -> None:
    model = fp8.convert(fp8_stack(), filter_fn=lambda m, fqn: True)  # no guard= here
    guard = fp8.Guard()
    with pytest.warns(UserWarning, match=r"Guard.step\(\) tracks no fp8 layer, so it decides nothing"):
        guard.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        guard.step()
        guard.step(model)  # given the model: it tracks it from now on
        guard.step()
    assert guard.steps == 4 and sorted(guard.state_dict()["windows"]) == ["0", "2", "4", "6"]
