"""The Guard's schedule: ``guard.step()`` once per optimizer step (never a forward), resumed bit
for bit from ``state_dict()`` at any step, the same all-reduces on ranks that run different
numbers of forwards (2 processes, gloo), and a warning when a policy's guard is never stepped."""

from __future__ import annotations

import io
import os
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import mixprec
from mixprec import Policy, fp8
from mixprec.control._guard import NO_STEP_FORWARDS

from _distributed import gloo_group, spawn
from _models import fp8_stack

STEPS, EVERY = 12, 4
OUTLIERS = {6: "2", 10: "4"}  # step -> layer whose input gets an outlier (its other values underflow)


def _inject(module: nn.Module, args: tuple) -> tuple:
    h = args[0].clone()
    h[0, 0] = 1e6
    return (h,)


class _Run:
    """A model, its optimizer and guard on the policy or the convert route."""

    def __init__(self, route: str) -> None:
        self.route, self.model = route, fp8_stack()
        self.guard = fp8.Guard(max_saturated=0.5, every=EVERY)
        if route == "convert":
            self.model = fp8.convert(self.model, filter_fn=lambda m, fqn: True, guard=self.guard)
            self.region = lambda: mixprec.autocast("cpu", dtype=torch.bfloat16)
        else:
            policy = Policy.parse("compute=bf16").fp8(first_last="fp8", guard=self.guard)
            self.region = lambda: mixprec.autocast("cpu", policy=policy)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-2)

    def train(self, start: int, stop: int) -> list[float]:
        losses = []
        for step in range(start, stop):
            x = torch.randn(16, 32, generator=torch.Generator().manual_seed(step))
            layer = OUTLIERS.get(step)
            handle = layer and self.model.get_submodule(layer).register_forward_pre_hook(_inject)
            with self.region():
                loss = self.model(x).float().square().mean()
            loss.backward()
            if handle:
                handle.remove()
            self.opt.step()
            self.opt.zero_grad()
            self.guard.step()  # the layers it tracks: by convert(guard=...) or the policy's forwards
            losses.append(loss.item())
        return losses

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "opt": self.opt.state_dict(), "guard": self.guard.state_dict()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.model.load_state_dict(sd["model"])
        self.opt.load_state_dict(sd["opt"])
        self.guard.load_state_dict(sd["guard"])


def _roundtrip(obj: Any) -> Any:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("route", ["policy", "convert"])
@pytest.mark.parametrize("resume_at", [3, 7, 8, 10])
def test_resume_at_any_step_is_bitwise_the_uninterrupted_run(route: str, resume_at: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fp8.Float8FallbackWarning)
        full = _Run(route)
        losses = full.train(0, STEPS)
        half = _Run(route)
        half.train(0, resume_at)
        saved = _roundtrip(half.state_dict())
        resumed = _Run(route)  # a fresh model, optimizer and guard
        resumed.load_state_dict(saved)
        assert resumed.guard.steps == resume_at
        resumed_losses = resumed.train(resume_at, STEPS)
    # the outlier of step 6 is decided at step 8 (its window 5..8), that of step 10 at step 12
    assert [(d.layer, d.operand, d.statistic, d.step) for d in full.guard.decisions.values()] == [
        ("2", "input", "underflow", 8), ("4", "input", "underflow", 12)]
    assert resumed.guard.decisions == full.guard.decisions
    assert resumed_losses == losses[resume_at:]
    for (name, a), b in zip(full.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name
    assert resumed.guard.state_dict() == full.guard.state_dict()


def test_state_dict_holds_steps_decisions_and_windows() -> None:
    run = _Run("convert")
    run.train(0, 2)
    sd = run.guard.state_dict()
    assert sd["steps"] == 2 and sd["decisions"] == {}
    assert sorted(sd["windows"]) == ["0", "2", "4", "6"]
    data = fp8.layer_state(run.model[2])._data
    assert torch.equal(torch.tensor(sd["windows"]["2"]["stats"]), data)  # window and last amax
    assert data[0, 0] > 0  # the window is open: steps 1 and 2 of 4
    with pytest.raises(ValueError, match=r"expects the dict of Guard.state_dict\(\) \(steps, decisions"):
        fp8.Guard().load_state_dict({"decisions": {}})  # a checkpoint without the schedule
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        run.guard.check(run.model, step=-1)


def test_forwards_never_check_and_a_policy_guard_never_stepped_warns_once() -> None:
    model = fp8_stack()
    guard = fp8.Guard(every=1)
    policy = Policy.parse("compute=bf16").fp8(first_last="fp8", guard=guard)
    model[2].register_forward_pre_hook(_inject)
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
    with gloo_group(rank, port):
        torch.set_num_threads(1)
        model = fp8_stack()
        guard = fp8.Guard(every=2)
        policy = Policy.parse("compute=bf16").fp8(first_last="fp8", guard=guard)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", fp8.Float8FallbackWarning)
            for step in range(6):
                x = torch.randn(8, 32, generator=torch.Generator().manual_seed(10 * step + rank))
                handle = model[2].register_forward_pre_hook(_inject) if (rank, step) == (1, 2) else None
                with mixprec.autocast("cpu", policy=policy):
                    model(x).float().square().mean().backward()
                if handle is not None:
                    handle.remove()
                if rank == 0:  # an evaluation with grad enabled on rank 0 only, twice
                    for _ in range(2):
                        with mixprec.autocast("cpu", policy=policy):
                            model(x).float().sum()
                opt.step()
                opt.zero_grad()
                guard.step()
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
