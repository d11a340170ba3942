"""What the per-GEMM fp4 Controller costs (issue 39): its measurements at four operand sizes, and
its training step against the same model's all-fp4 step.

* ``measure``: one :func:`mixprec.control._ladder.measure` of an NVFP4 cast (as the probe takes
  it: ``sample`` = 4096 elements, with and without the Hadamard transform of weight-gradient
  operands) on operands of 64 to 32768 rows of 256, against the NVFP4 cast of the whole operand
  (:func:`mixprec.formats._fp4.quantize`, what the training step itself does to it). A
  measurement on a true sample costs about the same at every size: its ratio to the whole cast
  falls as the operand grows.
* ``step``: one training step of the demo's ``mixprec-fp4`` mode (every Linear NVFP4, a
  Controller per GEMM with ``max_loss_cost``) against ``mixprec-fp4-all`` (the same, no
  controller), timed in alternation on the same batch (:func:`mixprec.demo.alternate.time_pair`:
  median of the per-round ratios and its quartiles), on the demo's ``tiny`` and ``small``.

The CPU and the load average are printed before and after. One thread.

    .venv/bin/python benchmarks/controller_fp4.py [--quick] [--sizes tiny,small]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._machine import machine  # noqa: E402
from mixprec.control._measure import measure  # noqa: E402
from mixprec.demo.alternate import time_pair  # noqa: E402
from mixprec.demo.corpus import load_tokens  # noqa: E402
from mixprec.demo.settings import Settings  # noqa: E402
from mixprec.formats._fp4 import quantize  # noqa: E402
from mixprec.formats._recipe import Cast  # noqa: E402
from mixprec.formats._state import new_window  # noqa: E402

ROWS = (64, 1024, 8192, 32768)
COLS = 256
SAMPLE = 4096  # ControllerSettings.sample's default


def _median_s(fn: Any, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_costs(repeats: int = 9) -> list[dict[str, float]]:
    """Per operand size: the measurement's time (with and without Hadamard) and the whole cast's."""
    cast = Cast("e2m1", "1x16")
    out = []
    for rows in ROWS:
        x = torch.randn(rows, COLS, dtype=torch.bfloat16)
        window = new_window()
        plain = _median_s(lambda: measure(window, 0, x, cast, False, SAMPLE), repeats)
        rotated = _median_s(lambda: measure(window, 0, x, cast, False, SAMPLE, hadamard_seed=0), repeats)
        whole = _median_s(lambda: quantize(x, cast), repeats)
        out.append({"rows": rows, "measure_ms": plain * 1e3, "hadamard_ms": rotated * 1e3, "cast_ms": whole * 1e3})
    return out


def step_ratios(sizes: tuple[str, ...], rounds: int, budget_s: float) -> dict[str, dict[str, Any]]:
    train, _ = load_tokens()
    return {size: time_pair("mixprec-fp4", "mixprec-fp4-all", Settings.for_size(size), torch.device("cpu"), train,
                            rounds=rounds, budget_s=budget_s) for size in sizes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny only, 3 rounds (a smoke run)")
    parser.add_argument("--sizes", default=None, help="comma-separated demo sizes (default: tiny,small)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    sizes = tuple(args.sizes.split(",")) if args.sizes else (("tiny",) if args.quick else ("tiny", "small"))
    before = machine()
    print(f"CPU: {before['cpu']}; load before: {before['load']}")
    print(f"measure (NVFP4, sample={SAMPLE}) against the whole operand's NVFP4 cast, {COLS} columns:")
    for r in measure_costs(3 if args.quick else 9):
        print(f"  {r['rows']:>6} rows: measure {r['measure_ms']:.3f} ms, with Hadamard {r['hadamard_ms']:.3f} ms, "
              f"whole cast {r['cast_ms']:.3f} ms ({r['measure_ms'] / r['cast_ms']:.3f}x)")
    rounds, budget = (3, 1.0) if args.quick else (15, 60.0)
    for size, r in step_ratios(sizes, rounds, budget).items():
        print(f"step, {size}: mixprec-fp4 (Controller per GEMM) {r['ratio']:.3f}x mixprec-fp4-all "
              f"(quartiles {r['low']:.3f}-{r['high']:.3f}, {r['rounds']} rounds; {r['reference_s'] * 1e3:.0f} ms "
              f"all-fp4 step)")
    print(f"load after: {machine()['load']}")


if __name__ == "__main__":
    main()
