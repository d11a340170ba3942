"""Training throughput and peak memory of a GPT-2-small-sized model under each precision mode.

    python benchmarks/gpu.py --device cuda [--steps 30] [--warmup 5] [--batch-size 8] [--out table.md]
    python benchmarks/gpu.py --device cuda --step-costs --fp8   # what scripts/gpu-check.sh runs
    python benchmarks/gpu.py --device cpu --tiny      # smoke run of the same code
    python benchmarks/gpu.py --device cpu --quick     # smoke run of every section

``--step-costs`` adds the demo's per-layer scaling (``mixprec-fp16-layerwise``, against
``mixprec-fp16``) and fp8 (``mixprec-fp8``, ``mixprec-fp8-rowwise``, against ``mixprec-bf16``)
modes in a second table; ``--fp8`` adds fp8 layers at GPT-2 small's width, mixprec against
torchao's ``Float8Linear`` and the fp8 Controller's step cost (:func:`fp8_section`).

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
# --step-costs: the demo's modes whose step cost is measured against a reference mode of the run
STEP_COSTS = {"mixprec-fp16-layerwise": "mixprec-fp16", "mixprec-fp8": "mixprec-bf16",
              "mixprec-fp8-rowwise": "mixprec-bf16"}


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


def markdown(rows: list[dict[str, Any]], s: Settings, device: torch.device,
             extra: Sequence[str] = ()) -> str:
    """The results as a markdown table, the ``extra`` sections, then a line on the hardware and
    settings."""
    by_mode = {r["mode"]: r for r in rows}
    fp32 = by_mode.get("fp32")
    lines = [
        "| mode | tokens/s | vs fp32 | vs torch.amp | peak memory (MiB) | loss after last step |",
        "|---|---:|---:|---:|---:|---:|",
    ]

    def speedup(row: dict[str, Any], ref: dict[str, Any] | None) -> str:
        return "-" if ref is None else f"{row['tokens_per_s'] / ref['tokens_per_s']:.2f}x"

    for r in rows:
        if r["mode"] in STEP_COSTS:
            continue
        ref = by_mode.get(REFERENCE.get(r["mode"], ""))
        lines.append(
            f"| {r['mode']} | {r['tokens_per_s']:,.0f} | {speedup(r, fp32)} | {speedup(r, ref)} | "
            f"{r['peak_bytes'] / 2**20:,.1f} | {r['final_loss']:.3f} |"
        )
    costs = [r for r in rows if r["mode"] in STEP_COSTS]
    if costs:
        lines += ["", "| mode | tokens/s | vs | ratio | peak memory (MiB) | loss after last step |",
                  "|---|---:|---|---:|---:|---:|"]
        for r in costs:
            ref = by_mode.get(STEP_COSTS[r["mode"]])
            lines.append(f"| {r['mode']} | {r['tokens_per_s']:,.0f} | {STEP_COSTS[r['mode']]} | {speedup(r, ref)} | "
                         f"{r['peak_bytes'] / 2**20:,.1f} | {r['final_loss']:.3f} |")
    lines += [line for section in extra for line in ("", section)]
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


def _fp8_variants(device: torch.device, width: int) -> dict[str, tuple[torch.nn.Module, Callable[[], Any], Any]]:
    """``{name: (model, context factory, controller or None)}``: bf16 weights, every Linear in fp8
    (mixprec's ``fp8.convert``, torchao's ``convert_to_float8_training``; emulated where
    ``torch._scaled_mm`` cannot run), and mixprec's ``Policy.fp8`` with a ``Controller(every=10)``."""
    import contextlib
    import copy
    import dataclasses

    import mixprec
    from mixprec import fp8
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:  # the table says so; mixprec's rows still run
        Float8LinearConfig = convert_to_float8_training = None

    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(4):  # GPT-2's MLP blocks: d -> 4d -> d
        layers += [torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)]
    base = torch.nn.Sequential(*layers).to(device=device, dtype=torch.bfloat16)
    fp8_gpu = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
    out: dict[str, tuple[torch.nn.Module, Callable[[], Any], Any]] = {
        "bf16": (copy.deepcopy(base), contextlib.nullcontext, None)}
    for recipe in ("tensorwise", "rowwise"):
        out[f"mixprec-{recipe}"] = (fp8.convert(copy.deepcopy(base), recipe), contextlib.nullcontext, None)
        if convert_to_float8_training is None:
            continue
        config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=not fp8_gpu)
        out[f"torchao-{recipe}"] = (convert_to_float8_training(copy.deepcopy(base), config=config),
                                    contextlib.nullcontext, None)
    ctl = mixprec.Controller(every=10)
    policy = mixprec.Policy.parse("compute=bf16").fp8("tensorwise", controller=ctl, first_last="fp8")
    out["mixprec-tensorwise-controller"] = (copy.deepcopy(base),
                                            lambda: mixprec.autocast(device.type, policy=policy), ctl)
    return out


def fp8_section(device: torch.device, quick: bool = False) -> str:
    """fp8 training steps of 4 MLP blocks at GPT-2 small's width (d=768, 8192 tokens; ``quick``:
    d=64, 64 tokens): milliseconds per step (forward, backward, AdamW), median over interleaved
    rounds, tokens/s, each fp8 variant against torchao's with the same recipe and against bf16,
    and the peak memory of one step (CUDA). A markdown table."""
    width, tokens = (64, 64) if quick else (768, 8192)
    rounds, steps = (2, 1) if quick else (8, 5)
    variants = _fp8_variants(device, width)
    x = torch.randn(tokens, width, device=device, dtype=torch.bfloat16)
    fused = device.type == "cuda"
    opts = {n: torch.optim.AdamW(m.parameters(), lr=1e-4, fused=fused, foreach=None if fused else True)
            for n, (m, _, _) in variants.items()}

    def step(name: str) -> None:
        model, context, ctl = variants[name]
        with context():
            loss = model(x).float().square().mean()
        loss.backward()
        opts[name].step()
        opts[name].zero_grad(set_to_none=True)
        if ctl is not None:
            ctl.step()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    peaks: dict[str, float] = {}
    for name in variants:  # warm-up (and the peak of one step)
        if device.type == "cuda":
            sync()
            torch.cuda.reset_peak_memory_stats(device)
        step(name)
        step(name)
        sync()
        if device.type == "cuda":
            peaks[name] = torch.cuda.max_memory_allocated(device) / 2**20
    times: dict[str, list[float]] = {n: [] for n in variants}
    names = list(variants)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            sync()
            start = time.perf_counter()
            for _ in range(steps):
                step(name)
            sync()
            times[name].append((time.perf_counter() - start) / steps)
    med = {n: sorted(t)[len(t) // 2] for n, t in times.items()}
    fp8_gpu = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
    lines = ["| fp8 layers | ms/step | tokens/s | vs torchao | vs bf16 | peak memory (MiB) | GEMMs |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for name in variants:
        recipe = name.split("-")[1] if name.startswith("mixprec-") else None
        ref = med.get(f"torchao-{recipe}") if recipe else None
        backend = "bf16" if name == "bf16" else ("torch._scaled_mm" if fp8_gpu else "emulated")
        lines.append(f"| {name} | {med[name] * 1e3:.2f} | {tokens / med[name]:,.0f} | "
                     f"{'-' if ref is None else f'{ref / med[name]:.2f}x'} | {med['bf16'] / med[name]:.2f}x | "
                     f"{f'{peaks[name]:,.1f}' if name in peaks else '-'} | {backend} |")
    if not any(n.startswith("torchao-") for n in variants):
        lines.append("\ntorchao is not installed (pip install -e '.[fp8]'): no torchao rows.")
    lines.append(f"\nfp8 layers: 4 MLP blocks, d={width}, {tokens} tokens, bf16 weights, AdamW; median of {rounds} "
                 f"interleaved rounds of {steps} steps; ratios are speed-ups (>1: faster than the reference).")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu.py", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--tiny", action="store_true", help="the demo's tiny model (smoke run)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run of everything: --tiny, 2 steps, --step-costs and --fp8 at a small width")
    parser.add_argument("--step-costs", action="store_true",
                        help=f"also the demo modes {', '.join(STEP_COSTS)} against their reference mode")
    parser.add_argument("--fp8", action="store_true",
                        help="also fp8 layers: mixprec against torchao's Float8Linear, and the Controller's step cost")
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
    if args.quick:
        args.tiny, args.step_costs, args.fp8 = True, True, True
        args.steps = args.steps or 2
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if args.step_costs:
        modes += [m for m in (*STEP_COSTS, *STEP_COSTS.values()) if m not in modes]
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
    extra = []
    if args.fp8:
        extra.append(fp8_section(device, quick=args.tiny))
    table = markdown(rows, s, device, extra)
    print(table)
    if args.out is not None:
        args.out.write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
