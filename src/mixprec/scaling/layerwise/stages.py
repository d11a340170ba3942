"""Per-layer scaling across pipeline stages (``torch.distributed.pipelining``).

A model split into stages is one chain of cut points: stage 0's (the input side) first, then stage
1's, and so on, each stage holding the cut points the unsplit model's scaler would choose among its
modules (a stage before the last keeps its last block's output: the unsplit model cuts there too).
Every stage's :class:`~mixprec.scaling.layerwise.Layerwise` holds the state of *all* the cut
points (their factors, margins, trackers, budgets; every region's statistic) and hooks its own:

* the gradient a stage receives at its output carries the scale of the region it left on the next
  stage (:attr:`StageLayout.entry`: the region below the next stage's lowest cut point), and the
  gradient it sends back carries its own lowest region's (:attr:`StageLayout.bottom`), both
  whatever ran in the step (a stage whose lower blocks were skipped brings its input's gradient to
  that scale, as it brings a parameter's): the gradients crossing a boundary are those of the
  unsplit model, bit for bit;
* ``update()`` all-reduces (MAX), in one collective over the scaler's group, every region's
  statistic, each cut point's parent region (as its stage learnt it) and the cut points each stage
  skipped in the step; every rank then applies the same rule to the same numbers.

The stages find each other once, in ``watch(stage)`` (one ``all_gather_object`` over the group):
which cut points each stage holds.
"""

from __future__ import annotations

import math
import weakref
from typing import Any, NamedTuple, Sequence

import torch

from mixprec.scaling.layerwise.graph import tensors_of
from mixprec.scaling.unscaling import pipeline_stage

__all__ = ["StageHook", "StageLayout", "agree", "pipeline_stage", "stage_layout"]


class StageLayout(NamedTuple):
    """Where one pipeline stage's cut points lie among all the stages'.

    Attributes:
        index, count: this stage's index and the number of stages.
        offset: the index of this stage's first cut point among all the stages' (its cut points
            are ``offset .. offset + len(local) - 1``).
        local: this stage's cut points, module names in the stage's module.
        names: every stage's cut points, stage 0's first (prefixed ``stage{i}.`` where two
            stages' names collide).
        entry: the region whose scale the gradient arriving at this stage's output carries (0,
            the loss scale's, on the last stage).
        bottom: the region whose scale the gradient this stage sends back carries.
    """

    index: int
    count: int
    offset: int
    local: list[str]
    names: list[str]
    entry: int
    bottom: int


def stage_layout(local: Sequence[str], index: int, count: int, group: Any) -> StageLayout:
    """The layout of stage ``index`` of ``count``, whose cut points are ``local``: one
    ``all_gather_object`` over ``group`` (every rank of the group calls it, in ``watch``).

    Raises:
        ValueError: ``group`` is ``None`` (no process group, or torch.distributed is not
            initialized), it lacks a stage, a stage counts the stages differently, or two ranks
            of one stage (replicas) cut it differently; the same on every rank of the group.
    """
    import torch.distributed as dist

    if group is None:
        raise ValueError(
            "GradScaler(per_layer=True).watch(stage) of a pipeline stage needs process_group: the group of every "
            "rank that trains the pipeline (every stage, every replica; process_group='default' for the world), so "
            "that the stages agree on the factors (and torch.distributed initialized)."
        )
    described = f"the process group of global ranks {dist.get_process_group_ranks(group)}"
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (index, count, list(local)), group=group)
    stages: dict[int, list[str]] = {}
    for i, n, names in gathered:
        if n != count or stages.setdefault(i, names) != names:
            raise ValueError(
                f"per_layer: the ranks of {described} disagree on the pipeline: (stage, stages, cut points) "
                f"{sorted(set((i, n, tuple(c)) for i, n, c in gathered))}. Every rank must watch its stage of "
                "the same pipeline, and replicas of a stage must hold the same modules."
            )
    if sorted(stages) != list(range(count)):
        raise ValueError(
            f"per_layer: {described} holds stages {sorted(stages)} of {count}, and the factors of a pipeline "
            "are agreed among all its stages: give GradScaler(per_layer=True) the group of every rank that trains "
            "the pipeline (every stage and every data-parallel replica; process_group='default' for a "
            "pipeline over the world), not one stage's data-parallel group."
        )
    sizes = [len(stages[i]) for i in range(count)]
    flat = [name for i in range(count) for name in stages[i]]
    clash = len(set(flat)) != len(flat)
    names = [f"stage{i}.{name}" if clash else name for i in range(count) for name in stages[i]]
    entry, bottom = 0, 0
    for i in reversed(range(count)):  # the last stage's gradients leave region 0
        offset = sum(sizes[:i])
        below = offset + 1 if sizes[i] else entry
        if i == index:
            return StageLayout(index, count, offset, list(local), names, entry, below)
        entry = below
    raise AssertionError("unreachable: index is among the stages")


def agree(
    stats: torch.Tensor, parents: Sequence[int], local: range, skipped: set[int], group: Any
) -> tuple[torch.Tensor, list[int], set[int]]:
    """One all-reduce (MAX) over ``group`` of the step's statistics (NaN as inf), the parent
    region of this stage's cut points ``local`` (others: -1) and the cut points it ``skipped``;
    returns the reduced statistics, every cut point's parent and every skipped cut point. One
    host read of the parents and skips (free in host memory)."""
    n = len(parents)
    mine = [float(p) if k in local else -1.0 for k, p in enumerate(parents)]
    flags = [1.0 if k in skipped else 0.0 for k in range(n)]
    extra = torch.tensor(mine + flags, dtype=torch.float32).to(stats.device)
    combined = torch.cat([torch.nan_to_num(stats, nan=math.inf, posinf=math.inf), extra])
    torch.distributed.all_reduce(combined, op=torch.distributed.ReduceOp.MAX, group=group)
    tail = combined[n + 1:].tolist()
    return combined[: n + 1], [int(p) for p in tail[:n]], {k for k in range(n) if tail[n + k] > 0}


class StageHook:
    """The forward hook on the module of a pipeline stage before the last, which scales no loss:
    plans the backward from the stage's outputs (what ``scale(loss)`` does on the last stage),
    once per micro-batch. Inert on a copy of the module, with grad disabled, and in a backward's
    recomputation (activation checkpointing)."""

    def __init__(self, owner: Any = None, module: torch.nn.Module | None = None) -> None:
        self.owner = None if owner is None else weakref.ref(owner)
        self.module = None if module is None else weakref.ref(module)

    @torch._dynamo.disable
    def __call__(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        owner = None if self.owner is None else self.owner()
        if owner is None or self.module is None or module is not self.module():
            return
        tensors = [t for t in tensors_of(output) if t.grad_fn is not None]
        if tensors and torch._C._current_graph_task_id() == -1:
            owner.observe(tensors, tensors[0].device)

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (StageHook, ())
