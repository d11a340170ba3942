"""Where one GEMM's NVFP4 input-gradient error lands (issue 39: why the head's backward costs the
loss and a hidden layer's does not).

The demo's ``tiny`` model trains ``--steps`` float32 AdamW steps on the demo's corpus; then, per
target Linear layer, its input-gradient GEMM alone runs NVFP4 (emulated in float32:
``compose((None, nvfp4, None))``), every other GEMM exact, on ``--batches`` batches, and the
squared relative error that one GEMM induces on every other layer's weight gradient is printed
(``|dG|**2 / |G|**2`` against the exact backward of the same batch), beside the GEMM's own
squared share ``|E_x|**2 / |R_x|**2`` of its result. Measured 2026-12-04 (docs/fp8.md): the head's
error reaches every earlier layer at 0.7-4.8%; a hidden layer's reaches the layer before it in its
own branch at about its own share and the layers past the residual add about a hundredfold less.

    PYTHONPATH=src .venv/bin/python benchmarks/gradient_reach.py [--steps 60] [--batches 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mixprec.control._ladder import compose  # noqa: E402
from mixprec.demo.corpus import batch_offsets, load_tokens, make_batch  # noqa: E402
from mixprec.demo.model import SIZES, TransformerLM, lm_loss  # noqa: E402
from mixprec.fp8 import Float8Recipe, linear  # noqa: E402

SEQ, BATCH = 64, 8


def trained(steps: int, seed: int = 0) -> tuple[nn.Module, torch.Tensor, list[int]]:
    """``tiny`` after ``steps`` float32 AdamW steps, the corpus and the offsets of the batches after them."""
    torch.manual_seed(seed)
    model = TransformerLM(SIZES["tiny"])
    data, _ = load_tokens()
    offsets = batch_offsets(len(data), steps + 16, BATCH, SEQ, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1.25e-3, betas=(0.9, 0.95), weight_decay=0.01)
    for offset in offsets[:steps]:
        x, y = make_batch(data, offset, SEQ, torch.device("cpu"))
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model, data, offsets[steps:]


def reach(model: nn.Module, data: torch.Tensor, offsets: list[int], target: str, batches: int
          ) -> tuple[float, dict[str, float]]:
    """``(own share, {layer: induced share})`` of ``target``'s NVFP4 input-gradient GEMM, means over ``batches``."""
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    modules = dict(model.named_modules())
    recipe = compose((None, Float8Recipe.nvfp4(), None))
    own, induced = [], {n: [] for n in names if n != target}
    for b in range(batches):
        x, y = make_batch(data, offsets[b], SEQ, torch.device("cpu"))
        grads = []
        for low in (False, True):
            torch.manual_seed(100 + b)  # (the stochastic rounding's draws)
            model.zero_grad()
            seen = {}
            layer = modules[target]

            def forward(inp: torch.Tensor, layer: nn.Linear = layer, low: bool = low) -> torch.Tensor:
                inp.register_hook(lambda g: seen.__setitem__("gx", g.detach().clone()))
                return linear(inp, layer.weight, layer.bias, recipe, backend="emulate_fp32") if low else \
                    nn.functional.linear(inp, layer.weight, layer.bias)

            layer.forward = forward
            try:
                lm_loss(model(x), y).backward()
            finally:
                del layer.forward
            grads.append(({n: modules[n].weight.grad.clone() for n in names}, seen["gx"]))
        (exact, gx), (noisy, gx_low) = grads
        own.append(float((gx_low - gx).square().sum() / gx.square().sum()))
        for n in induced:
            induced[n].append(float((noisy[n] - exact[n]).square().sum() / exact[n].square().sum()))
    return statistics.fmean(own), {n: statistics.fmean(v) for n, v in induced.items()}


def main(argv: list[str] | None = None) -> dict[str, tuple[float, dict[str, float]]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--targets", default="head,blocks.1.out,blocks.1.fc,blocks.1.proj,blocks.1.qkv,blocks.0.out")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model, data, offsets = trained(args.steps)
    out = {}
    print(f"tiny after {args.steps} float32 AdamW steps, {args.batches} batches; squared relative errors")
    for target in args.targets.split(","):
        own, induced = out[target] = reach(model, data, offsets, target, args.batches)
        cells = " ".join(f"{n.replace('blocks.', 'b')} {v:.4f}" for n, v in induced.items())
        print(f"{target:>14}: own {own:.4f}; induced on {cells}")
    return out


if __name__ == "__main__":
    main()
