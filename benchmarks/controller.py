"""Step-time cost of the fp8 Controller (not a test).

One training step (forward under the policy, backward, SGD step, ``ctl.step()``) of an MLP of
fp8 Linear layers, timed in rounds with the variants interleaved (order rotated every round);
each figure is the median over rounds of the per-round time ratio variant / reference:

* ``controller``: ``Policy.fp8("tensorwise", controller=Controller(every=10))``, every layer on
  its fp8 rung, against the same policy without controller (the statistics the fp8 layers
  record anyway, plus the controller's probe in fp8.linear and its checks: one read every 10 steps). The
  target is <= 1.05.
* ``promoted``: every layer promoted to the compute dtype (so it measures the shadow casts of the
  rung below on a sample, on ``shadow_steps=2`` of every 10 steps), against the same fp8 policy
  with every layer fallen back (``LayerState.fallback``, what a Guard does) and no controller.

It also counts host reads in the steps between two checks (must be 0).

    python benchmarks/controller.py [--quick] [--width 256] [--depth 8]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec import Controller, Policy


def _model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers[:-1])


class _Variant:
    def __init__(self, width: int, depth: int, policy: Policy, ctl: Controller | None) -> None:
        self.model, self.policy, self.ctl = _model(width, depth), policy, ctl
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-4)
        self.x, self.y = torch.randn(64, width), torch.randint(0, width, (64,))
        self.ctl_seconds = 0.0  # time inside ctl.step()

    def step(self) -> None:
        with mixprec.autocast("cpu", policy=self.policy):
            loss = F.cross_entropy(self.model(self.x).float(), self.y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.ctl is not None:
            start = time.perf_counter()
            self.ctl.step()
            self.ctl_seconds += time.perf_counter() - start


def _variants(width: int, depth: int) -> dict[str, _Variant]:
    base = Policy.parse("compute=bf16")
    fp8 = base.fp8("tensorwise", first_last="fp8")
    ctl, promoted = Controller(every=10), Controller(every=10, demote_windows=10 ** 9)  # stays promoted
    out = {"fp8": _Variant(width, depth, fp8, None),
           "controller": _Variant(width, depth, base.fp8("tensorwise", first_last="fp8", controller=ctl), ctl),
           "fallback": _Variant(width, depth, fp8, None),
           "promoted": _Variant(width, depth, base.fp8("tensorwise", first_last="fp8", controller=promoted),
                                promoted)}
    for v in out.values():
        v.step()  # the controllers track their layers
    for module in out["fallback"].model:
        if isinstance(module, nn.Linear):
            mixprec.fp8.layer_state(module).fallback = True
    for rec in promoted._layers.values():
        rec.rung = promoted.ladder.index("compute")
        promoted._apply(rec)
    return out


def _host_reads_between_checks(variant: _Variant) -> int:
    names = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")
    count = [0]
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def counted(original: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            count[0] += 1
            return original(*args, **kwargs)
        return call

    while variant.ctl.steps % variant.ctl.every != 0:
        variant.step()
    variant.step()  # the first step of a window
    try:
        for n in names:
            setattr(torch.Tensor, n, counted(saved[n]))
        for _ in range(variant.ctl.every - 2):
            variant.step()
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)
    return count[0]


def _ops_per_window(variant: _Variant) -> int:
    """The aten op calls of ``every`` steps (one check included): a count, free of timing noise."""
    from torch.profiler import profile

    with profile() as prof:
        for _ in range(10):
            variant.step()
    return sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))


def run(quick: bool = False, width: int = 256, depth: int = 8) -> dict[str, float]:
    """``{"controller": ratio, "promoted": ratio, "fp8_step_ms": ms, "ctl_step_ms": ms,
    "ops": ratio, "host_reads": n}``."""
    variants = _variants(width, depth)
    iters, rounds = (2, 1) if quick else (20, 9)
    order = list(variants)
    times: dict[str, list[float]] = {n: [] for n in order}
    for r in range(rounds):
        for name in order[r % len(order):] + order[:r % len(order)]:
            v = variants[name]
            start = time.perf_counter()
            for _ in range(iters):
                v.step()
            times[name].append((time.perf_counter() - start) / iters)
    ratio = {name: statistics.median(a / b for a, b in zip(times[name], times[ref]))
             for name, ref in (("controller", "fp8"), ("promoted", "fallback"))}
    ratio["fp8_step_ms"] = statistics.median(times["fp8"]) * 1e3
    ctl = variants["controller"]
    ratio["ctl_step_ms"] = ctl.ctl_seconds / (ctl.ctl.steps - 1) * 1e3
    ratio["ops"] = _ops_per_window(ctl) / _ops_per_window(variants["fp8"])
    ratio["host_reads"] = _host_reads_between_checks(variants["controller"])
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=8)
    args = parser.parse_args()
    out = run(args.quick, args.width, args.depth)
    print(f"fp8 step (every layer fp8, no controller): {out['fp8_step_ms']:.2f} ms")
    print(f"controller (every=10), all layers on fp8:  {out['controller']:.3f} x the fp8 step (target <= 1.05)")
    print(f"  time inside ctl.step(), per step:         {out['ctl_step_ms']:.3f} ms")
    print(f"  aten op calls per 10 steps:               {out['ops']:.3f} x the fp8 run's")
    print(f"promoted to the compute dtype (shadow on): {out['promoted']:.3f} x the fallen-back fp8 policy's step")
    print(f"host reads in the steps between two checks: {out['host_reads']}")


if __name__ == "__main__":
    main()
