"""A Controller's per-step device writes over all its layers at once (:class:`StepWrites`): the
step's loss-cost sums folded into each layer's window, and the step index compiled probes read.

The layers' loss-cost windows (``LayerRecord.cost``) are rows of a few shared buffers per device
(:data:`ROWS` rows each, allocated as layers are first reached, never moved: a probe's gradient
hook holds its row until the backward), so a step folds every layer that shares a loss scale in
a few ops on a buffer, with no stacking and no copies back; the step index is one device scalar
per device, written once a step. Both bitwise what each layer's own fold and counter give."""

from __future__ import annotations

import weakref
from collections import Counter
from typing import Any, Iterable, Sequence

import torch

from mixprec import _native

__all__ = ["ROWS", "StepIndex", "StepWrites", "fold"]

#: the layers' loss-cost windows per shared buffer
ROWS = 32


class StepIndex:
    """The index of the step under way on a device (``tensor``, a 0-d int64: what compiled code
    draws a loss cost's rows from, no guard), written only when it changes (``value``, its host
    copy): the layers of one controller share one per device, so a step writes it once.

    Example:
        >>> index = StepIndex(torch.device("cpu"))
        >>> index.set(3); index.set(3); int(index.tensor), index.value
        (3, 3)
    """

    __slots__ = ("tensor", "value")

    def __init__(self, device: torch.device) -> None:
        self.tensor = torch.zeros((), dtype=torch.int64, device=device)
        self.value = 0

    def set(self, step: int) -> None:
        """Write ``step`` (a device write where it changed, no host sync)."""
        if step != self.value:
            self.tensor.fill_(step)
            self.value = step


class _Buffer:
    """Up to :data:`ROWS` layers' loss-cost windows, rows ``[:used]`` handed out in order."""

    __slots__ = ("rows", "used")

    def __init__(self, shape: Sequence[int], device: torch.device) -> None:
        self.rows, self.used = torch.zeros(ROWS, *shape, device=device), 0


class StepWrites:
    """One controller's per-step device writes over its layers: the rows their loss-cost windows
    live in (:meth:`bank`) and the step index per device; :meth:`end_steps` folds a step.

    Example:
        >>> from mixprec.control._ladder import LayerRecord
        >>> from mixprec.formats._state import LayerState
        >>> writes, recs = StepWrites(), [LayerRecord(None, LayerState(), 0, 0, (True,) * 3, cost=True) for _ in range(3)]
        >>> for rec in recs:
        ...     writes.bank(rec)
        >>> for rec in recs:
        ...     rec.cost[0, :3] = torch.tensor([0.5, 0.0, 2.0])  # a step's sums: sum(g * e), squares, rows
        >>> writes.end_steps(recs, [2.0] * 3)
        >>> recs[2].cost[0, 3:5].tolist(), recs[0].step_index is recs[2].step_index
        ([0.25, 1.0], True)
    """

    def __init__(self) -> None:
        self._buffers: dict[torch.device, list[_Buffer]] = {}
        self._indices: dict[torch.device, StepIndex] = {}
        self._slots: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # record -> the buffer its window is a row of

    def bank(self, rec: Any) -> None:
        """Give ``rec`` (a newly made ``LayerRecord``, before any forward measured it) the
        controller's step index of its device and, where it has a loss-cost window, a row of a
        shared buffer for it (its values kept)."""
        device = rec.state.device
        rec.step_index = self._indices.setdefault(device, rec.step_index)
        if rec.cost is None:
            return
        buffers = self._buffers.setdefault(device, [])
        if not buffers or buffers[-1].used == ROWS:
            buffers.append(_Buffer(rec.cost.shape, rec.cost.device))
        buffer = buffers[-1]
        row = buffer.rows[buffer.used]
        row.copy_(rec.cost)
        rec.cost, buffer.used = row, buffer.used + 1
        self._slots[rec] = buffer

    def end_steps(self, records: Iterable[Any], scales: Iterable[Any]) -> None:
        """Fold each of ``records``' step loss-cost sums into its window (:func:`fold`) with its
        loss scale (``scales``, in order), and end its backward costs' step. The records on one
        device that share a scale (a number, or the same tensor) fold together: in place on a
        shared buffer all of whose layers share it (its other rows, of layers no longer tracked,
        fold unread), else stacked, as a per-layer loss scaler's layers. No host sync."""
        groups: dict[Any, tuple[Any, list[Any]]] = {}
        for rec, scale in zip(records, scales):
            if rec.backward is not None:
                rec.backward.end_step(scale)
            if rec.cost is not None:
                key = (rec.cost.device, id(scale) if isinstance(scale, torch.Tensor) else float(scale))
                group = groups.get(key)
                if group is None:
                    groups[key] = (scale, [rec])
                else:
                    group[1].append(rec)
        held = None if len(groups) == 1 else Counter(id(self._slots.get(r)) for _, recs in groups.values() for r in recs)
        for scale, recs in groups.values():
            buffers: dict[int, list] = {}  # id(buffer) -> [buffer, its records here]
            rest = []
            for rec in recs:
                buffer = self._slots.get(rec)
                if buffer is None:
                    rest.append(rec)
                else:
                    buffers.setdefault(id(buffer), [buffer, []])[1].append(rec)
            for key, (buffer, here) in buffers.items():
                if held is None or len(here) == held[key]:  # (every layer it holds shares this scale)
                    fold(buffer.rows[:buffer.used], scale, here[0].cost_sign)
                else:
                    rest += here
            rest = [r for r in rest if any(r.cost_rows_now())]  # (a step that measured no row summed nothing)
            if len(rest) == 1:
                fold(rest[0].cost.unsqueeze(0), scale, rest[0].cost_sign)
            elif rest:
                stacked = torch.stack([r.cost for r in rest])
                fold(stacked, scale, rest[0].cost_sign)
                for rec, folded in zip(rest, stacked):
                    rec.cost.copy_(folded)


def fold(c: torch.Tensor, scale: float | torch.Tensor, sign: torch.Tensor) -> None:
    """Fold the step sums of the loss-cost windows ``c`` (``(layers, 2, columns)``: per row the
    step's ``sum(g * e)``, squares and rows, then the window's sum, steps, sum of squares and
    index sum), in place, into their windows: the estimate (``_cost.loss_cost``, bitwise) of
    gradients scaled by ``scale``, ``sign`` per row (the own cost is taken at the error, the one
    below's without it); a row without rows or with a non-finite estimate (an overflowed
    gradient) is not counted, and a row that measured nothing folds into itself unchanged. On
    the CPU one pass of mixprec's C++ kernel (``cost_fold``), else torch's ops.

    Example:
        >>> c = torch.zeros(1, 2, 7); c[0, 0, :3] = torch.tensor([1.0, 0.5, 4.0])
        >>> fold(c, 2.0, torch.tensor([-1.0, 1.0])); c[0, :, 3:5].tolist()
        [[0.25, 1.0], [0.0, 0.0]]
    """
    ops = _fold_kernel(c, scale, sign)
    if ops is not None:  # (one pass in C++, the same bits: csrc/stats_kernel.cpp)
        ops.cost_fold(c, float(scale), isinstance(scale, torch.Tensor), sign)
        return
    estimate = c[..., 0] / scale + sign * (0.5 * c[..., 2] * c[..., 1] / (scale * scale))
    counted = (c[..., 2] > 0) & torch.isfinite(estimate)
    kept = torch.where(counted, estimate, 0.0)
    c[..., 3] += kept
    c[..., 6] += kept * c[..., 4]  # (its index among the window's counted steps: a rising cost's line, _early)
    c[..., 4] += counted
    c[..., 5] += kept * kept
    c[..., :3] = 0


def _fold_kernel(c: torch.Tensor, scale: Any, sign: torch.Tensor) -> Any | None:
    """``torch.ops.mixprec_native`` where its ``cost_fold`` serves (plain contiguous float32 CPU
    windows and signs; a number, or a one-element float32 CPU tensor, for the scale), else None."""
    if torch.compiler.is_compiling() or not _native.enabled():
        return None
    plain = (torch.Tensor,)
    tensors = (c, sign, scale) if isinstance(scale, torch.Tensor) else (c, sign)
    if (any(type(t) not in plain or t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous()
            for t in tensors) or c.dim() != 3 or c.shape[1] != 2 or c.shape[2] < 7 or sign.numel() != 2
            or (isinstance(scale, torch.Tensor) and scale.numel() != 1) or isinstance(scale, bool)):
        return None
    return _native.load()
