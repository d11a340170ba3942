"""An evaluation between training steps (a forward under ``torch.no_grad()`` or
``torch.inference_mode()``, the model in ``eval()`` mode or not) leaves an fp8 or fp4 run as it
was. A layer's rounding count advances only on calls whose backward may read it, so the
training's stochastic-rounding draws, losses and weights are bitwise those of the run without
evaluations, eager and compiled, and under a per-GEMM Controller its decisions too. And where the
very first forward is an evaluation under inference mode (``trainer.validate()`` before
``fit``), the layers' states and a Guard's or Controller's records it creates are normal
tensors, which the training then updates and saves for backward. (Before, each evaluated
forward advanced the count, so a run's draws depended on how often it was evaluated, and an
inference-mode count or state made the next training step raise: "Inference tensors cannot be
saved for backward", "Inplace update to inference tensor outside InferenceMode".)"""

from __future__ import annotations

import contextlib

import pytest
import torch

import mixprec
from test_controller_idle_probe import SETTINGS, _model


def _no_grad_in_eval_mode(model):
    model.eval()
    with torch.no_grad():
        yield
    model.train()


EVALUATIONS = {
    "no_grad": lambda model: torch.no_grad(),
    "inference_mode": lambda model: torch.inference_mode(),
    "eval() and no_grad": contextlib.contextmanager(_no_grad_in_eval_mode),
}


def _train(recipe: str = "nvfp4", evaluate=None, steps: int = 9, controller: bool = False,
           compiled: bool = False) -> tuple:
    """Train the idle-probe tests' model in ``recipe`` (under a Controller with those tests' settings
    when ``controller``), evaluating it on a batch of its own under ``evaluate(model)`` before every
    third step's forward; returns the losses, the counts, the weights and the decisions."""
    torch._dynamo.reset()
    model = _model(0)
    ctl = None
    if controller:
        ctl = mixprec.fp8.Controller(**SETTINGS)
        ctl.attach(model)
    policy = mixprec.Policy.parse("compute=bf16").fp8(recipe, first_last="fp8", backend="emulate_fp32",
                                                      controller=None if ctl is None else ctl.settings)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    forward = torch.compile(model) if compiled else model
    gen, held_out = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    target = torch.randn(32, 32, generator=gen)
    losses = []
    for step in range(steps):
        x = torch.randn(32, 64, generator=gen)
        if evaluate is not None and step % 3 == 1:
            with mixprec.autocast("cpu", policy=policy), evaluate(model):
                assert torch.isfinite(forward(torch.randn(16, 64, generator=held_out)).float()).all()
        with mixprec.autocast("cpu", policy=policy):
            loss = (forward(x).float() - target).square().mean()
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
        if ctl is not None:
            ctl.step()
    return losses, mixprec.fp8.rounding_steps(model), model.state_dict(), None if ctl is None else ctl.log


def _assert_same_run(got: tuple, want: tuple) -> None:
    assert got[0] == want[0]  # (bitwise losses)
    assert got[1] == want[1] and all(got[1].values())  # (the counts: only the training's calls)
    for name, value in want[2].items():
        assert torch.equal(got[2][name], value), name
    assert got[3] == want[3] and (want[3] is None or want[3])  # (the same decisions: some)


@pytest.mark.parametrize("recipe", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("evaluation", EVALUATIONS.values(), ids=EVALUATIONS.keys())
def test_an_evaluation_between_steps_leaves_the_fp4_run_bitwise(recipe, evaluation):
    _assert_same_run(_train(recipe, evaluation), _train(recipe))


@pytest.mark.parametrize("evaluation", EVALUATIONS.values(), ids=EVALUATIONS.keys())
def test_an_evaluation_between_steps_leaves_a_controlled_run_bitwise(evaluation):
    """No loss cost is measured on an evaluation (no gradient reaches it), and the NVFP4 draws of
    the steps it measures are the ones of the run without evaluations. (Its cast statistics on a
    shadow step read every forward, an evaluation's too: a frozen part of a model run under
    ``no_grad`` in training is a GEMM the Controller manages, e.g. fp16's range.)"""
    want = _train(evaluate=None, steps=16, controller=True)
    _assert_same_run(_train(evaluate=evaluation, steps=16, controller=True), want)


def test_a_compiled_model_evaluated_between_steps_draws_as_without():
    want = _train(steps=5, compiled=True)
    for name in ("no_grad", "inference_mode"):
        _assert_same_run(_train(evaluate=EVALUATIONS[name], steps=5, compiled=True), want)


def test_a_forward_without_gradients_takes_the_count_and_counts_nothing():
    state = mixprec.fp8.LayerState()
    state.rounding_step = 3
    with torch.inference_mode():
        step = state.next_rounding_step()
    assert int(step) == 3 and state.rounding_step == 3 and not state.draws and not step.is_inference()
    with torch.no_grad():
        assert int(state.next_rounding_step()) == 3
    assert int(state.next_rounding_step()) == 3 and state.rounding_step == 4 and state.draws


def _train_experts(evaluate=None, steps: int = 6) -> tuple:
    """A token-choice MoE's experts converted to NVFP4 (grouped GEMMs, one count per expert)."""
    from torch import nn

    from test_grouped_experts import MoE

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), MoE(64, 64, 4), nn.Linear(64, 32))
    mixprec.fp8.convert(model, "nvfp4", filter_fn=lambda m, fqn: fqn.endswith("experts"), backend="emulate_fp32")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen, held_out = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    losses = []
    for step in range(steps):
        x = torch.randn(32, 32, generator=gen)
        with mixprec.autocast("cpu", torch.bfloat16):
            if evaluate is not None and step % 2 == 1:
                with evaluate(model):
                    model(torch.randn(8, 32, generator=held_out))
            loss = model(x).float().square().mean()
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    counts = {name: state.rounding_step for name, state in mixprec.fp8.layer_states(model).items()}
    return losses, counts, model.state_dict(), None


@pytest.mark.parametrize("evaluation", ["no_grad", "inference_mode"])
def test_an_evaluation_between_steps_leaves_nvfp4_experts_bitwise(evaluation):
    want = _train_experts()
    assert len(want[1]) == 12 and set(want[1].values()) == {6}  # (3 weights x 4 experts, one call a step)
    _assert_same_run(_train_experts(EVALUATIONS[evaluation]), want)


def _first_call_cases() -> dict:
    def policy(recipe, **live):
        return lambda model: mixprec.Policy.parse("compute=bf16").fp8(recipe, first_last="fp8", backend="emulate_fp32",
                                                                      **live)

    def guarded(recipe):
        def build(model):
            guard = mixprec.fp8.Guard(every=2)
            guard.attach(model)
            return policy(recipe, guard=guard.settings)(model), guard
        return build

    def controlled(model):
        ctl = mixprec.fp8.Controller(**(SETTINGS | {"every": 2}))
        ctl.attach(model)
        return policy("nvfp4", controller=ctl.settings)(model), ctl

    return {
        "policy nvfp4": lambda m: (policy("nvfp4")(m), None),
        "policy mxfp4": lambda m: (policy("mxfp4")(m), None),
        "policy tensorwise": lambda m: (policy("tensorwise")(m), None),
        "Guard, tensorwise": guarded("tensorwise"),  # (its windows, updated in place)
        "Guard, nvfp4": guarded("nvfp4"),
        "Controller, NVFP4 ladder": controlled,
    }


FIRST_CALLS = _first_call_cases()


def _train_after(build, first=None, steps: int = 6) -> list[float]:
    """Train ``_model(0)`` under what ``build(model)`` gives (a policy, a Guard or Controller to
    step), after a first forward under ``first()`` when given."""
    model = _model(0)
    policy, live = build(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    if first is not None:
        with mixprec.autocast("cpu", policy=policy), first():
            model(torch.randn(8, 64, generator=torch.Generator().manual_seed(2)))
    losses = []
    for _ in range(steps):
        with mixprec.autocast("cpu", policy=policy):
            loss = model(torch.randn(16, 64, generator=gen)).float().square().mean()
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
        if live is not None:
            live.step()
    return losses


@pytest.mark.parametrize("build", FIRST_CALLS.values(), ids=FIRST_CALLS.keys())
def test_a_first_forward_under_inference_mode_leaves_states_training_can_use(build):
    want = _train_after(build)
    assert _train_after(build, torch.inference_mode) == want
    assert _train_after(build, torch.no_grad) == want


def test_a_state_moved_under_inference_mode_holds_normal_tensors():
    state = mixprec.fp8.LayerState()
    with torch.inference_mode():
        state.to("meta")
    assert state.device.type == "meta"
    assert not any(t.is_inference() for t in (state._data, state.output_sqnr_db, state._rounding))
