"""How far a forward GEMM's loss cost, as the Controller estimates it, lies from the loss change
it stands for (issue 39): per Linear layer, on one batch after another, the loss with the layer's
NVFP4 output error ``e`` against the loss without it (the truth: two forwards), beside the two
estimates ``control/_cost.py``'s :func:`~mixprec.control._cost.loss_cost` makes of it:

* ``own``: from the gradient ``g1`` at the output *with* the error (what a GEMM running NVFP4
  measures of its own casts): ``sum(g1 e) - rows / 2 * sum_t (g1_t . e_t)**2``;
* ``below``: from the gradient ``g0`` at the output *without* it (what a promoted GEMM measures of
  the rung below): ``sum(g0 e) + rows / 2 * sum_t (g0_t . e_t)**2``.

To second order the truth is ``g0 e + e'He / 2`` and ``g1 e = g0 e + e'He``, so ``own`` reads
``(e'He - e'Fe) / 2`` over it and ``below`` as much under, with ``F`` the empirical Fisher the
curvature term takes for the Hessian ``H``: the two estimates straddle the truth, apart by
``e'He - e'Fe``, whose ratio ``e'He / e'Fe`` (printed: ``(g1 - g0) e`` over the two curvature
terms) says how far the Fisher is from the curvature along ``e``. The model trains ``--warm``
steps in float32 first (``benchmarks/controller_quality.py``'s models, AdamW and schedule);
every other layer stays float32.

    PYTHONPATH=src .venv/bin/python benchmarks/cost_bias.py [--model llama] [--warm 200] [--batches 16]
        [--layers model.layers.0.mlp.down_proj,lm_head]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import controller_quality as quality  # noqa: E402
from benchmarks._machine import machine  # noqa: E402
from mixprec.control._cost import loss_cost  # noqa: E402
from mixprec.demo.corpus import batch_offsets, load_tokens, make_batch  # noqa: E402
from mixprec.demo.model import lm_loss  # noqa: E402
from mixprec.demo.settings import lr_factor  # noqa: E402
from mixprec.formats._linear import local_linear  # noqa: E402
from mixprec.formats._recipe import Float8Recipe  # noqa: E402


def estimates(model: torch.nn.Module, loss_of: Any, layer: torch.nn.Linear, recipe: Float8Recipe
              ) -> dict[str, float]:
    """One batch: ``loss_of(model)`` with ``layer``'s output as it is (``y``) and with the error
    ``e`` of ``recipe``'s GEMM added (``y + e``, emulated in float32); the truth (the two losses'
    difference), the ``own`` and ``below`` estimates and ``(g1 - g0) e`` (``e'He``) with the two
    curvature terms (``e'Fe / 2`` at ``g1`` and at ``g0``)."""
    seen: dict[str, Any] = {}

    def hook(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            bias = None if module.bias is None else module.bias.detach()
            seen["e"] = local_linear(args[0].detach(), module.weight.detach(), bias, recipe, "emulate_fp32", None) - out
        moved = out + seen["e"] if seen["with_error"] else out.view_as(out)
        moved.register_hook(lambda g: seen.__setitem__("g", g.detach()))
        return moved

    sums = {}
    handle = layer.register_forward_hook(hook)
    try:
        for with_error in (False, True):
            seen["with_error"] = with_error
            loss = loss_of(model)
            loss.backward()
            model.zero_grad(set_to_none=True)
            g = seen["g"].reshape(-1, seen["g"].shape[-1]).float()
            per_row = (g * seen["e"].reshape(g.shape).float()).sum(-1)
            sums[with_error] = (float(loss.detach()), per_row.sum(), per_row.square().sum(), torch.tensor(float(g.shape[0])))
    finally:
        handle.remove()
    (l0, f0, s0, rows), (l1, f1, s1, _) = sums[False], sums[True]
    return {"true": l1 - l0, "own": float(loss_cost(f1, s1, rows, at_error=True)), "below": float(loss_cost(f0, s0, rows)),
            "eHe": float(f1 - f0), "eFe_own": float(rows * s1 / 2), "eFe_below": float(rows * s0 / 2)}


def measure(model_name: str, seed: int, warm: int, layers: list[str], batches: int, batch: int = 8,
            recipe: str = "nvfp4") -> dict[str, dict[str, Any]]:
    """Per layer of ``layers``, :func:`estimates` over ``batches`` batches after ``warm`` float32
    steps: the means, the differences from the truth (mean, standard error) and the median ratio
    ``e'He / e'Fe``."""
    data, _ = load_tokens()
    model, logits_of, lr = quality.build(model_name, seed)
    steps = warm + batches
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, max(steps, 300)))
    offsets = batch_offsets(len(data), steps, batch, quality.SEQ, seed)
    cpu = torch.device("cpu")
    for step in range(warm):
        x, y = make_batch(data, offsets[step], quality.SEQ, cpu)
        lm_loss(logits_of(model, x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
    modules = dict(model.named_modules())
    cast = Float8Recipe.from_name(recipe)
    out = {}
    for name in layers:
        rows = []
        for step in range(warm, steps):
            x, y = make_batch(data, offsets[step], quality.SEQ, cpu)
            rows.append(estimates(model, lambda m: lm_loss(logits_of(m, x), y), modules[name], cast))
        figures: dict[str, Any] = {k: statistics.fmean(r[k] for r in rows) for k in ("true", "own", "below")}
        for k in ("own", "below"):
            diffs = [r[k] - r["true"] for r in rows]
            figures[f"{k}_bias"] = (statistics.fmean(diffs), statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else 0.0)
        figures["ratio"] = statistics.median(r["eHe"] / max(r["eFe_own"] + r["eFe_below"], 1e-30) for r in rows)
        out[name] = figures
    return out


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warm", type=int, default=200)
    ap.add_argument("--batches", type=int, default=16)
    ap.add_argument("--layers", default="model.layers.0.mlp.down_proj,model.layers.0.self_attn.v_proj,"
                                        "model.layers.2.mlp.down_proj,lm_head")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    before = machine()
    print(f"CPU: {before['cpu']}; load before: {before['load']}; {args.model}, seed {args.seed}, after {args.warm} "
          f"float32 steps, {args.batches} batches")
    out = measure(args.model, args.seed, args.warm, args.layers.split(","), args.batches)
    print("| layer | true | own | below | own - true | below - true | e'He / e'Fe |\n| --- | --- | --- | --- | --- | --- | --- |")
    for name, f in out.items():
        print(f"| {name} | {f['true']:+.2e} | {f['own']:+.2e} | {f['below']:+.2e} | {f['own_bias'][0]:+.2e} ± "
              f"{f['own_bias'][1]:.1e} | {f['below_bias'][0]:+.2e} ± {f['below_bias'][1]:.1e} | {f['ratio']:.2f} |")
    print(f"load after: {machine()['load']}")
    return out


if __name__ == "__main__":
    main()
