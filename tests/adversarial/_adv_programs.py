"""Small training programs of the kind users write, as data, and hypothesis strategies drawing them.

A :class:`Shape` builds the model (``blocks`` of ``Linear(width, width) + Tanh`` in an
``nn.ModuleList`` and a ``Linear(width, out)`` head, optionally a block shared at two positions or
two blocks with a tied weight); a :class:`Step` says what one optimizer step does (which blocks
run, where the forward exits early, how many rows each micro-batch has, per rank); the data of a
micro-batch is a function of ``(seed, step, rank, micro-batch)`` only, so a run can be repeated,
interrupted and resumed, or split over ranks, and see the same numbers.

Every test of ``tests/adversarial`` draws from here, so a pattern added once (say, a step whose
micro-batch is empty) reaches every feature combination.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import torch
from hypothesis import strategies as st
from torch import nn

from _train_cases import Data


@dataclass(frozen=True)
class Shape:
    """The model: ``blocks`` blocks of width ``width`` (weights times ``gain``), a head of
    ``out`` features. ``shared=(i, j)``: position ``j`` runs block ``i``'s module again;
    ``tied=(i, j)``: block ``j``'s Linear uses block ``i``'s weight."""

    width: int = 32
    blocks: int = 4
    gain: float = 0.05
    out: int = 1
    shared: tuple[int, int] | None = None
    tied: tuple[int, int] | None = None
    seed: int = 0


@dataclass(frozen=True)
class Step:
    """One optimizer step: ``skip`` blocks left out, the forward leaves after block ``depth - 1``
    (``None``: all blocks), ``rows[r]`` the rows of each micro-batch of rank ``r`` (an empty
    tuple: that rank runs no forward this step; 0 rows: an empty micro-batch); ``rank_skip[r]``:
    blocks rank ``r`` leaves out besides ``skip`` (ranks whose forwards differ know different
    layers, possibly as many); ``micro_skip[m]``: blocks micro-batch ``m`` leaves out besides
    those (a router's choice per batch: a layer may run in the step's later micro-batches only,
    or leave them)."""

    skip: frozenset[int] = frozenset()
    depth: int | None = None
    rows: tuple[tuple[int, ...], ...] = ((8,),)
    rank_skip: tuple[frozenset[int], ...] = ()
    micro_skip: tuple[frozenset[int], ...] = ()

    def skipped(self, rank: int = 0, micro: int = 0) -> frozenset[int]:
        """The blocks rank ``rank`` leaves out of its micro-batch ``micro`` on this step."""
        return (self.skip | (self.rank_skip[rank] if rank < len(self.rank_skip) else frozenset())
                | (self.micro_skip[micro] if micro < len(self.micro_skip) else frozenset()))


class Net(nn.Module):
    """The model of a :class:`Shape`; ``forward(x, step, rank, micro)`` runs the blocks ``step`` says."""

    def __init__(self, shape: Shape) -> None:
        super().__init__()
        torch.manual_seed(shape.seed)
        blocks = [nn.Sequential(nn.Linear(shape.width, shape.width), nn.Tanh()) for _ in range(shape.blocks)]
        with torch.no_grad():
            for block in blocks:
                block[0].weight.mul_(shape.gain)
        if shape.shared is not None:
            blocks[shape.shared[1]] = blocks[shape.shared[0]]
        self.blocks = nn.ModuleList(blocks)
        if shape.tied is not None:
            i, j = shape.tied
            self.blocks[j][0].weight = self.blocks[i][0].weight
        self.head = nn.Linear(shape.width, shape.out)

    def forward(self, x: torch.Tensor, step: Step = Step(), rank: int = 0, micro: int = 0) -> torch.Tensor:
        depth = len(self.blocks) if step.depth is None else step.depth
        skipped = step.skipped(rank, micro)
        for i in range(depth):
            if i not in skipped:
                x = self.blocks[i](x)
        return self.head(x)


def batch(shape: Shape, seed: int, step: int, rank: int, micro: int, rows: int, drift: float = 1.0,
          outlier: float | None = None) -> torch.Tensor:
    """The input of one micro-batch: ``randn(rows, width)`` from ``(seed, step, rank, micro)``;
    feature 0 times ``drift ** step``; with ``outlier``, element (0, 1) set to it."""
    g = torch.Generator().manual_seed(((seed * 1009 + step) * 31 + rank) * 17 + micro)
    x = torch.randn(rows, shape.width, generator=g)
    x[:, 0] *= drift ** step
    if outlier is not None and rows:
        x[0, 1] = outlier
    return x


def loss_of(out: torch.Tensor) -> torch.Tensor:
    """The loss of a micro-batch: mean of squares in float32 (a sum, 0, for an empty batch)."""
    out = out.float()
    return out.pow(2).mean() if out.numel() else out.sum()


def net(shape: Shape, *, seed: int) -> Net:
    """The model of ``shape`` with initial weights from ``seed`` (a case's model builder)."""
    return Net(replace(shape, seed=seed))


@dataclass(frozen=True)
class ProgramData(Data):
    """A program's data as a case's (tests/_train_cases.py): the micro-batches of ``steps[t]``
    (rank 0's), :func:`batch` of them (feature 0 times ``drift ** t``; an outlier of 1e6 on step
    ``outlier_step``), the loss :func:`loss_of`; the first micro-batch's loss of step
    ``overflow_step`` times inf (an overflow)."""

    shape: Shape
    steps: tuple[Step, ...]
    drift: float = 1.0
    outlier_step: int | None = None
    overflow_step: int | None = None

    def micro_batches(self, t: int) -> Sequence[Any]:
        return tuple(enumerate(self.steps[t].rows[0]))

    def loss(self, model: nn.Module, region: Callable[[], Any], batch_: Any, t: int) -> torch.Tensor:
        m, rows = batch_
        x = batch(self.shape, self.shape.seed, t, 0, m, rows, drift=self.drift,
                  outlier=1e6 if self.outlier_step == t else None)
        with region():
            loss = loss_of(model(x, self.steps[t], 0, m))
        return loss * float("inf") if self.overflow_step == t and m == 0 else loss


def clone_model(model: nn.Module) -> nn.Module:
    """A deep copy keeping shared modules and tied parameters shared (deepcopy's memo)."""
    return copy.deepcopy(model)


def grads_equal(model: nn.Module, reference: nn.Module) -> list[str]:
    """The parameter names whose ``.grad`` differs bitwise from the reference's (None vs a tensor
    counts as a difference; None vs None does not)."""
    bad = []
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        if (p.grad is None) != (q.grad is None):
            bad.append(f"{name} (grad {'None' if p.grad is None else 'set'} vs reference "
                       f"{'None' if q.grad is None else 'set'})")
        elif p.grad is not None and not torch.equal(p.grad, q.grad):
            ratio = (p.grad.abs().max() / q.grad.abs().max()).item() if q.grad.abs().max() > 0 else float("nan")
            bad.append(f"{name} (amax ratio {ratio:.6g})")
    return bad


# ----------------------------------------------------------------------------------- strategies


@st.composite
def shapes(draw: st.DrawFn, widths: tuple[int, ...] = (16, 32), max_blocks: int = 4,
           sharing: bool = True, out: int = 1) -> Shape:
    n = draw(st.integers(2, max_blocks))
    pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
    shared = tied = None
    if sharing:
        kind = draw(st.sampled_from(["none", "none", "shared", "tied"]))
        if kind != "none":
            pair = draw(st.sampled_from(pairs))
            shared, tied = (pair, None) if kind == "shared" else (None, pair)
    return Shape(width=draw(st.sampled_from(widths)), blocks=n,
                 gain=draw(st.sampled_from([0.05, 0.3, 1.0])), out=out, shared=shared, tied=tied,
                 seed=draw(st.integers(0, 3)))


@st.composite
def steps(draw: st.DrawFn, blocks: int, ranks: int = 1, max_steps: int = 12, min_steps: int = 2,
          uneven: bool = True, empty: bool = True, skips: bool = True) -> tuple[Step, ...]:
    """A schedule: per step the skipped blocks, the early-exit depth and the rows per micro-batch
    of each rank (``uneven``: ranks may run different numbers of micro-batches, none included,
    and, with ``skips``, leave out different blocks), and with ``skips`` the blocks some of its
    micro-batches leave out besides."""
    n = draw(st.integers(min_steps, max_steps))
    out = []
    for _ in range(n):
        skip = frozenset(draw(st.sets(st.integers(0, blocks - 1), max_size=blocks - 1))) if skips else frozenset()
        depth = draw(st.one_of(st.none(), st.integers(1, blocks))) if skips else None
        row = st.sampled_from([0, 4, 8]) if empty else st.sampled_from([4, 8])
        counts = st.integers(0 if uneven and ranks > 1 else 1, 3)
        if uneven:
            rows = tuple(tuple(draw(st.lists(row, min_size=draw(counts), max_size=3))[:3]) for _ in range(ranks))
        else:
            k = draw(counts)
            rows = tuple(tuple(draw(st.lists(row, min_size=k, max_size=k))) for _ in range(ranks))
        rank_skip: tuple[frozenset[int], ...] = ()
        if uneven and skips and ranks > 1 and draw(st.booleans()):
            rank_skip = tuple(frozenset(draw(st.sets(st.integers(0, blocks - 1), max_size=1))) for _ in range(ranks))
        micro_skip: tuple[frozenset[int], ...] = ()
        if skips and max(map(len, rows)) > 1 and draw(st.booleans()):
            micro_skip = tuple(frozenset(draw(st.sets(st.integers(0, blocks - 1), max_size=1))) for _ in range(3))
        out.append(Step(skip=skip, depth=depth, rows=rows, rank_skip=rank_skip, micro_skip=micro_skip))
    return tuple(out)

