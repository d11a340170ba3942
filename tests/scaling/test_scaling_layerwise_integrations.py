"""Per-layer gradient scaling with reentrant activation checkpointing and with HF Accelerate.

The models and helpers are ``test_scaling_layerwise``'s: the 44-binade chain of ``Shrink ->
Linear -> tanh`` blocks under ``mixprec.autocast`` float16, and its fp32 reference gradients.
"""

from __future__ import annotations

import os
from types import MethodType
from typing import Any, Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import mixprec
from test_scaling_layerwise import _data, _flushed, _grads_after, _loss, _reference_grads, _rel_err, chain

CUTS = [f"blocks.{i}" for i in range(8)]


def _checkpointed_linear(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A block's forward with its ``Linear`` under a reentrant checkpoint."""
    return torch.tanh(checkpoint(block.lin, block.shrink(x), use_reentrant=True))


class ReentrantChain(nn.Module):
    """The chain with ``torch.utils.checkpoint(use_reentrant=True)`` in blocks 1..7 (block 0's
    input does not require grad, which reentrant checkpointing needs): ``where="inside"``
    checkpoints each block's ``Linear`` (the cut points, the block outputs, stay outside);
    ``"block"`` checkpoints the blocks themselves; ``"function"`` a lambda calling the block."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.blocks = chain()
        self.where = where
        if where == "inside":
            for block in self.blocks[1:-1]:
                block.forward = MethodType(_checkpointed_linear, block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks[0](x)
        for block in self.blocks[1:-1]:
            if self.where == "inside":
                x = block(x)
            elif self.where == "block":
                x = checkpoint(block, x, use_reentrant=True)
            else:
                x = checkpoint(lambda y, block=block: block(y), x, use_reentrant=True)
        return self.blocks[-1](x)


def test_reentrant_checkpoints_inside_the_blocks_give_the_same_bits():
    """The walk cannot see into a reentrant checkpoint; a checkpointed module's parameters take
    the region the checkpoint lies in, and the cut-point hooks fire as without checkpointing."""
    model = chain()
    grads_a, factors_a = _grads_after(model, mixprec.GradScaler("cpu", per_layer=True).watch(model))
    ckpt = ReentrantChain("inside")
    grads_b, factors_b = _grads_after(ckpt, mixprec.GradScaler("cpu", per_layer=True, cut_points=CUTS).watch(ckpt))
    assert list(factors_a.values()) == list(factors_b.values()) and max(factors_a.values()) > 1
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))


@pytest.mark.parametrize("where", ["block", "function"])
def test_a_cut_point_inside_a_reentrant_checkpoint_is_refused(where):
    """A cut point run inside a reentrant checkpoint would get the wrong nesting (every region
    below it unscaled by the wrong factor): the first scale(loss) says what to do instead."""
    model = ReentrantChain(where)
    scaler = mixprec.GradScaler("cpu", per_layer=True, cut_points=CUTS).watch(model)
    x, t = _data(32)
    with pytest.raises(ValueError, match=r"cut point 'blocks\.[1-7]' runs inside reentrant .*use_reentrant=False"):
        scaler.scale(_loss(model, x, t))


@pytest.mark.slow
def test_reentrant_checkpoints_without_cut_points_inside_hold_the_chain():
    """After warm-up the checkpointed model's gradients are within fp16 of the fp32 ones."""
    model = ReentrantChain("inside")
    scaler = mixprec.GradScaler("cpu", per_layer=True, cut_points=CUTS).watch(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    for step in range(32):
        x, t = _data(32, seed=step)
        ref = _reference_grads(model, x, t) if step >= 30 else None
        optimizer.zero_grad()
        scaler.scale(_loss(model, x, t)).backward()
        scaler.unscale_(optimizer)
        if ref is not None:
            for name, param in model.named_parameters():
                if param.dim() == 2:
                    assert _flushed(ref[name], param.grad) < 0.01 and _rel_err(ref[name], param.grad) < 1e-2
        scaler.step(optimizer)
        scaler.update()
        assert step < 30 or not bool(scaler.last_step_skipped)


# ------------------------------------------------------------------ HF Accelerate


@pytest.fixture
def accelerate() -> Iterator[Any]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    module = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)  # a process-wide singleton holding the mixed precision
    yield module
    AcceleratorState._reset_state(True)


def _plain_loop(steps: int) -> tuple[list[Any], list[torch.Tensor]]:
    model = chain()
    scaler = mixprec.GradScaler("cpu", per_layer=True).watch(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    trace = []
    for step in range(steps):
        x, t = _data(32, seed=step)
        with mixprec.autocast("cpu", dtype=torch.float16):
            out = model(x)
        scaler.scale(F.mse_loss(out.float(), t)).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e6)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        trace.append((scaler.get_scale(), scaler.layer_scales()))
    return trace, [p.detach().clone() for p in model.parameters()]


def test_accelerate_with_a_per_layer_scaler_is_bitwise_the_plain_loop(accelerate):
    """``prepare(accelerator, scaler=GradScaler(per_layer=True))`` with fp16 on the CPU: the
    prepared model's forward, ``accelerator.backward``, ``clip_grad_norm_`` (unscale) and the
    prepared optimizer's step (step, update) go through the per-layer scaler, with the same
    factors, scales and weights as a hand-written mixprec loop."""
    from mixprec.integrations.accelerate import prepare

    steps = 12
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision="fp16")
    scaler = mixprec.GradScaler("cpu", per_layer=True)
    prepare(accelerator, scaler=scaler)
    model = chain()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-3))
    scaler.watch(model)
    trace = []
    for step in range(steps):
        x, t = _data(32, seed=step)
        accelerator.backward(F.mse_loss(model(x), t))
        accelerator.clip_grad_norm_(model.parameters(), 1e6)
        optimizer.step()
        optimizer.zero_grad()
        trace.append((scaler.get_scale(), scaler.layer_scales()))
    ref_trace, ref_weights = _plain_loop(steps)
    assert trace == ref_trace and max(trace[-1][1].values()) > 1
    assert all(torch.equal(a, b) for a, b in zip(accelerator.unwrap_model(model).parameters(), ref_weights))
