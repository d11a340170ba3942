"""Step-time cost of the diagnostics, and proof that they cost nothing when inactive (not a test).

One training step (forward, backward, SGD step) of an MLP, timed in rounds with the variants
interleaved (order rotated every round); each figure is the median over rounds of the per-round
time ratio variant / plain step:

* ``after_exit``: hooks were installed and removed again (must be ~1.0: nothing stays behind);
* ``collect_ranges``: :func:`mixprec.collect_ranges` active;
* ``trace_eager``: :func:`mixprec.trace_nonfinite` in eager mode (one host read per check);
* ``trace_deferred``: deferred mode, one :meth:`resolve` per step.

    python benchmarks/diagnostics_overhead.py [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from typing import Callable, ContextManager

import torch
from torch import nn

from mixprec.diagnostics import collect_ranges, trace_nonfinite


def _model(device: torch.device, width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, 1)).to(device)


def run(quick: bool = False, device: str | None = None, width: int | None = None,
        depth: int | None = None) -> dict[str, float]:
    """Returns ``{variant: median time ratio vs the plain step}`` plus ``"step_ms"`` (plain).

    ``quick`` uses a few rounds only (a smoke run, noisier). ``device`` defaults to CUDA when
    available, else the CPU. ``width``/``depth`` of the MLP default to 256/8 on the CPU and
    1024/12 on CUDA.
    """
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    sync: Callable[[], None] = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    width = width or (256 if dev.type == "cpu" else 1024)
    depth = depth or (8 if dev.type == "cpu" else 12)
    model = _model(dev, width, depth)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(64, width, device=dev)
    iters, rounds = (1, 1) if quick else (5, 9)

    def steps(ctx: Callable[[], ContextManager], resolve: bool = False) -> float:
        with ctx() as tool:
            sync()
            start = time.perf_counter()
            for _ in range(iters):
                opt.zero_grad(set_to_none=True)
                model(x).square().mean().backward()
                opt.step()
                if resolve:
                    tool.resolve()
            sync()
            return time.perf_counter() - start

    with trace_nonfinite(model), collect_ranges(model):
        pass  # install and remove hooks once before the "after_exit" timings

    variants: dict[str, Callable[[], float]] = {
        "plain": lambda: steps(contextlib.nullcontext),
        "after_exit": lambda: steps(contextlib.nullcontext),
        "collect_ranges": lambda: steps(lambda: collect_ranges(model)),
        "trace_eager": lambda: steps(lambda: trace_nonfinite(model)),
        "trace_deferred": lambda: steps(lambda: trace_nonfinite(model, deferred=True), True),
    }
    names = list(variants)
    for name in names:  # warm-up
        variants[name]()
    ratios: dict[str, list[float]] = {n: [] for n in names if n != "plain"}
    plain_times = []
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        times = {n: variants[n]() for n in order}
        plain_times.append(times["plain"])
        for n in ratios:
            ratios[n].append(times[n] / times["plain"])
    out = {n: statistics.median(v) for n, v in ratios.items()}
    out["step_ms"] = 1000 * statistics.median(plain_times) / iters
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few rounds (smoke run)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--width", type=int, default=None, help="MLP width")
    parser.add_argument("--depth", type=int, default=None, help="MLP depth (Linear+GELU pairs)")
    args = parser.parse_args()
    res = run(quick=args.quick, device=args.device, width=args.width, depth=args.depth)
    print(f"plain step: {res['step_ms']:.2f} ms")
    for name, ratio in res.items():
        if name != "step_ms":
            print(f"{name:>15}: {ratio:.3f}x step time")


if __name__ == "__main__":
    main()
