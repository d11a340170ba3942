"""FP8 recipes on CPU emulation: step time and saved-activation bytes, mixprec against torchao.

The model of ``benchmarks/fp8.py`` (pre-norm transformer, d=128, 2 blocks, batch 8 x 64 tokens,
fp32 weights); the blocks' 8 Linear layers run in fp8 with each recipe:

- ``tensorwise``, ``rowwise``: torchao ``Float8LinearConfig.from_recipe_name(name)``, ``emulate=True``;
- ``mxfp8``: torchao ``MXFP8Linear(kernel_preference=KernelPreference.EMULATED)`` (RCEIL), the
  same parameters swapped in;
- ``blockwise``: torchao's blockwise training needs Triton (a GPU): mixprec only.

Interleaved rounds in one process, one thread, median of per-round times; saved bytes of one
forward by ``saved_tensors_hooks`` (parameters left out: "activations"). mixprec runs without
per-layer statistics (torchao keeps none; ``benchmarks/fp8.py`` measures their cost). Prints the CPU model
(``lscpu``) and the load (``uptime``): the machine may be shared.

    .venv/bin/python benchmarks/fp8_formats.py [--quick]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._machine import machine  # noqa: E402
from benchmarks.fp8 import BATCH, D, TOKENS, _in_blocks, _model, _saved_bytes, _stateless  # noqa: E402

RECIPES = ("tensorwise", "rowwise", "mxfp8", "blockwise")


def _torchao(base: nn.Module, recipe: str) -> nn.Module | None:
    model = copy.deepcopy(base)
    if recipe in ("tensorwise", "rowwise"):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
        return convert_to_float8_training(model, config=config, module_filter_fn=_in_blocks)
    if recipe == "mxfp8":
        from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear
        from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

        for fqn, mod in list(model.named_modules()):
            if _in_blocks(mod, fqn):
                with torch.device("meta"):
                    new = MXFP8Linear(mod.in_features, mod.out_features,
                                      kernel_preference=KernelPreference.EMULATED)
                new.weight, new.bias = mod.weight, mod.bias
                parent, _, child = fqn.rpartition(".")
                setattr(model.get_submodule(parent), child, new)
        return model
    return None  # blockwise: Triton only


def _modes() -> dict[str, nn.Module]:
    from mixprec import fp8

    base = _model()
    modes = {"fp32": copy.deepcopy(base)}
    for recipe in RECIPES:
        ours = fp8.convert(copy.deepcopy(base), recipe, filter_fn=_in_blocks)
        for mod in ours.modules():  # no statistics (torchao keeps none): linear() gets no state
            if isinstance(mod, fp8.Float8Linear):
                mod.forward = _stateless(mod)
        modes[f"mixprec {recipe}"] = ours
        ref = _torchao(base, recipe)
        if ref is not None:
            modes[f"torchao {recipe}"] = ref
    return modes


def run(quick: bool = False) -> dict[str, Any]:
    """Median step ms per mode, mixprec/torchao ratios per recipe, saved bytes."""
    torch.set_num_threads(1)
    machine_before = machine()
    modes = _modes()
    x = torch.randn(BATCH, TOKENS, D, generator=torch.Generator().manual_seed(1))
    rounds, steps = (1, 1) if quick else (9, 3)
    times: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(rounds + 1):  # round 0 warms up
        for name, model in modes.items():
            start = time.perf_counter()
            for _ in range(steps):
                model(x).square().mean().backward()
                model.zero_grad(set_to_none=True)
            if r:
                times[name].append((time.perf_counter() - start) / steps * 1e3)
    ms = {m: statistics.median(v) for m, v in times.items()}
    saved = {m: _saved_bytes(model, x) for m, model in modes.items()}
    per_recipe = {}
    for recipe in RECIPES:
        ours, ref = f"mixprec {recipe}", f"torchao {recipe}"
        per_recipe[recipe] = {
            "mixprec_ms": ms[ours], "torchao_ms": ms.get(ref),
            "step_ratio": ms[ours] / ms[ref] if ref in ms else None,
            "vs_fp32": ms[ours] / ms["fp32"],
            "saved_activations": saved[ours][1],
            "saved_ratio": saved[ours][1] / saved[ref][1] if ref in saved else None,
            "saved_vs_fp32": saved[ours][1] / saved["fp32"][1],
        }
    return {"step_ms": ms, "saved_bytes": {m: {"all": a, "activations": b} for m, (a, b) in saved.items()},
            "recipes": per_recipe, "rounds": rounds, "machine": machine_before, "load_after": machine()["load"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (noisier)")
    res = run(quick=parser.parse_args().quick)
    m = res["machine"]
    print(f"CPU: {m['cpu']}; load average before: {m['load']}, after: {res['load_after']}; "
          f"torch {torch.__version__}, 1 thread, median of {res['rounds']} rounds; fp32 step "
          f"{res['step_ms']['fp32']:.1f} ms, fp32 activations {res['saved_bytes']['fp32']['activations'] / 2**20:.2f} MiB")
    head = f"{'recipe':<11} {'mixprec ms':>10} {'torchao ms':>10} {'ratio':>6} {'vs fp32':>7} " \
           f"{'saved MiB':>9} {'vs torchao':>10} {'vs fp32':>7}"
    print(head)
    fmt = lambda v, spec: "n/a" if v is None else format(v, spec)  # noqa: E731
    for recipe, r in res["recipes"].items():
        print(f"{recipe:<11} {r['mixprec_ms']:>10.1f} {fmt(r['torchao_ms'], '.1f'):>10} "
              f"{fmt(r['step_ratio'], '.2f'):>6} {r['vs_fp32']:>7.2f} {r['saved_activations'] / 2**20:>9.2f} "
              f"{fmt(r['saved_ratio'], '.2f'):>10} {r['saved_vs_fp32']:>7.2f}")
    print("(blockwise: torchao's blockwise training needs Triton, no CPU emulation to compare with)")


if __name__ == "__main__":
    main()
