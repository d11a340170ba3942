"""What a demo run measured, and the checks and statistics the report prints.

:class:`ModeResult` is one mode trained from one seed; :class:`DemoResult` holds every run of
every seed. :func:`compare` checks that a mode reproduces its reference exactly;
:func:`summarize` gives each mode's mean and seed-to-seed spread, and :func:`rank` never calls
a mode better or worse than fp32 by less than the spread of their difference.

Example:
    >>> a = ModeResult("a", "", [2.0, 1.5], 1.6, 1.0, {}, "", scales=[4.0, 2.0], skipped_steps=[1])
    >>> compare(a, a)
    'identical (losses, scales, skipped steps)'
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from mixprec.demo.modes import MODES
from mixprec.demo.settings import Settings
from mixprec.fp8 import Float8Recipe

__all__ = ["ModeResult", "DemoResult", "Progress", "Summary", "compare", "summarize", "rank", "fp8_summary",
           "format_fp8", "smooth"]


@dataclass
class ModeResult:
    """What one mode measured from one seed. Memory is in bytes, throughput in tokens per second.

    ``scales`` and ``skipped_steps`` are empty for modes without a loss scaler; ``eval_loss`` is
    the validation loss after training, in the mode's own precision.
    """

    mode: str
    summary: str
    losses: list[float]
    eval_loss: float
    tokens_per_s: float
    memory: dict[str, int]
    activation_method: str
    scales: list[float] = field(default_factory=list)
    skipped_steps: list[int] = field(default_factory=list)
    wall_s: float = 0.0
    seed: int = 0
    # fp8 modes: the layers' fp8 statistics over training and the guard's fallbacks (see
    # mixprec.demo.train._fp8_trace); empty for the other modes
    fp8: dict[str, Any] = field(default_factory=dict)
    # per-layer scaling (mixprec-fp16-layerwise): {cut point: its factor after each step}
    layer_scales: dict[str, list[float]] = field(default_factory=dict)
    # modes with an fp8 rule (fp8 and fp4 modes): per Linear layer and GEMM, the steps it ran in
    # fp4, fp8 or its compute dtype, and the shares of GEMM FLOPs (mixprec.demo.flops.GemmCounter)
    gemms: dict[str, Any] = field(default_factory=dict)

    @property
    def final_loss(self) -> float:
        """Mean training loss over the last 10% of steps (at least one)."""
        tail = self.losses[-max(1, len(self.losses) // 10):]
        return sum(tail) / len(tail)

    @property
    def total_memory(self) -> int:
        return sum(self.memory.values())

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "final_loss": self.final_loss, "total_memory": self.total_memory}


@dataclass(frozen=True)
class Summary:
    """One mode over every seed: mean and sample standard deviation (0 from one seed) of its losses,
    and of its validation loss minus the ``base`` mode's from the same seed."""

    mode: str
    seeds: int
    eval_loss: float
    eval_spread: float
    final_loss: float
    final_spread: float
    base: str = ""
    eval_vs_base: float = 0.0
    eval_vs_base_spread: float = 0.0

    @property
    def band(self) -> float:
        """The noise band of the validation loss minus the base mode's, in nats: twice the
        seed-to-seed standard deviation of that difference from :data:`MIN_SEEDS` seeds on, and
        never less than :data:`NEGLIGIBLE` of the base's loss (a run that is not chaotic has a
        near-zero spread, and 0.0001 nats is no result; from fewer seeds a standard deviation is
        itself mostly noise, so the band is that floor alone)."""
        floor = NEGLIGIBLE * abs(self.eval_loss - self.eval_vs_base)
        return max(2 * self.eval_vs_base_spread, floor) if self.seeds >= MIN_SEEDS else floor

    @property
    def within(self) -> bool:
        """Whether the mode is within the band (:func:`within_band`): its mean validation loss at most
        :attr:`band` above the base's, or below it. What the verdict recommends for speed and
        memory, and what the loss figure's caption calls within."""
        return within_band(self.eval_vs_base, self.band)

    @property
    def distinct(self) -> bool:
        """Whether the validation loss differs from the base mode's by more than :attr:`band`,
        either way (better or worse: ranked only from :data:`MIN_SEEDS` seeds)."""
        return abs(self.eval_vs_base) > self.band

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


#: A difference to the base mode's validation loss below this fraction of it is never called
#: better or worse (:attr:`Summary.distinct`).
NEGLIGIBLE = 0.001

#: The fewest seeds whose spread a band rests on, and modes are ranked from.
MIN_SEEDS = 3


def within_band(difference: float, tolerance: float) -> bool:
    """The one rule for "within the band" on the demo's page (verdict, captions, fp8 and fp4
    lines): a loss at most ``tolerance`` above the reference's; a loss below it is within,
    however far (lower is not worse).

    Example:
        >>> within_band(-0.002, 0.001), within_band(0.0005, 0.001), within_band(0.002, 0.001)
        (True, True, False)
    """
    return difference <= tolerance


@dataclass
class DemoResult:
    """A whole demo run: its settings, its environment, and one :class:`ModeResult` per mode and
    seed (``runs``, seed by seed in the order of ``modes``).

    ``settings.seed`` is the first seed; the others follow it (``seed + 1``, ...). ``speed`` is
    the speed panel (:func:`mixprec.demo.speed.measure`; empty when it did not run),
    ``seeds_note`` why this many seeds ran (when a time budget chose them), ``interrupted``
    where a Ctrl-C stopped the run (empty when it ran to the end); ``pairs``, per ``"mode =
    reference"`` that trained bitwise alike, their steps timed in alternation
    (:func:`mixprec.demo.alternate.time_pair`).
    """

    settings: Settings
    device: str
    environment: dict[str, Any]
    runs: list[ModeResult]
    speed: dict[str, Any] = field(default_factory=dict)
    seeds_note: str = ""
    interrupted: str = ""
    pairs: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def seeds(self) -> list[int]:
        return list(dict.fromkeys(r.seed for r in self.runs))

    @property
    def modes(self) -> list[ModeResult]:
        """The runs of the first seed: the curves, memory and throughput of the report."""
        first = self.runs[0].seed
        return [r for r in self.runs if r.seed == first]

    def of(self, mode: str) -> list[ModeResult]:
        """Every seed's run of ``mode``."""
        return [r for r in self.runs if r.mode == mode]

    def to_json(self) -> dict[str, Any]:
        return {
            "settings": asdict(self.settings),
            "device": self.device,
            "environment": self.environment,
            "seeds": self.seeds,
            "modes": [m.to_json() for m in self.modes],
            "runs": [r.to_json() for r in self.runs],
            "summary": [s.to_json() for s in summarize(self)],
            "checks": checks(self),
            "fp8": fp8_summary(self),
            "speed": self.speed,
            "seeds_note": self.seeds_note,
            "interrupted": self.interrupted,
            "pairs": self.pairs,
        }


class Progress(Protocol):
    """Receives progress while the demo trains (see :mod:`mixprec.demo.progress`)."""

    def start(self, mode: str, total: int) -> None: ...
    def update(self, step: int, loss: float, scale: float | None) -> None: ...
    def finish(self, result: ModeResult) -> None: ...
    def note(self, text: str) -> None: ...


def smooth(values: list[float]) -> list[float]:
    """Trailing mean over a window of 1/25 of the run (at least one step)."""
    window = max(1, len(values) // 25)
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def compare(ours: ModeResult, ref: ModeResult) -> str:
    """``"identical (losses, scales, skipped steps)"``, or the first difference, in words."""
    for step, (a, b) in enumerate(zip(ours.losses, ref.losses)):
        if a != b:
            return f"losses differ from step {step + 1}: {a!r} against {b!r}"
    if len(ours.losses) != len(ref.losses):
        return f"{len(ours.losses)} steps against {len(ref.losses)}"
    for step, (a, b) in enumerate(zip(ours.scales, ref.scales)):
        if a != b:
            return f"loss scales differ from step {step + 1}: {a:g} against {b:g}"
    if len(ours.scales) != len(ref.scales):
        return f"{len(ours.scales)} loss scales against {len(ref.scales)}"
    if ours.skipped_steps != ref.skipped_steps:
        return f"skipped steps differ: {ours.skipped_steps} against {ref.skipped_steps}"
    return "identical (losses, scales, skipped steps)"


def checks(result: DemoResult) -> dict[str, str]:
    """For every mode whose bitwise reference also ran (``Mode.reference``): ``"a = b"`` ->
    :func:`compare` over every seed (the first seed that differs is named)."""
    out = {}
    ran = {r.mode for r in result.runs}
    for name in dict.fromkeys(r.mode for r in result.runs):
        ref = MODES[name].reference if name in MODES else None
        if ref is None or ref not in ran:
            continue
        verdicts = [(run.seed, compare(run, other)) for run, other in zip(result.of(name), result.of(ref))]
        bad = next(((seed, v) for seed, v in verdicts if not v.startswith("identical")), None)
        seeds = f" over {len(verdicts)} seeds" if len(verdicts) > 1 else ""
        if bad is None:
            out[f"{name} = {ref}"] = verdicts[0][1] + seeds
        else:
            out[f"{name} = {ref}"] = f"seed {bad[0]}: {bad[1]}" if seeds else bad[1]
    return out


def summarize(result: DemoResult) -> list[Summary]:
    """Each mode's mean validation and final training loss over the seeds, with their spread, and
    its validation loss minus the first mode's (fp32's), seed by seed: mean and spread."""

    def spread(values: list[float]) -> float:
        return statistics.stdev(values) if len(values) > 1 else 0.0

    names = list(dict.fromkeys(r.mode for r in result.runs))
    base = {r.seed: r.eval_loss for r in result.of(names[0])}
    out = []
    for name in names:
        runs = result.of(name)
        evals, finals = [r.eval_loss for r in runs], [r.final_loss for r in runs]
        diffs = [r.eval_loss - base[r.seed] for r in runs]
        out.append(Summary(name, len(runs), statistics.fmean(evals), spread(evals), statistics.fmean(finals),
                           spread(finals), names[0], statistics.fmean(diffs), spread(diffs)))
    return out


def rank(summaries: list[Summary]) -> str:
    """One sentence comparing each mode's validation loss with the base mode's (the first, fp32),
    seed by seed, by the verdict's own rule (:attr:`Summary.within`, :attr:`Summary.band`): from
    :data:`MIN_SEEDS` seeds a mode is called higher or lower when its mean difference exceeds the
    band, and otherwise not distinguishable; from fewer seeds nothing is ranked and the sentence
    says which modes are within the band (at most 0.1% above the base's loss, or below it)."""
    if not summaries:
        return ""
    base, n = summaries[0].base, summaries[0].seeds
    others = [s for s in summaries if s.mode != base]
    if not others:
        return f"Over {n} seed(s), {base}'s validation loss is {summaries[0].eval_loss:.4f} ± {summaries[0].eval_spread:.4f}."

    def listed(group: list[Summary]) -> str:
        return ", ".join(f"{s.mode} ({s.eval_vs_base:+.4f}" + (f" ± {s.eval_vs_base_spread:.4f})" if n > 1 else ")")
                         for s in group)

    if n < MIN_SEEDS:
        groups = {f"within the band (at most 0.1% above {base}'s, or below it)": [s for s in others if s.within],
                  "above it": [s for s in others if not s.within]}
        parts = [f"{label}: {listed(group)}" for label, group in groups.items() if group]
        return (f"Validation loss minus {base}'s, {'one seed' if n == 1 else f'{n} seeds, mean ± standard deviation'}: "
                + "; ".join(parts) + f". From {n} seed{'s' if n > 1 else ''} the seed-to-seed spread is not "
                f"measured, so no mode is ranked (--seeds {MIN_SEEDS} measures it).")
    groups = {
        "lower": [s for s in others if s.distinct and s.eval_vs_base < 0],
        "higher": [s for s in others if s.distinct and s.eval_vs_base > 0],
        f"not distinguishable from {base} (difference within the band: twice the seed-to-seed standard "
        "deviation, at least 0.1%)": [s for s in others if not s.distinct],
    }
    parts = [f"{label}: {listed(group)}" for label, group in groups.items() if group]
    return (f"Validation loss minus {base}'s, seed by seed, over {n} seeds (mean ± standard deviation): "
            + "; ".join(parts) + f". Within the band (a loss below {base}'s is within it): "
            + (", ".join(s.mode for s in others if s.within) or "none") + ".")


def fp8_summary(result: DemoResult) -> dict[str, Any]:
    """Per fp8 mode (a mode whose runs recorded fp8 statistics): its recipe and fp8 layers, what
    judged them (``judge``: ``"guard"`` or ``"controller"``), the guard's fallbacks and the
    controller's decisions over every seed (each with its ``seed``), the share of layer-steps run
    in fp8 (``fp8_fraction``: the mean over seeds, ``fp8_fractions`` per seed; a guard mode keeps a
    layer in fp8 until it falls back), the worst underflow seen, and its mean final training loss
    against the first mode's (fp32's): ``within`` when ``|difference| <= tolerance``, fp32's spread
    (the standard deviation of its final loss over the seeds; the seed-by-seed difference and its
    spread are reported beside it); from one seed the spread is unknown and ``within`` is None
    (no verdict).

    Example:
        >>> fp8_summary(DemoResult(Settings.for_size("tiny", steps=1), "cpu", {}, []))
        {}
    """
    names = list(dict.fromkeys(r.mode for r in result.runs))
    out: dict[str, Any] = {}
    for name in names:
        runs = [r for r in result.of(name) if r.fp8]
        if not runs:
            continue
        worst = {"value": -1.0}
        for run in runs:
            for layer, operands in run.fp8["layers"].items():
                for operand, series in operands.items():
                    for end, value in zip(run.fp8["steps"], series["underflow"]):
                        if value > worst["value"]:
                            worst = {"value": value, "layer": layer, "operand": operand, "step": end, "seed": run.seed}
        base = {r.seed: r.final_loss for r in result.of(names[0])}
        paired = [r for r in runs if r.seed in base]
        entry: dict[str, Any] = {
            "recipe": runs[0].fp8["recipe"],
            "layers": list(runs[0].fp8["layers"]),
            "every": runs[0].fp8["every"],
            "thresholds": runs[0].fp8["thresholds"],
            "judge": runs[0].fp8.get("judge", "guard"),
            "fallbacks": [{**f, "seed": r.seed} for r in runs for f in r.fp8["fallbacks"]],
            "decisions": [{**d, "seed": r.seed} for r in runs for d in r.fp8.get("decisions", [])],
            "fp8_fractions": {r.seed: r.fp8["fp8_fraction"] for r in runs if "fp8_fraction" in r.fp8},
            "worst_underflow": worst if worst["value"] >= 0 else None,
        }
        fractions = list(entry["fp8_fractions"].values())
        entry["fp8_fraction"] = statistics.fmean(fractions) if fractions else None
        if paired and name != names[0]:
            diffs = [r.final_loss - base[r.seed] for r in paired]
            base_mean = statistics.fmean(base[r.seed] for r in paired)
            spread = statistics.stdev(diffs) if len(diffs) > 1 else 0.0
            tolerance = statistics.stdev(base[r.seed] for r in paired) if len(paired) > 1 else 0.0
            mean_diff = statistics.fmean(diffs)
            finals = [r.final_loss for r in paired]
            entry["final_vs_base"] = {
                "base": names[0], "seeds": len(paired), "mean": statistics.fmean(finals),
                "spread": statistics.stdev(finals) if len(finals) > 1 else 0.0, "base_mean": base_mean,
                "difference": mean_diff, "relative": mean_diff / base_mean, "difference_spread": spread,
                "tolerance": tolerance, "within": within_band(mean_diff, tolerance) if len(paired) > 1 else None,
            }
        out[name] = entry
    return out


def format_fp8(result: DemoResult) -> list[str]:
    """One line per fp8 mode: its layers, the guard's fallbacks and its final loss against fp32's.

    Example:
        >>> format_fp8(DemoResult(Settings.for_size("tiny", steps=1), "cpu", {}, []))
        []
    """
    lines = []
    for name, entry in fp8_summary(result).items():
        seeds = len(result.of(name))
        over = f" over {seeds} seeds" if seeds > 1 else ""
        falls = entry["fallbacks"]
        if entry["judge"] == "controller":
            guard = _decisions_text(entry["decisions"], seeds, over)
        elif falls:
            guard = "; ".join((f"seed {f['seed']}: " if seeds > 1 else "")
                              + f"{f['layer']} at step {f['step']} ({f['operand']} {f['statistic']} "
                              f"= {f['value']:.4g} {'<' if f['statistic'] == 'sqnr_db' else '>'} {f['threshold']:g})"
                              for f in falls)
            guard = f"{len(falls)} fallback(s) to bf16: {guard}"
        else:
            guard = f"no layer fell back{over}"
        fp4 = Float8Recipe.from_name(entry["recipe"]).fp4
        line = f"{name} ({entry['recipe']}, {len(entry['layers'])} {'fp4' if fp4 else 'fp8'} layers): {guard}"
        counted = [r.gemms["fp4_share"] for r in result.of(name) if r.gemms]
        if fp4 and counted:  # a layer-step of an fp4 mode may be in fp4 or fp8: the GEMM count says which
            line += f"; in fp4 {statistics.fmean(counted):.1%} of the linear layers' GEMM FLOPs"
        elif entry["fp8_fraction"] is not None:
            line += f"; in fp8 {entry['fp8_fraction']:.1%} of layer-steps"
        vs = entry.get("final_vs_base")
        if vs is not None:
            line += f"; final loss {vs['mean']:.4f} vs {vs['base']} {vs['base_mean']:.4f} ({vs['relative']:+.2%}"
            if vs["within"] is None:
                line += ", one seed: no verdict, --seeds 3 measures the spread)"
            else:
                verdict = "within" if vs["within"] else "NOT within"
                line += (f", {vs['difference']:+.4f} ± {vs['difference_spread']:.4f} seed by seed: {verdict} "
                         f"fp32's spread {vs['tolerance']:.4f})")
        lines.append(line)
    return lines


#: the controller's decisions a line of :func:`format_fp8` names (then "and N more")
_NAMED_DECISIONS = 4


def _decisions_text(decisions: list[dict[str, Any]], seeds: int, over: str) -> str:
    """The controller's decisions in words, e.g. ``2 controller decisions: blocks.0.fc promote
    fp8-tensorwise -> fp8-rowwise at step 40 (input underflow forecast 0.06 > 0.05); ...``."""
    if not decisions:
        return f"no controller decision{over}"
    named = "; ".join((f"seed {d['seed']}: " if seeds > 1 else "")
                      + f"{d['layer']} {d['action']} {d['from']} -> {d['to']} at step {d['step']} ({d['reason']})"
                      for d in decisions[:_NAMED_DECISIONS])
    more = len(decisions) - _NAMED_DECISIONS
    return (f"{len(decisions)} controller decision{'s' if len(decisions) > 1 else ''}{over}: {named}"
            + (f"; and {more} more (results.json)" if more > 0 else ""))
