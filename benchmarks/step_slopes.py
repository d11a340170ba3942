"""How much loss an optimizer step's shrink costs: per Linear layer, the first-order gain of each
AdamW update read on the gradient that made it (``-<G_t, dW_t>``: what the Controller's backward
cost weighs a GEMM's noise with, ``control/_backward.py``) against the loss slope at the step's
end on the next, independent batch (``-<G_{t+1}(w_{t+1}), dW_t>``: what shortening that step
would lose, to first order; negative: the step overshoots along its direction, and a shorter one
would have lost less).

The two differ by the step's self-correlation (the update carries its own batch's gradient noise,
which the first reads as gain) and its curvature (``dW' H dW``). Printed per phase of training:
each layer's mean of both and their ratio. The models and training are
``benchmarks/controller_quality.py``'s (bf16 autocast, no fp4: the question is the optimizer's, not
a format's).

    PYTHONPATH=src .venv/bin/python benchmarks/step_slopes.py [--model small] [--seed 0] [--steps N]

Measured 2026-12-05 (docs/fp8.md, "The end slope"): on small after step 10 every
hidden layer's end slope is negative (its steps overshoot) while the head's stays at 0.8-0.96 of
its first-order gain until step 40.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mixprec  # noqa: E402
from benchmarks import controller_quality as quality  # noqa: E402
from mixprec.demo.corpus import batch_offsets, load_tokens, make_batch  # noqa: E402

PHASES = ((0, 10), (10, 40), (40, 100), (100, 200), (200, 300))


def slopes(model_name: str, seed: int, steps: int, batch: int = 8) -> dict[str, list[tuple[int, float, float]]]:
    """Per Linear, per step ``t`` but the last: ``(t, -<G_t, dW_t>, -<G_{t+1}, dW_t>)``."""
    data, _ = load_tokens()
    model, logits_of, lr = quality.build(model_name, seed)
    modules = dict(model.named_modules())
    weights = {n: modules[n].weight for n in quality.linears(model)}
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: quality.lr_factor(s, steps))
    offsets = batch_offsets(len(data), steps, batch, quality.SEQ, seed)
    rows: dict[str, list[tuple[int, float, float]]] = {n: [] for n in weights}
    last: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # per layer: (G_t, dW_t)
    for step in range(steps):
        x, y = make_batch(data, offsets[step], quality.SEQ, torch.device("cpu"))
        with mixprec.autocast("cpu", dtype=torch.bfloat16):
            loss = quality.lm_loss(logits_of(model, x).float(), y)
        loss.backward()
        before = {}
        for name, w in weights.items():
            grad = w.grad.detach().clone()
            if name in last:
                g_prev, dw = last[name]
                rows[name].append((step - 1, float(-(g_prev * dw).sum()), float(-(grad * dw).sum())))
            before[name] = (grad, w.detach().clone())
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        last = {name: (grad, weights[name].detach() - w0) for name, (grad, w0) in before.items()}
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="small", choices=sorted(quality.STEPS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=None, help="default: the model's in controller_quality.STEPS")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = slopes(args.model, args.seed, args.steps or quality.STEPS[args.model])
    for lo, hi in PHASES:
        picked = {n: [r for r in rs if lo <= r[0] < hi] for n, rs in rows.items()}
        if not any(picked.values()):
            continue
        print(f"steps {lo}-{hi}: first-order gain on its own batch, slope at the step's end on the next, ratio")
        for name, rs in picked.items():
            own, end = statistics.fmean(r[1] for r in rs), statistics.fmean(r[2] for r in rs)
            print(f"  {name:34s} {own:+.2e}  {end:+.2e}  {end / own if own else float('nan'):+.2f}")


if __name__ == "__main__":
    main()
