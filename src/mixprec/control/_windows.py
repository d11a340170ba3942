"""What a check all-reduces: each layer's windows as one row (:func:`stacked_windows`), computed
for all the layers at once from their stacked device buffers: a few dozen device ops a check
however many layers (each layer's own took about 45), bitwise each layer's own row. The
backward part (:func:`backward_rows`, :func:`reach_rows`) also moves on the running values each
layer keeps between checks: its last mean gain, reach and end slope."""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from mixprec.control._backward import TERMS, BackwardCost
from mixprec.control._reach import Reach
from mixprec.control._update_error import TINY

__all__ = ["backward_rows", "reach_rows", "stacked_windows"]


def stacked_windows(records: Sequence[Any]) -> torch.Tensor:
    """The check's rows of ``records`` (the ``LayerRecord`` of each layer of one controller: one layout, one
    device; a row each, in order): the cast statistics, the shadow's, the range, the per-GEMM
    windows, the loss costs (the window's mean estimate, own and below, -inf where none was
    measured, whether one was, the mean squared estimate and the steps measured) and last the
    backward part (:func:`backward_rows`, which the check peels off first). No host sync.

    Example:
        >>> from mixprec.control._ladder import LayerRecord
        >>> from mixprec.formats._state import LayerState
        >>> recs = [LayerRecord(None, LayerState(), 0, 0, (True,) * 3, cost=True) for _ in range(2)]
        >>> stacked_windows(recs).shape
        torch.Size([2, 34])
    """
    first = records[0]
    parts = [torch.stack([r.state.window for r in records])[:, :, :-1].flatten(1),
             torch.stack([r.shadow for r in records])[:, :, :-1].flatten(1), torch.stack([r.range for r in records])]
    if first.gemm_windows is not None:
        parts.append(torch.stack([r.gemm_windows for r in records])[..., :-1].flatten(1))
    if first.cost is not None:
        cost = torch.stack([r.cost for r in records])
        steps = cost[:, :, 4]
        mean = torch.where(steps > 0, cost[:, :, 3] / steps.clamp(min=1), -math.inf)
        parts += [mean, (steps > 0).float(), cost[:, :, 5] / steps.clamp(min=1), steps]
    if first.backward is not None:
        parts.append(backward_rows([r.backward for r in records]))
    return torch.cat(parts, dim=1)


def backward_rows(costs: Sequence[BackwardCost]) -> torch.Tensor:
    """Per :class:`~mixprec.control._backward.BackwardCost`, its window as a row of the check's
    all-reduce: the mean terms per kind and GEMM (-inf: none measured), whether each was measured,
    the mean gain (the last window's that measured one; -inf: none yet), whether there is one,
    the reach (the last measured; 1: none yet), and the mean end slope and whether there is one
    (kept alike: each cost's ``end_last``). No host sync.

    Example:
        >>> cost = BackwardCost(torch.device("cpu"))
        >>> cost.window[0, 1] += torch.tensor([0.2, 0.1, 0.4, 2.0])  # two steps' own weight-gradient terms
        >>> backward_rows([cost])[0, 3:6].tolist(), backward_rows([cost]).shape
        ([0.10000000149011612, 0.05000000074505806, 0.20000000298023224], torch.Size([1, 21]))
    """
    window = torch.stack([c.window for c in costs])
    counts = window[..., TERMS:]
    means = torch.where(counts > 0, window[..., :TERMS] / counts.clamp(min=1), -torch.inf)
    end, last = torch.stack([c.end for c in costs]), torch.stack([c.end_last for c in costs])
    last = torch.where(end[:, 1] > 0, end[:, 0] / end[:, 1].clamp(min=1), last)
    for cost, kept in zip(costs, last.unbind()):
        cost.end_last = kept
    reaches = reach_rows([c.reach for c in costs], torch.stack([c.gain for c in costs]))
    return torch.cat([means.flatten(1), (counts > 0).float().flatten(1), reaches,
                      torch.stack([last, torch.isfinite(last).float()], dim=1)], dim=1)


def reach_rows(reaches: Sequence[Reach], gains: torch.Tensor) -> torch.Tensor:
    """Per :class:`~mixprec.control._reach.Reach`, the check's ``[gain, whether there is one,
    reach]`` from its window's ``gains`` (a row each: sum, count), each the last window's where
    this one measured none (kept: the reach's ``gain`` and ``known``). No host sync.

    Example:
        >>> reach = Reach(torch.device("cpu"))
        >>> reach_rows([reach], torch.tensor([[3.0, 2.0]])).tolist(), reach_rows([reach], torch.zeros(1, 2)).tolist()
        ([[1.5, 1.0, 1.0]], [[1.5, 1.0, 1.0]])
    """
    gain = torch.where(gains[:, 1] > 0, gains[:, 0] / gains[:, 1].clamp(min=1), torch.stack([r.gain for r in reaches]))
    window = torch.stack([r.window for r in reaches])
    # (a share of the weights, at most 1: its two sums, added in their own orders, may round it over)
    known = torch.where(window[:, 1] > 0, (window[:, 0] / window[:, 1].clamp(min=TINY)).clamp(max=1.0),
                        torch.stack([r.known for r in reaches]))
    for reach, g, k in zip(reaches, gain.unbind(), known.unbind()):
        reach.gain, reach.known = g, k
    return torch.stack([gain, torch.isfinite(gain).float(), known], dim=1)
