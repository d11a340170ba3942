"""A Controller and a Guard pickle (``pickle``, ``torch.save`` of the objects) with a converted
model: unpickled mid-run, the run goes on bitwise as the uninterrupted one (decisions, outputs,
weights), as with ``state_dict``; so does ``copy.deepcopy`` (a Controller copies as it pickles, its records
taken over when reached; a Guard with its model's layer states)."""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixprec import Controller, fp8

STEPS, PICKLE_AT = 60, 23
COPIES = {"pickle": lambda pair: pickle.loads(pickle.dumps(pair)), "deepcopy": copy.deepcopy}


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(32, 64, generator=g), torch.randint(0, 64, (32,), generator=g)
    if step < 40:
        x[:, 0] *= 1.25 ** step  # one input feature drifts up, then returns
    return x, y


def _setup(judge: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
    if judge == "controller":
        checker = Controller(every=5, trend_windows=1, min_dwell=10, demote_windows=1)
    else:
        checker = fp8.Guard(every=5)
    model = fp8.convert(model, filter_fn=lambda m, fqn: True, **{judge: checker})
    return {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=1e-3), judge: checker}


def _train(run: dict[str, Any], judge: str, steps: range, outputs: list) -> None:
    for step in steps:
        x, y = _batch(step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = run["model"](x)
        F.cross_entropy(out.float(), y).backward()
        run["opt"].step()
        run["opt"].zero_grad()
        run[judge].step()
        outputs.append(out.detach())


def _decisions(run: dict[str, Any], judge: str) -> list:
    if judge == "controller":
        return run[judge].log
    return sorted(run[judge].decisions.items())


@pytest.mark.parametrize("how", COPIES.values(), ids=COPIES.keys())
@pytest.mark.parametrize("judge", ["controller", "guard"])
def test_pickled_mid_run_resumes_bitwise(judge, how):
    whole, outputs = _setup(judge), []
    _train(whole, judge, range(STEPS), outputs)
    assert _decisions(whole, judge), "the drift should move a layer"

    run, resumed = _setup(judge), []
    _train(run, judge, range(PICKLE_AT), resumed)
    run = how(run)  # model, optimizer and controller/guard in one pickle (before: a deep copy's next switch raised)
    if judge == "controller":
        assert run[judge].steps == PICKLE_AT
        run[judge].track(run["model"])  # the converted layers: controlled again, from the pickled state
    _train(run, judge, range(PICKLE_AT, STEPS), resumed)

    assert _decisions(run, judge) == _decisions(whole, judge)
    assert all(torch.equal(a, b) for a, b in zip(outputs, resumed, strict=True))
    for p, q in zip(whole["model"].parameters(), run["model"].parameters(), strict=True):
        assert torch.equal(p, q)


def test_a_pickled_controller_alone_holds_its_state_dict():
    run = _setup("controller")
    _train(run, "controller", range(PICKLE_AT), [])
    ctl = run["controller"]
    back = pickle.loads(pickle.dumps(ctl))
    assert back == ctl and back.state_dict() == ctl.state_dict() and back.log == ctl.log
    guard = fp8.Guard(every=3)
    guard.step(fp8.convert(nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32)), filter_fn=lambda m, f: True))
    assert pickle.loads(pickle.dumps(guard)).state_dict() == guard.state_dict()


def test_a_deep_copy_of_a_controller_alone_holds_its_state_dict():
    run = _setup("controller")
    _train(run, "controller", range(PICKLE_AT), [])
    twin = copy.deepcopy(run["controller"])
    assert twin == run["controller"] and twin.state_dict() == run["controller"].state_dict() and twin.steps == PICKLE_AT


def _outlier(module: nn.Module, args: tuple) -> tuple:
    h = args[0].clone()
    h[0, 0] = 1e6  # (tensorwise: the rest of the input flushes)
    return (h,)


def _guarded_run(copy_at: int | None, how: Any = None, steps: int = 4) -> tuple[list, Any, Any]:
    """A Guard(every=1) on 4 converted Linears; an outlier in layer 2's input at step 2; the
    model and guard replaced by ``how((model, guard))`` before step ``copy_at``."""
    torch.manual_seed(0)
    guard = fp8.Guard(every=1)
    model = fp8.convert(nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)]), "tensorwise", guard=guard,
                        filter_fn=lambda m, f: True)
    original, decisions = (model, guard), []
    for step in range(steps):
        if step == copy_at:
            model, guard = how((model, guard))
        hook = model[2].register_forward_pre_hook(_outlier) if step == 2 else None
        model(torch.randn(16, 32, generator=torch.Generator().manual_seed(step))).tanh().mean().backward()
        if hook is not None:
            hook.remove()
        decisions += [(d.layer, d.operand, d.statistic, d.step) for d in guard.step()]
    return decisions, model, original


@pytest.mark.parametrize("how", COPIES.values(), ids=COPIES.keys())
def test_a_guard_copied_with_its_model_judges_the_next_window_of_the_copy(how):
    """Copied with its converted model right before a step whose input underflows, the copy's
    guard falls that layer back at that step, as the straight run's does (before: pickled, its
    first check loaded the saved window over the one just recorded and missed it; deep-copied, it
    watched the original's layers and reset the original's fallback flags), and the original
    is left as it was."""
    straight, _, _ = _guarded_run(None)
    assert [d[0] for d in straight] == ["2", "3"]
    decisions, model, (original, original_guard) = _guarded_run(2, how)
    assert decisions == straight
    assert fp8.layer_state(model[2]).fallback and not fp8.layer_state(original[2]).fallback
    assert fp8.layer_state(model[2]) is not fp8.layer_state(original[2])
    assert not original_guard.decisions


def test_a_controller_deep_copied_with_a_converted_model_says_to_track_it():
    """As after unpickling, the copy controls the converted layers once ``ctl.track(model)`` is
    called (bitwise: ``test_pickled_mid_run_resumes_bitwise``); without it, its steps warn that it
    tracks no layer (before: its records' probes were dropped by the copy, and its first switch
    raised AttributeError)."""
    run = _setup("controller")
    _train(run, "controller", range(PICKLE_AT), [])
    run = copy.deepcopy(run)
    with pytest.warns(UserWarning, match="tracks no fp8 layer"):
        _train(run, "controller", range(PICKLE_AT, STEPS), [])
