"""The gap between a forward GEMM's two loss-cost estimates, learned where it made the GEMM flip.

A forward GEMM's loss cost is read two ways (:func:`~mixprec.control._cost.loss_cost`): on its own
rung, from the gradient with its error in it (the *own* estimate, high by ``(e'He - e'Fe)/2``
against the truth, ``F`` the empirical Fisher the curvature term uses), and while promoted, as the
rung below's, from the gradient without it (the *below* estimate, as much low). A demotion reads the
below estimate and the promotion that may follow reads the own one: where ``e'He`` far exceeds
``e'Fe`` (a language-model head: its logits' softmax curvature) the two disagree by more than the
hysteresis between ``max_loss_cost`` and ``demote_loss_cost``, and the GEMM flips: on the demo's
``small``, the head came down to fp8 on a below estimate of -1.4e-4 and went back up 80 steps
later on an own estimate of 1.4e-3 (docs/controller.md, "How far the two estimates lie").

So when a GEMM demoted for its below estimate ``b`` to a rung is promoted from that rung for its
own estimate ``o``, the gap ``o - b`` (at least 0) is kept, per unit of the rung's squared
:func:`~mixprec.control._ladder.output_roundoff` (the gap is a curvature term: it scales with the
error's square; the fp8 rungs round alike, NVFP4 16 times coarser); a later demotion compares the
below estimate plus that gap at the rung below (:func:`expected_own`: what its own estimate will
read there) with ``demote_loss_cost``. The latest flip's gap replaces the earlier one. Before a
GEMM's first flip, no gap: its first demotion reads the below estimate alone.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Mapping

from mixprec.control._ladder import Decision, LayerRecord, output_roundoff

if TYPE_CHECKING:
    from mixprec.control._check import Check

__all__ = ["expected_own", "learn_gaps"]


def _roundoff_sq(at: Check, rung: int) -> float:
    name = at.settings.ladder[rung]
    return output_roundoff(at.recipes.get(name), at.compute) ** 2


def expected_own(at: Check, rec: LayerRecord, down: int, below: float) -> float:
    """What the own estimate of the forward GEMM of ``rec`` will read on rung ``down``, whose
    below estimate is ``below``: ``below`` plus the gap learned at its last flip, scaled to that
    rung's roundoff (``below`` itself before any flip).

    Example:
        >>> from mixprec.control._check import Check
        >>> from mixprec.control._settings import ControllerSettings
        >>> from mixprec.formats._state import LayerState
        >>> at = Check.of(ControllerSettings(ladder=("nvfp4", "tensorwise", "compute"), max_loss_cost=1e-3))
        >>> rec = LayerRecord(None, LayerState(), 0, 0, (True,) * 3, cost=True)
        >>> rec.cost_gap = 1e-3 / _roundoff_sq(at, 1)  # learned on the fp8 rung
        >>> round(expected_own(at, rec, 1, 2e-4), 6), round(expected_own(at, rec, 0, 2e-4), 6)
        (0.0012, 0.0162)
    """
    return below + rec.cost_gap * _roundoff_sq(at, down) if rec.cost_gap else below


def learn_gaps(at: Check, records: Mapping[str, LayerRecord], decisions: list[Decision]) -> list[Decision]:
    """Keep, in the records of ``decisions``' layers, what their forward GEMMs' switches for a loss
    cost teach: a demotion, the rung it went to and the below estimate it read (its value less the
    gap it was judged with); a promotion from that rung, the gap between its own estimate and that
    one. Returns ``decisions``.

    Example:
        >>> from mixprec.control._check import Check
        >>> from mixprec.control._settings import ControllerSettings
        >>> from mixprec.formats._state import LayerState
        >>> at = Check.of(ControllerSettings(ladder=("tensorwise", "compute"), max_loss_cost=1e-3))
        >>> rec = LayerRecord(None, LayerState(), 1, 0, (True,) * 2, cost=True)
        >>> down = Decision(120, "head", "output", "demote", "bf16", "fp8-tensorwise", "loss_cost", 2e-4, 5e-4, "")
        >>> rec.rung = 0
        >>> _ = learn_gaps(at, {"head": rec}, [down])
        >>> up = Decision(160, "head", "output", "promote", "fp8-tensorwise", "bf16", "loss_cost", 1.8e-3, 1e-3, "")
        >>> rec.rung = 1
        >>> _ = learn_gaps(at, {"head": rec}, [up])
        >>> round(expected_own(at, rec, 0, 2e-4), 6)
        0.0018
    """
    for d in decisions:
        rec = records.get(d.layer)
        if rec is None or rec.cost is None or d.statistic != "loss_cost" or d.gemm not in (None, "output"):
            continue
        if d.action == "demote":
            to = rec.rungs[0]
            gap = rec.cost_gap * _roundoff_sq(at, to) if rec.cost_gap else 0.0
            rec.demoted_below = (to, d.value - gap)
            continue
        here = next((r for r in range(len(at.settings.ladder)) if at.rung_name(r) == d.from_), None)
        if rec.demoted_below is None or here != rec.demoted_below[0] or not math.isfinite(d.value):
            continue
        rec.cost_gap = max(0.0, d.value - rec.demoted_below[1]) / _roundoff_sq(at, here)
        rec.demoted_below = None
    return decisions
