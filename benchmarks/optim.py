"""Low-precision optimizers side by side: step time, bytes per parameter, final loss (not a test).

Every recipe runs in the same process, on the same parameters and gradients:

* the reference, ``torch.optim.AdamW(foreach=True)`` (``SGD(momentum=0.9, foreach=True)``) on
  float32 weights;
* torch's fused AdamW/SGD on float32 weights (a second reference, 2-4x faster on the CPU);
* ``mixprec.optim.AdamW``/``SGD`` on bfloat16 weights: ``compensation="exact"``, ``"kahan"``,
  ``"stochastic"``, with float32 (default), bfloat16 or 8-bit moments; by default (mixprec's
  one-pass C++ kernel), ``foreach=True`` (torch's foreach arithmetic), ``foreach=True`` under
  ``torch.compile(opt.step, fullgraph=True)`` (Inductor; compiled on the first step, excluded from
  the times; not in ``--quick``), or ``fused=True`` (bf16 state: working copies);
* peers when they are installed (the ``bench`` extra), bfloat16 weights: torch-optimi's AdamW/SGD
  with Kahan summation (foreach), torchao's ``_AdamW`` and ``AdamW8bit`` with bf16 stochastic
  rounding (each parameter shape is ``torch.compile``d on its first step; not in ``--quick``).

Figures:

* **step time**, ``optimizer.step()`` alone (gradients preset), on the tiny LM's parameters
  (5 tensors, 97K elements) and on a 4.2M-parameter stack (4 x 1024x1024 + biases), one thread;
  every round times each recipe once, interleaved, and the figure is the median over rounds of
  the per-round ratio to the reference;
* **bytes/param**: parameters plus optimizer state, from the tensors' storages (torchao's
  quantized states through their inner tensors), after one step;
* **loss**: a tiny character-level LM (4-token context, embedding 96x64, MLP 256 -> 256 -> 96)
  on a synthetic sparse-bigram text, AdamW lr 1e-4 (SGD: lr 0.05), eval loss after training, as
  a ratio to fp32's. The forward computes in float32 from the stored weights, so recipes differ
  only in how weights and state are stored and updated. At lr 1e-4 a bf16 weight of magnitude
  0.06 drops every update (half a gap is 1.2e-4): naive bf16 stalls.

    python benchmarks/optim.py [--quick]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import mixprec

VOCAB, DIM, HIDDEN, CONTEXT = 96, 64, 256, 4
LARGE_SHAPES = [(1024, 1024)] * 4 + [(1024,)] * 4


@dataclass(frozen=True)
class Recipe:
    """One optimizer setup: ``make(params)`` on weights of ``dtype``; ``peer`` names the package."""

    kind: str  # "AdamW" or "SGD"
    label: str
    dtype: torch.dtype
    make: Callable[[list[Tensor]], torch.optim.Optimizer]
    peer: Optional[str] = None
    compiles: bool = False


class _CompiledStep:
    """An optimizer whose ``step()`` is ``torch.compile(opt.step)`` (compiled on the first call)."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        # each optimizer compiles the shared step code for itself (as torch.optim's do): more
        # than Dynamo's default 8 versions in one benchmark run
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self.opt, self.state = opt, opt.state
        self.step = torch.compile(opt.step, fullgraph=True)

    def zero_grad(self) -> None:
        self.opt.zero_grad()


def _mixprec(kind: str, how: str = "default", **kw: Any) -> Callable[[list[Tensor]], Any]:
    """``how``: "default" (no flags: the C++ kernel where it applies), "foreach", "fused", or
    "compiled" (foreach=True under torch.compile)."""
    flags = {"default": {}, "foreach": dict(foreach=True), "fused": dict(fused=True),
             "compiled": dict(foreach=True)}[how]
    kw = dict(generator=torch.Generator().manual_seed(0), **flags, **kw)
    if kind == "AdamW":
        make = lambda ps: mixprec.optim.AdamW(ps, lr=1e-4, **kw)  # noqa: E731
    else:
        make = lambda ps: mixprec.optim.SGD(ps, lr=0.05, momentum=0.9, **kw)  # noqa: E731
    return (lambda ps: _CompiledStep(make(ps))) if how == "compiled" else make


def _recipes() -> list[Recipe]:
    bf16, fp32 = torch.bfloat16, torch.float32
    sr = dict(compensation="stochastic")
    exact, kahan = dict(compensation="exact"), dict(compensation="kahan")
    return [
        Recipe("AdamW", "fp32 AdamW (foreach)", fp32, lambda ps: torch.optim.AdamW(ps, lr=1e-4, foreach=True)),
        Recipe("AdamW", "fp32 AdamW (fused)", fp32, lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True)),
        Recipe("AdamW", "mixprec exact (default: C++ kernel)", bf16, _mixprec("AdamW", **exact)),
        Recipe("AdamW", "mixprec exact (foreach)", bf16, _mixprec("AdamW", "foreach", **exact)),
        Recipe("AdamW", "mixprec exact (foreach, torch.compile)", bf16, _mixprec("AdamW", "compiled", **exact),
               compiles=True),
        Recipe("AdamW", "mixprec Kahan (default: C++ kernel)", bf16, _mixprec("AdamW", **kahan)),
        Recipe("AdamW", "mixprec Kahan (foreach)", bf16, _mixprec("AdamW", "foreach", **kahan)),
        Recipe("AdamW", "mixprec Kahan (foreach, torch.compile)", bf16, _mixprec("AdamW", "compiled", **kahan),
               compiles=True),
        Recipe("AdamW", "mixprec stochastic rounding (default: C++ kernel)", bf16, _mixprec("AdamW", **sr)),
        Recipe("AdamW", "mixprec stochastic rounding (foreach)", bf16, _mixprec("AdamW", "foreach", **sr)),
        Recipe("AdamW", "mixprec SR, bf16 state (fused)", bf16, _mixprec("AdamW", "fused", state_dtype=bf16, **sr)),
        Recipe("AdamW", "mixprec SR, 8-bit state (default: C++ kernel)", bf16,
               _mixprec("AdamW", state_dtype="8bit", **sr)),
        Recipe("AdamW", "mixprec exact, 8-bit state (default: C++ kernel)", bf16,
               _mixprec("AdamW", state_dtype="8bit", **exact)),
        Recipe("AdamW", "naive bf16 (torch AdamW, foreach)", bf16,
               lambda ps: torch.optim.AdamW(ps, lr=1e-4, foreach=True)),
        Recipe("AdamW", "optimi AdamW Kahan (foreach)", bf16,
               lambda ps: _optimi().AdamW(ps, lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                                          kahan_sum=True, foreach=True), "optimi"),
        Recipe("AdamW", "torchao AdamW bf16 SR", bf16,
               lambda ps: _torchao()._AdamW(ps, lr=1e-4, bf16_stochastic_round=True), "torchao", True),
        Recipe("AdamW", "torchao AdamW8bit bf16 SR", bf16,
               lambda ps: _torchao().AdamW8bit(ps, lr=1e-4, bf16_stochastic_round=True), "torchao", True),
        Recipe("SGD", "fp32 SGD (foreach)", fp32, lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, foreach=True)),
        Recipe("SGD", "fp32 SGD (fused)", fp32, lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, fused=True)),
        Recipe("SGD", "mixprec exact (default: C++ kernel)", bf16, _mixprec("SGD", **exact)),
        Recipe("SGD", "mixprec exact (foreach)", bf16, _mixprec("SGD", "foreach", **exact)),
        Recipe("SGD", "mixprec Kahan (default: C++ kernel)", bf16, _mixprec("SGD", **kahan)),
        Recipe("SGD", "mixprec Kahan (foreach)", bf16, _mixprec("SGD", "foreach", **kahan)),
        Recipe("SGD", "mixprec Kahan (foreach, torch.compile)", bf16, _mixprec("SGD", "compiled", **kahan),
               compiles=True),
        Recipe("SGD", "mixprec stochastic rounding (default: C++ kernel)", bf16, _mixprec("SGD", **sr)),
        Recipe("SGD", "optimi SGD Kahan (foreach)", bf16,
               lambda ps: _optimi().SGD(ps, lr=0.05, momentum=0.9, torch_init=True, kahan_sum=True, foreach=True),
               "optimi"),
    ]


def _optimi() -> Any:
    import optimi

    return optimi


def _torchao() -> Any:
    import torchao.optim

    return torchao.optim


# -- the tiny LM -------------------------------------------------------------------------------
class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.l1 = nn.Linear(CONTEXT * DIM, HIDDEN)
        self.l2 = nn.Linear(HIDDEN, VOCAB)
        with torch.no_grad():
            self.emb.weight.mul_(0.1)

    def forward(self, x: Tensor) -> Tensor:  # float32 compute from the stored weights
        h = F.embedding(x, self.emb.weight.float()).flatten(1)
        h = F.gelu(F.linear(h, self.l1.weight.float(), self.l1.bias.float()))
        return F.linear(h, self.l2.weight.float(), self.l2.bias.float())


def _text(n: int = 40_000) -> Tensor:
    """A sparse-bigram text: each token is followed by one of 3 tokens, with fixed odds."""
    g = torch.Generator().manual_seed(0)
    successors = torch.randint(0, VOCAB, (VOCAB, 3), generator=g)
    odds = torch.tensor([0.6, 0.3, 0.1])
    text = torch.empty(n, dtype=torch.long)
    text[0] = 0
    picks = torch.multinomial(odds, n, replacement=True, generator=g)
    for i in range(1, n):
        text[i] = successors[text[i - 1], picks[i]]
    return text


def _windows(text: Tensor, starts: Tensor) -> tuple[Tensor, Tensor]:
    idx = starts.unsqueeze(1) + torch.arange(CONTEXT + 1)
    w = text[idx]
    return w[:, :CONTEXT], w[:, CONTEXT]


def _model(dtype: torch.dtype) -> TinyLM:
    torch.manual_seed(1)
    return TinyLM().to(dtype)


def train_loss(recipe: Recipe, steps: int, text: Tensor) -> float:
    """Eval loss of the tiny LM after ``steps`` steps of ``recipe`` (batch 64)."""
    model = _model(recipe.dtype)
    opt = recipe.make(list(model.parameters()))
    g = torch.Generator().manual_seed(2)
    train, held = text[:30_000], text[30_000:]
    for _ in range(steps):
        x, y = _windows(train, torch.randint(0, train.numel() - CONTEXT - 1, (64,), generator=g))
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    x, y = _windows(held, torch.arange(0, 1024 * 9, 9))
    with torch.no_grad():
        return F.cross_entropy(model(x), y).item()


# -- step time and bytes ---------------------------------------------------------------------
def _params(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    out = []
    for shape in shapes:
        p = nn.Parameter((torch.randn(shape, generator=g) * 0.05).to(dtype))
        p.grad = (torch.randn(shape, generator=g) * 1e-3).to(dtype)
        out.append(p)
    return out


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer state's storages, each once; tensor subclasses (torchao's
    quantized states) through their inner tensors."""
    seen: set[int] = set()

    def size(t: Any) -> int:
        if isinstance(t, dict):
            return sum(size(v) for v in t.values())
        if not isinstance(t, Tensor):
            return 0
        if hasattr(t, "__tensor_flatten__") and type(t) is not Tensor and type(t) is not nn.Parameter:
            names, _ = t.__tensor_flatten__()
            return sum(size(getattr(t, n)) for n in names)
        storage = t.untyped_storage()
        if storage.data_ptr() in seen:
            return 0
        seen.add(storage.data_ptr())
        return storage.nbytes()

    return sum(size(s) for s in opt.state.values())


Figures = dict[str, float]


def _time_steps(recipes: list[Recipe], shapes: list[tuple[int, ...]], rounds: int) -> tuple[Figures, Figures, Figures]:
    """Median per-round ratio to the first recipe, median ms, and bytes/param, per label."""
    opts = {}
    numel = sum(torch.Size(s).numel() for s in shapes)
    bytes_pp = {}
    for r in recipes:
        params = _params(shapes, r.dtype)
        opt = r.make(params)
        for _ in range(3):  # warm-up: state creation, torchao's compilation
            opt.step()
        opts[r.label] = opt
        bytes_pp[r.label] = (sum(p.untyped_storage().nbytes() for p in params) + _state_bytes(opt)) / numel
    times: dict[str, list[float]] = {label: [] for label in opts}
    for _ in range(rounds):
        for label, opt in opts.items():
            start = time.perf_counter()
            opt.step()
            times[label].append(time.perf_counter() - start)
    ref = times[recipes[0].label]
    ratios = {k: statistics.median(t / r for t, r in zip(v, ref)) for k, v in times.items()}
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return ratios, ms, bytes_pp


def measure(quick: bool = False) -> dict[str, Any]:
    """Every available recipe: step-time ratios (tiny LM, 4.2M), bytes/param, loss vs fp32."""
    steps = 50 if quick else 2000
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    missing: dict[str, str] = {}
    recipes = []
    for r in _recipes():
        if r.peer is not None and importlib.util.find_spec(r.peer) is None:
            missing[r.label] = f"{r.peer} is not installed (pip install mixprec[bench])"
        elif quick and r.compiles:
            missing[r.label] = "skipped in --quick (compiles on its first step)"
        else:
            recipes.append(r)
    small_shapes = [tuple(p.shape) for p in TinyLM().parameters()]
    try:
        text = _text()
        results: dict[str, Any] = {"missing": missing, "steps": steps, "recipes": {}}
        for kind in ("AdamW", "SGD"):
            group = [r for r in recipes if r.kind == kind]
            small, small_ms, _ = _time_steps(group, small_shapes, 5 if quick else 200)
            large, large_ms, bytes_pp = _time_steps(group, LARGE_SHAPES, 2 if quick else 25)
            losses = {r.label: train_loss(r, steps, text) for r in group}
            ref = losses[group[0].label]
            for r in group:
                results["recipes"][(kind, r.label)] = {
                    "step_ratio_small": small[r.label],
                    "step_ratio_large": large[r.label],
                    "step_ms_small": small_ms[r.label],
                    "step_ms_large": large_ms[r.label],
                    "bytes_per_param": bytes_pp[r.label],
                    "loss": losses[r.label],
                    "loss_vs_fp32": losses[r.label] / ref,
                }
    finally:
        torch.set_num_threads(threads)
    return results


def run(quick: bool = False) -> dict[str, Any]:
    """:func:`measure`, plus ``rows`` for ``python -m benchmarks`` (step time on the 4.2M stack)."""
    res = measure(quick)
    rows = []
    for (kind, label), r in res["recipes"].items():
        ref = "fp32 torch.optim." + kind + " (foreach)"
        rows.append((
            "optim", f"{kind} step time, {label}", r["step_ratio_large"], ref,
            f"{r['bytes_per_param']:.2f} B/param, loss {r['loss_vs_fp32']:.3f}x fp32's, "
            f"tiny-LM step {r['step_ratio_small']:.2f}x",
        ))
    res["rows"] = rows
    return res


def format_table(res: dict[str, Any]) -> str:
    """A markdown table of :func:`measure`'s results, and the peers that did not run."""
    lines = [
        "| optimizer | recipe | loss / fp32 (tiny LM) | bytes/param (params+state) "
        "| step time / fp32 (tiny LM / 4.2M) | ms (tiny LM / 4.2M) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for (kind, label), r in res["recipes"].items():
        lines.append(
            f"| {kind} | {label} | {r['loss_vs_fp32']:.3f} | {r['bytes_per_param']:.2f} | "
            f"{r['step_ratio_small']:.2f} / {r['step_ratio_large']:.2f} | "
            f"{r['step_ms_small']:.2f} / {r['step_ms_large']:.1f} |"
        )
    lines.append(f"\n{res['steps']} training steps.")
    for label, why in res["missing"].items():
        lines.append(f"- not run: {label}: {why}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and rounds, no torchao")
    args = parser.parse_args()
    print(format_table(measure(quick=args.quick)))


if __name__ == "__main__":
    main()
