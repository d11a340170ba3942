"""The controller's early promotions (``Controller(max_loss_cost=...)``): a forward GEMM whose
loss cost lies far over ``max_loss_cost`` is promoted within the first steps of a window that
measures it on every step, not at the window's check.

A window measures a forward GEMM's loss cost on every step when it is the first of the run or
follows a switch of that GEMM (:func:`~mixprec.control._cost.cost_steps`). In such a window
(:func:`early_window`: the first of the run, or one after a check or early promotion that switched a
forward GEMM, read from the log, so a resumed run checks the same steps), each step from the
:data:`EARLY_STEPS`-th on until the check reads, per layer, the lower bound of its forward
GEMM's mean cost so far, :data:`~mixprec.control._cost.COST_Z` standard errors below the mean
(:func:`lower_bounds`, device tensors, -inf where fewer than :data:`EARLY_STEPS` steps were
measured), all-reduced (MAX, as a check takes each rank's window), and promotes the forward
GEMMs whose bound passes the limit (:func:`early_promotions`): its window starts over on the rung
above. A cost near the limit waits for the check as before; a cost that rises over a window is
still the check's to see. The bound is a fast trigger, and loose (3 standard errors of a
variance estimated on 3 steps miss 1 time in 21): a promotion is provisional, and the check
that closes its window, whose rung below was measured on every step since, brings it down a
rung when that cost is under ``demote_loss_cost`` (``_decide._may_demote``; a run's first steps
are not its next ones: small's hidden forwards cost 2e-3 over steps 0-2 and 1e-4 after). On the
steps it reads: one all-reduce of a header and one of a float per layer (:mod:`~mixprec.control._collective`, the same on every rank, identical decisions), one
host sync; on other steps nothing. Eager, never traced: a promotion reroutes the layer (a
recompile, as any switch); the steps between read nothing but device flags.

Before the run's first check, under ``max_backward_cost``, a forward GEMM promoted early takes
its layer's backward GEMMs up with it (:func:`early_promotions`): their costs are read at checks
only (one shadow step a window), so until the first none has been, and a layer whose output
costs the loss this much this soon is the one whose backward errors cost most in the first steps
(the Llama's head: its input gradient reads 60-170 times ``max_backward_cost`` over steps 3-8,
every hidden GEMM's at most a third of it; pinned to bf16 from step 1 it keeps 0.007 nats of the
60-step run's loss). They come down as any promoted GEMM, by their rung below's measured cost,
and at the check with their forward when it comes down under them.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from mixprec.control._check import Check
from mixprec.control._cost import COST_Z
from mixprec.control._decide import composes, gemm_up, layer_up, switch_gemms, switch_layer
from mixprec.control._estimate_gap import learn_gaps
from mixprec.control._ladder import GEMMS, Decision, LayerRecord

__all__ = ["EARLY_STEPS", "TREND_STEPS", "cost_bound", "early_promotions", "early_window", "lower_bounds", "promote_early",
           "with_forward"]

#: the fewest measured steps of a window whose mean cost an early promotion reads (a variance
#: needs 2; at 3 a bound already lies well under the mean of a noisy cost)
EARLY_STEPS = 3
#: the fewest measured steps of a window whose cost's line (a rising cost's level) an early
#: promotion reads (3 degrees of freedom left: fewer leave its residual too loose to bound)
TREND_STEPS = 5


def early_window(steps: int, every: int, log: Sequence[Decision]) -> bool:
    """Whether the step after ``steps`` (``steps % every`` of its window) is one an early
    promotion reads: from the :data:`EARLY_STEPS`-th step of the run's first window, or of a
    window after one in which a forward GEMM switched (``log``'s decisions, the newest last).

    Example:
        >>> [s for s in range(1, 25) if early_window(s, 10, [])]
        [3, 4, 5, 6, 7, 8, 9]
    """
    at = steps % every
    if at == 0 or at < EARLY_STEPS:
        return False
    start = steps - at  # this window's check step; the one before starts at start - every
    if start == 0:
        return True
    for d in reversed(log):
        if d.step <= start - every:
            break
        if d.step <= start and d.gemm in (None, "output"):
            return True
    return False


def cost_bound(total: torch.Tensor, n: torch.Tensor, squares: torch.Tensor, at_sum: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bound, estimate)`` of a cost from the sums of its ``n`` per-step estimates (``total``),
    of their squares and of each times its index (0, 1, ...: ``at_sum``): the larger of two lower
    bounds, :data:`COST_Z` standard errors under the mean, and (from :data:`TREND_STEPS` steps on)
    under the level a least-squares line through the steps reaches at the last one (a cost that
    rises over the window, as a head's while the model leaves its initialization: the mean lags
    it); the estimate is the mean or that level, whichever bound is larger. -inf under
    :data:`EARLY_STEPS` steps. Tensors (no host sync), or floats in tensors.

    Example:
        >>> b, e = cost_bound(*map(torch.tensor, (15.0, 5.0, 55.0, 40.0)))  # 1, 2, 3, 4, 5
        >>> round(float(e), 6), round(float(b), 6)                          # on a line: its last
        (5.0, 5.0)
    """
    mean = total / n.clamp(min=1)
    centred = (squares - n * mean * mean).clamp(min=0)
    bound = mean - COST_Z * (centred / (n - 1).clamp(min=1) / n.clamp(min=1)).sqrt()
    middle = (n - 1) / 2
    spread = (n * (n * n - 1) / 12).clamp(min=1)  # sum of (index - middle)**2
    covary = at_sum - middle * total
    level = mean + covary / spread * middle
    residual = (centred - covary * covary / spread).clamp(min=0) / (n - 2).clamp(min=1)
    line = level - COST_Z * (residual * (1 / n.clamp(min=1) + middle * middle / spread)).sqrt()
    line = torch.where(n >= TREND_STEPS, line, -torch.inf)
    estimate = torch.where(line > bound, level, mean)
    return torch.where(n >= EARLY_STEPS, torch.maximum(bound, line), -torch.inf), estimate


def lower_bounds(recs: Sequence[LayerRecord]) -> torch.Tensor:
    """Per record, ``[bound, estimate, steps]`` of its forward GEMM's own loss cost in the open
    window (:func:`cost_bound` of its measured steps, one call over all the records' sums;
    -inf without casts on the forward, or without a cost). Device tensors, no host sync; on the
    device of the first record with a cost."""
    live = [rec.cost is not None and rec.forward_low and not rec.cost_blind for rec in recs]
    device = next((rec.cost.device for rec, alive in zip(recs, live) if alive), torch.device("cpu"))
    empty = torch.tensor([-torch.inf, 0.0, 0.0], device=device)
    if not any(live):
        return empty.expand(len(recs), 3).clone()
    sums = torch.stack([rec.cost[0, 3:7].to(device) for rec, alive in zip(recs, live) if alive])  # sum, steps, sum_sq, sum_at
    bound, estimate = cost_bound(sums[:, 0], sums[:, 1], sums[:, 2], sums[:, 3])
    rows = iter(torch.stack([bound, estimate, sums[:, 1]], dim=1).unbind(0))
    return torch.stack([next(rows) if alive else empty for alive in live])


def early_promotions(at: Check, names: Sequence[str], recs: Sequence[LayerRecord], rows: list[list[float]]
                     ) -> list[Decision]:
    """Promote the forward GEMM of each record whose all-reduced :func:`lower_bounds` row passes
    ``max_loss_cost`` (to the rung its mean cost calls for: :func:`~mixprec.control._decide.gemm_up`,
    or the layer's :func:`~mixprec.control._decide.layer_up` for a whole-layer record), and before
    the first check, under ``max_backward_cost``, its backward GEMMs below that rung with it (where
    it composes); its windows started over; returns the decisions (statistic ``loss_cost``, the
    mean as value)."""
    out, check = [], at
    for name, rec, (bound, mean, n) in zip(names, recs, rows):
        at = check.for_layer(name)  # (its share of the limits under cost_scope="model")
        limit = at.settings.max_loss_cost
        if not bound > limit or not rec.forward_low:
            continue
        here = rec.rungs[0]
        to = gemm_up(at, rec, 0, mean) if at.settings.per_gemm else layer_up(rec, at, mean)
        where, gemm = ("output GEMM: ", "output") if at.settings.per_gemm else ("", None)
        reason = (f"{where}output loss cost {mean:.4g} > {limit:g} (early: {int(n)} steps, "
                  f"{COST_Z:g} standard errors over)")
        out.append(Decision(at.steps, name, "output", "promote", at.rung_name(here), at.rung_name(to), "loss_cost",
                            mean, float(limit), reason, gemm))
        if at.settings.per_gemm:
            switch_gemms(at, rec, (0,), to)
            out += with_forward(at, name, rec, out[-1], int(n))
        else:
            switch_layer(at, rec, to)
        rec.reset()  # the window starts over on the new rung
    return out


def with_forward(at: Check, name: str, rec: LayerRecord, forward: Decision, steps: int) -> list[Decision]:
    """Before the run's first check, under ``max_backward_cost``: move the backward GEMMs of
    ``rec`` below its forward GEMM's new rung up to it (each where it composes), as the forward
    was promoted (``forward``, the decision: its cost the value, read on ``steps`` steps); their
    decisions."""
    to, out = rec.rungs[0], []
    if at.settings.max_backward_cost is None or at.steps >= at.settings.every:
        return out
    for g in (1, 2):
        here = rec.rungs[g]
        if here < to and composes(at, rec, g, to):
            reason = (f"{GEMMS[g]} GEMM: up with its forward GEMM, before any check of its own cost (forward loss "
                      f"cost {forward.value:.4g} > {forward.threshold:g}, early: {steps} steps)")
            out.append(Decision(at.steps, name, "output", "promote", at.rung_name(here), at.rung_name(to), "loss_cost",
                                forward.value, forward.threshold, reason, GEMMS[g]))
            switch_gemms(at, rec, (g,), to)
    return out


def promote_early(at: Check, names: Sequence[str], recs: Sequence[LayerRecord],
                  all_reduce_max: Callable[[torch.Tensor], torch.Tensor]) -> list[Decision]:
    """:func:`early_promotions` of ``recs`` (the layers ``names`` every rank agreed on) from their
    :func:`lower_bounds` reduced by ``all_reduce_max`` (one collective, one host sync; none without records),
    what they teach kept (:func:`~mixprec.control._estimate_gap.learn_gaps`)."""
    decided = early_promotions(at, names, recs, all_reduce_max(lower_bounds(recs)).tolist()) if recs else []
    return learn_gaps(at, dict(zip(names, recs)), decided)
