"""The audit's passes: forward/backward runs from a snapshot of the model, restored after."""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from torch import nn

from mixprec.diagnostics.event import NonFiniteEvent
from mixprec.diagnostics.trace import trace_nonfinite
from mixprec.engine.region import autocast

__all__ = ["FixedScale", "Passes", "Snapshot"]


class FixedScale:
    """A stand-in scaler whose ``get_scale()`` returns a fixed value."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def get_scale(self) -> float:
        return self.scale


class Snapshot:
    """Parameters, gradients, buffers and RNG state, to restore between and after passes."""

    def __init__(self, model: nn.Module, device_type: str) -> None:
        self.model = model
        self.params = [(p, p.detach().clone()) for p in model.parameters()]
        self.grads = [(p, None if p.grad is None else p.grad.detach().clone())
                      for p in model.parameters()]
        self.buffers = [(b, b.detach().clone()) for b in model.buffers()]
        self.cuda = device_type == "cuda" and torch.cuda.is_available()
        self.rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if self.cuda else None

    def reset(self) -> None:
        """Back to the snapshot's parameters, buffers and RNG; gradients cleared."""
        with torch.no_grad():
            for p, v in self.params:
                p.copy_(v)
            for b, v in self.buffers:
                b.copy_(v)
        for p, _ in self.grads:
            p.grad = None
        torch.set_rng_state(self.rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)

    def restore(self) -> None:
        """Everything as it was, gradients included."""
        self.reset()
        for p, g in self.grads:
            p.grad = g


class Passes:
    """Runs ``steps`` forward/backward passes from the snapshot, under a policy or in float32.

    Every run says what it is before it starts (``say(what)``; with ``steps > 1``, once per
    step: ``what (step i of n)``): no forward of the model runs unannounced, however long it takes.
    """

    def __init__(self, model: nn.Module, batch: Any, loss_fn: Callable[[nn.Module, Any], torch.Tensor],
                 device_type: str, steps: int, say: Callable[[str], None] = lambda line: None) -> None:
        self.model, self.batch, self.loss_fn = model, batch, loss_fn
        self.device_type, self.steps, self.say = device_type, steps, say
        self.snapshot = Snapshot(model, device_type)

    def run(self, policy: Any, scale: float, *tools: Any, what: str) -> None:
        """Passes under ``policy`` (``None``: float32) with the loss times ``scale``, inside
        ``tools`` (tracers, collectors), announced as ``what``."""
        self.snapshot.reset()
        with contextlib.ExitStack() as stack:
            for tool in tools:
                stack.enter_context(tool)
            for step in range(self.steps):
                self.say(what if self.steps == 1 else f"{what} (step {step + 1} of {self.steps})")
                for p in self.model.parameters():
                    p.grad = None
                region = contextlib.nullcontext() if policy is None else autocast(self.device_type, policy=policy)
                with region:
                    loss = self.loss_fn(self.model, self.batch)
                if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.requires_grad):
                    raise ValueError(
                        "loss_fn(model, batch) must return a scalar tensor that requires grad, "
                        f"got {type(loss).__name__}"
                        + (f" of shape {tuple(loss.shape)}, requires_grad={loss.requires_grad}"
                           if isinstance(loss, torch.Tensor) else "")
                    )
                (loss.float() * scale).backward()

    def traced(self, policy: Any, scale: float, *tools: Any, what: str) -> NonFiniteEvent | None:
        """:meth:`run` with a deferred tracer; the first inf/NaN, or None."""
        tracer = trace_nonfinite(self.model, deferred=True)
        self.run(policy, scale, tracer, *tools, what=what)
        return tracer.resolve()
