"""Per-layer scaling when what trains changes after the first step, or lies outside the watched
module: a loss term added later (an L2 penalty on a lower block, deep supervision), parameters
created later (a LoRA adapter, a replaced layer), trainable tensors outside the watched module
that feed it (a stem, a soft prompt), two forwards before their two backwards; and, beside
them, an overflow a cut point absorbs at ``min_scale``.

As in ``test_scaling_layerwise_dynamic.py``, the models run in float32, where the powers of two
of per-layer scaling round nothing: the unscaled gradients must equal a plain float32 backward
of a copy, bit for bit.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
from torch import nn

import mixprec
from mixprec.scaling.layerwise import planning


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class Net(nn.Module):
    """A stem, 4 blocks (weights x0.3: the factors differ) and a head; returns the output and
    each block's output."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(8, 1)
        with torch.no_grad():
            for block in self.blocks:
                block.lin.weight.mul_(0.3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        x, outputs = self.stem(x), []
        for block in self.blocks:
            x = block(x)
            outputs.append(x)
        return self.head(x), outputs


class LoRA(nn.Module):
    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.base = base
        self.a = nn.Parameter(torch.randn(2, 8) * 0.1)
        self.b = nn.Parameter(torch.randn(8, 2) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.a.t() @ self.b.t()


def _batch(seed: int = 0) -> torch.Tensor:
    return torch.randn(16, 8, generator=torch.Generator().manual_seed(seed))


def _plain(net: nn.Module, extra: dict[str, Any], step: int) -> list[torch.Tensor]:
    return [net(_batch())[0].pow(2).mean()]


def _l2_from_step_1(net: nn.Module, extra: dict[str, Any], step: int) -> list[torch.Tensor]:
    loss = net(_batch())[0].pow(2).mean()
    return [loss + 0.01 * net.blocks[0].lin.weight.pow(2).sum() if step >= 1 else loss]


def _prompted(net: nn.Module, extra: dict[str, Any], step: int) -> list[torch.Tensor]:
    return [net(_batch() + extra["prompt"])[0].pow(2).mean()]


def _two_forwards(net: nn.Module, extra: dict[str, Any], step: int) -> list[torch.Tensor]:
    return [net(_batch(0))[0].pow(2).mean(), net(_batch(1))[0].pow(2).mean()]


def _lora_at_step_1(net: nn.Module, extra: dict[str, Any], step: int) -> None:
    if step == 1:
        net.blocks[0].lin = LoRA(net.blocks[0].lin)


def _replace_at_step_1(net: nn.Module, extra: dict[str, Any], step: int) -> None:
    if step == 1:
        torch.manual_seed(2)
        net.blocks[1].lin = nn.Linear(8, 8)


#: name: (the losses of a step, a change before the step, the watched module, extra trainable tensors)
CASES: dict[str, tuple[Callable[..., Any], Callable[..., Any] | None, Callable[[Net], nn.Module], bool]] = {
    "an L2 penalty on block 0 added at step 1": (_l2_from_step_1, None, lambda net: net, False),
    "a LoRA adapter injected in block 0 at step 1": (_plain, _lora_at_step_1, lambda net: net, False),
    "block 1's Linear replaced at step 1": (_plain, _replace_at_step_1, lambda net: net, False),
    "the blocks watched, the stem below them outside": (_plain, None, lambda net: net.blocks, False),
    "a soft prompt outside the model": (_prompted, None, lambda net: net, True),
    "two forwards, then their two backwards": (_two_forwards, None, lambda net: net, False),
}


def _scaler(module: nn.Module, exponents=(3, -2, 5, 2), **options: Any) -> mixprec.GradScaler:
    """A per-layer scaler watching ``module``, its factors set to ``2**exponents`` (a wrongly
    counted factor shows)."""
    scaler = mixprec.GradScaler("cpu", per_layer=True, init_scale=16.0, **options).watch(module)
    state = scaler.state_dict()
    names = state["layerwise"]["cut_points"]
    n = len(names)
    state["layerwise"] = {
        "cut_points": names, "exponent": list(exponents[:n]), "margin": [0] * n,
        "growth_tracker": [0] * n, "hysteresis_left": [1] * n,
    }
    scaler.load_state_dict(state)
    return scaler


def _trainable(net: nn.Module, extra: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {**dict(net.named_parameters()), **extra}


def _run(losses, change, watched, prompt: bool, steps: int = 3) -> None:
    """``steps`` steps (lr 0, the same batches); asserts after ``unscale_`` that every
    trainable tensor's gradient is a float32 backward's of a copy, bit for bit."""
    net = Net()
    noise = torch.randn(16, 8, generator=torch.Generator().manual_seed(3))
    extra = {"prompt": nn.Parameter(noise * 0.1)} if prompt else {}
    scaler = _scaler(watched(net))
    for step in range(steps):
        if change is not None:
            change(net, extra, step)
        ref_net, ref_extra = copy.deepcopy((net, extra))
        for loss in losses(ref_net, ref_extra, step):
            loss.backward()
        want = {n: t.grad for n, t in _trainable(ref_net, ref_extra).items()}
        optimizer = torch.optim.SGD(list(_trainable(net, extra).values()), lr=0.0)
        optimizer.zero_grad()
        for loss in [scaler.scale(loss) for loss in losses(net, extra, step)]:
            loss.backward()
        scaler.unscale_(optimizer)
        wrong = [n for n, t in _trainable(net, extra).items() if not torch.equal(t.grad, want[n])]
        assert wrong == [], f"step {step}"
        scaler.step(optimizer)
        scaler.update()


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_what_trains_changes_or_lies_outside_the_watched_module_gives_exact_gradients(case):
    _run(*case)


def test_deep_supervision_added_later_is_refused_as_from_the_first_step():
    """An auxiliary loss on block 1's output from step 1: the cut point's gradient sums paths
    that crossed different cut points. Before, the step skipped the walk and its gradients were
    silently wrong."""
    net = Net()
    scaler = _scaler(net)
    scaler.scale(net(_batch())[0].pow(2).mean()).backward()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.0)
    scaler.step(optimizer)
    scaler.update()
    out, hidden = net(_batch())
    with pytest.raises(ValueError, match="'blocks.1' receives gradients that crossed different cut points"):
        scaler.scale(out.pow(2).mean() + hidden[1].pow(2).mean())


def test_a_tensor_outside_the_model_first_trained_late_is_refused_then_placed():
    """A soft prompt created at step 1 (no module holds it): the step's backward was planned
    without a walk, so unscale_ refuses its gradient; the next steps are walked and exact."""
    net = Net()
    scaler = _scaler(net)
    scaler.scale(_plain(net, {}, 0)[0]).backward()
    scaler.step(torch.optim.SGD(net.parameters(), lr=0.0))
    scaler.update()
    prompt = nn.Parameter(torch.full((16, 8), 0.1))
    optimizer = torch.optim.SGD([*net.parameters(), prompt], lr=0.0)
    scaler.scale(_prompted(net, {"prompt": prompt}, 1)[0]).backward()
    with pytest.raises(ValueError, match=r"tensors of shape \(16, 8\) got a gradient, but no graph walk placed"):
        scaler.unscale_(optimizer)
    scaler.update(new_scale=16.0)
    for step in range(2):
        ref_net, ref_prompt = copy.deepcopy((net, prompt))
        _prompted(ref_net, {"prompt": ref_prompt}, step)[0].backward()
        optimizer.zero_grad()
        scaler.scale(_prompted(net, {"prompt": prompt}, step)[0]).backward()
        scaler.unscale_(optimizer)
        assert torch.equal(prompt.grad, ref_prompt.grad), f"step {step}"
        assert all(torch.equal(p.grad, r.grad) for p, r in zip(net.parameters(), ref_net.parameters()))
        scaler.step(optimizer)
        scaler.update()


def test_regular_steps_still_skip_the_walk(monkeypatch):
    """The shortcut stays: after the first step, a regular step walks only the head (a walk
    that stops at the cut points), also after a forward whose graph died unscaled (an
    evaluation with grad enabled) and after two forwards then two backwards."""
    full = []
    real = planning.walk

    def counting(*args: Any, **kwargs: Any) -> Any:
        full.append(not kwargs.get("stop_at_cuts", False))
        return real(*args, **kwargs)

    monkeypatch.setattr(planning, "walk", counting)
    net = Net()
    scaler = _scaler(net)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.0)
    walked = []
    for step, kind in enumerate(["plain", "plain", "eval", "plain", "two", "plain", "plain"]):
        full.clear()
        optimizer.zero_grad()
        if kind == "eval":
            net(_batch(5))  # computed with grad, never scaled: its graph dies here
        for loss in [scaler.scale(loss) for loss in (_two_forwards if kind == "two" else _plain)(net, {}, step)]:
            loss.backward()
        scaler.step(optimizer)
        scaler.update()
        walked.append(sum(full))
    assert walked == [1, 0, 0, 0, 1, 0, 0]


def test_an_overflow_a_cut_point_absorbs_at_min_scale_is_no_min_scale_error():
    """The loss scale at ``min_scale``, an inf below cut point 'blocks.0': the cut point backs
    off, the loss scale is kept, and that is no MinScaleError (before, it was raised)."""
    net = Net()
    scaler = _scaler(net, min_scale=16.0, on_min_scale="raise")
    optimizer = torch.optim.SGD(net.parameters(), lr=0.0)
    factors = []
    for step in range(3):
        optimizer.zero_grad()
        scaler.scale(_plain(net, {}, step)[0]).backward()
        if step == 1:
            net.blocks[0].lin.weight.grad[0, 0] = float("inf")
        scaler.step(optimizer)
        scaler.update()
        factors.append(scaler.layer_scales()["blocks.0"])
        assert scaler.get_scale() == 16.0
    assert factors[1] == factors[0] / 2  # absorbed by the cut point


def test_an_overflow_above_every_cut_point_at_min_scale_still_raises():
    net = Net()
    scaler = _scaler(net, min_scale=16.0, on_min_scale="raise")
    optimizer = torch.optim.SGD(net.parameters(), lr=0.0)
    scaler.scale(_plain(net, {}, 0)[0]).backward()
    net.head.weight.grad[0, 0] = float("inf")
    scaler.step(optimizer)
    with pytest.raises(mixprec.MinScaleError):
        scaler.update()
