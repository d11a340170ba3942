"""``mixprec export``: write a saved transformers model for serving, scales from recorded statistics."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import mixprec.export as ex
from mixprec.export._atomic import check_folder
from mixprec.fp8 import as_recipe

__all__ = ["add_export_parser"]


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def add_export_parser(sub: Any) -> None:
    """Add the ``export`` subcommand to the ``mixprec`` parser's subparsers."""
    p = sub.add_parser(
        "export", help="write an fp8-trained model for serving (compressed-tensors or torchao)",
        description="Load MODEL (a folder transformers' from_pretrained reads), take the static scales from "
        "the statistics a mixprec.export.Recorder saved (--stats), and write OUT for vLLM/transformers "
        "(compressed-tensors) or torchao. See docs/export.md.")
    p.add_argument("model", type=Path, help="folder of the trained model (save_pretrained)")
    p.add_argument("out", type=Path, help="folder to write")
    p.add_argument("--stats", type=Path, required=True, help="file written by Recorder.save")
    p.add_argument("--format", choices=("compressed-tensors", "torchao"), default="compressed-tensors")
    p.add_argument("--layers", default=None,
                   help="comma-separated layers to quantize (default: the fp8 layers the statistics file lists)")
    p.add_argument("--windows", type=int, default=8, help="the last N windows the rule reads (0: all; default 8)")
    p.add_argument("--percentile", type=_positive, default=100.0, help="percentile over the windows (default 100: max)")
    p.add_argument("--margin", type=_positive, default=1.0, help="factor on the amax (default 1)")
    p.add_argument("--weight-strategy", choices=("tensor", "channel"), default="tensor")
    p.add_argument("--recipe", default=None,
                   help="the recipe of layers the statistics record none for (e.g. nvfp4, mxfp4: they export in "
                   "fp4; default: fp8); each layer the statistics name exports in the recipe it ran (a --recipe "
                   "that contradicts it warns)")
    p.add_argument("--no-kv-cache", action="store_true", help="write no k_scale/v_scale")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    prog = "mixprec export"
    if not (args.model / "config.json").is_file():
        print(f"{prog}: error: {args.model} is not a saved transformers model (no config.json)", file=sys.stderr)
        return 1
    if not args.stats.is_file():
        print(f"{prog}: error: no statistics file {args.stats} (write it with mixprec.export.Recorder.save)",
              file=sys.stderr)
        return 1
    from transformers import AutoModelForCausalLM

    try:
        rule = ex.ScaleRule(windows=args.windows or None, percentile=args.percentile, margin=args.margin)
        recipe = None if args.recipe is None else as_recipe(args.recipe)
        stats = ex.load_stats(args.stats)
        check_folder(args.out)  # before the model is loaded (export checks it again)
        layers = args.layers.split(",") if args.layers else stats.fp8_layers
        if not layers:
            raise ValueError(f"{args.stats} lists no fp8 layer (a calibrated model): pass --layers")
        model = AutoModelForCausalLM.from_pretrained(args.model)
        q = ex.export(model, args.out, args.format, stats=stats, rule=rule, layers=layers,
                      weight_strategy=args.weight_strategy, kv_cache=not args.no_kv_cache, recipe=recipe)
    except (ValueError, OSError) as e:  # bad input (OSError: from_pretrained's unreadable model folder)
        print(f"{prog}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    fp4 = f", {len(q.fp4)} fp4 layers" if q.fp4 else ""
    print(f"{prog}: wrote {args.out} ({args.format}): {len(q.layers)} fp8 layers{fp4}, {len(q.kept)} kept in high "
          f"precision, KV scales for {len(q.kv_scales)} attention layers; input scales: {rule.describe()}")
    if q.kv_scales and args.format == "compressed-tensors":
        print(f"{prog}: note: {ex.KV_NOTE}")
    return 0
