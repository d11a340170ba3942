"""The fp4 modes side by side (:data:`mixprec.demo.modes.FP4_MODES`): each one's final training
loss against the base mode's (the first, fp32) and its seed spread, its share of the linear
layers' GEMM FLOPs in fp4 (per GEMM and per layer, :mod:`mixprec.demo.flops`), whether the
controller's mode meets issue 28's bar (within fp32's seed spread with at least
:data:`FP4_TARGET` of the GEMM FLOPs in fp4), and which of the three wins.

*Within fp32's spread*: the mean over seeds of the final training loss (the mean of the last 10%
of steps) differs from fp32's mean by at most fp32's own seed-to-seed standard deviation, as
:func:`mixprec.demo.results.fp8_summary` judges the fp8 modes. *Wins*: of the fp4 modes within
fp32's spread, the one with the largest share of GEMM FLOPs in fp4; none when no mode is within.
From one seed the spread is unknown: no verdict and no winner.

Example:
    >>> from mixprec.demo.settings import Settings
    >>> fp4_summary(DemoResult(Settings.for_size("tiny", steps=1), "cpu", {}, []))
    {}
"""

from __future__ import annotations

import statistics
from typing import Any

from mixprec.demo.flops import GEMM_WORDS, GEMMS
from mixprec.demo.modes import FP4_MODES
from mixprec.demo.results import DemoResult, within_band

__all__ = ["FP4_TARGET", "ROLES", "fp4_decisions", "fp4_summary", "fp4_paragraph"]

#: The share of the linear layers' GEMM FLOPs the controller's mode must keep in fp4 (issue 28).
FP4_TARGET = 0.6
#: Each fp4 mode's part in the comparison, in words.
ROLES = {"mixprec-fp4": "controller", "mixprec-fp4-all": "all fp4, no controller",
         "mixprec-fp4-hand": "hand recipe: first and last layers bf16"}
_CONTROLLED = FP4_MODES[0]


def _sd(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def _mean_of(dicts: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.fmean(d[k] for d in dicts) for k in dicts[0]} if dicts else {}


def fp4_summary(result: DemoResult) -> dict[str, Any]:
    """``{}`` when no fp4 mode ran, else ``{"base": ..., "seeds": n, "base_mean": ...,
    "tolerance": fp32's spread, "modes": {mode: entry}, "winner": mode or None, "criterion":
    {...} or None}``. Each entry: ``final`` (mean over seeds) and ``final_spread``,
    ``difference`` (to the base's final loss, seed by seed: mean) and ``difference_spread``,
    ``within`` (None from one seed), ``fp4_share`` (mean over seeds), ``fp4_shares`` (per seed),
    ``per_gemm`` and ``per_layer`` (fp4 shares, means over seeds). ``criterion`` (when the
    controller's mode ran): its ``share`` against ``target``, ``within``, ``met`` (None from one
    seed) and, when missed, ``excess`` (how far beyond the spread, nats) and ``short`` (how far
    below the target share)."""
    names = list(dict.fromkeys(r.mode for r in result.runs))
    ran = [m for m in FP4_MODES if m in names]
    if not ran or not names:
        return {}
    base = names[0]
    finals = {r.seed: r.final_loss for r in result.of(base)}
    seeds = len(finals)
    tolerance = _sd(list(finals.values()))
    modes: dict[str, Any] = {}
    for name in ran:
        runs = [r for r in result.of(name) if r.seed in finals and r.gemms]
        if not runs:
            continue
        diffs = [r.final_loss - finals[r.seed] for r in runs]
        mean_diff = statistics.fmean(diffs)
        modes[name] = {
            "role": ROLES.get(name, ""), "seeds": len(runs),
            "final": statistics.fmean(r.final_loss for r in runs), "final_spread": _sd([r.final_loss for r in runs]),
            "difference": mean_diff, "difference_spread": _sd(diffs),
            "within": within_band(mean_diff, tolerance) if len(runs) > 1 else None,
            "fp4_share": statistics.fmean(r.gemms["fp4_share"] for r in runs),
            "fp4_shares": {r.seed: r.gemms["fp4_share"] for r in runs},
            "per_gemm": _mean_of([r.gemms["per_gemm"] for r in runs]),
            "per_layer": _mean_of([r.gemms["per_layer"] for r in runs]),
        }
    if not modes:
        return {}
    within = [m for m, e in modes.items() if e["within"]]
    out: dict[str, Any] = {
        "base": base, "seeds": seeds, "base_mean": statistics.fmean(finals.values()), "tolerance": tolerance,
        "modes": modes, "winner": max(within, key=lambda m: modes[m]["fp4_share"]) if within else None,
        "criterion": None,
    }
    ctl = modes.get(_CONTROLLED)
    if ctl is not None:
        met = None if ctl["within"] is None else bool(ctl["within"] and ctl["fp4_share"] >= FP4_TARGET)
        out["criterion"] = {"mode": _CONTROLLED, "share": ctl["fp4_share"], "target": FP4_TARGET,
                            "within": ctl["within"], "met": met,
                            "excess": max(0.0, abs(ctl["difference"]) - tolerance),
                            "short": max(0.0, FP4_TARGET - ctl["fp4_share"])}
    return out


def _mode_words(name: str, e: dict[str, Any], base: str) -> str:
    gemms = ", ".join(f"{GEMM_WORDS[g]} {e['per_gemm'][g]:.0%}" for g in GEMMS)
    verdict = "" if e["within"] is None else (", within" if e["within"] else ", NOT within") + f" {base}'s spread"
    return (f"{name} ({e['role']}) {e['final']:.4f}, {e['difference']:+.4f} ± {e['difference_spread']:.4f} seed by "
            f"seed{verdict}, {e['fp4_share']:.1%} of the GEMM FLOPs in fp4 ({gemms})")


def fp4_decisions(result: DemoResult) -> list[str]:
    """The controller's decisions in the fp4 mode, one line per GEMM that switched in a seed's
    run: which GEMM of which layer, at which step, from and to which rung, why (the statistic
    against its limit, e.g. a loss cost in nats), and what it cost: the share of that run's GEMM
    FLOPs the GEMM ran out of fp4 (counted step by step, :mod:`mixprec.demo.flops`).

    Example:
        >>> from mixprec.demo.settings import Settings
        >>> fp4_decisions(DemoResult(Settings.for_size("tiny", steps=1), "cpu", {}, []))
        []
    """
    lines = []
    for run in result.of(_CONTROLLED):
        decisions = (run.fp8 or {}).get("decisions", [])
        if not decisions or not run.gemms:
            continue
        layers = run.gemms["layers"]
        total = sum(e["flops_per_gemm"] * sum(c.values()) for e in layers.values() for c in e["gemms"].values())
        switched: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for d in decisions:
            switched.setdefault((d["layer"], d.get("gemm") or "output"), []).append(d)
        for (layer, gemm), ds in switched.items():
            entry = layers.get(layer)
            counts = entry["gemms"][gemm] if entry is not None else {}
            out = entry["flops_per_gemm"] * (sum(counts.values()) - counts.get("fp4", 0)) / total if entry and total else 0.0
            steps = "; ".join(f"step {d['step']} {d['from']} -> {d['to']} ({d['reason'].split(': ', 1)[-1]})" for d in ds)
            lines.append(f"seed {run.seed}: {layer} {GEMM_WORDS.get(gemm, gemm)} GEMM: {steps}; out of fp4 for "
                         f"{out:.1%} of the run's GEMM FLOPs")
    return lines


def fp4_paragraph(result: DemoResult) -> str | None:
    """The report's paragraph on the fp4 modes (:func:`fp4_summary` in words), or None when none
    ran."""
    summary = fp4_summary(result)
    if not summary:
        return None
    base, n = summary["base"], summary["seeds"]
    modes = summary["modes"]
    text = (f"For fp4 ({n} seed{'s' if n > 1 else ''}; final training loss against {base}'s "
            f"{summary['base_mean']:.4f} ± {summary['tolerance']:.4f}, share of the linear layers' GEMM FLOPs run in "
            f"fp4): " + "; ".join(_mode_words(m, e, base) for m, e in modes.items()) + ".")
    if n < 2:
        return text + (f" From one seed {base}'s spread is unknown, so no fp4 mode is called within it and none "
                       "wins (--seeds 3 measures it).") + _decisions_words(result, modes)
    winner = summary["winner"]
    if winner is None:
        text += f" No fp4 mode ends within {base}'s spread, so none wins."
    else:
        text += (f" Wins: {winner}, of the fp4 modes within {base}'s spread the one with the most GEMM FLOPs in fp4 "
                 f"({modes[winner]['fp4_share']:.1%}).")
    crit = summary["criterion"]
    if crit is not None:
        bar = f"within {base}'s spread with at least {crit['target']:.0%} of the GEMM FLOPs in fp4"
        if crit["met"]:
            text += f" The controller's mode meets the bar ({bar})."
        else:
            misses = ([f"its loss is {crit['excess']:.4f} beyond the spread"] if not crit["within"] else []) + (
                [f"{crit['share']:.1%} in fp4, {crit['short'] * 100:.1f} points short"] if crit["short"] > 0 else [])
            text += f" The controller's mode misses the bar ({bar}): " + " and ".join(misses) + "."
    return text + _decisions_words(result, modes)


def _decisions_words(result: DemoResult, modes: dict[str, Any]) -> str:
    decisions = fp4_decisions(result)
    if decisions:
        return " The controller's decisions (GEMM, step, rungs, why, what it cost): " + "; ".join(decisions) + "."
    return " The controller made no decision: every GEMM stayed in fp4." if _CONTROLLED in modes else ""
