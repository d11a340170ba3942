"""How far a layer's input-gradient error reaches the layers before it (``BackwardCost.reach``).

An input-gradient GEMM's error joins the gradient every earlier layer sees, but where its
gradient merges with gradient from elsewhere (a residual stream's skip path, a sibling layer
reading the same input) it is diluted: measured on tiny, a hidden layer's NVFP4 input-gradient
error induces about a hundredth of its own relative error past its block's residual add, the
head's its whole error on every earlier layer (``benchmarks/gradient_reach.py``). The backward
cost charges each earlier layer's gain with the share the error reaches it with.

The share is read off the step's own backward, without another product: on a measured step a
walk of the autograd graph upstream of the layer's GEMM hooks each node (up to
:data:`WALK_NODES`), and as the backward runs it carries, per node, the fraction ``r`` of the
gradient's squared norm that came from the layer: the layer's own node has ``r = 1``; a node
receives ``sum_p sqrt(r_p) v_p`` from the walked nodes ``p`` (their gradient ``v_p`` for it)
against the gradient it received in all, ``r = min(1, |sum_p sqrt(r_p) v_p|**2 / |total|**2)``
(a node fed only by walked nodes keeps their ``r``; one fed by a skip path too takes its
share). An error relative to a gradient by ``s`` that passes the same Jacobians as the gradient
(isotropic to first order) is then relative by ``s * r`` at each node: ``r`` at an earlier
controlled layer's output is the share of the layer's error its weight gradient sees. The
earlier layers' ``r`` are averaged, weighted by their last window's gain (what their cost
charges), into the layer's reach; a layer the walk does not reach (a parallel branch) counts
``0``; past a truncated walk (over :data:`WALK_NODES`), the last one reached counts for the
rest. A layer walks in its first measured window and every :data:`REACH_EVERY`-th after (the
others keep the last reach), once (on the window's first forward that asks: under gradient
accumulation, over the layers that forward ran before it), never inside a backward (an
activation checkpoint's recompute). The layers of one forward that walk share one joint walk
(:mod:`._joint_walk`: each node hooked once, ``r`` carried as a vector, one entry per walking
layer); a layer whose nodes do not fit it walks alone (:func:`walk`). The hooks hold no graph
node; their device work is a few norms where gradients merge, no host sync.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Callable

import torch

from mixprec.control._joint_walk import JointWalk, dead_end, skipped
from mixprec.control._update_error import TINY

__all__ = ["REACH_EVERY", "Reach", "ReachMap", "StartsOver", "WALK_NODES", "walk"]

#: the most autograd nodes one walk hooks (the layers past them take the last reached one's share)
WALK_NODES = 256
#: a layer walks its reach in the first window that measures its input gradient's cost and in
#: every ``REACH_EVERY``-th after (its reach moves slowly: on tiny about 4x from the start to step
#: 20, about 2x more by step 60); the layers that walk in one forward share a joint walk, one hook a
#: node (on the Llama of docs/fp8.md its first window's 29 walks: about 4,700 hooks alone, 50 ms
#: of a step joined, against 150 ms)
REACH_EVERY = 4


class ReachMap:
    """One controller's map, for the forward under way, from each controlled layer (its
    :class:`Reach`) to the autograd node of its GEMM's output, in the order of their forwards;
    cleared at every ``Controller.step()`` (it holds the step's nodes until then), at each forward
    of the model (a policy's: ``Controller.govern``; a converted one's: :class:`StartsOver`) and
    when the first layer it holds runs again (a pipeline stage's next micro-batch: the nodes it
    held are another graph's, which a walk must not count as layers its error does not reach); a
    later layer run again in one forward (its weight shared) keeps its latest output only."""

    def __init__(self) -> None:
        self._nodes: dict[int, tuple[Any, Any]] = {}
        self._joint: JointWalk | None = None  # the forward's joint walk (_joint_walk)

    def walk(self, reach: Reach, start: Any, timed: Callable[[Callable], Callable] = lambda fn: fn) -> None:
        """``reach``'s layer ran (its output node ``start``) and its input gradient's cost is
        measured: in a window its reach walks (:meth:`Reach.due`), it joins the forward's joint
        walk over the layers before it (:class:`~mixprec.control._joint_walk.JointWalk`: the
        graph hooked once for all the layers that walk), or walks alone where that is full
        (:meth:`Reach.walk_alone`). The hooks' work is ``timed``."""
        if not reach.due():
            return
        earlier = self.earlier(reach)
        if start is None or not earlier:
            return
        if self._joint is None:
            self._joint = JointWalk(timed)
        total = self._joint.join(reach, start, earlier)
        if total is None:
            reach.walk_alone(start, earlier, timed)
        else:
            reach.window[1] += total

    def add(self, layer: Any, node: Any) -> None:
        """``layer`` ran, its output ``node``: where it is the first layer the map holds, a new
        forward began (the map starts over); where it ran earlier in this forward (its weight
        shared), its latest output counts."""
        if self._starts(layer):
            self.clear()
        self._nodes.pop(id(layer), None)
        if node is not None:
            self._nodes[id(layer)] = (layer, node)

    def earlier(self, layer: Any) -> dict[Any, Any]:
        """``{node: layer}`` for the other layers' outputs in the forward ``layer`` runs in (none
        where it starts a new one)."""
        if self._starts(layer):
            return {}
        return {node: other for other, node in self._nodes.values() if other is not layer}

    def _starts(self, layer: Any) -> bool:
        return next(iter(self._nodes), None) == id(layer)

    def clear(self) -> None:
        self._nodes.clear()
        self._joint = None


class StartsOver:
    """A converted model's forward pre-hook (``Controller.track``) that starts its controller's
    :class:`ReachMap` over: each forward is a micro-batch's, as a policy's forward is
    (``Controller.govern``). A copy or a pickle of the model keeps a hook that does nothing (its
    probes are dropped alike); traced code does nothing."""

    __slots__ = ("reaches",)

    def __init__(self, reaches: ReachMap | None) -> None:
        self.reaches = reaches

    def __call__(self, module: Any, args: Any) -> None:
        if self.reaches is not None and not torch.compiler.is_compiling():
            self.reaches.clear()

    def __reduce__(self) -> tuple:
        return StartsOver, (None,)

    @staticmethod
    def hook(model: Any, reaches: ReachMap) -> None:
        """Hook ``model``'s forwards to start ``reaches`` over (once: a model tracked again keeps its hook)."""
        if not any(isinstance(h, StartsOver) and h.reaches is reaches for h in model._forward_pre_hooks.values()):
            model.register_forward_pre_hook(StartsOver(reaches))


#: the largest reach a checkpoint may hold: 1, and the float32 rounding over it that sessions
#: before 39 saved (``reach_rows`` clamps it since), loaded as 1
_MOST_REACH = 1.0 + 2.0 ** -20


class Reach:
    """A layer's reach (on its ``BackwardCost``): the window's sums of ``weight * r`` and of the
    weights over its walks, the last reach measured (1, undiluted, before any), and the layer's
    last mean gain (-inf before any: what its share weighs in a later layer's reach)."""

    def __init__(self, device: torch.device) -> None:
        self.window = torch.zeros(2, device=device)
        self.known = torch.ones((), device=device)
        self.gain = torch.full((), -torch.inf, device=device)
        self.asked = 0  # the windows that asked for a walk (REACH_EVERY)
        self._walks: bool | None = None  # whether the window under way walks (None: it asked for none yet)

    def weight(self) -> torch.Tensor:
        """What this layer's ``r`` weighs in a later layer's reach: its last gain, what the cost
        charges it with (about 0 before any, or for a step lost to first order)."""
        return self.gain.clamp(min=0) + TINY  # (none known anywhere: all alike)

    def due(self) -> bool:
        """Whether this ask walks: the window's first (under gradient accumulation its first
        micro-batch's: one walk a window), in the first window that asks and every
        :data:`REACH_EVERY`-th after (the others keep the last reach)."""
        if self._walks is None:
            self.asked += 1
            self._walks = not (self.asked - 1) % REACH_EVERY
        walks, self._walks = self._walks, False
        return walks

    def walk_alone(self, start: Any, earlier: dict[Any, Reach], timed: Callable[[Callable], Callable]) -> None:
        """Walk the graph upstream of ``start`` over the ``earlier`` layers' output nodes alone
        (:func:`walk`, truncated past :data:`WALK_NODES`)."""
        total = walk(start, earlier, Reach.weight, self._reached, timed)
        if total is not None:
            self.window[1] += total

    def _reached(self, weight: torch.Tensor, r: torch.Tensor | float) -> None:
        self.window[0] += weight * r

    def reset(self) -> None:
        self.window.zero_()
        self._walks = None

    def state(self) -> list:
        """The window, the last reach, the last gain (None: none yet) and the windows that asked
        for a walk, as plain data (a host sync)."""
        gain = float(self.gain)
        return [self.window.tolist(), float(self.known), gain if gain > -math.inf else None, self.asked]

    def load(self, saved: Any) -> None:
        """Restore :meth:`state` (None: saved before it was, nothing measured). Raises ValueError for anything else."""
        if saved is None:
            return
        try:
            (total, weights), known, gain, asked = saved
            values = [float(total), float(weights), float(known), -math.inf if gain is None else float(gain)]
        except (TypeError, ValueError):
            values, asked = [], None
        if (not values or any(v != v for v in values) or not 0 <= values[2] <= _MOST_REACH or min(values[:2]) < 0
                or not isinstance(asked, int) or isinstance(asked, bool) or asked < 0):
            raise ValueError(f"Controller.load_state_dict: a layer's backward_cost reach must be [[sum, weights], "
                             f"reach in [0, 1], gain or None, walks asked (an int >= 0)] as state_dict() saves it, "
                             f"got {saved!r}")
        self.window.copy_(torch.tensor(values[:2]))
        self.known.fill_(min(values[2], 1.0))
        self.gain.fill_(values[3])
        self.asked = asked


class _Walk:
    """One walk's state while the backward runs: per walked node (by ``id``), the contributions
    its walked parents sent ``{slot: [(sqrt r_p, tensor)]}`` and its own ``r`` until its hook
    (one a node, after its backward: :class:`_Hook`) passes it on. Holds no node (a hook on a
    node keeps it; it must not keep the node)."""

    def __init__(self, sink: Callable[[Any, torch.Tensor], None]) -> None:
        self.sent: dict[int, dict[int, list]] = {}
        self.r: dict[int, Any] = {}
        self.sink = sink

    def received(self, key: int, grads: tuple, weight: Any) -> None:
        """A walked node's ``r`` from what the walk sent it against what it got (``grads``)."""
        sent = self.sent.pop(key, {})
        r = _share(sent, grads)
        self.r[key] = r
        if weight is not None:
            self.sink(weight, r)

    def passed(self, key: int, grads: tuple, edges: tuple[tuple[int, int, int], ...]) -> None:
        """A walked node's gradients sent, weighted by ``sqrt r``, along its walked edges."""
        r = self.r.pop(key, None)
        if r is None:
            return
        root = 1.0 if isinstance(r, float) else r.sqrt()
        for i, child, slot in edges:
            g = grads[i] if i < len(grads) else None
            if g is not None:
                self.sent.setdefault(child, {}).setdefault(slot, []).append((root, g))


def _share(sent: dict[int, list], grads: tuple) -> Any:
    """``r`` of a node from ``sent`` (per slot, the walk's weighted contributions) and the
    gradients it received (``grads``): 1.0 or the parent's ``r`` where its one gradient is one
    walked parent's, unweighted (no device work), else the ratio of squared norms (capped at 1)."""
    if not sent:
        return 0.0
    slots = [g for g in grads if g is not None]
    if len(sent) == len(slots) and all(len(c) == 1 for c in sent.values()):
        if all(c[0][1] is grads[s] for s, c in sent.items() if s < len(grads)):
            roots = [c[0][0] for c in sent.values()]
            if all(isinstance(q, float) for q in roots):
                return 1.0
            if len(roots) == 1:
                return roots[0] * roots[0]
    ours = total = 0.0
    for s, g in enumerate(grads):
        if g is None:
            continue
        total = total + g.float().square().sum()
        if s in sent:
            mixed = sum(q * t.float() for q, t in sent[s])
            ours = ours + mixed.square().sum()
    if isinstance(total, float):
        return 0.0
    return (ours / total.clamp(min=TINY)).clamp(max=1.0)


def walk(start: Any, outputs: dict[Any, Any], weights: Callable[[Any], Any],
         add: Callable[[Any, torch.Tensor], None], timed: Callable[[Callable], Callable] = lambda fn: fn,
         limit: int = WALK_NODES) -> Any:
    """Hook the autograd graph upstream of ``start`` (a layer's GEMM output node) so that its
    backward calls, per earlier layer's output node in ``outputs`` (node -> layer, one node a
    layer: :meth:`ReachMap.earlier`) it reaches, ``add(weights(layer), r)``; returns the sum of
    the earlier layers' weights (what the added terms are divided by), or None where there is
    nothing to walk or to reach. Nodes that lead only to leaves (a weight's cast) are not walked.
    The hooks' work is ``timed``."""
    if start is None or not outputs:
        return None
    layers = {id(layer): layer for layer in outputs.values()}
    state = _Walk(add)
    seen: dict[int, Any] = {id(start): start}
    order, queue, truncated = [start], deque([start]), False
    while queue and not truncated:
        for child, _ in queue.popleft().next_functions:
            if skipped(child) or id(child) in seen or (dead_end(child) and child not in outputs):
                continue
            if len(order) >= limit:
                truncated = True
                break
            seen[id(child)] = child
            order.append(child)
            queue.append(child)
    total = sum(weights(layer) for layer in layers.values())
    reached = [node for node in order[1:] if node in outputs]
    last = reached[-1] if reached else None
    unreached = 0.0
    if truncated:
        hit = {id(outputs[n]) for n in reached}
        unreached = sum(weights(layer) for key, layer in layers.items() if key not in hit)
    received, passed = timed(state.received), timed(state.passed)  # (one wrapper a walk, not a node)
    for node in order:
        key = id(node)
        edges = tuple((i, id(child), slot) for i, (child, slot) in enumerate(node.next_functions)
                      if child is not None and id(child) in seen and child is not start)
        layer = outputs.get(node)
        if node is start:
            state.r[key] = 1.0
            if edges:
                node.register_hook(_Hook(None, passed, key, None, edges))
        elif edges or layer is not None:
            weight = None if layer is None else weights(layer) + (unreached if node is last else 0.0)
            node.register_hook(_Hook(received, passed, key, weight, edges))
    return total


class _Hook:
    """A walked node's one hook, after its backward: its ``r`` from the gradients it received
    (``received``; None: the start, whose ``r`` is 1), then its gradients sent along its walked
    ``edges``. One object a node (a walk hooks hundreds, alive until the backward: a closure's
    cells would be several, each one more for the garbage collector to move up its generations)."""

    __slots__ = ("received", "passed", "key", "weight", "edges")

    def __init__(self, received: Callable | None, passed: Callable, key: int, weight: Any,
                 edges: tuple[tuple[int, int, int], ...]) -> None:
        self.received, self.passed, self.key, self.weight, self.edges = received, passed, key, weight, edges

    def __call__(self, grad_inputs: tuple, grad_outputs: tuple) -> None:
        if self.received is not None:
            self.received(self.key, grad_outputs, self.weight)
        if self.edges:
            self.passed(self.key, grad_inputs, self.edges)
