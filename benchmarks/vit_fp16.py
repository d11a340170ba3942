"""Why a small ViT ended lower under fp16 + GradScaler than under fp32 and bf16 (issue 30 item 5).

A transformers ``ViTForImageClassification`` (4 layers, hidden 192, 3 heads, 10 labels), 30 AdamW
steps with a linear warm-up and decay, one seed, once ended fp16 + GradScaler at 1.3141 against
fp32 1.4582 and bf16 1.4569. This script reproduces the setting on synthetic images (10 classes:
a fixed random prototype per class plus noise; fixed seeds) and trains, per seed:

- ``fp32``;
- ``torch-amp``: ``torch.autocast`` fp16 + ``torch.amp.GradScaler`` (init scale 2**16), trained
  before mixprec is imported, so it is PyTorch's own;
- ``mixprec-fp16``: ``mixprec.autocast`` fp16 + ``mixprec.GradScaler`` (same settings);
- ``bf16``: ``torch.autocast`` bf16, no scaler;
- ``fp32-skips``: fp32 that skips the optimizer steps ``torch-amp`` skipped on that seed (the
  learning-rate schedule still advances): fp16's effective schedule with fp32's arithmetic;
- ``torch-amp-2^10``: ``torch-amp`` with init scale 2**10 (no overflow, so no skipped step).

It records each run's training loss per step, final loss (mean of the last 3 steps), loss on a
held-out batch (fp32), skipped steps and the loss-scale trajectory, and prints a markdown table
(mean over seeds and each seed's value) with the CPU model and load. One thread.

    PYTHONPATH=src python benchmarks/vit_fp16.py [--seeds 3] [--steps 30] [--image-size 16] [--modes a,b]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._machine import machine  # noqa: E402

__all__ = ["run", "train", "MODES"]

#: The modes, in the order they train (PyTorch's own before mixprec is imported).
MODES = ("fp32", "torch-amp", "bf16", "fp32-skips", "torch-amp-2^10", "mixprec-fp16")
LABELS = 10


def _data(seed: int, image_size: int, n: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` synthetic images of 10 classes (a fixed prototype per class plus noise) and labels."""
    g = torch.Generator().manual_seed(1000 + seed)
    prototypes = torch.randn(LABELS, 3, image_size, image_size, generator=g)
    labels = torch.randint(0, LABELS, (n,), generator=g)
    images = prototypes[labels] + 1.5 * torch.randn(n, 3, image_size, image_size, generator=g)
    return images, labels


def _model(seed: int, image_size: int) -> torch.nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(seed)
    cfg = ViTConfig(image_size=image_size, patch_size=4, num_channels=3, hidden_size=192, num_hidden_layers=4,
                    num_attention_heads=3, intermediate_size=768, num_labels=LABELS)
    return ViTForImageClassification(cfg)


def _schedule(step: int, steps: int) -> float:
    """Linear warm-up over the first 10% of the steps, then linear decay to 0 (HF Trainer's)."""
    warmup = max(1, steps // 10)
    return (step + 1) / warmup if step < warmup else max(0.0, (steps - step) / (steps - warmup))


def train(mode: str, seed: int, steps: int = 30, image_size: int = 16, batch: int = 32, lr: float = 1e-3,
          skip: frozenset[int] = frozenset()) -> dict[str, Any]:
    """Train one mode from ``seed``; ``skip``: the steps whose optimizer step ``fp32-skips`` leaves out."""
    images, labels = _data(seed, image_size)
    model = _model(seed, image_size)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _schedule(s, steps))
    scaler: Any = None
    autocast: Callable[[], Any] = lambda: torch.autocast("cpu", enabled=False)  # noqa: E731
    if mode in ("torch-amp", "torch-amp-2^10"):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** (16 if mode == "torch-amp" else 10))
        autocast = lambda: torch.autocast("cpu", dtype=torch.float16)  # noqa: E731
    elif mode == "bf16":
        autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    elif mode == "mixprec-fp16":
        import mixprec

        scaler = mixprec.GradScaler("cpu", init_scale=2.0**16)
        autocast = lambda: mixprec.autocast("cpu", dtype=torch.float16)  # noqa: E731
    g = torch.Generator().manual_seed(seed)
    order = [torch.randint(0, len(labels), (batch,), generator=g) for _ in range(steps)]
    losses, scales, skipped = [], [], []
    for step, idx in enumerate(order):
        opt.zero_grad(set_to_none=True)
        with autocast():
            loss = torch.nn.functional.cross_entropy(model(pixel_values=images[idx]).logits.float(), labels[idx])
        if scaler is None:
            loss.backward()
            if step not in skip:
                opt.step()
        else:
            before = scaler.get_scale()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
            if scales[-1] < before:  # no hysteresis: a step was skipped exactly when the scale fell
                skipped.append(step)
        sched.step()
        losses.append(loss.item())
    held = torch.arange(len(labels) - 128, len(labels))
    with torch.no_grad():
        heldout = torch.nn.functional.cross_entropy(model(pixel_values=images[held]).logits, labels[held]).item()
    return {"mode": mode, "seed": seed, "losses": losses, "final": statistics.fmean(losses[-3:]),
            "heldout": heldout, "skipped": skipped, "scales": scales}


def run(seeds: int = 3, steps: int = 30, image_size: int = 16, modes: tuple[str, ...] = MODES) -> dict[str, Any]:
    """Each of ``modes`` (in :data:`MODES`' order; ``fp32-skips`` needs ``torch-amp``) from seeds
    0 .. ``seeds - 1``; ``{"machine", "runs", "seconds", "settings"}``.

    Raises:
        ValueError: an unknown mode, or ``fp32-skips`` without ``torch-amp``.
    """
    if set(modes) - set(MODES) or ("fp32-skips" in modes and "torch-amp" not in modes):
        raise ValueError(f"modes must be among {', '.join(MODES)} (fp32-skips with torch-amp), got {modes}")
    torch.set_num_threads(1)
    start = time.perf_counter()
    runs: list[dict[str, Any]] = []
    for mode in (m for m in MODES if m in modes):
        for seed in range(seeds):
            skip = frozenset()
            if mode == "fp32-skips":
                skip = frozenset(next(r["skipped"] for r in runs if r["mode"] == "torch-amp" and r["seed"] == seed))
            runs.append(train(mode, seed, steps, image_size, skip=skip))
            print(f"{mode} seed {seed}: final {runs[-1]['final']:.4f}, held-out {runs[-1]['heldout']:.4f}, "
                  f"skipped {runs[-1]['skipped']}, last scale {runs[-1]['scales'][-1:] or '-'}",
                  file=sys.stderr, flush=True)
    return {"machine": machine(), "runs": runs, "seconds": time.perf_counter() - start,
            "settings": {"seeds": seeds, "steps": steps, "image_size": image_size}}


def format_table(res: dict[str, Any]) -> str:
    """Markdown: per mode the mean final loss over seeds, each seed's, held-out loss, skipped steps,
    and whether ``mixprec-fp16`` equals ``torch-amp`` bitwise."""
    by = {}
    for r in res["runs"]:
        by.setdefault(r["mode"], []).append(r)
    lines = ["| mode | final loss (mean) | per seed | held-out loss (mean) | skipped steps per seed |",
             "|---|---:|---|---:|---|"]
    for mode, rs in by.items():
        per_seed = ", ".join(f"{r['final']:.4f}" for r in rs)
        lines.append(f"| {mode} | {statistics.fmean(r['final'] for r in rs):.4f} | "
                     f"{per_seed} | {statistics.fmean(r['heldout'] for r in rs):.4f} | "
                     + ("; ".join(str(r["skipped"]) for r in rs) if mode in ("torch-amp", "mixprec-fp16",
                                                                            "torch-amp-2^10", "fp32-skips")
                        else "-") + " |")
    amp, mix = by.get("torch-amp", []), by.get("mixprec-fp16", [])
    same = all(a["losses"] == b["losses"] and a["scales"] == b["scales"] for a, b in zip(amp, mix))
    m = res["machine"]
    lines.append("")
    lines.append(f"mixprec-fp16 = torch-amp bitwise (losses and scales, every seed): {same}. "
                 f"{res['settings']['steps']} steps, image {res['settings']['image_size']}, "
                 f"{len(amp)} seeds, {res['seconds']:.0f} s, 1 thread, CPU {m['cpu']}, load {m['load']}.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--image-size", type=int, default=16)
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, among " + ", ".join(MODES))
    parser.add_argument("--json", type=Path, default=None, help="write every run's series here")
    args = parser.parse_args(argv)
    if args.seeds < 1 or args.steps < 2 or args.image_size < 4 or args.image_size % 4:
        parser.error("expected --seeds >= 1, --steps >= 2 and --image-size a multiple of 4")
    try:
        res = run(args.seeds, args.steps, args.image_size, tuple(args.modes.split(",")))
    except ValueError as e:
        parser.error(str(e))
    if args.json is not None:
        args.json.write_text(json.dumps(res))
    print(format_table(res))
    return 0 if all(math.isfinite(r["final"]) for r in res["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
