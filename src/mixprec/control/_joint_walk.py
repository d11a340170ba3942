"""One walk of a forward's autograd graph for every layer whose reach is due (:class:`JointWalk`).

Each layer's reach (:mod:`._reach`) is the share ``r`` of the gradient's squared norm its
input-gradient error carries to each earlier layer's output. Walked alone, a layer hooks every
node upstream of its output (up to :data:`~mixprec.control._reach.WALK_NODES`), so the layers of a
window that all walk hook the graph once each: on the Llama of docs/fp8.md 29 walks, about 4,700
hooks run in one backward, 150 ms of a 50 ms step. A joint walk hooks each node once for all of
them and carries ``r`` as a vector, one entry per walking layer (its *source*): a node fed by one
walked node's whole gradient takes its vector as it is (no device work); where walked gradients
``v_p`` merge, ``|sum_p sqrt(r_p) v_p|**2`` is, for every source at once, ``q' G q`` with ``G``
the merging gradients' Gram matrix (``G_pq = <v_p, v_q>``) and ``q`` their ``sqrt(r)``; a
source's own output node sets its entry to 1. A source's entry is 0 wherever its gradient does
not flow (downstream of it, a parallel branch), so the vectors need no per-source graph: the
shares are each layer's own walk's, to rounding. At each earlier layer's output the vector,
times that layer's weight, adds to every source's sum at once; the sums land in the sources'
windows at the backward's end (an autograd engine callback). No host sync.

The joint walk is bounded by :data:`JOINT_NODES`; a source whose nodes would pass it walks
alone, truncated as before (``Reach.walk_alone``)."""

from __future__ import annotations

from collections import deque
from typing import Any, Callable

import torch

from mixprec.control._update_error import TINY

__all__ = ["JOINT_NODES", "JointWalk", "dead_end", "skipped"]

#: the most autograd nodes one forward's joint walk hooks (past them, a source walks alone)
JOINT_NODES = 8192


def skipped(node: Any) -> bool:
    """A leaf's gradient accumulator: nothing upstream of it to reach."""
    return node is None or hasattr(node, "variable")


def dead_end(node: Any) -> bool:
    """A node whose gradient goes only to leaves (a weight's cast): no layer's output beyond it."""
    return all(skipped(child) for child, _ in node.next_functions)


class JointWalk:
    """One forward's joint walk (:meth:`join` per source, in forward order): the nodes hooked so
    far (by ``id``: it holds no node), and while the backward runs, per node the vectors and
    gradients its walked parents sent it, and the sources' weighted sums. ``timed`` wraps its
    hooks' work (one wrapper a walk).

    Example:
        >>> from mixprec.control._reach import Reach
        >>> k, l_ = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        >>> h = k(torch.randn(3, 4)); y = h + l_(h)  # l's error reaches k past a residual add
        >>> earlier, source = Reach(torch.device("cpu")), Reach(torch.device("cpu"))
        >>> _ = earlier.gain.fill_(1.0)
        >>> float(JointWalk().join(source, y.grad_fn.next_functions[1][0], {h.grad_fn: earlier}))
        1.0
        >>> y.square().sum().backward()
        >>> 0 < float(source.window[0]) < 1  # (its share of the gradient h received)
        True
    """

    def __init__(self, timed: Callable[[Callable], Callable] = lambda fn: fn, limit: int | None = None) -> None:
        self.sources: list[Any] = []  # each source's Reach, by its entry
        self.limit = JOINT_NODES if limit is None else limit
        self._seen: set[int] = set()  # the nodes expanded (their walked children hooked)
        self._weights: dict[int, torch.Tensor] = {}  # id(Reach) -> its weight, once a source counted it
        self._summed: list[Any] = []  # the layers whose weights _total sums, in order
        self._total: Any = 0
        self._sent: dict[int, dict[int, list]] = {}  # per node, per slot: its walked parents' (r, gradient)
        self._sums: torch.Tensor | None = None
        self._queued = False
        self._run = timed(self._hooked)

    def join(self, reach: Any, start: Any, earlier: dict[Any, Any]) -> Any:
        """``reach``'s layer (output node ``start``) walks over the ``earlier`` layers' output
        nodes (node -> Reach, in forward order): hook the nodes upstream of ``start`` that no
        earlier source hooked (those past ``dead_end`` nodes that are no layer's output are not
        walked). Returns the earlier layers' weights summed (what its sum is divided by), or None
        where nothing is hooked: ``start`` was reached before (a layer run again), or its nodes
        would pass :attr:`limit` (it walks alone)."""
        if id(start) in self._seen:
            return None
        new, queue = [start], deque([start])
        fresh = {id(start)}
        while queue:
            for child, _ in queue.popleft().next_functions:
                key = id(child)
                if skipped(child) or key in self._seen or key in fresh or (dead_end(child) and child not in earlier):
                    continue
                if len(self._seen) + len(fresh) >= self.limit:
                    return None
                fresh.add(key)
                new.append(child)
                queue.append(child)
        self._seen |= fresh
        source = len(self.sources)
        self.sources.append(reach)
        for node in new:
            edges = tuple((i, id(child), slot) for i, (child, slot) in enumerate(node.next_functions)
                          if child is not None and id(child) in self._seen)
            layer = reach if node is start else earlier.get(node)
            if edges or layer is not None:
                node.register_hook(_JointHook(self._run, id(node), edges, layer, source if node is start else None))
        return self._total_of(list(earlier.values()))

    def _total_of(self, layers: list[Any]) -> Any:
        """The weights of ``layers`` summed, in order (a running sum where they extend the last ones)."""
        done = self._summed
        if len(layers) < len(done) or any(a is not b for a, b in zip(layers, done)):
            self._summed, self._total = [], 0
        for layer in layers[len(self._summed):]:
            weight = self._weights.get(id(layer))
            if weight is None:
                weight = self._weights[id(layer)] = layer.weight()
            self._total = self._total + weight
            self._summed.append(layer)
        return self._total

    def _hooked(self, hook: _JointHook, grad_inputs: tuple, grad_outputs: tuple) -> None:
        if not self._queued:  # (the sums land in the windows once the backward ends)
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._land)
        sent = self._sent.pop(hook.key, None)
        r = _shares(sent, grad_outputs) if sent else None
        weight = self._weights.get(id(hook.layer)) if hook.layer is not None else None
        if r is not None and weight is not None:  # (an earlier layer of some source: every source's term)
            term = weight * r.to(weight.device)  # (layers on several devices: each term where its layer is)
            self._sums = term if self._sums is None else self._sums + term.to(self._sums.device)
        if hook.source is not None:  # (a source's output: its own entry 1, a device fill)
            if r is None:
                g = next((g for g in grad_outputs if g is not None), None)
                r = torch.zeros(len(self.sources), device=None if g is None else g.device)
            else:
                r = r.clone()
            r[hook.source] = 1.0
        if r is None or not hook.edges:
            return
        for i, child, slot in hook.edges:
            g = grad_inputs[i] if i < len(grad_inputs) else None
            if g is not None:
                self._sent.setdefault(child, {}).setdefault(slot, []).append((r, g))

    def _land(self) -> None:
        """The backward ended: each source's weighted sum into its window."""
        sums, self._sums, self._queued = self._sums, None, False
        self._sent.clear()
        if sums is None:
            return
        for source, reach in enumerate(self.sources):
            reach.window[0] += sums[source].to(reach.window.device)


def _shares(sent: dict[int, list], grads: tuple) -> torch.Tensor | None:
    """A node's vector of shares from ``sent`` (per slot, its walked parents' ``(r, gradient)``)
    and the gradients it received (``grads``): the one walked parent's ``r`` where its one
    gradient is that parent's (no device work), else per source ``|sum_p sqrt(r_p) v_p|**2``
    over the squared norm received, capped at 1; None where nothing walked arrived."""
    slots = [s for s, g in enumerate(grads) if g is not None]
    if len(slots) == 1 and len(sent) == 1:
        (slot, parts), = sent.items()
        if len(parts) == 1 and slot == slots[0] and parts[0][1] is grads[slot]:
            return parts[0][0]
    ours = total = None
    for s in slots:
        g = grads[s].float()
        squared = g.square().sum()
        total = squared if total is None else total + squared
        parts = sent.get(s)
        if not parts:
            continue
        if len(parts) == 1:
            r, v = parts[0]
            term = r.to(g.device) * (squared if v is grads[s] else v.float().square().sum())
        else:
            v = torch.stack([v.reshape(-1).to(g.device) for _, v in parts]).float()
            gram = v @ v.t()
            q = torch.stack([r.to(g.device) for r, _ in parts]).sqrt()
            term = ((gram @ q) * q).sum(0)
        ours = term if ours is None else ours + term
    if ours is None:
        return None
    return (ours / total.clamp(min=TINY)).clamp(max=1.0)


class _JointHook:
    """A node's one hook in a joint walk, after its backward: ``key`` (its ``id``), its walked
    ``edges`` ``(gradient index, child id, child slot)``, the Reach of the layer whose output it
    is (or None) and the source entry it starts (or None)."""

    __slots__ = ("run", "key", "edges", "layer", "source")

    def __init__(self, run: Callable, key: int, edges: tuple, layer: Any, source: int | None) -> None:
        self.run, self.key, self.edges, self.layer, self.source = run, key, edges, layer, source

    def __call__(self, grad_inputs: tuple, grad_outputs: tuple) -> None:
        self.run(self, grad_inputs, grad_outputs)
