"""Training throughput and peak memory of a GPT-2-small-sized model under each precision mode.

    python benchmarks/gpu.py --device cuda [--steps 30] [--warmup 5] [--batch-size 8] [--out table.md]
    python benchmarks/gpu.py --device cpu --tiny      # smoke run of the same code

The model is :class:`mixprec.demo.model.TransformerLM` at GPT-2 small's shape (12 layers,
d=768, 12 heads, sequence 1024, vocabulary 50257; 163M parameters, the head is untied), trained
with fused AdamW (``torch.optim.AdamW(fused=True)``; both loss scalers unscale and skip inside
its kernel) on the demo corpus by :func:`mixprec.demo.train.run_mode`, in fp32, torch.amp (fp16
with its GradScaler, and bf16) and mixprec (fp16 with mixprec.GradScaler, and bf16). fp32 is
strict float32 (torch's default: no TF32 matmuls). Tokens/s leave out the first ``--warmup``
steps, with the device synchronised at both ends of the timed span; peak memory is
``torch.cuda.max_memory_allocated`` from the first training step to the end of a mode's run on
CUDA (``run_mode`` resets the peak statistics at its first step), and params + grads +
optimizer state + saved activations on the CPU. Prints a markdown table (and writes it to
``--out``). Expected to take about a minute on one H200 (estimated from the FLOPs; not yet
measured).
"""

from __future__ import annotations

import argparse
import gc
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from mixprec.demo.model import GPT2_SMALL, SIZES
from mixprec.demo.train import ModeResult, Settings, check_modes, run_mode

MODES = ("fp32", "torch-amp", "mixprec-fp16", "torch-amp-bf16", "mixprec-bf16")
# mixprec mode -> the torch.amp mode it is compared with
REFERENCE = {"mixprec-fp16": "torch-amp", "mixprec-bf16": "torch-amp-bf16"}


def settings(
    tiny: bool, steps: int | None = None, batch_size: int | None = None, warmup: int | None = None
) -> Settings:
    """GPT-2 small (or the demo's tiny model with ``tiny``) with benchmark step/batch/warm-up
    counts (None: 30/8/5 steps/sequences/untimed steps; tiny 3/2/1) and fused AdamW.

    Raises:
        ValueError: for a count out of range (see :class:`Settings`).
    """
    model = SIZES["tiny"] if tiny else GPT2_SMALL
    default_steps, default_batch, default_warmup = (3, 2, 1) if tiny else (30, 8, 5)
    return Settings(
        model=model,
        steps=default_steps if steps is None else steps,
        batch_size=default_batch if batch_size is None else batch_size,
        lr=3e-4,
        eval_batches=1,
        size="tiny" if tiny else "gpt2-small",
        untimed_steps=default_warmup if warmup is None else warmup,
        fused=True,
    )


def _count(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value

    return parse


def bench_mode(name: str, s: Settings, device: torch.device) -> dict[str, Any]:
    """Train ``name`` for ``s.steps`` steps; its throughput, peak memory and losses."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the previous mode's blocks
    result: ModeResult = run_mode(name, s, device)  # resets the peak statistics at its first step
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else result.total_memory
    return {
        "mode": name,
        "tokens_per_s": result.tokens_per_s,
        "peak_bytes": peak,
        "final_loss": result.losses[-1],
        "skipped_steps": len(result.skipped_steps),
        "wall_s": result.wall_s,
    }


def markdown(rows: list[dict[str, Any]], s: Settings, device: torch.device) -> str:
    """The results as a markdown table with a line on the hardware and settings."""
    by_mode = {r["mode"]: r for r in rows}
    fp32 = by_mode.get("fp32")
    lines = [
        "| mode | tokens/s | vs fp32 | vs torch.amp | peak memory (MiB) | loss after last step |",
        "|---|---:|---:|---:|---:|---:|",
    ]

    def speedup(row: dict[str, Any], ref: dict[str, Any] | None) -> str:
        return "-" if ref is None else f"{row['tokens_per_s'] / ref['tokens_per_s']:.2f}x"

    for r in rows:
        ref = by_mode.get(REFERENCE.get(r["mode"], ""))
        lines.append(
            f"| {r['mode']} | {r['tokens_per_s']:,.0f} | {speedup(r, fp32)} | {speedup(r, ref)} | "
            f"{r['peak_bytes'] / 2**20:,.1f} | {r['final_loss']:.3f} |"
        )
    hardware = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "CPU"
    m = s.model
    lines.append(
        f"\n{time.strftime('%Y-%m-%d')}, {hardware}, torch {torch.__version__}: {m.n_layers} layers, "
        f"d={m.d_model}, {m.n_heads} heads, sequence {m.seq_len}, vocabulary {m.vocab_size}, batch "
        f"{s.batch_size}, {s.steps} fused AdamW steps per mode ({len(s.timed_steps)} timed). Peak memory: "
        + ("torch.cuda.max_memory_allocated." if device.type == "cuda"
           else "params + grads + optimizer state + saved activations.")
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu.py", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--tiny", action="store_true", help="the demo's tiny model (smoke run)")
    parser.add_argument("--steps", type=_count(1), default=None, help="steps per mode (default 30; tiny 3)")
    parser.add_argument("--warmup", type=_count(0), default=None,
                        help="first steps left out of tokens/s (default 5; tiny 1)")
    parser.add_argument("--batch-size", type=_count(1), default=None, help="sequences per step (default 8; tiny 2)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=None, help="also write the markdown table here")
    args = parser.parse_args(argv)
    try:
        device = torch.device(args.device)
    except RuntimeError:
        print(f"gpu.py: error: not a device: {args.device!r} (use cuda or cpu)", file=sys.stderr)
        return 2
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu.py: error: CUDA is not available; use --device cpu --tiny for a smoke run", file=sys.stderr)
        return 2
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    try:
        check_modes(modes)
        s = settings(args.tiny, args.steps, args.batch_size, args.warmup)
    except (ValueError, RuntimeError) as e:
        print(f"gpu.py: error: {e}", file=sys.stderr)
        return 2
    rows = []
    for name in modes:
        row = bench_mode(name, s, device)
        print(f"{name}: {row['tokens_per_s']:,.0f} tokens/s, peak {row['peak_bytes'] / 2**20:,.1f} MiB, "
              f"{row['wall_s']:.1f} s", file=sys.stderr, flush=True)
        rows.append(row)
    table = markdown(rows, s, device)
    print(table)
    if args.out is not None:
        args.out.write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
