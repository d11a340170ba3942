"""The loss cost of a layer's backward GEMMs (``Controller(max_backward_cost=...)``, per GEMM):
what the error of the input-gradient and weight-gradient GEMMs costs the loss through the
updates it steers, measured on shadow steps, so that the loss, not the flush of their operands,
moves them up and down the ladder.

The weight-gradient GEMM gives ``G + E`` for the gradient ``G`` (its result from the same
operands in float32, or from bfloat16 operands accumulated in float32: ``ControllerSettings.reference``,
:mod:`._reference`). The optimizer's update is modelled as a step ``-eta * (G + E)`` along it, with
``eta`` the step it took along ``G``: ``eta = gain / |G|**2``, where ``gain = -<G, dW>`` is the
first-order loss change of the update ``dW`` it applied to the weight (measured between two
forwards). Against the step without the error, the loss changes to second order by

    cost = -eta <G, E> + eta**2 G'HE + eta**2 / 2 E'HE              (nats per step)

with ``H`` the empirical Fisher of the step's rows, as the forward cost takes it
(``_ladder.loss_cost``): ``u'Hv = rows * sum_t (g_t' u x_t) (g_t' v x_t)`` for the rows'
output gradients ``g_t`` (carrying the loss's ``1 / rows``) and inputs ``x_t``. So a GEMM whose
error is unbiased costs about its curvature term, one whose error takes from the gradient
(a flush) its first-order term. The input-gradient GEMM's result steers every layer whose
forward came before this one (the controller's tracking order, a model's forward order): its
error ``E_x`` in ``R_x`` costs the first-order share ``-<R_x, E_x> / |R_x|**2`` of their gain
and the curvature share ``|E_x|**2 / |R_x|**2 * eta * h / 2``, both times the share of the
error that reaches them (its reach, :mod:`._reach`: a residual stream's skip path dilutes a
hidden layer's about a hundredfold, the head's not at all) (``h``: this layer's mean
curvature over directions, standing in for theirs: ``tr(H) / n = rows * sum_t |g_t|**2 |x_t|**2
/ n`` for the ``n`` weights, exactly what ``Z'HZ / |Z|**2`` along a random direction ``Z``
estimates, at the cost of the rows' norms instead of a GEMM).

Under an optimizer that normalizes its updates (Adam, AdamW, Lion: ``ControllerSettings.
normalized_updates``, the default) a result's scale does not reach the step: both GEMMs' errors
are first taken as :func:`step_error` makes them, the part across the reference result against
its rescaled length, so the first-order terms vanish and a shrink or growth of the gradient costs
nothing (a result pointing against its reference keeps its whole error); what such an optimizer
does see is the error's noise, which inflates the second moment it divides by and so shrinks
every step the result steers by about half its squared share ``s = |E|**2 / |R|**2``: a shrink
term ``s / 2``. What a shrunk step loses is the loss's slope along it at its end, not its
first-order gain: the weight-gradient GEMM's shrink is weighed by the layer's **end slope**
``-<G', dW>``, ``G'`` the next step's weight gradient (another batch, at the moved weight), read
on the step after each shadow step's update (:meth:`BackwardCost.observe`). The gain read on the
gradient that made the update overstates it twice, by the update's own batch noise and by its
curvature: on the demo's small model every hidden layer's steps overshoot after step 10 (end
slope below 0, a shrink costs nothing) while the head's keeps 0.8-0.96 of its gain until step
40 (``benchmarks/step_slopes.py``). The input-gradient GEMM's shrink is still weighed by the
first-order gains of the layers before it: weighed by their end slopes, the head's NVFP4 input
gradient on tiny (seed 11) stayed until step 80 and its run ended 0.039 nats over fp32 (0.012 with it
promoted at 20). Under SGD the error is costed as it comes.

The terms are measured on shadow steps by the emulated backward GEMMs of the layer's recipe
(its own casts where its forward was not tapped, and the rung below's while a GEMM is promoted:
``linear_grads``, no forward GEMM) on the GEMM's own input, weight and output gradient; the gain on the step after each shadow step's backward (the
weight's version counter says the optimizer moved it), the end slope in that step's backward
(one reference GEMM of its output gradient with the update). Each term is a ratio in which a loss
scale cancels, and the gain's and end slope's are divided out (:meth:`BackwardCost.end_step`). Not measured under
``torch.compile``, nor where FSDP2 all-gathers the weight in fp8: there the flush rule decides.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from mixprec.formats._linear import linear_grads
from mixprec.control._cost import Cadence, share_of_rows
from mixprec.control._reach import Reach, ReachMap
from mixprec.control._reference import emulation_backend, operand_dtype, reference_mm
from mixprec.control._settings import LOW_RUNGS
from mixprec.control._update_error import (TINY, along_update, cost_ratio, mean_curvature, projections, step_error,
                                          update_terms)
from mixprec.formats._recipe import Float8Recipe

__all__ = ["BackwardCost", "BACKWARD_GEMMS", "BACKWARD_WINDOWS", "FAR", "TERMS", "backward_costs", "backward_recipes", "cost_ratio", "far_by_factor",
           "peel", "stats_read", "step_error"]

#: the backward GEMMs, in the order of the cost's rows (the GEMMs 1 and 2 of ``_ladder.GEMMS``)
BACKWARD_GEMMS = ("grad_input", "grad_weight")
#: how far (a factor) from its limit a backward GEMM's cost lets its cadence measure it in fewer
#: windows (``_cost.Cadence``): its terms are window means without a per-step variance
FAR = 2.0
#: the checks in a row whose backward cost of a GEMM reads over ``max_backward_cost`` before it is
#: promoted: each window's cost is one step's estimate (a gradient error's projection on the
#: step, of either sign), and one window over its limit by chance would ratchet a GEMM up where
#: a demotion takes ``demote_windows`` clean ones (an own cost over the limit is measured again
#: in the next window however far over: ``LayerRecord.carry_backward``); at the first check, one
#: :data:`FAR` times over is promoted at once (no window before it to confirm it, and the early
#: steps are where an NVFP4 backward does harm: the Llama's head reads 3-4x over 3.3e-5 there,
#: every hidden layer at most half of it, and its seed 5 ended +0.106 nats over fp32 with the
#: head's input gradient promoted at step 20, +0.015 at step 10; later, a window far over is a
#: spike as often: a hidden weight gradient read 185x over once after its forward switched)
BACKWARD_WINDOWS = 2
#: the cost terms a window sums per backward GEMM (first order, shrink, curvature), before its count
TERMS = 3


def far_by_factor(cost: float, limit: float) -> bool:
    """Whether ``cost`` lies :data:`FAR` times below ``limit`` (a gain: any negative cost) or above it.

    Example:
        >>> far_by_factor(1e-4, 1e-3), far_by_factor(6e-4, 1e-3), far_by_factor(5e-3, 1e-3)
        (True, False, True)
    """
    return cost * FAR <= limit or cost >= limit * FAR


class _Tap(torch.autograd.Function):
    """``(x, w)`` unchanged; its backward hands the gradients one GEMM gave them to ``sink``
    (the layer's own backward GEMMs' results: :meth:`BackwardCost.tap`)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, sink: Callable) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.sink = sink
        return x.view_as(x), w.view_as(w)

    @staticmethod
    def backward(ctx: Any, gx: torch.Tensor | None, gw: torch.Tensor | None) -> tuple:
        ctx.sink(gx, gw)
        return gx, gw, None


class _Shadow:
    """One measured forward's operands until its backward: input, weight (detached), the parameter, the
    output's gradient, (tapped) the layer's own backward GEMMs' results, the step (it draws the rows)."""

    def __init__(self, x: torch.Tensor, w: torch.Tensor, weight: torch.Tensor, tapped: bool, step: int = 0) -> None:
        self.x, self.w, self.weight, self.tapped, self.step = x, w, weight, tapped, step
        self.grad: torch.Tensor | None = None


def _emulated_grads(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor, recipe: Float8Recipe,
                    measured: tuple[bool, bool], backend: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The input and weight gradients ``recipe``'s backward GEMMs give for the output gradient
    ``g`` (emulated with ``backend``: :func:`~mixprec.control._reference.emulation_backend`), only
    those ``measured`` (the other GEMM does not run; without the
    weight gradient its operand is not cast; the forward GEMM never runs: :func:`linear_grads`)."""
    return linear_grads(x.detach(), w.detach(), g.detach().to(x.dtype), recipe, measured, backend)


class BackwardCost:
    """One layer's backward-GEMM cost measurements (on its record: ``LayerRecord.backward``).

    ``window``: ``(2, 2, 4)``, per kind (own casts, the rung below's), per backward GEMM, the
    sums of its three terms (first order, shrink, curvature: :func:`update_terms`' ``c1`` and
    ``c2`` with the shrink ``s / 2`` apart; for the input gradient ``[c1, s / 2, |E_x|**2 /
    |R_x|**2 * h / (2 |G|**2)]``) and the count; ``gain``, ``end``: the window's sums of the step
    gains and of the end slopes, with their counts. ``recipes``: what a shadow step emulates, ``(kind, recipe, (grad_input
    measured, grad_weight measured))`` (set with the rungs, ``_decide.apply_gemms``). The own
    casts' errors are read from the layer's own backward GEMMs where its forward was tapped
    (:meth:`tap`), else emulated like the rung below's.
    """

    def __init__(self, device: torch.device) -> None:
        self.window = torch.zeros(2, len(BACKWARD_GEMMS), TERMS + 1, device=device)
        self.gain = torch.zeros(2, device=device)
        self.end = torch.zeros(2, device=device)
        self.end_last = torch.full((), -torch.inf, device=device)  # the last window's mean end slope (-inf: none yet)
        self.reach = Reach(device)  # how far the input gradient's error reaches the layers before (_reach)
        self._recipes: list[tuple[int, Float8Recipe, tuple[bool, bool]]] | None = []
        # per kind (own casts, the rung below's), in which windows it is measured (LayerRecord.carry_backward)
        self.cadence = [Cadence(), Cadence()]
        self.normalized = True  # the optimizer normalizes its updates (ControllerSettings.normalized_updates: step_error)
        self.reference: torch.dtype | None = torch.float32  # the reference GEMMs' (ControllerSettings.reference: _reference)
        self.row_share, self.step = 1.0, 0  # the rows per-row terms take (cost_row_share), drawn by the step under way
        # per (kind, GEMM), as backward_costs orders them, its last measured windows' [1, cost, cost**2] (_cost.clear_pooled)
        self.pool: list[list[list[float]]] = [[] for _ in range(_KINDS)]
        # the weight gradient of the last measured step, until the optimizer moved the weight:
        # [gradient, <gradient, weight before>, the weight, its version, the loss scale or None,
        # the weight before (float32, normalized updates: its end slope's update)]
        self.pending: list[Any] | None = None
        # [gain, 1] of that update once made (end_step, or loaded): added at the layer's next forward (observe)
        self.gained: torch.Tensor | None = None
        # the update whose end slope the next step's backward reads: [update, weight, its version, the
        # slope's sum, whether a backward added to it] (ready: loaded from a checkpoint, no forward yet)
        self.slope: list[Any] | None = None
        self.ready: torch.Tensor | None = None
        self._open: _Shadow | None = None  # the tapped forward's operands, until observe() sees its output

    @property
    def due(self) -> bool:
        """Whether the window under way measures a kind it emulates (one without recipes, a
        layer whose backward GEMMs have no rung below, measures nothing: its cadence stays due)."""
        return any(self.cadence[kind].due for kind, _, _ in self.recipes)

    @property
    def recipes(self) -> list[tuple[int, Float8Recipe, tuple[bool, bool]]]:
        return self._recipes or []

    @recipes.setter
    def recipes(self, value: list[tuple[int, Float8Recipe, tuple[bool, bool]]]) -> None:
        """(A switch: measured again from the next window on, the pools emptied; the first
        routing after :meth:`loaded` is the loaded rungs' and keeps them.)"""
        if self._recipes is not None and value != self._recipes:
            for cadence in self.cadence:
                cadence.reset()
            self.pool = [[] for _ in range(_KINDS)]
        self._recipes = value

    def loaded(self) -> None:
        """Its cadences and pools were loaded with the layer's rungs (``_records.load_layer``): the
        routing for those rungs that follows is no switch (a resumed run measures the windows an
        uninterrupted one does)."""
        self._recipes = None

    def tap(self, x: torch.Tensor, weight: torch.Tensor, timed: Callable[[Callable], Callable] = lambda fn: fn
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, weight)`` for the layer's GEMM on a measured step: views whose backward hands
        the GEMM's own input and weight gradients to the measurement (no emulated GEMM for the
        own casts, ``timed``); unchanged where the own casts are not measured or no gradient flows."""
        own = any(kind == 0 for kind, _, _ in self.recipes) and self.cadence[0].due
        if not own or not torch.is_grad_enabled() or not (x.requires_grad or weight.requires_grad):
            return x, weight
        shadow = _Shadow(x.detach(), weight.detach(), weight, True, self.step)
        self._open = shadow
        return _Tap.apply(x, weight, timed(lambda gx, gw: self._measure(shadow, gx, gw)))

    def observe(self, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, measuring: bool,
                timed: Callable[[Callable], Callable] = lambda fn: fn, reaches: ReachMap | None = None) -> None:
        """A forward of the layer: count the gain of the update since the last measured backward
        (once the weight moved) and, on a measured step, measure this forward's backward (its
        hooks ``timed``) and, where its input gradient is measured, walk its reach over the
        earlier layers in ``reaches`` (:mod:`._reach`), where this forward's output goes too."""
        self._settle()  # (a step whose ctl.step() came before the optimizer's)
        if self.gained is not None:
            self.gain += self.gained
            self.gained = None
        if self.ready is not None:
            if self.ready.shape != weight.shape:
                raise ValueError(f"Controller: a checkpoint's update of shape {tuple(self.ready.shape)} for a weight of shape "
                                 f"{tuple(weight.shape)}: load the state_dict of this model's controller")
            self.slope, self.ready = [self.ready, weight, weight._version, torch.zeros((), device=weight.device), False], None
        sl = self.slope
        if (sl is not None and sl[1] is weight and weight._version == sl[2] and out.requires_grad
                and torch._C._current_graph_task_id() == -1):  # (each micro-batch; not a checkpoint's recompute)
            x2, share, step = x.detach().reshape(-1, x.shape[-1]), self.row_share, self.step
            out.register_hook(timed(lambda grad: _end_slope(sl, x2, grad, self.reference, share, step)))
        shadow, self._open = self._open, None
        # (not inside a backward: an activation checkpoint's recompute has a graph of its own)
        walks = reaches is not None and out.requires_grad and torch._C._current_graph_task_id() == -1
        if measuring and out.requires_grad:
            shadow = shadow or _Shadow(x.detach(), weight.detach(), weight, False, self.step)
            out.register_hook(timed(lambda grad: self._output_grad(shadow, grad)))
            if walks and any(m[0] for kind, _, m in self.recipes if self.cadence[kind].due):
                reaches.walk(self.reach, out.grad_fn, timed)
        if walks:
            reaches.add(self.reach, out.grad_fn)

    def _settle(self) -> None:
        """Once the optimizer made the pending gradient's update (the weight moved, ``end_step`` gave its
        scale): its gain (normalized updates: the update the next end slope reads) taken, the gradient dropped."""
        p = self.pending
        if p is not None and p[4] is not None and p[2]._version != p[3]:
            if len(p) > 5:  # (normalized updates: the update whose end slope this step's backward reads)
                self.ready = p[2].detach().float() - p[5]
            self.gained, self.pending = self._pending_gain(p[2]), None  # (none yet: a forward added the last)

    def _pending_gain(self, weight: torch.Tensor) -> torch.Tensor:
        """``[gain, 1]`` of the pending gradient's update, read on ``weight`` after it."""
        p = self.pending
        moved = (p[0] * weight.detach().float()).sum() - p[1]
        return torch.stack([-moved / p[4], torch.ones_like(moved)])

    def settled_update(self) -> torch.Tensor | None:
        """The update whose end slope the next step's backward reads, once the optimizer has made
        it (float32, the weight's size; None: none): what a checkpoint keeps of a shadow step under
        normalized updates, so a run resumed before that backward reads the same slope."""
        p = self.pending
        if self.ready is not None or p is None or len(p) < 6 or p[4] is None or p[2]._version == p[3]:
            return self.ready
        return p[2].detach().float() - p[5]

    def settled_gain(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(the window's gain sums, the made update's gain the next forward adds or None)``: what a
        checkpoint keeps (not the weight-sized gradient), apart, so a resumed run adds it where the live
        one does (the layer's next forward, after a check where it is skipped). Reads no state it changes."""
        p = self.pending
        if p is None or p[4] is None or p[2]._version == p[3]:
            return self.gain, self.gained
        return self.gain, self._pending_gain(p[2])

    def _output_grad(self, shadow: _Shadow, grad: torch.Tensor) -> None:
        shadow.grad = grad.detach()
        if not shadow.tapped:  # (tapped: measured when the own GEMMs' results come back)
            self._measure(shadow, None, None)

    def _measure(self, shadow: _Shadow, own_gi: torch.Tensor | None, own_gw: torch.Tensor | None) -> None:
        g, x, w, weight = shadow.grad, shadow.x, shadow.w, shadow.weight
        if g is None:
            return
        rows = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
        g2, x2, wf = rows[0].float(), rows[1].float(), w.float()
        if g2.shape[0] == 0:
            return
        due = [(kind, recipe, measured) for kind, recipe, measured in self.recipes if self.cadence[kind].due]
        inputs = any(m[0] for _, _, m in due)
        dtype = operand_dtype(self.reference, g.dtype)
        gm, xm = (g2, x2) if dtype == torch.float32 else rows  # (the GEMMs' operands: bfloat16 ones taken as they came)
        total = g2.shape[0]  # (the per-row terms, the input gradient's and the Fisher projections: the step's rows)
        sample = share_of_rows(total, self.row_share, shadow.step, g2.device)
        gs, xs = (gm, x2) if sample is None else (gm.index_select(0, sample), x2.index_select(0, sample))
        grad_input = reference_mm(gs, wf, dtype) if inputs else None
        grad_weight = reference_mm(gm.t(), xm, dtype)
        gg = grad_weight.square().sum().clamp(min=TINY)
        h = mean_curvature(g2, x2) if inputs else None
        along = projections(gs, xs, grad_weight, dtype) if any(m[1] for _, _, m in due) else None
        for kind, recipe, measured in due:
            if kind == 0 and shadow.tapped:
                gi, gw = own_gi, own_gw
            else:
                gi, gw = _emulated_grads(x, w, g, recipe, measured, emulation_backend(dtype))
            if measured[0] and gi is not None:
                gi = gi.reshape(total, -1) if sample is None else gi.reshape(total, -1).index_select(0, sample)
                ref, e = grad_input, gi.float() - grad_input
                e = step_error(ref, e) if self.normalized else e
                share = e.square().sum() / ref.square().sum().clamp(min=TINY)
                shrink = share / 2 if self.normalized else torch.zeros_like(share)
                self.window[kind, 0] += torch.stack([cost_ratio(ref, ref + e), shrink, share * h / (2 * gg), gg.new_ones(())])
            if measured[1] and gw is not None:
                gw = grad_weight + step_error(grad_weight, gw.float() - grad_weight) if self.normalized else gw
                terms = update_terms(gs, xs, grad_weight, gw, along, dtype, total)
                shrink = (gw - grad_weight).square().sum() / gg / 2 if self.normalized else torch.zeros_like(gg)
                self.window[kind, 1] += torch.stack([terms[0], shrink, terms[1], gg.new_ones(())])
        p = self.pending
        if p is not None and p[2] is weight and p[3] == weight._version and p[4] is None:  # another micro-batch
            p[0] += grad_weight
            p[1] += (grad_weight * wf).sum()
        else:
            self.pending = [grad_weight, (grad_weight * wf).sum(), weight, weight._version, None]
            if self.normalized:  # (the weight before the update, for its end slope)
                self.pending.append(w.detach().to(torch.float32, copy=True))

    def end_step(self, loss_scale: float | torch.Tensor) -> None:
        """The optimizer step ended: this step's end slope (its gradient carried ``loss_scale``;
        not counted where it is not finite, an overflowed gradient) joins the window, and the
        pending gradient carried ``loss_scale`` (divided out of its gain)."""
        sl, self.slope = self.slope, None
        if sl is not None and sl[4]:
            slope = -sl[3] / loss_scale
            counted = torch.isfinite(slope)
            self.end += torch.stack([torch.where(counted, slope, 0.0), counted.float()])
        if self.pending is not None and self.pending[4] is None:
            self.pending[4] = loss_scale
            self._settle()

    def reset(self) -> None:
        self.window.zero_()
        self.gain.zero_()
        self.end.zero_()
        self.reach.reset()


def _end_slope(slope: list[Any], x2: torch.Tensor, grad: torch.Tensor, reference: torch.dtype | None = torch.float32,
               share: float = 1.0, step: int = 0) -> None:
    """Add this backward's :func:`~mixprec.control._update_error.along_update` with the update
    ``slope[0]`` to ``slope``'s sum (no rows, nothing)."""
    dot = along_update(grad, x2, slope[0], operand_dtype(reference, grad.dtype), share, step)
    if dot is not None:
        slope[3], slope[4] = slope[3] + dot, True


_KINDS = 2 * len(BACKWARD_GEMMS)  # (kind, GEMM) pairs
#: the length of a layer's backward part of a check's row (:func:`~mixprec.control._windows.backward_rows`)
ROW = (TERMS + 1) * _KINDS + 5


def backward_costs(backs: list[list[float] | None]) -> list[list[float] | None]:
    """Per layer (in forward order), from its all-reduced backward row (``_windows.backward_rows``; None: no
    measurement), ``[own grad_input, own grad_weight, below grad_input, below grad_weight]``
    costs in nats per step followed by whether each was measured: the weight gradient's
    ``gain * c1 + slope * shrink + gain**2 * c2`` with its layer's gain and end slope (its gain
    until one is measured), the input gradient's ``up * (c1 + shrink) + up * gain * c2`` with
    ``up`` the gains of the layers before it summed, times the share of its error that reaches
    them (:mod:`._reach`); a negative gain or slope (the step lost to first order, or
    overshooting) counts as none.

    Example:
        >>> terms = [0.1, 0.0, 0.0, 0.2, 0.1, 1.0] + [0.0] * 6  # own (grad_input, grad_weight), below
        >>> row = terms + [1, 1, 0, 0] + [0.5, 1, 1.0] + [0.2, 1]  # gain 0.5, reach 1, end slope 0.2
        >>> [round(c, 4) for c in backward_costs([row, row])[1][:2]]  # grad_input: the first's gain
        [0.05, 0.37]
        >>> [round(c, 4) for c in backward_costs([row, row[:-3] + [0.1, 0.2, 0]])[1][:2]]  # a tenth reaches; no slope yet
        [0.005, 0.4]
    """
    out: list[list[float] | None] = []
    upstream = 0.0
    head = (TERMS + 1) * _KINDS
    for row in backs:
        if row is None:
            out.append(None)
            continue
        terms, measured, (gain, has_gain, reach, end, has_end) = row[:TERMS * _KINDS], row[TERMS * _KINDS:head], row[head:]
        own = max(gain, 0.0) if has_gain > 0 else 0.0
        own_end = max(end, 0.0) if has_end > 0 else own
        costs = []
        for i, m in enumerate(measured):
            first, shrink, curvature = terms[TERMS * i:TERMS * (i + 1)]
            scale = upstream * reach if i % 2 == 0 else own  # (kind, GEMM) in order: grad_input, grad_weight
            slope = scale if i % 2 == 0 else own_end
            costs.append(scale * first + slope * shrink + scale * own * curvature if m > 0 and has_gain > 0 else 0.0)
        out.append(costs + [float(m > 0 and has_gain > 0) for m in measured])
        upstream += own
    return out


def peel(names: list[str], rows: list[list[float]], forward: Mapping[str, int], settings: Any
         ) -> tuple[list[list[float]], dict[str, list[float] | None]]:
    """A check's all-reduced rows (of the layers ``names``) without their backward part, and
    per name its :func:`backward_costs` (None without ``settings.max_backward_cost``), computed in
    the order of ``forward`` (per name, ``LayerRecord.order``: where the layers were first reached;
    ties by name, so ranks that reached different layers first order them alike)."""
    if settings.max_backward_cost is None:
        return rows, dict.fromkeys(names)
    order = sorted(range(len(names)), key=lambda i: (forward.get(names[i], len(forward)), names[i]))
    costs = backward_costs([rows[i][-ROW:] for i in order])
    return [row[:-ROW] for row in rows], {names[i]: c for i, c in zip(order, costs)}


def backward_recipes(ladder: tuple[str, ...], rungs: list[int], own: Float8Recipe | None, downs: dict[int, int | None],
                     compose: Callable[[list[int]], Float8Recipe | None]) -> list:
    """What a shadow step emulates (``BackwardCost.recipes``) for a layer whose GEMMs are on
    ``rungs`` of ``ladder`` and run ``own``: that recipe where a backward GEMM (1, 2) runs casts,
    and the recipe (``compose(rungs)``) with each backward GEMM that may come down to casts on
    its rung below (``downs``: per GEMM, that rung or None) moved there, both in one recipe
    where they compose, else one each."""
    low = [ladder[r] in LOW_RUNGS for r in rungs]
    out = [(0, own, (low[1], low[2]))] if own is not None and (low[1] or low[2]) else []
    downs = {g: d for g, d in downs.items() if d is not None and ladder[d] in LOW_RUNGS}
    both = list(rungs)
    for g, d in downs.items():
        both[g] = d
    recipe = compose(both) if downs else None
    if recipe is not None:
        return out + [(1, recipe, (1 in downs, 2 in downs))]
    for g, d in downs.items():  # each composes alone (gemm_down)
        one = list(rungs)
        one[g] = d
        out.append((1, compose(one), (g == 1, g == 2)))
    return out


def stats_read(back: list[float] | None) -> tuple[bool, bool]:
    """Whether the next window's check reads a GEMM's own casts' statistics and the rung below's,
    from this check's backward costs of it (``back``: own, below, whether each was measured;
    None: none, the forward GEMM): not where a measured cost decides instead of the flush.

    Example:
        >>> stats_read(None), stats_read([2e-5, 0.0, 1.0, 0.0])
        ((True, True), (False, True))
    """
    return (back is None or not back[2] > 0), (back is None or not back[3] > 0)
