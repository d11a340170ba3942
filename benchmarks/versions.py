"""Two versions of mixprec side by side: the step time of autocast, fp8, fp4 and Controller runs,
each version in its own fresh process per round, alternated, and the median ratio of the second to
the first (below 1: the second is faster).

    python -m benchmarks.versions /path/to/old/src /path/to/new/src [--rounds 5] [--only "fp8 tensorwise"]

Each run uses only API both versions have (``Policy.fp8(controller=ctl)``), one thread, fixed data.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from benchmarks._machine import machine

#: the measured workloads: name -> Python run in the worker (prints seconds per step)
WORKER = r"""
import json, sys, time, warnings
import torch, torch.nn as nn, torch.nn.functional as F
warnings.simplefilter("ignore")
torch.set_num_threads(1)
import mixprec
from mixprec import Controller, Policy

def model():
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(128, 128), nn.GELU())], nn.Linear(128, 128))

def step_time(policy, live=None, steps=12, warm=3):
    m = model(); opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    x, y = torch.randn(64, 128, generator=torch.Generator().manual_seed(1)), torch.randint(0, 128, (64,))
    times = []
    for i in range(warm + steps):
        t = time.perf_counter()
        with mixprec.autocast("cpu", torch.bfloat16, policy=policy):
            loss = F.cross_entropy(m(x).float(), y)
        loss.backward(); opt.step(); opt.zero_grad()
        if live is not None:
            live.step()
        if i >= warm:
            times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]

def ops(policy):
    x = torch.randn(16, 16)
    with mixprec.autocast("cpu", policy=policy):
        for _ in range(50):
            torch.mm(x, x).softmax(-1)
        t = time.perf_counter()
        for _ in range(500):
            torch.mm(x, x).softmax(-1)
    return (time.perf_counter() - t) / 1000

kind = sys.argv[1]
if kind == "autocast default":
    out = ops(None)
elif kind == "autocast edited":
    out = ops(Policy.parse("compute=bf16").with_ops(fp32=["softmax"]))
elif kind == "fp8 tensorwise":
    out = step_time(Policy.fp8("tensorwise"))
elif kind == "fp4 nvfp4":
    out = step_time(Policy.fp8("nvfp4"))
elif kind == "controller fp8":
    ctl = Controller(every=5, sample=256)
    out = step_time(Policy.fp8("tensorwise", controller=ctl), ctl)
else:
    ctl = Controller(every=5, per_gemm=True, ladder=("nvfp4", "tensorwise", "compute"), max_loss_cost=1e-2, sample=256)
    out = step_time(Policy.fp8("nvfp4", controller=ctl), ctl)
print(json.dumps(out))
"""
KINDS = ("autocast default", "autocast edited", "fp8 tensorwise", "fp4 nvfp4", "controller fp8",
         "controller fp4 per-GEMM + loss cost")


def measure(src: str, kind: str) -> float:
    """Seconds (per step, or per op for autocast) of ``kind`` with the mixprec under ``src``."""
    env = {**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", WORKER, kind], env=env, capture_output=True, text=True, check=True)
    return float(json.loads(out.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", nargs="*", choices=KINDS, help="these workloads alone")
    args = parser.parse_args(argv)
    print(machine())
    for kind in args.only or KINDS:
        ratios = []
        for i in range(args.rounds):
            first, second = (args.old, args.new) if i % 2 == 0 else (args.new, args.old)
            a, b = measure(first, kind), measure(second, kind)
            old, new = (a, b) if first == args.old else (b, a)
            ratios.append(new / old)
        print(f"{kind:40s} new/old {statistics.median(ratios):.3f}  (rounds: {', '.join(f'{r:.3f}' for r in ratios)})",
              flush=True)
    print(machine())


if __name__ == "__main__":
    main()
