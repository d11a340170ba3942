"""FP4 acceptance (issue 28): the demo's fp4 mode with the controller against all-fp4, the hand
recipe and fp32, on the demo's default model (``tiny``) and on ``small``, 3 seeds each.

Each mode trains the demo's preset (tiny: 120 steps, small: 300) from seeds 0, 1, 2
(:func:`mixprec.demo.train.run_mode`, one thread): ``fp32``; ``mixprec-fp4`` (every Linear layer
in NVFP4, a Controller moving each up nvfp4 -> fp8 tensorwise -> fp8 rowwise -> bf16);
``mixprec-fp4-all`` (every Linear in NVFP4, no controller); ``mixprec-fp4-hand`` (the first and
last Linear in bf16, the rest NVFP4). Printed per size: each mode's final training loss (mean of
the last 10% of steps; mean ± standard deviation over the seeds), its difference to fp32's seed by
seed, whether it is within fp32's seed spread, and its share of the linear layers' GEMM FLOPs in
fp4, overall and per GEMM (counted step by step, :mod:`mixprec.demo.flops`); whether
``mixprec-fp4`` ends within fp32's spread with at least 60% of the FLOPs in fp4, and which of the
three wins (:mod:`mixprec.demo.fp4`). Nothing here is tuned to pass: the figures are what ran.

Step cost: one training step of each fp4 mode timed in alternation with one of each of the
demo's fp8 modes (``mixprec-fp8``: tensorwise, ``mixprec-fp8-rowwise``; both emulated, first and
last layers bf16, with their controller) on the same batch (:func:`mixprec.demo.alternate.time_pair`:
median of the per-round ratios, with its quartiles). The CPU and the load average are recorded
before and after (``benchmarks/_machine.py``).

    .venv/bin/python benchmarks/fp4.py [--quick] [--sizes tiny,small] [--json fp4.json]

``--quick``: ``tiny`` only, 10 steps, 2 seeds, 3 timing rounds (a smoke run, no result).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._machine import machine  # noqa: E402
from mixprec.demo.alternate import time_pair  # noqa: E402
from mixprec.demo.corpus import load_tokens  # noqa: E402
from mixprec.demo.fp4 import fp4_summary  # noqa: E402
from mixprec.demo.modes import FP4_MODES  # noqa: E402
from mixprec.demo.results import DemoResult, ModeResult  # noqa: E402
from mixprec.demo.settings import Settings  # noqa: E402
from mixprec.demo.train import run_mode  # noqa: E402

SIZES = ("tiny", "small")
SEEDS = 3
#: the fp8 modes each fp4 mode's step is timed against
FP8_REFERENCES = ("mixprec-fp8", "mixprec-fp8-rowwise")
_CPU = torch.device("cpu")


def _train(size: str, seeds: int, steps: int | None, data: Any, log: Any, runs: Path | None,
           modes: tuple[str, ...]) -> DemoResult:
    """Every mode of ``modes`` from each seed; with ``runs``, a run found there (same size, steps,
    seed and mode) is read instead of trained, and each new run is written there."""
    settings = Settings.for_size(size, steps=steps)
    result = DemoResult(settings, "cpu", {}, [])
    for seed in range(seeds):
        seeded = dataclasses.replace(settings, seed=seed)
        for mode in modes:
            path = None if runs is None else runs / f"{size}-{settings.steps}-{seed}-{mode}.json"
            start = time.perf_counter()
            cached = path is not None and path.exists()
            if cached:
                data_ = json.loads(path.read_text())
                run = ModeResult(**{f.name: data_[f.name] for f in dataclasses.fields(ModeResult)})
            else:
                run = run_mode(mode, seeded, _CPU, data=data)
                if path is not None:
                    path.write_text(json.dumps(run.to_json()))
            result.runs.append(run)
            log(f"  {size} seed {seed} {mode}: final loss {run.final_loss:.4f}"
                + (f", fp4 {run.gemms['fp4_share']:.1%}" if run.gemms else "")
                + (f" (read from {path})" if cached else f" ({time.perf_counter() - start:.0f} s)"))
    return result


def _timing(size: str, quick: bool, train: torch.Tensor) -> dict[str, dict[str, Any]]:
    settings = Settings.for_size(size)
    rounds, budget = (3, 1.0) if quick else (9, 30.0)
    return {mode: {ref: time_pair(mode, ref, settings, _CPU, train, rounds=rounds, budget_s=budget)
                   for ref in FP8_REFERENCES} for mode in FP4_MODES}


def run(quick: bool = False, sizes: tuple[str, ...] | None = None,
        log: Any = lambda line: print(line, file=sys.stderr, flush=True), runs: Path | None = None,
        train_only: tuple[str, ...] = ()) -> dict[str, Any]:
    """Per size: the :func:`mixprec.demo.fp4.fp4_summary` of the runs, each mode's final loss per
    seed, and the step-time ratios; the machine before and after; ``rows`` for ``python -m
    benchmarks``. ``quick``: 10 steps, 2 seeds, 3 timing rounds, ``tiny`` only unless ``sizes``
    says otherwise (default: :data:`SIZES`). ``runs``: a folder keeping each finished run
    (JSON), read back instead of training it again (a long run resumed, or its modes trained in
    several calls); ``train_only``: train just these modes into ``runs`` and return ``{}``."""
    sizes = (("tiny",) if quick else SIZES) if sizes is None else sizes
    torch.set_num_threads(1)
    data = load_tokens()
    out: dict[str, Any] = {"machine_before": machine(), "threads": 1, "quick": quick, "sizes": {}}
    start = time.perf_counter()
    if train_only:
        for size in sizes:
            _train(size, 2 if quick else SEEDS, 10 if quick else None, data, log, runs, train_only)
        return {}
    for size in sizes:
        result = _train(size, 2 if quick else SEEDS, 10 if quick else None, data, log, runs, ("fp32", *FP4_MODES))
        finals = {mode: {r.seed: r.final_loss for r in result.of(mode)} for mode in ("fp32", *FP4_MODES)}
        out["sizes"][size] = {"steps": result.settings.steps, "summary": fp4_summary(result), "finals": finals,
                              "timing": _timing(size, quick, data[0])}
    out["machine_after"] = machine()
    out["seconds"] = time.perf_counter() - start
    out["rows"] = _rows(out)
    return out


def _rows(res: dict[str, Any]) -> list[tuple[str, str, float, str, str]]:
    """``(benchmark, figure, ratio, reference, detail)`` rows for ``python -m benchmarks``."""
    rows = []
    for size, entry in res["sizes"].items():
        modes = entry["summary"]["modes"]
        for mode in FP4_MODES:
            m, t = modes[mode], entry["timing"][mode]
            rows.append(("fp4", f"training step, {mode}, {size}", t["mixprec-fp8"]["ratio"],
                         "mixprec-fp8 (tensorwise emulated, alternated)",
                         f"final loss {m['final']:.4f} ({m['difference']:+.4f} vs fp32), fp4 {m['fp4_share']:.1%} "
                         f"of GEMM FLOPs; {t['mixprec-fp8-rowwise']['ratio']:.2f}x mixprec-fp8-rowwise"))
    return rows


def format_table(res: dict[str, Any]) -> str:
    """The results as a markdown table per size, and the verdict lines under each."""
    lines = []
    for size, entry in res["sizes"].items():
        s = entry["summary"]
        fp32 = list(entry["finals"]["fp32"].values())
        lines += [f"### {size} ({entry['steps']} steps, {s['seeds']} seeds)", "",
                  "| mode | final loss | minus fp32, seed by seed | within fp32's spread | fp4 share of GEMM FLOPs "
                  "| forward / input grad / weight grad | step / mixprec-fp8 | step / mixprec-fp8-rowwise |",
                  "|---|---:|---:|---|---:|---:|---:|---:|",
                  f"| fp32 | {s['base_mean']:.4f} ± {s['tolerance']:.4f} | | | | | | |"]
        for mode in FP4_MODES:
            m, t = s["modes"][mode], entry["timing"][mode]
            within = "n/a (one seed)" if m["within"] is None else ("yes" if m["within"] else "**no**")
            per = " / ".join(f"{m['per_gemm'][g]:.0%}" for g in ("output", "grad_input", "grad_weight"))
            ratio = [f"{t[r]['ratio']:.2f}x ({t[r]['low']:.2f}-{t[r]['high']:.2f})" for r in FP8_REFERENCES]
            lines.append(f"| {mode} | {m['final']:.4f} ± {m['final_spread']:.4f} | {m['difference']:+.4f} ± "
                         f"{m['difference_spread']:.4f} | {within} | {m['fp4_share']:.1%} | {per} | {ratio[0]} | "
                         f"{ratio[1]} |")
        crit = s["criterion"]
        verdict = ("no verdict (one seed)" if crit["met"] is None else "**met**" if crit["met"] else
                   "**not met**" + (f": {crit['excess']:.4f} nats beyond the spread" if not crit["within"] else "")
                   + (f"{';' if not crit['within'] else ':'} {crit['short'] * 100:.1f} points below 60% in fp4"
                      if crit["short"] > 0 else ""))
        lines += ["", f"fp32 per seed: {', '.join(f'{v:.4f}' for v in fp32)}. Criterion (mixprec-fp4 within "
                      f"fp32's spread {s['tolerance']:.4f} with >= 60% of GEMM FLOPs in fp4): {verdict}. "
                      f"Wins: {s['winner'] or 'none (no fp4 mode within the spread)'}.", ""]
    before, after = res["machine_before"], res["machine_after"]
    lines.append(f"CPU: {before['cpu']}, {res['threads']} thread; load average before {before['load']}, after "
                 f"{after['load']}; {res['seconds'] / 60:.1f} min.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10 steps, 2 seeds, 3 timing rounds, tiny (a smoke run)")
    parser.add_argument("--sizes", default=None, help="comma-separated demo sizes (default: tiny,small)")
    parser.add_argument("--json", default=None, help="also write every figure to this JSON file")
    parser.add_argument("--runs", type=Path, default=None,
                        help="keep each finished run in this folder and read back the runs found there")
    parser.add_argument("--train-only", default="", help="with --runs: only train these comma-separated modes")
    args = parser.parse_args()
    sizes = tuple(args.sizes.split(",")) if args.sizes else None
    if args.runs is not None:
        args.runs.mkdir(parents=True, exist_ok=True)
    only = tuple(m for m in args.train_only.split(",") if m)
    res = run(quick=args.quick, sizes=sizes, log=lambda line: print(line, flush=True), runs=args.runs, train_only=only)
    if only:
        return
    print(format_table(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
