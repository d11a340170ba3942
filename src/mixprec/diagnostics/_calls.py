"""What :func:`mixprec.trace_nonfinite` records about module calls and the tensors at their
boundaries (its bookkeeping; the hooks live in ``trace.py``)."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from mixprec.diagnostics._tensors import FLOAT32_MAX
from mixprec.fp8 import layer_state

__all__ = ["Call", "SeenTensor", "min_max", "stack_pairs", "stats_mark", "version_of"]


def min_max(t: torch.Tensor) -> torch.Tensor:
    """``[min, max]`` of ``t`` as a float32 device tensor; NaN if ``t`` holds a NaN. No sync."""
    t = t.detach()
    mn, mx = torch.aminmax(t)
    pair = torch.stack((mn, mx))
    if t.dtype == torch.float64:  # finite float64 beyond float32 range must not read as inf
        pair = torch.where(torch.isfinite(pair), pair.clamp(-FLOAT32_MAX, FLOAT32_MAX), pair)
    return pair.float()


def stack_pairs(pairs: list[torch.Tensor]) -> torch.Tensor:
    """``[k, 2]`` from k pairs (a view when k == 1)."""
    return pairs[0][None] if len(pairs) == 1 else torch.stack(pairs)


def version_of(t: torch.Tensor) -> int:
    """``t``'s version counter (bumped by every in-place op); inference tensors have none."""
    return -1 if t.is_inference() else t._version


class Call:
    """One forward call of a module."""

    __slots__ = ("name", "module", "parent", "input_pairs", "inputs", "outputs", "fp8_mark",
                 "fp8", "weight_pair")

    def __init__(self, name: str, module: nn.Module, parent: "Call | None") -> None:
        self.name = name
        self.module = module
        self.parent = parent
        self.input_pairs: list[torch.Tensor] = []
        self.inputs: list[SeenTensor] = []
        self.outputs: list[SeenTensor] = []
        state = layer_state(module, create=False)
        # the fp8 statistics' storage and version: they move when the call runs in fp8
        self.fp8_mark = None if state is None else stats_mark(state)
        self.fp8 = False
        self.weight_pair: torch.Tensor | None = None


def stats_mark(state: Any) -> tuple[int, int]:
    """Where a LayerState's statistics live and their version: it changes when fp8.linear records."""
    return state.stats.data_ptr(), state.stats._version


class SeenTensor:
    """What the tracer knows about one tensor seen at a module boundary in forward."""

    __slots__ = ("ref", "version", "pair", "producer", "enclosing", "consumer", "grad_pair", "fp8_use")

    def __init__(self, t: torch.Tensor, pair: torch.Tensor, producer: Call | None,
                 enclosing: Call | None) -> None:
        self.ref = weakref.ref(t)
        self.version = version_of(t)  # an in-place op moves it: the checked values are stale
        self.pair = pair
        self.producer = producer
        self.enclosing = enclosing
        self.consumer: Call | None = None
        self.grad_pair: torch.Tensor | None = None
        self.fp8_use: tuple[str, str] | None = None  # (fp8 layer, "input") that took it
