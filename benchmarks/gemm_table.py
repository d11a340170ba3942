"""The GEMM table: per recipe and shape, what mixprec's forward GEMM costs and how far it lands from fp32.

    python benchmarks/gemm_table.py --device cuda --out benchmarks/gpu-NAME.md --append

For each recipe (tensorwise, rowwise, blockwise, mxfp8, mxfp4, nvfp4) and shape (M, K, N; up to
8192) it measures, side by side in one run:

* ``gemm TFLOPS``: the forward GEMM alone on operands cast once beforehand, as mixprec calls it
  (``_native_gemm``: scales swizzled or laid out, K padded, each call), where the device has the
  recipe's scaled GEMM ("-" where it runs emulated);
* ``layer TFLOPS``: ``fp8.linear``'s forward (casts and GEMM; ``backend="auto"``), and which
  backend ran (``scaled_mm`` or ``emulated``, from the layer's state);
* ``vs bf16``: the layer's time against ``torch.mm`` in bf16 on the same operands (above 1: faster);
* ``rel err``: the layer's output against the fp32 GEMM of the unquantized operands
  (``||y - y32|| / ||y32||``).

Times are CUDA events over repeated calls after a warm-up (``time.perf_counter`` on the CPU).
``--quick`` runs small shapes (a CPU smoke run).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from mixprec import fp8  # noqa: E402
from mixprec.formats import _native_gemm  # noqa: E402
from mixprec.formats._blocks import quantize as block_quantize  # noqa: E402
from mixprec.formats._fp4 import quantize as fp4_quantize  # noqa: E402
from mixprec.formats._quant import _scaled_mm, cast_to_fp8  # noqa: E402

RECIPES = ("tensorwise", "rowwise", "blockwise", "mxfp8", "mxfp4", "nvfp4")
SHAPES = ((16, 4096, 4096), (2048, 2048, 2048), (4096, 4096, 4096), (8192, 4096, 1024), (8192, 8192, 8192))
QUICK_SHAPES = ((1, 256, 128), (200, 256, 128))


def _timed(fn: Callable[[], object], device: torch.device, repeat: int) -> float:
    """Seconds per call of ``fn`` (after two warm-up calls)."""
    for _ in range(2):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeat):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / repeat
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t0) / repeat


def _native_forward(recipe: fp8.Float8Recipe, x: torch.Tensor, w: torch.Tensor) -> Callable[[], torch.Tensor]:
    """The forward GEMM on operands cast once, as mixprec calls torch's scaled GEMM."""
    ca, cb = recipe.input, recipe.weight
    if ca.is_fp4:
        a = fp4_quantize(x, ca, subnormal_scales=recipe.subnormal_scales)
        b = fp4_quantize(w, cb, subnormal_scales=recipe.subnormal_scales)
        return lambda: _native_gemm.fp4_mm(a, ca, b, cb, torch.bfloat16)
    if ca.block is not None:
        a, b = block_quantize(x, ca, recipe.pow2_scales)[:2], block_quantize(w, cb, recipe.pow2_scales)[:2]
        return lambda: _native_gemm.block_mm(a, ca, b, cb, torch.bfloat16)
    xq, sx, _ = cast_to_fp8(x, ca, -1, recipe.pow2_scales)
    wq, sw, _ = cast_to_fp8(w.t(), cb, 0, recipe.pow2_scales)
    sx = sx.reshape(-1, 1) if sx.dim() else sx
    return lambda: _scaled_mm(xq, sx, wq, sw, torch.bfloat16, True)


def row(recipe_name: str, m: int, k: int, n: int, device: torch.device, repeat: int) -> dict[str, object]:
    g = torch.Generator(device=device).manual_seed(m + k + n)
    x = torch.randn(m, k, device=device, generator=g).bfloat16()
    w = (torch.randn(n, k, device=device, generator=g) / k ** 0.5).bfloat16()
    flops = 2 * m * k * n
    recipe = fp8.as_recipe(recipe_name)
    state = fp8.LayerState(device)
    with torch.no_grad():
        y = fp8.linear(x, w, recipe=recipe, state=state)
        ref = x.float() @ w.float().t()
        err = float(torch.linalg.vector_norm(y.float() - ref) / torch.linalg.vector_norm(ref))
        t_bf16 = _timed(lambda: torch.mm(x, w.t()), device, repeat)
        t_layer = _timed(lambda: fp8.linear(x, w, recipe=recipe), device, repeat)
        t_gemm = None
        if state.backend == "scaled_mm":
            t_gemm = _timed(_native_forward(recipe, x, w), device, repeat)
    return {"recipe": recipe_name, "shape": f"{m}x{k}x{n}", "backend": state.backend,
            "gemm": None if t_gemm is None else flops / t_gemm / 1e12, "layer": flops / t_layer / 1e12,
            "bf16": flops / t_bf16 / 1e12, "vs_bf16": t_bf16 / t_layer, "err": err}


def table(rows: list[dict[str, object]], device_name: str) -> str:
    lines = [f"## GEMM table: {device_name}, torch {torch.__version__}", "",
             "Forward GEMM per recipe and shape (M x K x N): the scaled GEMM alone on pre-cast operands, "
             "fp8.linear's forward (casts + GEMM), its speed against a bf16 torch.mm, its output error "
             "against the fp32 GEMM of the unquantized operands (benchmarks/gemm_table.py).", "",
             "| recipe | M x K x N | backend | gemm TFLOPS | layer TFLOPS | bf16 TFLOPS | vs bf16 | rel err |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        gemm = "-" if r["gemm"] is None else f"{r['gemm']:.1f}"
        lines.append(f"| {r['recipe']} | {r['shape']} | {r['backend']} | {gemm} | {r['layer']:.2f} | "
                     f"{r['bf16']:.1f} | {r['vs_bf16']:.2f}x | {r['err']:.2e} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=None, help="write (or with --append, add) the table here")
    parser.add_argument("--append", action="store_true")
    parser.add_argument("--quick", action="store_true", help="small shapes, few repeats (a CPU smoke run)")
    parser.add_argument("--budget", type=float, default=240.0, help="seconds; shapes left are skipped, said so")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    shapes, repeat = (QUICK_SHAPES, 2) if args.quick else (SHAPES, 10)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    start, rows, skipped = time.perf_counter(), [], 0
    for m, k, n in shapes:
        for recipe in RECIPES:
            if time.perf_counter() - start > args.budget:
                skipped += 1
                continue
            rows.append(row(recipe, m, k, n, device, repeat))
            print(f"gemm_table: {rows[-1]}", flush=True)
    text = table(rows, name)
    if skipped:
        text += f"\n{skipped} recipe x shape rows left out: past the {args.budget:.0f} s budget.\n"
    if args.out is None:
        print(text)
    else:
        with open(args.out, "a" if args.append else "w") as f:
            f.write(("\n" if args.append else "") + text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
