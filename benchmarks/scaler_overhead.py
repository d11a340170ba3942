"""Overhead of mixprec.GradScaler against torch.amp.GradScaler (not a test).

A loop of ``unscale_`` + ``step`` + ``update`` over ~200 parameter tensors of mixed shapes with
gradients already filled (no backward in the timed part), for SGD and fused AdamW. The two
scalers run interleaved (AB BA AB ...) on twin parameter sets; the figure is the median over rounds of
the per-round time ratio mixprec / torch. Target: <= 1.05.

    python benchmarks/scaler_overhead.py [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from mixprec.scaling import GradScaler

SHAPES = [(64, 64), (256,), (32, 128), (128,), (16, 16, 3, 3), (512,), (8, 256), (64,)]
N_TENSORS = 200


def _params(device: torch.device) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    params = []
    for i in range(N_TENSORS):
        shape = SHAPES[i % len(SHAPES)]
        p = torch.nn.Parameter(torch.randn(shape, generator=gen).to(device))
        p.grad = torch.randn(shape, generator=gen).to(device) * 1e-3
        params.append(p)
    return params


def _optimizer(kind: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=1e-6, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-6, fused=True)


def _loop(scaler, optimizer, params, grads, iters: int, sync: Callable[[], None]) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        for p, g in zip(params, grads):  # refill the (unscaled in place) gradients: both pay it
            p.grad.copy_(g)
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
    sync()
    return time.perf_counter() - start


def run(quick: bool = False, device: str | None = None) -> dict[str, float]:
    """Returns ``{"sgd": ratio, "fused_adamw": ratio}`` (mixprec time / torch time, medians).

    ``quick`` runs a few rounds only (a smoke run, noisier). ``device`` defaults to CUDA when
    available, else the CPU.
    """
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    rounds, iters = (2, 2) if quick else (20, 10)
    ratios: dict[str, float] = {}
    for kind in ("sgd", "fused_adamw"):
        setups = {}
        for name, cls in (("torch", torch.amp.GradScaler), ("mixprec", GradScaler)):
            params = _params(dev)
            grads = [p.grad.clone() for p in params]
            optimizer = _optimizer(kind, params)
            scaler = cls(dev.type, init_scale=2.0**10, growth_interval=1000)
            scaler.scale(torch.ones((), device=dev))
            _loop(scaler, optimizer, params, grads, 2, sync)  # warm-up (optimizer state, caches)
            setups[name] = (scaler, optimizer, params, grads)
        per_round = []
        for r in range(rounds):
            order = ("torch", "mixprec") if r % 2 == 0 else ("mixprec", "torch")  # ABBA
            times = {name: _loop(*setups[name], iters, sync) for name in order}
            per_round.append(times["mixprec"] / times["torch"])
        ratios[kind] = statistics.median(per_round)
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few rounds only")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    args = parser.parse_args()
    ratios = run(quick=args.quick, device=args.device)
    for kind, ratio in ratios.items():
        verdict = "ok" if ratio <= 1.05 else "ABOVE TARGET"
        print(f"{kind:12s} mixprec/torch median time ratio: {ratio:.3f}  (target <= 1.05: {verdict})")


if __name__ == "__main__":
    main()
