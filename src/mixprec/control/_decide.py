"""The controller's decisions at a check, per layer (:func:`decide_layer`, the default) and per
GEMM: functions of a :class:`Check` (the settings, the step, the compute dtype: values), a layer's
record and its all-reduced measurements. Per-GEMM rungs (``Controller(per_gemm=True)``): a layer's
forward, input-gradient and weight-gradient GEMMs each on their own rung, composed into one recipe
(:func:`~mixprec.control._ladder.compose`), each decided from the statistics of the two operands
that GEMM reads (input and weight; grad_output and weight; grad_output and input), with the
layer's hysteresis, dwell and switch budget counted per GEMM. Range trouble (fp16 compute) and
the ``fp32`` rung stay the whole layer's."""

from __future__ import annotations

import math
from typing import Any

import torch

from mixprec.control._backward import BACKWARD_WINDOWS, FAR, BackwardCost, backward_recipes, peel, stats_read
from mixprec.control._check import Check
from mixprec.control._cost import pool
from mixprec.control._estimate_gap import expected_own
from mixprec.control._ladder import GEMM_OPERANDS, GEMMS, Decision, LayerRecord, compose, gemm_casts, output_roundoff, past_costly
from mixprec.control._settings import FP4_RUNGS, LOW_RUNGS, rung_name
from mixprec.control._trend import Trend, demote_windows, grow, log2, ratio, underflow_forecast
from mixprec.formats._quant import STAT_NAMES
from mixprec.formats._state import OPERANDS

__all__ = ["apply_gemms", "apply_layer", "switch_layer", "cheap_below", "composes", "decide_gemms", "decide_layer", "gemm_down", "gemm_up",
           "layer_down", "layer_up", "limits", "peel", "rung_name", "switch_gemms", "too_costly", "up_by_cost"]

#: the checks in a row that must read a forward GEMM's own loss cost over ``max_loss_cost`` before
#: it is promoted, unless its windows since its last switch lie over it together or this window
#: lies clear over it on its own steps (:func:`too_costly`): a cost in the zone under the limit
#: reads over it in a window now and then by chance, and each such promotion measures the GEMM on
#: every step of the next windows and comes back down a few windows later (the backward GEMMs
#: wait as long: ``BACKWARD_WINDOWS``)
OVER_WINDOWS = 2


_NCOL = len(STAT_NAMES)
_UNDERFLOW, _NONFINITE = STAT_NAMES.index("underflow"), STAT_NAMES.index("nonfinite")
_RANGE = ("input", "output")
_NO_DATA = [0.0] * _NCOL  # a cast's statistics not measured in a window (amax 0: no evidence)
_FP16_MAX = float(torch.finfo(torch.float16).max)


def limits(at: Check, rung: int | None, below: int | None) -> tuple[float, float]:
    """``(max_underflow, demote_underflow)`` for a layer or GEMM on ``rung`` with ``below`` under
    it: the fp4 ones where that rung is fp4 (an e2m1 block flushes about 7-11% of Gaussian data)."""
    fp4 = FP4_RUNGS
    return (at.settings.fp4_max_underflow if rung is not None and at.settings.ladder[rung] in fp4 else at.settings.max_underflow,
            at.settings.fp4_demote_underflow if below is not None and at.settings.ladder[below] in fp4 else at.settings.demote_underflow)


def too_costly(at: Check, cost: list[float] | None, rec: LayerRecord) -> bool:
    """Whether this check promotes ``rec``'s forward GEMM by its own casts' loss cost (``cost``:
    own, below, whether each was measured; None: not measured): read over ``max_loss_cost`` at
    :data:`OVER_WINDOWS` checks in a row (counted in ``rec.cost_over``, once a check; one without
    a reading leaves the count), or at this one with its window clear over it (``rec.cost_clear``:
    ``LayerRecord.split``) or with the windows measured since the GEMM's last switch, two or more,
    over it together (``rec.cost_pool``: a noisy cost over the limit, whose windows cross it)."""
    if cost is None or not cost[2] > 0:
        return False
    limit = at.settings.max_loss_cost
    over = cost[0] > limit
    rec.cost_over = rec.cost_over + 1 if over else 0
    return over and (rec.cost_over >= OVER_WINDOWS or rec.cost_clear
                     or (len(rec.cost_pool[0]) >= 2 and pool(rec.cost_pool[0])[0] > limit))


def cheap_below(at: Check, cost: list[float], expected: float | None = None) -> bool:
    """Whether the recipe below's forward was measured and cost at most ``demote_loss_cost`` (a
    window without a measurement is no evidence); ``expected``: its cost as its own estimate will
    read it there (:func:`~mixprec.control._estimate_gap.expected_own`), in place of ``cost[1]``."""
    return cost[3] > 0 and (cost[1] if expected is None else expected) <= at.settings.demote_cost


def layer_up(rec: LayerRecord, at: Check | None = None, cost: float | None = None) -> int:
    """The rung a promotion goes to: the next one up the layer can run (a block rung needs
    features that are multiples of its blocks); for its forward's loss ``cost`` over the limit,
    :func:`up_by_cost`'s."""
    above = [i for i in range(rec.rung + 1, len(rec.allowed)) if rec.allowed[i]]
    return above[0] if cost is None else up_by_cost(at, cost, rec.rung, above)


def up_by_cost(at: Check, cost: float, here: int, above: list[int]) -> int:
    """Of the rungs ``above`` rung ``here`` (in order), the one a forward GEMM whose casts cost the loss
    ``cost`` over ``max_loss_cost`` goes to (:func:`~mixprec.control._ladder.past_costly`; at most the compute dtype)."""
    ladder, top = at.settings.ladder, at.settings.ladder.index("compute")
    roundoff = [output_roundoff(at.recipes.get(r), at.compute) for r in ladder]
    return past_costly(cost, at.settings.max_loss_cost, roundoff[here], [(r, roundoff[r]) for r in above if r <= top])


def layer_down(rec: LayerRecord) -> int | None:
    """The rung a demotion goes to (the next one down it can run, not below its floor), or None."""
    return next((i for i in range(rec.rung - 1, rec.floor - 1, -1) if rec.allowed[i]), None)


def decide_layer(at: Check, name: str, rec: LayerRecord, row: list[float], cost: list[float] | None = None
                 ) -> tuple[Decision, int] | None:
    """The layer's switch after this window (the decision and the new rung), or None. ``cost``:
    the window's loss costs of its forward GEMM (own, below, whether each was measured), under
    ``Controller.max_loss_cost``."""
    at = at.for_layer(name)  # (its share of the limits under cost_scope="model")
    own = [row[i * _NCOL:(i + 1) * _NCOL] for i in range(len(OPERANDS))]
    off = len(OPERANDS) * _NCOL
    shadow = [row[off + i * _NCOL:off + (i + 1) * _NCOL] for i in range(len(OPERANDS))]
    ranges = row[2 * off:]
    ladder = at.settings.ladder
    on_fp8 = ladder[rec.rung] in LOW_RUNGS
    down = layer_down(rec)
    has_shadow = down is not None and ladder[down] in LOW_RUNGS
    fit, windows = (at.settings.every, at.settings.ema, at.settings.trend_windows), at.settings.trend_windows
    measured = own if on_fp8 else (shadow if has_shadow else None)
    for op, stats in zip(OPERANDS, measured or []):
        rec.trends[op].update(log2(stats[0]), *fit)
    for op, own_stats, shadow_stats in zip(OPERANDS, own, shadow):
        if on_fp8:
            rec.trends[f"underflow_{op}"].update(own_stats[_UNDERFLOW], *fit)
        if has_shadow:
            rec.trends[f"shadow_{op}"].update(shadow_stats[_UNDERFLOW], *fit)
    fp16 = at.compute is torch.float16
    if fp16:
        for r, amax in zip(_RANGE, ranges):
            rec.trends[f"range_{r}"].update(log2(amax), *fit)
    ahead = at.settings.horizon * at.settings.every

    def underflow(op: str, u: float, key: str, rung: int) -> float:
        return underflow_forecast(u, rec.trends[op], rec.trends[key], ahead, windows, ladder[rung] in FP4_RUNGS)

    def amax_forecast(r: str, amax: float) -> float:
        return grow(amax, rec.trends[f"range_{r}"].rise(ahead, windows))

    here = at.rung_name(rec.rung)
    max_u, demote_u = limits(at, rec.rung, down)

    def decision(op: str, action: str, to: int, stat: str, value: float, limit: float, side: str
                 ) -> tuple[Decision, int]:
        reason = f"{op} {stat.replace('_', ' ')} {value:.4g} {side} {limit:g}"
        return Decision(at.steps, name, op, action, here, at.rung_name(to), stat, value, float(limit), reason), to

    # promote: the worst trouble first
    compute, top = ladder.index("compute"), len(ladder) - 1
    if on_fp8 and at.settings.max_nonfinite is not None:
        for op, stats in zip(OPERANDS, own):
            if stats[_NONFINITE] > at.settings.max_nonfinite:
                return decision(op, "promote", compute, "nonfinite", stats[_NONFINITE], at.settings.max_nonfinite, ">")
    if fp16 and ladder[top] == "fp32" and rec.rung < top:
        for r, amax in zip(_RANGE, ranges):
            forecast = amax_forecast(r, amax)
            if forecast > at.settings.max_range * _FP16_MAX:
                return decision(r, "promote", top, "amax_forecast", forecast, at.settings.max_range * _FP16_MAX, ">")
    if on_fp8:
        for op, stats in zip(OPERANDS, own):
            forecast = underflow(op, stats[_UNDERFLOW], f"underflow_{op}", rec.rung)
            if forecast > max_u:
                return decision(op, "promote", layer_up(rec), "underflow_forecast", forecast, max_u, ">")
        if too_costly(at, cost, rec):
            return decision("output", "promote", layer_up(rec, at, cost[0]), "loss_cost", cost[0], at.settings.max_loss_cost, ">")
    if down is None:
        return None
    # demote: the rung below, judged by the shadow (fp8 below) or the range (compute below fp32)
    worst = ("input", "underflow_forecast", 0.0, demote_u)  # the closest to its limit
    # a window without a measurement (no forward in its last steps) is not evidence of safety
    safe = not (has_shadow and not (shadow[0][0] > 0 and shadow[1][0] > 0)) and not (fp16 and not ranges[1] > 0)
    if has_shadow:
        for op, stats in zip(OPERANDS, shadow):
            forecast = underflow(op, stats[_UNDERFLOW], f"shadow_{op}", down)
            nonfinite = at.settings.max_nonfinite is not None and stats[_NONFINITE] > at.settings.max_nonfinite
            if nonfinite or not forecast <= demote_u:
                safe = False
            elif ratio(forecast, demote_u) > ratio(worst[2], worst[3]):
                worst = (op, "underflow_forecast", forecast, demote_u)
    if fp16:
        for r, amax in zip(_RANGE, ranges):
            forecast = amax_forecast(r, amax)
            limit = at.settings.demote_range * _FP16_MAX
            if not forecast <= limit:
                safe = False
            elif ladder[rec.rung] == "fp32" and ratio(forecast, limit) > ratio(worst[2], worst[3]):
                worst = (r, "amax_forecast", forecast, limit)
    if has_shadow and cost is not None:
        limit, expected = at.settings.demote_cost, expected_own(at, rec, down, cost[1])
        if not (rec.below_wanted(safe) and cheap_below(at, cost, expected)):  # (measured where it alone decides)
            safe = False
        elif ratio(expected, limit) > ratio(worst[2], worst[3]):
            worst = ("output", "loss_cost", expected, limit)
    rec.clean = rec.clean + 1 if safe else 0
    if _may_demote(at, rec.clean, rec.switches, ladder[down] in FP4_RUNGS, True):
        op, stat, value, limit = worst
        return decision(op, "demote", down, stat, value, limit, "<=")
    return None


def _recipes(at: Check, rungs: list[int]) -> tuple:
    return tuple(at.recipes.get(at.settings.ladder[r]) for r in rungs)


def composes(at: Check, rec: LayerRecord, g: int, rung: int) -> bool:
    """Whether GEMM ``g`` may sit on ``rung`` beside the layer's other GEMMs' rungs."""
    if not rec.allowed[rung]:
        return False
    if at.settings.ladder[rung] not in LOW_RUNGS:
        return True  # the compute dtype runs beside any casts
    rungs = list(rec.rungs)
    rungs[g] = rung
    return compose(_recipes(at, rungs)) is not None


def gemm_up(at: Check, rec: LayerRecord, g: int, cost: float | None = None) -> int:
    """The rung GEMM ``g`` is promoted to: the next one up that the layer can run and that
    composes with its other GEMMs (at the latest the compute dtype); for the forward GEMM's loss
    ``cost`` over the limit, :func:`up_by_cost`'s."""
    above = [i for i in range(rec.rungs[g] + 1, len(at.settings.ladder)) if composes(at, rec, g, i)]
    return above[0] if cost is None else up_by_cost(at, cost, rec.rungs[g], above)


def gemm_down(at: Check, rec: LayerRecord, g: int) -> int | None:
    """The rung GEMM ``g`` is demoted to (the next one down that composes, not below the floor), or None."""
    if at.settings.ladder[rec.rungs[g]] == "fp32":
        return None  # the whole layer's (range)
    return next((i for i in range(rec.rungs[g] - 1, rec.floor - 1, -1) if composes(at, rec, g, i)), None)


def apply_layer(at: Check, rec: LayerRecord) -> None:
    """Route a whole-layer record for its rung (an fp8 recipe, or the fallback flag, in float32
    on the fp32 rung) and set the casts of its shadow."""
    name = at.settings.ladder[rec.rung]
    rec.state.route(at.recipes.get(name), name not in LOW_RUNGS)
    rec.state.probe, rec.probe.fp32 = rec.probe, name == "fp32"
    down = layer_down(rec)
    rec.below = at.recipes.get(at.settings.ladder[down]) if down is not None else None
    rec.forward_low, rec.forward_below = name in LOW_RUNGS, rec.below if rec.cost is not None else None


def switch_layer(at: Check, rec: LayerRecord, to: int) -> None:
    """Move a whole-layer record to rung ``to`` (its decision taken): the hysteresis restarts,
    the trends of the casts it measures too, and the layer is routed there."""
    rec.rung, rec.clean = to, 0
    rec.trends.update({f"{k}_{op}": Trend() for op in OPERANDS for k in ("underflow", "shadow")})  # (their casts changed)
    rec.switches.append(at.steps)
    apply_layer(at, rec)


def apply_gemms(at: Check, rec: LayerRecord) -> None:
    """Set the layer's state for its GEMMs' rungs (the composed recipe; the fallback flag when
    all three are on the compute dtype or fp32) and, per GEMM, the casts its measurements use."""
    names = [at.settings.ladder[r] for r in rec.rungs]
    recipe = compose(_recipes(at, rec.rungs))
    rec.state.route(recipe, recipe is None)
    rec.state.probe, rec.probe.fp32 = rec.probe, names[0] == "fp32"
    rec.below, rec.forward_low = None, names[0] in LOW_RUNGS
    for g, gemm in enumerate(GEMMS):
        here = at.recipes.get(names[g])
        rec.own[g] = gemm_casts(here, gemm)
        down = gemm_down(at, rec, g)
        below = at.recipes.get(at.settings.ladder[down]) if down is not None else None
        rec.below_gemm[g] = gemm_casts(below, gemm)
        if g == 0:  # the forward's: its loss cost's recipe below
            rec.forward_below = below if rec.cost is not None else None
    if at.settings.max_backward_cost is not None:
        if rec.backward is None:
            rec.backward = BackwardCost(rec.state.device)
        rec.backward.normalized, rec.backward.reference = at.settings.normalized_updates, rec.reference
        rec.backward.row_share, rec.backward.step = at.settings.cost_row_share, rec.cost_step
        downs = {g: gemm_down(at, rec, g) for g in (1, 2)}
        rec.backward.recipes = backward_recipes(at.settings.ladder, rec.rungs, recipe, downs,
                                                lambda rungs: compose(_recipes(at, rungs)))


def switch_gemms(at: Check, rec: LayerRecord, gemms: range | tuple, to: int) -> None:  # (and route the layer)
    for g in gemms:
        rec.rungs[g] = to
        rec.gemm_clean[g] = rec.back_over[g] = 0
        rec.gemm_switches[g].append(at.steps)
        rec.trends.update({f"{GEMMS[g]}.{k}_{op}": Trend() for op in GEMM_OPERANDS[GEMMS[g]] for k in ("underflow", "shadow")})
    apply_gemms(at, rec)


def decide_gemms(at: Check, name: str, rec: LayerRecord, row: list[float], cost: list[float] | None = None,
                 backward: list[float] | None = None) -> list[Decision]:
    """The switches of the layer's GEMMs after this window (``row``: its all-reduced windows;
    ``cost``: its forward GEMM's loss costs, as :func:`decide_layer`'s; ``backward``: its backward
    GEMMs' costs, :func:`~mixprec.control._backward.backward_costs`), applied to ``rec``; in
    GEMM order, each judged with the rungs the earlier ones left."""
    at = at.for_layer(name)  # (its share of the limits under cost_scope="model")
    backward = rec.carry_backward(backward, at.settings)  # (a window its cadence skipped: the last measured)
    off = 2 * 3 * _NCOL + len(_RANGE)  # LayerState's and the whole-layer shadow's rows, the range
    ranges, win = row[off - len(_RANGE):off], row[off:]

    def stats(kind: int, g: int, side: int) -> list[float]:
        at = ((kind * len(GEMMS) + g) * 2 + side) * _NCOL
        return win[at:at + _NCOL]

    fit, windows, ahead = (at.settings.every, at.settings.ema, at.settings.trend_windows), at.settings.trend_windows, at.settings.horizon * at.settings.every
    fp16 = at.compute is torch.float16
    ladder, top = at.settings.ladder, len(at.settings.ladder) - 1
    if fp16:
        for r, amax in zip(_RANGE, ranges):
            rec.trends[f"range_{r}"].update(log2(amax), *fit)

    def decision(gemm: str | None, op: str, action: str, here: int, to: int, stat: str, value: float,
                 limit: float, side: str) -> Decision:
        where = f"{gemm} GEMM: " if gemm else ""
        reason = f"{where}{op} {stat.replace('_', ' ')} {value:.4g} {side} {limit:g}"
        return Decision(at.steps, name, op, action, at.rung_name(here), at.rung_name(to), stat, value,
                        float(limit), reason, gemm)

    # the whole layer: fp16 range trouble goes to fp32, and comes back to the compute dtype
    if fp16 and ladder[top] == "fp32":
        limit = at.settings.max_range * _FP16_MAX
        for r, amax in zip(_RANGE, ranges):
            forecast = grow(amax, rec.trends[f"range_{r}"].rise(ahead, windows))
            if min(rec.rungs) < top and forecast > limit:
                d = decision(None, r, "promote", rec.rungs[0], top, "amax_forecast", forecast, limit, ">")
                rec.clean, rec.switches = 0, [*rec.switches, at.steps]
                switch_gemms(at, rec, range(len(GEMMS)), top)
                return [d]
        if all(r == top for r in rec.rungs):
            forecasts = [grow(a, rec.trends[f"range_{r}"].rise(ahead, windows)) for r, a in zip(_RANGE, ranges)]
            limit = at.settings.demote_range * _FP16_MAX
            safe = ranges[1] > 0 and all(f <= limit for f in forecasts)
            rec.clean = rec.clean + 1 if safe else 0
            if _may_demote(at, rec.clean, rec.switches, False):
                i = max(range(len(_RANGE)), key=lambda k: ratio(forecasts[k], limit))
                d = decision(None, _RANGE[i], "demote", top, top - 1, "amax_forecast", forecasts[i], limit, "<=")
                rec.clean, rec.switches = 0, [*rec.switches, at.steps]
                switch_gemms(at, rec, range(len(GEMMS)), top - 1)
                return [d]
            return []
    # under fp16 a GEMM comes down only while the layer's range stays far from 65504, as a layer's
    range_ok = not fp16 or (ranges[1] > 0 and all(
        grow(a, rec.trends[f"range_{r}"].rise(ahead, windows)) <= at.settings.demote_range * _FP16_MAX
        for r, a in zip(_RANGE, ranges)))
    layer = {op: row[i * _NCOL:(i + 1) * _NCOL] for i, op in enumerate(OPERANDS)}  # LayerState's: every step, whole
    out = []
    for g, gemm in enumerate(GEMMS):
        d = _decide_gemm(at, rec, g, gemm, [stats(0, g, s) for s in (0, 1)], [stats(1, g, s) for s in (0, 1)],
                         fit, windows, ahead, decision, range_ok, cost if gemm == "output" and not rec.cost_blind else None,
                         None if backward is None or g == 0 else backward[g - 1::2], layer)
        if d is not None:
            out.append(d)
    return out


def _may_demote(at: Check, clean: int, switches: list[int], to_fp4: bool, forward: bool = False) -> bool:
    """Whether a layer or GEMM with ``clean`` safe windows in a row and its ``switches`` (steps)
    comes down now: ``demote_windows`` clean windows (:func:`~mixprec.control._trend.demote_windows`:
    to an fp4 rung, twice as many for each round trip in the last ``budget_steps``), ``min_dwell``
    steps since its last switch, fewer than ``max_switches`` in the last ``budget_steps``. A ``forward``
    GEMM's (or layer's) switch since the last check, an early promotion (:mod:`._early`), is provisional: the check's
    clean window takes it back (and the backward GEMMs it took up, once it went back under them)."""
    recent, last = [s for s in switches if s > at.steps - at.settings.budget_steps], switches[-1] if switches else -math.inf
    early = forward and clean >= 1 and 0 < at.steps - last < at.settings.every
    settled = clean >= demote_windows(at.settings.demote_windows, len(recent), to_fp4) and at.steps - last >= at.settings.min_dwell
    return (early or settled) and len(recent) < at.settings.max_switches


def _decide_gemm(at: Check, rec: LayerRecord, g: int, gemm: str, own: list, shadow: list, fit: tuple,
                 windows: int, ahead: int, decision: Any, range_ok: bool, cost: list[float] | None,
                 back: list[float] | None, layer: dict[str, list[float]]) -> Decision | None:
    """One GEMM's switch (applied to ``rec``), or None: the layer's rule on this GEMM's two
    operands; a GEMM whose loss cost was measured (``cost``, the forward's, or ``back``: own,
    below, whether each was measured) is judged by it instead of its operands' flush, and the
    next window does not measure those casts (:func:`stats_read`): a non-finite operand is then
    read from the layer's own statistics (``layer``: LayerState's rows, every step's casts)."""
    read = (rec.stats_read[0][g], rec.stats_read[1][g])  # what this window measured (eager code: only those)
    own, shadow = (own if read[0] else [_NO_DATA] * 2), (shadow if read[1] else [_NO_DATA] * 2)
    loss = back if cost is None else cost  # (the loss costs of this GEMM: own, below, whether each was measured)
    rec.stats_read[0][g], rec.stats_read[1][g] = stats_read(loss)
    ladder, rung = at.settings.ladder, rec.rungs[g]
    on_low = ladder[rung] in LOW_RUNGS
    down = gemm_down(at, rec, g)
    has_shadow = down is not None and ladder[down] in LOW_RUNGS
    ops = GEMM_OPERANDS[gemm]
    max_u, demote_u = limits(at, rung, down)
    measured = own if on_low else (shadow if has_shadow else None)
    for op, st in zip(ops, measured or []):
        rec.trends[f"{gemm}.{op}"].update(log2(st[0]), *fit)
    for op, own_st, shadow_st in zip(ops, own, shadow):
        if on_low and read[0]:
            rec.trends[f"{gemm}.underflow_{op}"].update(own_st[_UNDERFLOW], *fit)
        if has_shadow and read[1]:
            rec.trends[f"{gemm}.shadow_{op}"].update(shadow_st[_UNDERFLOW], *fit)

    def underflow(op: str, u: float, key: str, at: int) -> float:
        return underflow_forecast(u, rec.trends[f"{gemm}.{op}"], rec.trends[f"{gemm}.{key}_{op}"], ahead, windows,
                                  ladder[at] in FP4_RUNGS)

    if not on_low:
        rec.back_over[g] = 0
    else:
        compute = ladder.index("compute")
        if at.settings.max_nonfinite is not None:
            for op, st in zip(ops, own if read[0] else [layer[op] for op in ops]):
                if st[_NONFINITE] > at.settings.max_nonfinite:
                    d = decision(gemm, op, "promote", rung, compute, "nonfinite", st[_NONFINITE], at.settings.max_nonfinite,
                                 ">")
                    switch_gemms(at, rec, (g,), compute)
                    return d
        by_cost = loss is not None and loss[2] > 0  # the GEMM's measured loss cost, not its flush
        for op, st in zip(ops, () if by_cost else own):
            forecast = underflow(op, st[_UNDERFLOW], "underflow", rung)
            if forecast > max_u:
                to = gemm_up(at, rec, g)
                d = decision(gemm, op, "promote", rung, to, "underflow_forecast", forecast, max_u, ">")
                switch_gemms(at, rec, (g,), to)
                return d
        rec.back_over[g] = rec.back_over[g] + 1 if by_cost and back is not None and back[0] > at.settings.max_backward_cost else 0
        over = ((cost[0], "loss_cost", at.settings.max_loss_cost) if too_costly(at, cost, rec) else
                (back[0], "backward_cost", at.settings.max_backward_cost) if rec.back_over[g] >= BACKWARD_WINDOWS
                or (rec.back_over[g] and at.steps <= at.settings.every and back[0] > FAR * at.settings.max_backward_cost) else None)
        if over is not None:
            to = gemm_up(at, rec, g, over[0] if over[1] == "loss_cost" else None)
            d = decision(gemm, "output", "promote", rung, to, over[1], over[0], over[2], ">")
            switch_gemms(at, rec, (g,), to)
            return d
    if not has_shadow:
        return None
    worst = (ops[0], 0.0)
    safe = range_ok and all(st[0] > 0 for st in shadow)  # a window without a measurement is no evidence of safety
    for op, st in zip(ops, shadow):
        forecast = underflow(op, st[_UNDERFLOW], "shadow", down)
        nonfinite = at.settings.max_nonfinite is not None and st[_NONFINITE] > at.settings.max_nonfinite
        if nonfinite or not forecast <= demote_u:
            safe = False
        elif forecast > worst[1]:
            worst = (op, forecast)
    worst = (*worst, "underflow_forecast", demote_u)
    if cost is not None:  # the forward's way down: its rung below's loss cost, measured from now on (none yet: no evidence)
        safe = False
        rec.below_wanted(True)
    if loss is not None and loss[3] > 0:  # the rung below's loss cost decides, not its flush (a non-finite cost: no)
        limit, stat = (at.settings.demote_cost, "loss_cost") if cost is not None else (at.settings.demote_backward, "backward_cost")
        value = expected_own(at, rec, down, loss[1]) if cost is not None else loss[1]  # (the forward's: _estimate_gap)
        safe, worst = range_ok and value <= limit, ("output", value, stat, limit)
    rec.gemm_clean[g] = rec.gemm_clean[g] + 1 if safe else 0
    if _may_demote(at, rec.gemm_clean[g], rec.gemm_switches[g], ladder[down] in FP4_RUNGS, g == 0 or rec.rungs[0] < rung):
        d = decision(gemm, worst[0], "demote", rung, down, worst[2], worst[1], worst[3], "<=")
        switch_gemms(at, rec, (g,), down)
        return d
    return None
