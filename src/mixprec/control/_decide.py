"""The controller's decisions at a check, per layer (:func:`decide_layer`, the default) and per
GEMM. Per-GEMM rungs (``Controller(per_gemm=True)``): a layer's forward,
input-gradient and weight-gradient GEMMs each on their own rung, composed into one recipe
(:func:`~mixprec.fp8._ladder.compose`), each decided from the statistics of the two operands
that GEMM reads (input and weight; grad_output and weight; grad_output and input), with the
layer's hysteresis, dwell and switch budget counted per GEMM. Range trouble (fp16 compute) and
the ``fp32`` rung stay the whole layer's."""

from __future__ import annotations

import math
from typing import Any

import torch

from mixprec.fp8._ladder import FP4_RUNGS, GEMM_OPERANDS, GEMMS, LOW_RUNGS, Decision, LayerRecord, compose, gemm_casts
from mixprec.fp8._quant import STAT_NAMES
from mixprec.fp8._state import OPERANDS
from mixprec.fp8._trend import Trend, demote_windows, grow, log2, ratio, underflow_forecast

__all__ = ["apply_gemms", "cheap_below", "decide_gemms", "decide_layer", "gemm_down", "gemm_up", "layer_down",
           "layer_up", "limits", "too_costly"]

_NCOL = len(STAT_NAMES)
_UNDERFLOW, _NONFINITE = STAT_NAMES.index("underflow"), STAT_NAMES.index("nonfinite")
_RANGE = ("input", "output")
_FP16_MAX = float(torch.finfo(torch.float16).max)


def limits(ctl: Any, rung: int | None, below: int | None) -> tuple[float, float]:
    """``(max_underflow, demote_underflow)`` for a layer or GEMM on ``rung`` with ``below`` under
    it: the fp4 ones where that rung is fp4 (an e2m1 block flushes about 7-11% of Gaussian data)."""
    fp4 = FP4_RUNGS
    return (ctl.fp4_max_underflow if rung is not None and ctl.ladder[rung] in fp4 else ctl.max_underflow,
            ctl.fp4_demote_underflow if below is not None and ctl.ladder[below] in fp4 else ctl.demote_underflow)


def too_costly(ctl: Any, cost: list[float] | None) -> bool:
    """Whether the forward GEMM's own casts cost the loss more than ``max_loss_cost`` over the
    window (``cost``: own, below, whether each was measured; None: not measured)."""
    return cost is not None and cost[2] > 0 and cost[0] > ctl.max_loss_cost


def cheap_below(ctl: Any, cost: list[float]) -> bool:
    """Whether the recipe below's forward was measured and cost at most ``demote_loss_cost``
    (a window without a measurement is no evidence)."""
    return cost[3] > 0 and cost[1] <= ctl.demote_cost


def layer_up(rec: LayerRecord) -> int:
    """The rung a promotion goes to: the next one up the layer can run (a block rung needs
    features that are multiples of its blocks)."""
    return next(i for i in range(rec.rung + 1, len(rec.allowed)) if rec.allowed[i])


def layer_down(rec: LayerRecord) -> int | None:
    """The rung a demotion goes to (the next one down it can run, not below its floor), or None."""
    return next((i for i in range(rec.rung - 1, rec.floor - 1, -1) if rec.allowed[i]), None)


def decide_layer(ctl: Any, name: str, rec: LayerRecord, row: list[float], cost: list[float] | None = None
                 ) -> tuple[Decision, int] | None:
    """The layer's switch after this window (the decision and the new rung), or None. ``cost``:
    the window's loss costs of its forward GEMM (own, below, whether each was measured), under
    ``Controller.max_loss_cost``."""
    own = [row[i * _NCOL:(i + 1) * _NCOL] for i in range(len(OPERANDS))]
    off = len(OPERANDS) * _NCOL
    shadow = [row[off + i * _NCOL:off + (i + 1) * _NCOL] for i in range(len(OPERANDS))]
    ranges = row[2 * off:]
    ladder = ctl.ladder
    on_fp8 = ladder[rec.rung] in LOW_RUNGS
    down = layer_down(rec)
    has_shadow = down is not None and ladder[down] in LOW_RUNGS
    fit, windows = (ctl.every, ctl.ema, ctl.trend_windows), ctl.trend_windows
    measured = own if on_fp8 else (shadow if has_shadow else None)
    for op, stats in zip(OPERANDS, measured or []):
        rec.trends[op].update(log2(stats[0]), *fit)
    for op, own_stats, shadow_stats in zip(OPERANDS, own, shadow):
        if on_fp8:
            rec.trends[f"underflow_{op}"].update(own_stats[_UNDERFLOW], *fit)
        if has_shadow:
            rec.trends[f"shadow_{op}"].update(shadow_stats[_UNDERFLOW], *fit)
    fp16 = ctl._compute is torch.float16
    if fp16:
        for r, amax in zip(_RANGE, ranges):
            rec.trends[f"range_{r}"].update(log2(amax), *fit)
    ahead = ctl.horizon * ctl.every

    def underflow(op: str, u: float, key: str, rung: int) -> float:
        return underflow_forecast(u, rec.trends[op], rec.trends[key], ahead, windows, ladder[rung] in FP4_RUNGS)

    def amax_forecast(r: str, amax: float) -> float:
        return grow(amax, rec.trends[f"range_{r}"].rise(ahead, windows))

    here = ctl._rung_name(rec.rung)
    max_u, demote_u = limits(ctl, rec.rung, down)

    def decision(op: str, action: str, to: int, stat: str, value: float, limit: float, side: str
                 ) -> tuple[Decision, int]:
        reason = f"{op} {stat.replace('_', ' ')} {value:.4g} {side} {limit:g}"
        return Decision(ctl.steps, name, op, action, here, ctl._rung_name(to), stat, value, float(limit),
                        reason), to

    # promote: the worst trouble first
    compute, top = ladder.index("compute"), len(ladder) - 1
    if on_fp8 and ctl.max_nonfinite is not None:
        for op, stats in zip(OPERANDS, own):
            if stats[_NONFINITE] > ctl.max_nonfinite:
                return decision(op, "promote", compute, "nonfinite", stats[_NONFINITE], ctl.max_nonfinite, ">")
    if fp16 and ladder[top] == "fp32" and rec.rung < top:
        for r, amax in zip(_RANGE, ranges):
            forecast = amax_forecast(r, amax)
            if forecast > ctl.max_range * _FP16_MAX:
                return decision(r, "promote", top, "amax_forecast", forecast, ctl.max_range * _FP16_MAX, ">")
    if on_fp8:
        for op, stats in zip(OPERANDS, own):
            forecast = underflow(op, stats[_UNDERFLOW], f"underflow_{op}", rec.rung)
            if forecast > max_u:
                return decision(op, "promote", layer_up(rec), "underflow_forecast", forecast, max_u, ">")
        if too_costly(ctl, cost):
            return decision("output", "promote", layer_up(rec), "loss_cost", cost[0], ctl.max_loss_cost, ">")
    if down is None:
        return None
    # demote: the rung below, judged by the shadow (fp8 below) or the range (compute below fp32)
    worst = ("input", "underflow_forecast", 0.0, demote_u)  # the closest to its limit
    # a window without a measurement (no forward in its last steps) is not evidence of safety
    safe = not (has_shadow and not (shadow[0][0] > 0 and shadow[1][0] > 0)) and not (fp16 and not ranges[1] > 0)
    if has_shadow:
        for op, stats in zip(OPERANDS, shadow):
            forecast = underflow(op, stats[_UNDERFLOW], f"shadow_{op}", down)
            nonfinite = ctl.max_nonfinite is not None and stats[_NONFINITE] > ctl.max_nonfinite
            if nonfinite or not forecast <= demote_u:
                safe = False
            elif ratio(forecast, demote_u) > ratio(worst[2], worst[3]):
                worst = (op, "underflow_forecast", forecast, demote_u)
    if fp16:
        for r, amax in zip(_RANGE, ranges):
            forecast = amax_forecast(r, amax)
            limit = ctl.demote_range * _FP16_MAX
            if not forecast <= limit:
                safe = False
            elif ladder[rec.rung] == "fp32" and ratio(forecast, limit) > ratio(worst[2], worst[3]):
                worst = (r, "amax_forecast", forecast, limit)
    if has_shadow and cost is not None:
        limit = ctl.demote_cost
        if not cheap_below(ctl, cost):
            safe = False
        elif ratio(cost[1], limit) > ratio(worst[2], worst[3]):
            worst = ("output", "loss_cost", cost[1], limit)
    rec.clean = rec.clean + 1 if safe else 0
    if _may_demote(ctl, rec.clean, rec.switches, ladder[down] in FP4_RUNGS):
        op, stat, value, limit = worst
        return decision(op, "demote", down, stat, value, limit, "<=")
    return None


def _recipes(ctl: Any, rungs: list[int]) -> tuple:
    return tuple(ctl._recipes.get(ctl.ladder[r]) for r in rungs)


def _composes(ctl: Any, rec: LayerRecord, g: int, rung: int) -> bool:
    """Whether GEMM ``g`` may sit on ``rung`` beside the layer's other GEMMs' rungs."""
    if not rec.allowed[rung]:
        return False
    if ctl.ladder[rung] not in LOW_RUNGS:
        return True  # the compute dtype runs beside any casts
    rungs = list(rec.rungs)
    rungs[g] = rung
    return compose(_recipes(ctl, rungs)) is not None


def gemm_up(ctl: Any, rec: LayerRecord, g: int) -> int:
    """The rung GEMM ``g`` is promoted to: the next one up that the layer can run and that
    composes with its other GEMMs (at the latest the compute dtype)."""
    return next(i for i in range(rec.rungs[g] + 1, len(ctl.ladder)) if _composes(ctl, rec, g, i))


def gemm_down(ctl: Any, rec: LayerRecord, g: int) -> int | None:
    """The rung GEMM ``g`` is demoted to (the next one down that composes, not below the floor), or None."""
    if ctl.ladder[rec.rungs[g]] == "fp32":
        return None  # the whole layer's (range)
    return next((i for i in range(rec.rungs[g] - 1, rec.floor - 1, -1) if _composes(ctl, rec, g, i)), None)


def apply_gemms(ctl: Any, rec: LayerRecord) -> None:
    """Set the layer's state for its GEMMs' rungs (the composed recipe; the fallback flag when
    all three are on the compute dtype or fp32) and, per GEMM, the casts its measurements use."""
    names = [ctl.ladder[r] for r in rec.rungs]
    recipe = compose(_recipes(ctl, rec.rungs))
    rec.state.fallback = recipe is None
    rec.state.recipe = recipe
    rec.state.probe, rec.probe.fp32 = rec.probe, names[0] == "fp32"
    rec.below = None
    rec.forward_low = names[0] in LOW_RUNGS
    for g, gemm in enumerate(GEMMS):
        here = ctl._recipes.get(names[g])
        rec.own[g] = gemm_casts(here, gemm)
        down = gemm_down(ctl, rec, g)
        below = ctl._recipes.get(ctl.ladder[down]) if down is not None else None
        rec.below_gemm[g] = gemm_casts(below, gemm)
        if g == 0:  # the forward's: its loss cost's recipe below
            rec.forward_below = below if rec.cost is not None else None


def _switch(ctl: Any, rec: LayerRecord, gemms: range | tuple, to: int) -> None:
    for g in gemms:
        rec.rungs[g] = to
        rec.gemm_clean[g] = 0
        rec.gemm_switches[g].append(ctl.steps)
        for op in GEMM_OPERANDS[GEMMS[g]]:  # the casts these measure change with the rung
            rec.trends[f"{GEMMS[g]}.underflow_{op}"] = Trend()
            rec.trends[f"{GEMMS[g]}.shadow_{op}"] = Trend()
    apply_gemms(ctl, rec)


def decide_gemms(ctl: Any, name: str, rec: LayerRecord, row: list[float], cost: list[float] | None = None
                 ) -> list[Decision]:
    """The switches of the layer's GEMMs after this window (``row``: its all-reduced windows;
    ``cost``: its forward GEMM's loss costs, as :func:`decide_layer`'s), applied to ``rec``; in
    GEMM order, each judged with the rungs the earlier ones left."""
    off = 2 * 3 * _NCOL + len(_RANGE)  # LayerState's and the whole-layer shadow's rows, the range
    ranges = row[off - len(_RANGE):off]
    win = row[off:]

    def stats(kind: int, g: int, side: int) -> list[float]:
        at = ((kind * len(GEMMS) + g) * 2 + side) * _NCOL
        return win[at:at + _NCOL]

    fit, windows, ahead = (ctl.every, ctl.ema, ctl.trend_windows), ctl.trend_windows, ctl.horizon * ctl.every
    fp16 = ctl._compute is torch.float16
    ladder, top = ctl.ladder, len(ctl.ladder) - 1
    if fp16:
        for r, amax in zip(_RANGE, ranges):
            rec.trends[f"range_{r}"].update(log2(amax), *fit)

    def decision(gemm: str | None, op: str, action: str, here: int, to: int, stat: str, value: float,
                 limit: float, side: str) -> Decision:
        where = f"{gemm} GEMM: " if gemm else ""
        reason = f"{where}{op} {stat.replace('_', ' ')} {value:.4g} {side} {limit:g}"
        return Decision(ctl.steps, name, op, action, ctl._rung_name(here), ctl._rung_name(to), stat, value,
                        float(limit), reason, gemm)

    # the whole layer: fp16 range trouble goes to fp32, and comes back to the compute dtype
    if fp16 and ladder[top] == "fp32":
        limit = ctl.max_range * _FP16_MAX
        for r, amax in zip(_RANGE, ranges):
            forecast = grow(amax, rec.trends[f"range_{r}"].rise(ahead, windows))
            if min(rec.rungs) < top and forecast > limit:
                d = decision(None, r, "promote", rec.rungs[0], top, "amax_forecast", forecast, limit, ">")
                rec.clean, rec.switches = 0, [*rec.switches, ctl.steps]
                _switch(ctl, rec, range(len(GEMMS)), top)
                return [d]
        if all(r == top for r in rec.rungs):
            forecasts = [grow(a, rec.trends[f"range_{r}"].rise(ahead, windows)) for r, a in zip(_RANGE, ranges)]
            limit = ctl.demote_range * _FP16_MAX
            safe = ranges[1] > 0 and all(f <= limit for f in forecasts)
            rec.clean = rec.clean + 1 if safe else 0
            if _may_demote(ctl, rec.clean, rec.switches, False):
                i = max(range(len(_RANGE)), key=lambda k: ratio(forecasts[k], limit))
                d = decision(None, _RANGE[i], "demote", top, top - 1, "amax_forecast", forecasts[i], limit, "<=")
                rec.clean, rec.switches = 0, [*rec.switches, ctl.steps]
                _switch(ctl, rec, range(len(GEMMS)), top - 1)
                return [d]
            return []
    # under fp16 a GEMM comes down only while the layer's range stays far from 65504, as a layer's
    range_ok = not fp16 or (ranges[1] > 0 and all(
        grow(a, rec.trends[f"range_{r}"].rise(ahead, windows)) <= ctl.demote_range * _FP16_MAX
        for r, a in zip(_RANGE, ranges)))
    out = []
    for g, gemm in enumerate(GEMMS):
        d = _decide_gemm(ctl, rec, g, gemm, [stats(0, g, s) for s in (0, 1)], [stats(1, g, s) for s in (0, 1)],
                         fit, windows, ahead, decision, range_ok, cost if gemm == "output" else None)
        if d is not None:
            out.append(d)
    return out


def _may_demote(ctl: Any, clean: int, switches: list[int], to_fp4: bool) -> bool:
    """Whether a layer or GEMM with ``clean`` safe windows in a row and its ``switches`` (steps)
    comes down now: ``demote_windows`` clean windows (:func:`~mixprec.fp8._trend.demote_windows`:
    to an fp4 rung, twice as many for each round trip in the last ``budget_steps``), ``min_dwell``
    steps since its last switch, fewer than ``max_switches`` in the last ``budget_steps``."""
    recent = [s for s in switches if s > ctl.steps - ctl.budget_steps]
    last = switches[-1] if switches else -math.inf
    return (clean >= demote_windows(ctl.demote_windows, len(recent), to_fp4) and ctl.steps - last >= ctl.min_dwell
            and len(recent) < ctl.max_switches)


def _decide_gemm(ctl: Any, rec: LayerRecord, g: int, gemm: str, own: list, shadow: list, fit: tuple,
                 windows: int, ahead: int, decision: Any, range_ok: bool, cost: list[float] | None) -> Decision | None:
    """One GEMM's switch (applied to ``rec``), or None: the layer's rule on this GEMM's two
    operands (and, the forward GEMM's, on its loss cost)."""
    ladder, rung = ctl.ladder, rec.rungs[g]
    on_low = ladder[rung] in LOW_RUNGS
    down = gemm_down(ctl, rec, g)
    has_shadow = down is not None and ladder[down] in LOW_RUNGS
    ops = GEMM_OPERANDS[gemm]
    max_u, demote_u = limits(ctl, rung, down)
    measured = own if on_low else (shadow if has_shadow else None)
    for op, st in zip(ops, measured or []):
        rec.trends[f"{gemm}.{op}"].update(log2(st[0]), *fit)
    for op, own_st, shadow_st in zip(ops, own, shadow):
        if on_low:
            rec.trends[f"{gemm}.underflow_{op}"].update(own_st[_UNDERFLOW], *fit)
        if has_shadow:
            rec.trends[f"{gemm}.shadow_{op}"].update(shadow_st[_UNDERFLOW], *fit)

    def underflow(op: str, u: float, key: str, at: int) -> float:
        return underflow_forecast(u, rec.trends[f"{gemm}.{op}"], rec.trends[f"{gemm}.{key}_{op}"], ahead, windows,
                                  ladder[at] in FP4_RUNGS)

    if on_low:
        compute = ladder.index("compute")
        if ctl.max_nonfinite is not None:
            for op, st in zip(ops, own):
                if st[_NONFINITE] > ctl.max_nonfinite:
                    d = decision(gemm, op, "promote", rung, compute, "nonfinite", st[_NONFINITE], ctl.max_nonfinite,
                                 ">")
                    _switch(ctl, rec, (g,), compute)
                    return d
        for op, st in zip(ops, own):
            forecast = underflow(op, st[_UNDERFLOW], "underflow", rung)
            if forecast > max_u:
                to = gemm_up(ctl, rec, g)
                d = decision(gemm, op, "promote", rung, to, "underflow_forecast", forecast, max_u, ">")
                _switch(ctl, rec, (g,), to)
                return d
        if too_costly(ctl, cost):
            to = gemm_up(ctl, rec, g)
            d = decision(gemm, "output", "promote", rung, to, "loss_cost", cost[0], ctl.max_loss_cost, ">")
            _switch(ctl, rec, (g,), to)
            return d
    if not has_shadow:
        return None
    worst = (ops[0], 0.0)
    safe = range_ok and all(st[0] > 0 for st in shadow)  # a window without a measurement is no evidence of safety
    for op, st in zip(ops, shadow):
        forecast = underflow(op, st[_UNDERFLOW], "shadow", down)
        nonfinite = ctl.max_nonfinite is not None and st[_NONFINITE] > ctl.max_nonfinite
        if nonfinite or not forecast <= demote_u:
            safe = False
        elif forecast > worst[1]:
            worst = (op, forecast)
    worst = (*worst, "underflow_forecast", demote_u)
    if cost is not None:
        if not cheap_below(ctl, cost):
            safe = False
        elif ratio(cost[1], ctl.demote_cost) > ratio(worst[1], demote_u):
            worst = ("output", cost[1], "loss_cost", ctl.demote_cost)
    rec.gemm_clean[g] = rec.gemm_clean[g] + 1 if safe else 0
    if _may_demote(ctl, rec.gemm_clean[g], rec.gemm_switches[g], ladder[down] in FP4_RUNGS):
        d = decision(gemm, worst[0], "demote", rung, down, worst[2], worst[1], worst[3], "<=")
        _switch(ctl, rec, (g,), down)
        return d
    return None
