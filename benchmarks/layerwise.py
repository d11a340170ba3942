"""Cost and training of per-layer gradient scaling on the demo's model (not a test).

The demo's TransformerLM (``--size``, default "tiny") under ``mixprec.autocast`` float16 with
fused AdamW, trained with ``mixprec.GradScaler`` (one scale) and with ``per_layer=True`` (a cut
point after each block) from the same seed and batches. Times whole steps (forward, backward,
unscale, step, update) interleaved AB/BA; the figure is the median over rounds of the time ratio
per-layer / global (and of a third run with ``layer_bounds=(1, 1)``: the hooks, statistics and
rule with every factor kept at 1), and of the process CPU time, which other jobs on a shared
machine disturb less (1 torch thread by default, so that it counts work, not spinning).
Target: <= 1.05. Also prints both runs' mean loss over their last 10 steps, their skipped steps
and the per-cut-point factors, the CPU, the torch threads and the load average before and after.

    python benchmarks/layerwise.py [--quick] [--size tiny|small] [--threads 1] [--rounds 12]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from typing import Any

import torch

import mixprec
from mixprec.demo.corpus import batch_offsets, load_tokens, make_batch
from mixprec.demo.model import SIZES, TransformerLM, lm_loss


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


class _Run:
    """One training run: the model, fused AdamW, a scaler, the batches."""

    def __init__(self, size: str, per_layer: bool, batches: list[tuple[torch.Tensor, torch.Tensor]],
                 **options: Any) -> None:
        torch.manual_seed(0)
        self.model = TransformerLM(SIZES[size])
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-3, fused=True)
        self.scaler = mixprec.GradScaler(
            "cpu", init_scale=2.0**16, growth_interval=20, per_layer=per_layer, **options
        )
        self.scaler.watch(self.model)
        self.batches = batches
        self.losses: list[float] = []
        self.step_index = 0

    def step(self) -> torch.Tensor:
        x, y = self.batches[self.step_index % len(self.batches)]
        self.step_index += 1
        self.optimizer.zero_grad()
        with mixprec.autocast("cpu", dtype=torch.float16):
            loss = lm_loss(self.model(x), y)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return loss.detach()

    def timed(self, steps: int) -> tuple[float, float]:
        """Wall-clock and process CPU seconds of ``steps`` steps."""
        start, cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            self.losses.append(float(self.step()))
        return time.perf_counter() - start, time.process_time() - cpu


def _load() -> tuple[float, float, float]:
    return os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3


def run(quick: bool = False, size: str = "tiny", threads: int = 1, rounds: int | None = None) -> dict[str, Any]:
    """Returns ``{"ratio": per-layer / global step time (median), "cpu_ratio": the same of the
    process CPU time, "final_losses": (global, per_layer) means over the last 10 steps,
    "skipped": (global, per_layer), "layer_scales": {...}, "cpu": model, "threads": n, "load":
    (1-minute load average before, after)}``. ``threads``: torch's intra-op threads (1: the CPU
    time is the work, not other jobs' contention or idle spinning); ``rounds``: alternating
    rounds of 5 steps each (default 12, 2 of 1 step with ``quick``)."""
    torch.set_num_threads(threads)
    load_before = _load()[0]
    torch.manual_seed(0)
    cfg = SIZES[size]
    tokens, _ = load_tokens()
    offsets = batch_offsets(len(tokens), 40, 8, cfg.seq_len, seed=0)
    batches = [make_batch(tokens, o, cfg.seq_len, torch.device("cpu")) for o in offsets]
    plain, layered = _Run(size, False, batches), _Run(size, True, batches)
    pinned = _Run(size, True, batches, layer_bounds=(1.0, 1.0))  # the machinery, factors kept at 1
    default_rounds, steps = (2, 1) if quick else (12, 5)
    rounds = rounds or default_rounds
    for r in (plain, layered, pinned):  # warm-up: kernels, the graph walk, the scale coming down
        r.timed(3)
    ratios, pinned_ratios, cpu_ratios, times_a, times_b = [], [], [], [], []
    for i in range(rounds):
        order = (plain, layered, pinned) if i % 2 == 0 else (pinned, layered, plain)
        took = {id(r): r.timed(steps) for r in order}
        (a, cpu_a), (b, cpu_b) = took[id(plain)], took[id(layered)]
        ratios.append(b / a)
        cpu_ratios.append(cpu_b / cpu_a)
        pinned_ratios.append(took[id(pinned)][0] / a)
        times_a.append(a)
        times_b.append(b)
    return {
        "ratio": statistics.median(ratios),
        "ratio_of_fastest": min(times_b) / min(times_a),  # less sensitive to a loaded machine
        "cpu_ratio": statistics.median(cpu_ratios),
        "pinned_ratio": statistics.median(pinned_ratios),
        "step_ms": 1e3 * min(times_a) / steps,
        "final_losses": (statistics.mean(plain.losses[-10:]), statistics.mean(layered.losses[-10:])),
        "skipped": (int(plain.scaler.skipped_steps), int(layered.scaler.skipped_steps)),
        "layer_scales": layered.scaler.layer_scales(),
        "cpu": _cpu(),
        "threads": torch.get_num_threads(),
        "load": (load_before, _load()[0]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--size", default="tiny", choices=sorted(SIZES))
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 12)")
    args = parser.parse_args()
    res = run(quick=args.quick, size=args.size, threads=args.threads, rounds=args.rounds)
    print(f"CPU: {res['cpu']}, {os.cpu_count()} cores, torch threads {res['threads']}, 1-minute load "
          f"average {res['load'][0]:.2f} before, {res['load'][1]:.2f} after")
    print(f"per-layer / global step time: median of rounds {res['ratio']:.3f}, fastest rounds "
          f"{res['ratio_of_fastest']:.3f}, CPU time {res['cpu_ratio']:.3f}   (target <= 1.05; global "
          f"step {res['step_ms']:.0f} ms, {args.threads} thread(s)); "
          f"factors pinned at 1 (the machinery alone): {res['pinned_ratio']:.3f}")
    print(f"mean loss over the last 10 steps: global {res['final_losses'][0]:.4f}, per-layer "
          f"{res['final_losses'][1]:.4f}; skipped steps {res['skipped'][0]} / {res['skipped'][1]}")
    print("per-cut-point factors:", ", ".join(f"{k}={v:g}" for k, v in res["layer_scales"].items()))


if __name__ == "__main__":
    main()
