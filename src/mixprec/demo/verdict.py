"""The top of the demo report: which mode to use here, for accuracy, for speed and for memory,
computed from the run, with the noise band it rests on; and why a mode that ends far above fp32
did so.

Accuracy compares each mode's validation loss with the base mode's (the first, fp32) seed by
seed, as :func:`mixprec.demo.results.rank` does: a mode is better or worse only beyond twice the
standard deviation of that difference over the seeds and beyond 0.1% of fp32's loss; from fewer than :data:`MIN_SEEDS` seeds
there is no band to rest on (a standard deviation from two values is itself mostly noise):
nothing is called better or worse, the line says what those seeds can and cannot tell, and speed
and memory recommend only the modes within the band (:attr:`~mixprec.demo.results.Summary.within`,
the rule the loss figure's caption uses too: at most 0.1% above fp32's loss, or below it);
fp32 itself is the reference and never carries a caveat. Speed is this run's throughput (the trained size), and the
speed panel's crossover (:mod:`mixprec.demo.speed`) for larger models.

Example:
    >>> from mixprec.demo.results import DemoResult, ModeResult
    >>> from mixprec.demo.settings import Settings
    >>> runs = [ModeResult(m, "", [2.0] * 10, 2.0, tps, {"params": 8}, "") for m, tps in (("fp32", 9.0), ("b", 4.0))]
    >>> verdict(DemoResult(Settings.for_size("tiny", steps=10), "cpu", {}, runs))[1]
    'For speed at this size (tiny, 10 steps): fp32 (9 tokens/s).'
"""

from __future__ import annotations

from mixprec.demo.fp4 import fp4_paragraph
from mixprec.demo.results import MIN_SEEDS, DemoResult, ModeResult, Summary, smooth, summarize
from mixprec.demo.speed import speed_sentence

__all__ = ["verdict", "departure", "within_bar", "DEPARTURE_RATIO", "MIN_SEEDS"]

#: A mode whose final training loss ends more than this fraction above fp32's gets its departure
#: from fp32's curve explained (:func:`departure`).
DEPARTURE_RATIO = 0.02
# the smoothed difference to the base mode that counts as leaving its curve, nats
_LEAVES = 0.05


def within_bar(result: DemoResult, mode: str) -> bool:
    """Whether ``mode`` is within the band of the base mode (the first): :attr:`Summary.within`,
    the one rule of the page (a loss below the base's is within); from fewer than
    :data:`MIN_SEEDS` seeds the band is 0.1% of the base's loss."""
    return next(s for s in summarize(result) if s.mode == mode).within


def _few_seeds(result: DemoResult, stats: list[Summary]) -> tuple[str, list[str]]:
    """The accuracy sentence from fewer than :data:`MIN_SEEDS` seeds: what they can tell (each
    mode's difference to fp32 on these seeds, and which are within the band: at most 0.1% above
    fp32's loss, or below it) and what they cannot (whether a difference is systematic); the
    modes within the band (the base first)."""
    base, n = stats[0].base, stats[0].seeds
    others = stats[1:]
    which = f"seed {result.seeds[0]}" if n == 1 else f"seeds {', '.join(map(str, result.seeds))}"
    inside = [s for s in others if s.within]
    outside = [s for s in others if s not in inside]

    def listed(group: list[Summary]) -> str:
        return ", ".join(f"{s.mode} ({s.eval_vs_base:+.3f})" for s in group) or "none"

    mean = "" if n == 1 else " (mean over them)"
    whose = "this seed's" if n == 1 else "these seeds'"
    text = (f"For accuracy, from {n} seed{'s' if n > 1 else ''} ({which}): validation loss minus {base}'s{mean}, "
            f"within the band (at most 0.1% above {base}'s {stats[0].eval_loss:.3f}, or below it): {listed(inside)}; "
            f"above it: {listed(outside)}. {'One seed' if n == 1 else f'{n} seeds'} cannot tell whether a difference is "
            f"systematic or {whose} chance (the seed-to-seed noise band "
            f"takes {MIN_SEEDS} seeds: --seeds {MIN_SEEDS}), so no mode is called better or worse than {base} "
            f"(the reference); speed and memory below consider only {base} and the modes within the band"
            + (f" ({result.seeds_note})" if result.seeds_note else "") + ".")
    return text, [base] + [s.mode for s in inside]


def _accuracy(result: DemoResult, stats: list[Summary]) -> tuple[str, list[str]]:
    """The accuracy sentence and the modes that pass its bar (the base first)."""
    base, n = stats[0].base, stats[0].seeds
    others = stats[1:]
    if n < MIN_SEEDS:
        return _few_seeds(result, stats)
    match = [s for s in others if not s.distinct]
    better = [s for s in others if s.distinct and s.eval_vs_base < 0]
    worse = [s for s in others if s.distinct and s.eval_vs_base > 0]
    bands = [s.band for s in others]
    band = (f"{min(bands):.3f} to {max(bands):.3f}" if others else "")

    def listed(group: list[Summary]) -> str:
        return ", ".join(f"{s.mode} ({s.eval_vs_base:+.3f} ± {s.eval_vs_base_spread:.3f})" for s in group) or "none"

    use = f"{better[0].mode}" if better else f"{base} or any mode that matches it"
    text = (f"For accuracy ({n} seeds; noise band: twice the seed-to-seed standard deviation of each mode's "
            f"validation loss minus {base}'s, at least 0.1% of {base}'s loss: {band} nats here; a loss below "
            f"{base}'s is within it): use {use}. Matching {base}: {listed(match)}; "
            f"better: {listed(better)}; worse: {listed(worse)}"
            + (f" ({result.seeds_note})" if result.seeds_note else "") + ".")
    return text, [base] + [s.mode for s in others if s.within]  # better + match: the band's rule


def departure(mode: ModeResult, base: ModeResult) -> tuple[int, str] | None:
    """Where ``mode``'s training loss leaves ``base``'s (the first step at which their trailing
    means differ by more than 0.05) and its largest jump above it: ``(step, words)``, or None
    when it never leaves.

    Example:
        >>> a = ModeResult("a", "", [3.0, 2.0, 2.0, 2.0], 2.0, 1.0, {}, "")
        >>> departure(ModeResult("b", "", [3.0, 2.0, 3.5, 2.5], 2.5, 1.0, {}, ""), a)
        (3, 'b +25.0% (leaves the curve at step 3, jumps to 3.50 at step 3 against 2.00)')
    """
    diff = [a - b for a, b in zip(smooth(mode.losses), smooth(base.losses))]
    leaves = next((i for i, d in enumerate(diff) if d > _LEAVES), None)
    if leaves is None:
        return None
    raw = [a - b for a, b in zip(mode.losses, base.losses)]
    peak = max(range(len(raw)), key=raw.__getitem__)
    return leaves + 1, (f"{mode.mode} {mode.final_loss / base.final_loss - 1:+.1%} (leaves the curve at step "
                        f"{leaves + 1}, jumps to {mode.losses[peak]:.2f} at step {peak + 1} against "
                        f"{base.losses[peak]:.2f})")


def _departures(result: DemoResult, base: ModeResult) -> str | None:
    """One line for the modes whose final loss ends more than :data:`DEPARTURE_RATIO` above
    ``base``'s (first seed): where each left its curve, and what that says."""
    found = [d for m in result.modes if m is not base and m.final_loss > (1 + DEPARTURE_RATIO) * base.final_loss
             if (d := departure(m, base)) is not None]
    if not found:
        return None
    s = result.settings
    warmup = max(1, s.steps // 10)
    after = all(step > warmup for step, _ in found)
    why = ("each leaves it after the warm-up to the peak learning rate (" f"{s.lr:g}, reached at step {warmup}): "
           "in that phase a run of this small model is tipped off course by any rounding difference and stays on "
           "a higher plateau, so one seed does not rank these modes" if after else
           f"the warm-up to the peak learning rate ({s.lr:g}) ends at step {warmup}")
    return (f"Far above {base.mode}'s final training loss (seed {base.seed}): " + "; ".join(w for _, w in found)
            + f"; {why}. Compare over seeds (docs/demo.md, 'Far above fp32 from one seed').")


def verdict(result: DemoResult) -> list[str]:
    """The report's verdict: one line for accuracy, one for speed (this run's throughput, and
    the speed panel when it ran), one for memory, one for the modes that ended more than
    :data:`DEPARTURE_RATIO` above the base mode's final loss (see :func:`departure`), and one
    for the fp4 modes when any ran (:func:`mixprec.demo.fp4.fp4_paragraph`: which of them wins).

    Precondition: at least one run.
    """
    stats = summarize(result)
    accuracy, good = _accuracy(result, stats)
    modes = {m.mode: m for m in result.modes}
    base = modes[stats[0].base]
    s = result.settings
    several = stats[0].seeds >= MIN_SEEDS
    candidates = [modes[m] for m in good if m in modes]
    fastest = max(candidates, key=lambda m: m.tokens_per_s)

    def caveat(mode: ModeResult) -> str:
        # the base mode is the reference: no caveat about its own accuracy, ever
        return "" if several or mode is base else f"; within the band of {base.mode}'s loss, not shown to match it"

    ratio = base.tokens_per_s / fastest.tokens_per_s
    seed = f"seed {fastest.seed}, " if len(result.seeds) > 1 else ""
    speed = (f"For speed at this size ({s.size}, {s.steps} steps): {fastest.mode} ({seed}{fastest.tokens_per_s:,.0f} tokens/s"
             + (f", {ratio:.2f}x {base.mode}'s time" if fastest is not base else "") + caveat(fastest) + ").")
    if result.speed.get("sizes"):
        speed += " At other sizes (the speed panel), " + speed_sentence(result.speed, result.device)
    lines = [accuracy, speed]
    if len(candidates) > 1:
        least = min(candidates, key=lambda m: m.total_memory)
        lines.append(f"For memory: {least.mode} ({least.total_memory / 2**20:.2f} MiB, "
                     f"{least.total_memory / base.total_memory:.0%} of {base.mode}'s"
                     + caveat(least).replace(";", ",", 1) + ").")
    else:
        lines.append(f"For memory: no mode passes the accuracy bar above, so none is recommended over "
                     f"{base.mode} ({base.total_memory / 2**20:.2f} MiB).")
    far = _departures(result, base)
    fp4 = fp4_paragraph(result)
    return lines + [line for line in (far, fp4) if line is not None]
