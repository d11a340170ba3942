"""The rule of per-layer scaling, pure: device functions and their host twin, bit for bit.

A sibling of :mod:`mixprec.scaling.rule` (the loss scale's rule): :func:`clean_step`,
:func:`overflow_step` and :func:`layer_rule` are functions of device tensors over the cut points'
:func:`topology` (no host sync); :func:`host_rule` is the same rule on host numbers, for a state
in host memory (the CPU), where it replaces some fifty tiny tensor ops by two reads. The rule
itself is written out in :mod:`mixprec.scaling.layerwise`'s docstring.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch

from mixprec.scaling.rule import ScaleConfig

__all__ = [
    "DEFAULT_BOUNDS", "HEADROOM", "TOTAL_BOUND", "ZERO_JUMP", "LayerState", "Topology", "clean_step", "exponent_of",
    "host_rule", "host_totals", "layer_rule", "overflow_step", "pow2", "topology",
]


#: Binades every region sits below the top region: equalising floor(log2 amax) leaves a region's
#: amax up to twice the top's, which the loss scale's probing does not cover.
HEADROOM = 1
#: Binades a region whose gradients were all zero moves up per clean step.
ZERO_JUMP = 4
#: Bound on the total exponent of a region, so that ``loss scale * 2**T`` stays in float32.
TOTAL_BOUND = 100
#: Default bounds of each cut point's factor: float16's smallest normal and largest power of two
#: (the factor is cast to the gradient's dtype when it multiplies).
DEFAULT_BOUNDS = (2.0**-14, 2.0**15)


def pow2(exponent: torch.Tensor) -> torch.Tensor:
    """``2**exponent`` as float32, exact, for integer exponents in [-126, 127] (any shape).

    Built from the bits (no ``exp2`` rounding). Example: ``pow2(torch.tensor([-1, 3]))`` is
    ``tensor([0.5, 8.])``.
    """
    return ((exponent.to(torch.int32) + 127) << 23).view(torch.float32)


def exponent_of(value: float, name: str) -> int:
    """The exponent of ``value``, a power of two a float16 factor holds exactly.

    Raises:
        ValueError: naming ``name``, when ``value`` is not a power of two in [2**-14, 2**15].
    """
    exponent = math.log2(value) if value > 0 else math.nan
    if not (math.isfinite(exponent) and exponent == int(exponent) and -14 <= exponent <= 15):
        raise ValueError(
            f"{name} must be a power of two in [2**-14, 2**15] (a factor float16 holds exactly), "
            f"got {value!r}."
        )
    return int(exponent)


class Topology(NamedTuple):
    """The cut points' tree as device tensors, built by :func:`topology` after the graph walk.

    ``n`` cut points; region ``k + 1`` is the one right below cut point ``k``, region 0 the top.

    Attributes:
        parent: int64 ``(n,)``: the region that region ``k + 1`` hangs from (0: the top).
        membership: float32 ``(n, n)``: ``[k, j] = 1`` when region ``k + 1`` lies below cut point
            ``j`` (its total exponent is ``membership @ exponent``).
        depth: float32 ``(n,)``: how many cut points lie above region ``k + 1`` (``k`` included).
        scored: ``membership * depth``; outside: ``1 - membership``.
        step_down: float32 ``(n, n)``: ``step_down @ totals`` is each cut point's exponent (its
            region's total minus its parent region's).
    """

    parent: torch.Tensor
    membership: torch.Tensor
    depth: torch.Tensor
    scored: torch.Tensor
    outside: torch.Tensor
    step_down: torch.Tensor


def topology(parents: Sequence[int], device: torch.device | str) -> Topology:
    """The :class:`Topology` of cut points whose regions hang from ``parents[k]`` (0 or ``j + 1``).

    Raises:
        RuntimeError: the parents form a cycle.

    Example:
        >>> topology([2, 0], "cpu").membership  # a chain: region 1 lies below cut points 0 and 1
        tensor([[1., 1.],
                [0., 1.]])
    """
    n = len(parents)
    rows: dict[int, list[float]] = {0: [0.0] * n}

    def row(region: int, depth: int = 0) -> list[float]:
        if region not in rows:
            if depth > n:
                raise RuntimeError("per_layer: the cut points' parents form a cycle")
            rows[region] = list(row(parents[region - 1], depth + 1))
            rows[region][region - 1] = 1.0
        return rows[region]

    membership = torch.tensor([row(r) for r in range(1, n + 1)], dtype=torch.float32).reshape(n, n)
    step_down = torch.eye(n)
    for k, p in enumerate(parents):
        if p:
            step_down[k, p - 1] = -1.0
    depth = membership.sum(dim=1)
    host = Topology(torch.tensor(list(parents), dtype=torch.int64), membership, depth,
                    membership * depth, 1.0 - membership, step_down)
    return Topology(*(t.to(device) for t in host))


class LayerState(NamedTuple):
    """Per cut point, int32 ``(n,)`` device tensors: the exponent of its factor, its margin
    (extra binades below the top region), its growth tracker and its hysteresis budget."""

    exponent: torch.Tensor
    margin: torch.Tensor
    growth_tracker: torch.Tensor
    hysteresis_left: torch.Tensor


def _binade_steps(config: ScaleConfig) -> tuple[int, int]:
    """Binades a margin moves by on a back-off and on a growth."""
    return max(1, round(-math.log2(config.backoff_factor))), max(1, round(math.log2(config.growth_factor)))


def clean_step(
    state: LayerState, stats: torch.Tensor, totals: torch.Tensor, topo: Topology, config: ScaleConfig,
    bounds: tuple[int, int],
) -> LayerState:
    """The rule on a step without overflow (pure; no host sync).

    ``stats``: float32 ``(n + 1,)``, each region's amax of the step (-1: nothing seen); ``totals``:
    float32 ``(n,)``, the total exponents of regions 1..n. Trackers count up; after
    ``growth_interval`` clean steps a margin comes down by a growth binade and the hysteresis
    budget refills (every clean step with ``consecutive_hysteresis``). Each measured region moves
    so that its amax exponent is the top region's minus ``HEADROOM`` and its margin; a region
    that saw only zeros moves ``ZERO_JUMP`` binades per zero-only region between it and its
    nearest measured ancestor (or the top) with that ancestor; the factors are the differences of
    the totals, clamped into ``bounds``. Nothing moves unless the top region measured a positive
    amax and every statistic is finite.
    """
    lo, hi = bounds
    tracker = state.growth_tracker + 1
    grow = tracker >= config.growth_interval
    margin = torch.where(grow, (state.margin - _binade_steps(config)[1]).clamp_min_(0), state.margin)
    left = state.hysteresis_left
    if config.consecutive_hysteresis:
        left = torch.full_like(left, config.hysteresis)
    else:
        left = torch.where(grow, config.hysteresis, left)
    tracker = tracker.masked_fill_(grow, 0)

    _, exponents = torch.frexp(stats)
    lower = stats[1:]
    positive = lower > 0
    measured = torch.where(positive, exponents[0] - exponents[1:] - (margin + HEADROOM), 0)
    # Each row (a region) scores the cut points above it: their depth where measured, 0 where
    # not, -1 off its path; depths differ along a path, so the nearest measured ancestor-or-self
    # is the one column equal to the row's amax (none measured: only unmeasured columns, 0).
    score = topo.scored * positive - topo.outside
    nearest = score.amax(dim=1, keepdim=True)
    moved = ((score == nearest) * measured).sum(dim=1)  # one term per row: exact
    zeros_below = (topo.membership * (lower == 0) * (topo.depth > nearest)).sum(dim=1)
    new_totals = (totals + torch.add(moved, zeros_below, alpha=ZERO_JUMP)).clamp_(-TOTAL_BOUND, TOTAL_BOUND)
    equalised = (topo.step_down @ new_totals).clamp_(lo, hi).to(torch.int32)
    active = (stats[0] > 0) & torch.isfinite(stats).all()
    exponent = torch.where(active, equalised, state.exponent.clamp_min(lo))
    return LayerState(exponent, margin, tracker, left)


def overflow_step(
    state: LayerState, stats: torch.Tensor, topo: Topology, config: ScaleConfig, bounds: tuple[int, int]
) -> tuple[LayerState, torch.Tensor, torch.Tensor]:
    """The rule on a step with an overflow (pure; no host sync): returns the new state, the
    culprits (bool ``(n,)``: cut points whose region overflowed below a region that did not) and
    whether the cut points absorbed the overflow (0-dim bool: there were culprits and each could
    back off or tolerate it, so the loss scale need not back off).

    A culprit spends one unit of hysteresis budget; when the budget is spent (or ``hysteresis``
    is 1) its margin rises and its factor drops by a back-off binade (not below ``bounds[0]``).
    Every growth tracker restarts.
    """
    back_step = _binade_steps(config)[0]
    finite = torch.isfinite(stats)
    culprit = finite.index_select(0, topo.parent) > finite[1:]
    left = state.hysteresis_left
    decremented = (left - 1).clamp_min_(0)
    backoff = culprit & (decremented == 0) if config.hysteresis > 1 else culprit
    margin = torch.add(state.margin, backoff, alpha=back_step)
    exponent = torch.add(state.exponent, backoff, alpha=-back_step).clamp_min_(bounds[0])
    stuck = backoff & (state.exponent <= bounds[0])
    absorbed = culprit.any() & ~stuck.any()
    new = LayerState(exponent, margin, torch.zeros_like(state.growth_tracker), torch.where(culprit, decremented, left))
    return new, culprit, absorbed


def layer_rule(
    state: LayerState, stats: torch.Tensor, totals: torch.Tensor, overflow: bool | torch.Tensor,
    topo: Topology, config: ScaleConfig, bounds: tuple[int, int],
) -> tuple[LayerState, torch.Tensor | None, torch.Tensor | None]:
    """One update of the cut points: :func:`clean_step` or :func:`overflow_step`.

    ``overflow``: a host bool when the step's overflow flag was already read (one branch runs),
    else a 0-dim bool tensor (both run, and the result is selected on the device). Returns the
    new state, the culprits and the absorbed flag (``None`` for both on a clean step known on
    the host: no culprits, nothing absorbed).
    """
    if overflow is False:
        return clean_step(state, stats, totals, topo, config, bounds), None, None
    over, culprit, absorbed = overflow_step(state, stats, topo, config, bounds)
    if overflow is True:
        return over, culprit, absorbed
    clean = clean_step(state, stats, totals, topo, config, bounds)
    chosen = LayerState(*(torch.where(overflow, a, b) for a, b in zip(over, clean)))
    return chosen, overflow & culprit, overflow & absorbed


def host_rule(
    state: LayerState, stats: Sequence[float], overflow: bool, parents: Sequence[int], config: ScaleConfig,
    bounds: tuple[int, int],
) -> tuple[LayerState, list[bool], bool]:
    """:func:`layer_rule` on host numbers: ``state`` holds lists of ints, ``stats`` floats,
    ``parents`` the region each cut point's region hangs from. Returns the new state (lists),
    the culprits and whether the overflow was absorbed (``False`` on a clean step).

    The same results, bit for bit (``tests/scaling/test_scaling_layerwise.py`` compares them on random
    states). The scaler runs it where its state lives in host memory (the CPU), where reading it
    costs no sync and the fifty small tensor ops of :func:`layer_rule` cost more than the rest of
    the step's scaling work together.

    Example:
        >>> s = LayerState([0], [0], [0], [1])
        >>> host_rule(s, [2.0**-3, 2.0**-9], False, [0], ScaleConfig(), (-14, 15))[0].exponent
        [5]
    """
    n = len(parents)
    lo, hi = bounds
    back_step, grow_step = _binade_steps(config)
    exponent, margin, tracker, left = (list(values) for values in state)
    culprit = [False] * n
    if overflow:
        finite = [math.isfinite(s) for s in stats]
        stuck = False
        for k in range(n):
            culprit[k] = finite[parents[k]] and not finite[k + 1]
            decremented = max(left[k] - 1, 0)
            backoff = culprit[k] and (decremented == 0 or config.hysteresis <= 1)
            stuck = stuck or (backoff and exponent[k] <= lo)
            margin[k] += back_step * backoff
            exponent[k] = max(exponent[k] - back_step * backoff, lo)
            left[k] = decremented if culprit[k] else left[k]
        return LayerState(exponent, margin, [0] * n, left), culprit, any(culprit) and not stuck
    for k in range(n):
        tracker[k] += 1
        grow = tracker[k] >= config.growth_interval
        if grow:
            margin[k], tracker[k] = max(margin[k] - grow_step, 0), 0
        if grow or config.consecutive_hysteresis:
            left[k] = config.hysteresis
    if not (stats[0] > 0 and all(math.isfinite(s) for s in stats)):
        return LayerState([max(e, lo) for e in exponent], margin, tracker, left), culprit, False
    top = math.frexp(stats[0])[1]
    totals = host_totals(exponent, parents)
    moved = []
    for k in range(n):  # up from region k + 1 to its nearest measured region, counting zero-only ones
        j, zeros, change = k, 0, 0
        while j >= 0:
            if stats[j + 1] > 0:
                change = top - math.frexp(stats[j + 1])[1] - margin[j] - HEADROOM
                break
            zeros += stats[j + 1] == 0
            j = parents[j] - 1
        moved.append(min(max(totals[k] + change + ZERO_JUMP * zeros, -TOTAL_BOUND), TOTAL_BOUND))
    exponent = [min(max(moved[k] - (moved[p - 1] if p else 0), lo), hi) for k, p in enumerate(parents)]
    return LayerState(exponent, margin, tracker, left), culprit, False


def host_totals(exponent: Sequence[int], parents: Sequence[int]) -> list[int]:
    """Each region's total exponent (regions 1..n): the sum of the exponents on its path up."""
    totals = []
    for k in range(len(parents)):
        total, j = 0, k
        while j >= 0:
            total += exponent[j]
            j = parents[j] - 1
        totals.append(total)
    return totals
