"""Bytes per parameter and final loss of low-precision weight recipes (not a test).

One deterministic task, seven recipes, all AdamW with the same hyper-parameters:

* ``fp32``: float32 weights, ``torch.optim.AdamW``;
* ``autocast``: float32 weights, forward under ``mixprec.autocast("cpu", bfloat16)``;
* ``master``: bfloat16 weights, ``mixprec.MasterWeights(torch.optim.AdamW(...))``;
* ``kahan``: bfloat16 weights, ``mixprec.optim.AdamW(compensation="kahan")``;
* ``stochastic``: bfloat16 weights, ``mixprec.optim.AdamW(compensation="stochastic")``;
* ``naive``: bfloat16 weights, ``torch.optim.AdamW`` (state in bfloat16, updates rounded to nearest);
* ``nearest``: bfloat16 weights, ``mixprec.optim.AdamW(compensation=None)`` (float32 state,
  updates rounded to nearest): shows that the stall comes from the weight update, not the state.

Task: a 16 -> 256 -> 1 tanh MLP regressing a random teacher (plus noise) on 512 fixed points,
full batch, ``lr=2e-4``: Adam moves each weight by about ``lr`` per step, well below half a
bfloat16 gap of a weight of magnitude 0.3 (``2**-10``), so rounding to nearest drops most
updates. Except under ``autocast``, the forward computes in float32 from the stored weights,
so the recipes differ only in how weights are stored and updated.

Memory is measured with :func:`mixprec.lowp.memory_bytes` (storage bytes of the model's params
and grads, masters and master grads, and every optimizer-state tensor, each storage once) in a
step post-hook of the innermost optimizer, the moment when all of them are alive.

    python benchmarks/lowp_memory.py [--quick]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.lowp import memory_bytes

RECIPES = ("fp32", "autocast", "master", "kahan", "stochastic", "naive", "nearest")
LABELS = {
    "fp32": "fp32 AdamW",
    "autocast": "autocast + fp32 weights",
    "master": "bf16 + MasterWeights",
    "kahan": "bf16 + Kahan",
    "stochastic": "bf16 + stochastic rounding",
    "naive": "naive bf16",
    "nearest": "bf16, fp32 state, nearest",
}
LR = 2e-4
HIDDEN = 256


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(16, HIDDEN)
        self.l2 = nn.Linear(HIDDEN, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(F.linear(x, self.l1.weight.float(), self.l1.bias.float()))
        return F.linear(x, self.l2.weight.float(), self.l2.bias.float())


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 16, generator=g)
    teacher = _Net()
    with torch.no_grad():
        for p in teacher.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        y = teacher(x) + 0.1 * torch.randn(512, 1, generator=g)
    return x, y


def _setup(recipe: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(1)
    model = _Net()
    if recipe not in ("fp32", "autocast"):
        mixprec.to_low_precision(model, torch.bfloat16)
    if recipe in ("fp32", "autocast", "naive"):
        return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    if recipe == "master":
        return model, mixprec.MasterWeights(torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0))
    gen = torch.Generator().manual_seed(0)
    compensation = None if recipe == "nearest" else recipe
    opt = mixprec.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, compensation=compensation, generator=gen)
    return model, opt


def _run_recipe(recipe: str, x: torch.Tensor, y: torch.Tensor, steps: int) -> dict[str, Any]:
    model, opt = _setup(recipe)
    measured: list[dict[str, Any]] = []
    inner = getattr(opt, "optimizer", opt)  # MasterWeights: while the master grads are alive
    handle = inner.register_step_post_hook(
        lambda *_: measured.append(memory_bytes(model, opt)) if not measured else None
    )
    start = time.perf_counter()
    for _ in range(steps):
        if recipe == "autocast":
            with mixprec.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
        else:
            out = model(x)
        F.mse_loss(out.float(), y).backward()
        opt.step()
        opt.zero_grad()
    seconds = time.perf_counter() - start
    handle.remove()
    with torch.no_grad():
        loss = F.mse_loss(model(x), y).item()
    mem = measured[0]
    return {
        "recipe": recipe,
        "label": LABELS[recipe],
        "bytes_per_param": mem["bytes_per_param"],
        "params_bytes": mem["params"],
        "grads_bytes": mem["grads"],
        "master_bytes": mem["master"],
        "state_bytes": mem["optimizer_state"],
        "numel": mem["numel"],
        "final_loss": loss,
        "steps": steps,
        "seconds": seconds,
    }


def run(quick: bool = False) -> list[dict[str, Any]]:
    """Run every recipe; one dict per recipe, with ``loss_vs_fp32`` = final loss / fp32's.

    ``quick``: 100 steps instead of 2000 (memory figures are the same; losses less separated).
    """
    steps = 100 if quick else 2000
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: one intra-op thread is fastest
    try:
        x, y = _data()
        with torch.no_grad():
            initial = F.mse_loss(_setup("fp32")[0](x), y).item()
        rows = [_run_recipe(recipe, x, y, steps) for recipe in RECIPES]
    finally:
        torch.set_num_threads(threads)
    fp32 = rows[0]["final_loss"]
    for row in rows:
        row["initial_loss"] = initial
        row["loss_vs_fp32"] = row["final_loss"] / fp32
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """A markdown table of :func:`run`'s rows."""
    lines = [
        "| recipe | bytes/param | params | grads | masters | opt. state | final loss | vs fp32 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        n = r["numel"]
        lines.append(
            f"| {r['label']} | {r['bytes_per_param']:.2f} | {r['params_bytes'] / n:.2f} | "
            f"{r['grads_bytes'] / n:.2f} | {r['master_bytes'] / n:.2f} | {r['state_bytes'] / n:.2f} | "
            f"{r['final_loss']:.4f} | {r['loss_vs_fp32']:.4f} |"
        )
    first = rows[0]
    lines.append(
        f"\n{first['numel']} parameters, {first['steps']} steps, initial loss {first['initial_loss']:.4f}."
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="100 steps instead of 2000")
    args = parser.parse_args()
    print(format_table(run(quick=args.quick)))


if __name__ == "__main__":
    main()
