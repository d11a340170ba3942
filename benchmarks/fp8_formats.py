"""FP8 and FP4 recipes on CPU emulation: step time and saved-activation bytes, mixprec against torchao.

The model of ``benchmarks/fp8.py`` (pre-norm transformer, d=128, 2 blocks, batch 8 x 64 tokens,
fp32 weights); the blocks' 8 Linear layers run in fp8 with each recipe:

- ``tensorwise``, ``rowwise``: torchao ``Float8LinearConfig.from_recipe_name(name)``, ``emulate=True``;
- ``mxfp8``: torchao ``MXFP8Linear(kernel_preference=KernelPreference.EMULATED)`` (RCEIL), the
  same parameters swapped in;
- ``blockwise``: torchao's blockwise training needs Triton (a GPU): mixprec only.
- fp4 (``res["fp4"]``): mixprec ``mxfp4`` and ``nvfp4`` (TE's defaults: 16x16 weight blocks,
  Hadamard on the weight-gradient GEMM, stochastic rounding), each against mixprec's fp8
  emulations side by side (``mxfp8``, ``tensorwise``); beside them torchao's MXFP4 QAT linear
  (``MXFakeQuantizedLinear``: fp4 forward, high-precision backward; no fp4 backward to compare).

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
FP4_RECIPES = ("mxfp4", "nvfp4")


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
    if recipe == "mxfp4":  # the QAT linear: fp4 forward, high-precision backward
        from torchao.prototype.qat.mx import MXFakeQuantizeConfig, MXFakeQuantizedLinear

        for fqn, mod in list(model.named_modules()):
            if _in_blocks(mod, fqn):
                new = MXFakeQuantizedLinear.from_linear(mod, MXFakeQuantizeConfig(), MXFakeQuantizeConfig())
                parent, _, child = fqn.rpartition(".")
                setattr(model.get_submodule(parent), child, new)
        return model
    return None  # blockwise: Triton only; nvfp4: no torchao training path


def _modes() -> dict[str, nn.Module]:
    from mixprec import fp8

    base = _model()
    modes = {"fp32": copy.deepcopy(base)}
    for recipe in RECIPES + FP4_RECIPES:
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
    fp4 = {}
    for recipe in FP4_RECIPES:
        ours, ref = f"mixprec {recipe}", f"torchao {recipe}"
        fp4[recipe] = {
            "mixprec_ms": ms[ours], "vs_mxfp8": ms[ours] / ms["mixprec mxfp8"],
            "vs_tensorwise": ms[ours] / ms["mixprec tensorwise"], "vs_fp32": ms[ours] / ms["fp32"],
            "torchao_qat_ms": ms.get(ref),
            "saved_activations": saved[ours][1], "saved_vs_fp32": saved[ours][1] / saved["fp32"][1],
        }
    return {"step_ms": ms, "saved_bytes": {m: {"all": a, "activations": b} for m, (a, b) in saved.items()},
            "recipes": per_recipe, "fp4": fp4, "rounds": rounds, "machine": machine_before, "load_after": machine()["load"]}


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
    print(f"{'fp4 recipe':<11} {'mixprec ms':>10} {'vs mxfp8':>8} {'vs tensorwise':>13} {'vs fp32':>7} "
          f"{'saved MiB':>9} {'vs fp32':>7} {'torchao QAT ms':>14}")
    for recipe, r in res["fp4"].items():
        print(f"{recipe:<11} {r['mixprec_ms']:>10.1f} {r['vs_mxfp8']:>8.2f} {r['vs_tensorwise']:>13.2f} "
              f"{r['vs_fp32']:>7.2f} {r['saved_activations'] / 2**20:>9.2f} {r['saved_vs_fp32']:>7.2f} "
              f"{fmt(r['torchao_qat_ms'], '.1f'):>14}")
    print("(torchao QAT: MXFakeQuantizedLinear, fp4 forward and high-precision backward; saved vs fp32: "
          "fp32 activations, so bf16's ratio is twice it)")


if __name__ == "__main__":
    main()
