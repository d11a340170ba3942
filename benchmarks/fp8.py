"""FP8 training step on CPU: mixprec's emulated fp8 linear against torchao's, bf16 autocast, fp32.

A small pre-norm transformer (d=128, 4 heads, MLP 4x, 2 blocks, batch 8 x 64 tokens, fp32
weights); the Linear layers of the blocks (qkv, out, fc1, fc2) run in fp8 tensorwise. Modes,
timed in interleaved rounds in one process with one thread (median of per-round times):

- ``fp32``: the plain model; ``bf16``: ``torch.autocast("cpu", bfloat16)``;
- ``torchao``: ``torchao.float8.convert_to_float8_training(emulate=True)``;
- ``mixprec``: ``mixprec.fp8.convert`` (emulate), and ``mixprec+stats``: the same with the
  per-layer statistics a Guard reads (``Guard.check`` every step, every 10th reading).

Also the bytes saved for backward by one forward (``saved_tensors_hooks``), all saved tensors and
activations only (parameters left out), mixprec against torchao. The layer selection and the
references do not go through mixprec.

    .venv/bin/python benchmarks/fp8.py [--quick]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import time
from typing import Any, Callable

import torch
from torch import nn

D, HEADS, BLOCKS, BATCH, TOKENS = 128, 4, 2, 8, 64


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.out = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, t, D))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm2(x))))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, D), *[Block() for _ in range(BLOCKS)], nn.LayerNorm(D), nn.Linear(D, D))


def _in_blocks(module: nn.Module, fqn: str) -> bool:
    return type(module) is nn.Linear and fqn.split(".")[0] not in ("0", str(BLOCKS + 2))


def _modes() -> dict[str, tuple[nn.Module, Callable[[], Any], Callable[[int], None]]]:
    import contextlib

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from mixprec import fp8

    none = contextlib.nullcontext
    base = _model()
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name("tensorwise"), emulate=True)
    guard = fp8.Guard(every=10)
    guarded = fp8.convert(copy.deepcopy(base), filter_fn=_in_blocks)
    plain = fp8.convert(copy.deepcopy(base), filter_fn=_in_blocks)
    for st in fp8.layer_states(plain).values():
        st.fallback = False
    # "mixprec" without statistics: the same modules, but linear() gets no state
    for mod in plain.modules():
        if isinstance(mod, fp8.Float8Linear):
            mod.forward = _stateless(mod)
    noop = lambda step: None  # noqa: E731
    return {
        "fp32": (copy.deepcopy(base), none, noop),
        "bf16": (copy.deepcopy(base), lambda: torch.autocast("cpu", dtype=torch.bfloat16), noop),
        "torchao": (convert_to_float8_training(copy.deepcopy(base), config=config,
                                               module_filter_fn=_in_blocks), none, noop),
        "mixprec": (plain, none, noop),
        "mixprec+stats": (guarded, none, lambda step: guard.check(guarded, step)),
    }


def _stateless(mod: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    from mixprec import fp8

    return lambda x: fp8.linear(x, mod.weight, mod.bias, mod.recipe, backend="emulate")


def _saved_bytes(model: nn.Module, x: torch.Tensor) -> tuple[int, int]:
    params = {p.data_ptr() for p in model.parameters()}
    total = acts = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total, acts
        n = t.numel() * t.element_size()
        total += n
        if t.data_ptr() not in params:
            acts += n
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).sum()
    return total, acts


def run(quick: bool = False) -> dict[str, Any]:
    """Median step ms per mode, ratios, saved bytes. Returns a dict of figures."""
    torch.set_num_threads(1)
    modes = _modes()
    x = torch.randn(BATCH, TOKENS, D, generator=torch.Generator().manual_seed(1))
    rounds, steps = (1, 1) if quick else (15, 5)
    times: dict[str, list[float]] = {m: [] for m in modes}
    step_no = 0
    for r in range(rounds + 1):  # round 0 warms up
        for name, (model, region, after) in modes.items():
            start = time.perf_counter()
            for _ in range(steps):
                with region():
                    loss = model(x).square().mean()
                loss.backward()
                after(step_no)
                model.zero_grad(set_to_none=True)
                step_no += 1
            if r:
                times[name].append((time.perf_counter() - start) / steps * 1e3)
    ms = {m: statistics.median(v) for m, v in times.items()}
    saved = {m: _saved_bytes(modes[m][0], x) for m in ("fp32", "torchao", "mixprec")}
    # one fp8 linear alone (the MLP's fc1): what the fp8 saving is where it applies
    fc1 = {m: modes[m][0][1].fc1 for m in ("torchao", "mixprec")}
    h = torch.randn(BATCH, TOKENS, D, requires_grad=True)
    linear_saved = {m: _saved_bytes(mod, h)[0] for m, mod in fc1.items()}
    res = {
        "step_ms": ms,
        "mixprec_vs_torchao": ms["mixprec"] / ms["torchao"],
        "mixprec_stats_vs_torchao": ms["mixprec+stats"] / ms["torchao"],
        "torchao_vs_fp32": ms["torchao"] / ms["fp32"],
        "mixprec_vs_fp32": ms["mixprec"] / ms["fp32"],
        "bf16_vs_fp32": ms["bf16"] / ms["fp32"],
        "saved_bytes": {m: {"all": a, "activations": b} for m, (a, b) in saved.items()},
        "saved_ratio_all": saved["mixprec"][0] / saved["torchao"][0],
        "saved_ratio_activations": saved["mixprec"][1] / saved["torchao"][1],
        "saved_ratio_linear": linear_saved["mixprec"] / linear_saved["torchao"],
        "rounds": rounds,
    }
    res["rows"] = _rows(res)
    return res


def _rows(res: dict[str, Any]) -> list[tuple[str, str, float, str, str]]:
    """``(benchmark, figure, ratio, reference, detail)`` rows for ``python -m benchmarks``."""
    ms, saved = res["step_ms"], res["saved_bytes"]
    mib = lambda m, k: saved[m][k] / 2**20  # noqa: E731
    return [
        ("fp8", "training step, fp8 tensorwise", res["mixprec_vs_torchao"], "torchao emulate",
         f"{ms['mixprec']:.1f} vs {ms['torchao']:.1f} ms; fp32 {ms['fp32']:.1f}, bf16 autocast {ms['bf16']:.1f}"),
        ("fp8", "training step, fp8 + guard statistics", res["mixprec_stats_vs_torchao"], "torchao emulate",
         f"{ms['mixprec+stats']:.1f} vs {ms['torchao']:.1f} ms"),
        ("fp8", "saved for backward, one fp8 Linear", res["saved_ratio_linear"], "torchao emulate",
         "fp8 input and weight + scales vs high precision"),
        ("fp8", "saved for backward, whole model", res["saved_ratio_all"], "torchao emulate",
         f"{mib('mixprec', 'all'):.2f} vs {mib('torchao', 'all'):.2f} MiB "
         f"(activations only {res['saved_ratio_activations']:.3f})"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (noisier)")
    res = run(quick=parser.parse_args().quick)
    print(f"step time (median of {res['rounds']} rounds, ms): "
          + ", ".join(f"{m} {v:.2f}" for m, v in res["step_ms"].items()))
    for key in ("mixprec_vs_torchao", "mixprec_stats_vs_torchao", "torchao_vs_fp32", "mixprec_vs_fp32", "bf16_vs_fp32"):
        print(f"{key}: {res[key]:.3f}")
    for m, b in res["saved_bytes"].items():
        print(f"saved for backward, {m}: {b['all'] / 2**20:.2f} MiB ({b['activations'] / 2**20:.2f} MiB activations)")
    print(f"saved bytes mixprec / torchao: {res['saved_ratio_all']:.3f} (activations only: "
          f"{res['saved_ratio_activations']:.3f}; one fp8 Linear: {res['saved_ratio_linear']:.3f})")


if __name__ == "__main__":
    main()
