"""The per-GEMM fp4 Controller against hand recipes (issue 39): loss minus fp32's and fp4 share of
the linear layers' GEMM FLOPs, on three models, 3 seeds each.

Models: the demo's ``tiny`` and ``small`` (:mod:`mixprec.demo.model`) and an HF Llama
(``transformers.LlamaForCausalLM``: 4 layers, hidden 64, 4 heads, MLP 176, byte vocabulary;
``llama-<hidden>`` the same at another width: :func:`llama_hidden`), all on the demo's corpus
(:mod:`mixprec.demo.corpus`, the same batches for every config of a seed), AdamW with the demo's schedule (:func:`mixprec.demo.settings.lr_factor`), bf16 compute.
Configs (every fp4 layer NVFP4, emulated in float32 as the demo's fp4 modes run it):

* ``fp32``: float32 weights and compute, the reference;
* ``all-fp4``: every Linear NVFP4;
* ``head-bf16``: every Linear NVFP4 but the language-model head (bf16);
* ``last-bf16``: the last transformer block's Linear layers and the head in bf16 (NeMo's recipe
  keeps the last layers in high precision);
* ``alt-bf16``: every other Linear (in module order, the first included) in bf16;
* ``controller``: every Linear NVFP4 under ``Controller(per_gemm=True, ladder=("nvfp4",
  "tensorwise", "rowwise", "compute"), max_loss_cost=1e-3, max_backward_cost=3.3e-5,
  cost_row_share=0.25)`` (the demo's ``mixprec-fp4``: ``max_backward_cost`` is ``max_loss_cost /
  (every * horizon)``, a per-step cost against a level; ``--max-loss-cost`` (with the backward
  limit following it), ``--max-backward-cost``, ``--cost-row-share`` and ``--cost-scope`` change them);
* ``controller-flush``: the same without ``max_backward_cost`` (backward GEMMs by their flush);
* ``controller-late``: ``controller`` with a late phase (``late_start`` at :data:`LATE_AT` of the
  run, ``late_factor`` :data:`LATE_FACTOR`: the loss-cost limits tightened for the last steps,
  as NVIDIA's NVFP4 recipe moves to higher precision late in training).

Printed per model: each config's final training loss (mean of the last 10% of steps) minus
fp32's, seed by seed (mean ± standard deviation, and the median: a seed whose run turns chaotic moves
the mean, not the median), whether that mean is within fp32's seed spread
(its standard deviation over the seeds), and the fp4 share of GEMM FLOPs (:mod:`mixprec.demo.flops`,
counted step by step); then the issue's bar (:func:`verdict`): the controller's share at least
the best hand recipe's with a loss gap no worse, and >= 85% in fp4 within fp32's spread; then the
controllers' decisions on the first seed. Nothing here is tuned to pass: the figures are what ran.

    PYTHONPATH=src .venv/bin/python benchmarks/controller_quality.py [--steps N] [--seeds 0,1,2]
        [--models tiny,small,llama] [--configs ...] [--max-loss-cost 1e-3] [--max-backward-cost 3.3e-5] [--json out.json]

Each model trains :data:`STEPS` steps unless ``--steps`` says otherwise: tiny 120 (the demo's
preset), small 300 (its preset: at 120 it is on its plateau, where seeds part by 0.05 nats on one
decision), the Llama 60. An fp4 run takes 7-17 s for tiny, 30-50 s for small and 4-11 s for the
Llama on a lightly loaded 2-core CPU (1-4 min under a load of 7-10).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mixprec  # noqa: E402
from mixprec.demo.corpus import batch_offsets, load_tokens, make_batch  # noqa: E402
from mixprec.demo.flops import GemmCounter  # noqa: E402
from mixprec.demo.model import SIZES, TransformerLM, lm_loss  # noqa: E402
from mixprec.demo.modes import (FP4_COST_ROW_SHARE, FP4_LADDER, FP4_MAX_BACKWARD_COST, FP4_MAX_LOSS_COST,  # noqa: E402
                                 FP8_EVERY)
from mixprec.demo.settings import lr_factor  # noqa: E402

CONFIGS = ("fp32", "all-fp4", "head-bf16", "last-bf16", "alt-bf16", "controller", "controller-flush", "controller-late")
CONTROLLERS = ("controller", "controller-flush", "controller-late")
HAND = ("head-bf16", "last-bf16", "alt-bf16")
LADDER = FP4_LADDER
MAX_LOSS_COST = FP4_MAX_LOSS_COST
MAX_BACKWARD_COST = FP4_MAX_BACKWARD_COST  # the demo's: max_loss_cost / (every * horizon)
SEQ = 64
#: each model's training length (``--steps`` overrides it for all): the demo's presets for tiny and
#: small, 60 for the Llama (docs/fp8.md, "The controller against hand recipes")
STEPS = {"tiny": 120, "small": 300, "llama": 60}
#: ``controller-late``: where its late phase starts (a share of the run's steps) and how much it
#: tightens the limits (``Controller(late_start=..., late_factor=...)``)
LATE_AT, LATE_FACTOR = 0.8, 0.1


def llama_hidden(model: str) -> int | None:
    """The hidden size of a Llama model name: ``llama`` (64, the benchmark's) or ``llama-<hidden>``
    (a multiple of 64: its MLP ``11/4`` of it, as ``llama``'s 176, every GEMM's features whole NVFP4
    blocks); None for another model. Raises ValueError for a ``llama-`` name without such a size.

    Example:
        >>> llama_hidden("llama"), llama_hidden("llama-256"), llama_hidden("tiny")
        (64, 256, None)
    """
    if model == "llama":
        return 64
    if not model.startswith("llama-"):
        return None
    size = model.removeprefix("llama-")
    if not size.isdigit() or int(size) <= 0 or int(size) % 64:
        raise ValueError(f"model {model!r}: a Llama's hidden size goes after 'llama-' as a positive multiple of 64 "
                         f"(llama-128, llama-256)")
    return int(size)


def steps_of(model: str) -> int | None:
    """The default training length of ``model`` (:data:`STEPS`; a ``llama-<hidden>``: the Llama's), None: unknown."""
    return STEPS.get("llama" if model.startswith("llama-") else model)


def build(model: str, seed: int) -> tuple[nn.Module, Callable[[nn.Module, torch.Tensor], torch.Tensor], float]:
    """The model (from ``seed``), its logits function and its peak learning rate (``llama-<hidden>``:
    the Llama at another width, :func:`llama_hidden`)."""
    torch.manual_seed(seed)
    hidden = llama_hidden(model)
    if hidden is not None:
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ,
                          tie_word_embeddings=False, attn_implementation="eager")
        return LlamaForCausalLM(cfg), lambda m, x: m(input_ids=x).logits, 2e-3
    cfg = SIZES[model]
    return TransformerLM(cfg), lambda m, x: m(x), 1.25e-3 if model == "tiny" else 2e-3


def linears(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def blocks_of(name: str) -> int | None:
    parts = name.split(".")
    return next((int(p) for p in parts if p.isdigit()), None)


def policy_for(config: str, names: list[str], backward_cost: float = MAX_BACKWARD_COST, steps: int = 0,
               row_share: float = FP4_COST_ROW_SHARE, loss_cost: float = MAX_LOSS_COST,
               scope: str = "gemm") -> tuple[Any, Any]:
    """``(policy, controller or None)`` of a config for a run of ``steps``; the layers it keeps in
    bf16 are the ones its ``names`` pattern leaves out."""
    if config == "fp32":
        return None, None
    head = names[-1]
    last = max(b for b in map(blocks_of, names) if b is not None)
    keep = {"all-fp4": set(), **dict.fromkeys(CONTROLLERS, set()), "head-bf16": {head},
            "last-bf16": {n for n in names if blocks_of(n) == last} | {head},
            "alt-bf16": set(names[::2])}[config]
    fp4 = [n for n in names if n not in keep]
    pattern = "^(" + "|".join(n.replace(".", r"\.") for n in fp4) + ")$"
    ctl = None
    if config.startswith("controller"):
        late = {}
        if config == "controller-late":
            if steps <= 0:
                raise ValueError("policy_for('controller-late', ...): its late phase starts at a share of the run: pass steps=")
            late = {"late_start": int(LATE_AT * steps), "late_factor": LATE_FACTOR}
        ctl = mixprec.Controller(every=FP8_EVERY, ladder=LADDER, per_gemm=True, max_loss_cost=loss_cost,
                                 max_backward_cost=None if config == "controller-flush" else backward_cost,
                                 cost_row_share=row_share, cost_scope=scope, **late)
    policy = mixprec.Policy.parse("compute=bf16").fp8("nvfp4", names=pattern, first_last="fp8", controller=ctl,
                                                      backend="emulate_fp32")
    return policy, ctl


def trainer(model_name: str, config: str, seed: int, steps: int, backward_cost: float = MAX_BACKWARD_COST,
            row_share: float = FP4_COST_ROW_SHARE, loss_cost: float = MAX_LOSS_COST, scope: str = "gemm"
            ) -> tuple[Callable[[torch.Tensor, torch.Tensor], torch.Tensor], nn.Module, Any, Any]:
    """``(step, model, policy, controller)``: a fresh model (from ``seed``) under ``config``'s
    policy and controller (None: none) for a run of ``steps``, and its training step on a batch
    (the forward in the policy's autocast, backward, AdamW and the demo's schedule; returns the
    loss). The caller calls ``controller.step()`` after each (reading what it counts between)."""
    model, logits_of, lr = build(model_name, seed)
    policy, ctl = policy_for(config, linears(model), backward_cost, steps, row_share, loss_cost, scope)
    if ctl is not None:
        ctl.attach(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, steps))

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if policy is None:
            loss = lm_loss(logits_of(model, x), y)
        else:
            with mixprec.autocast("cpu", policy=policy):
                loss = lm_loss(logits_of(model, x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        return loss

    return step, model, policy, ctl


def run(model_name: str, config: str, seed: int, steps: int, batch: int, data: torch.Tensor,
        backward_cost: float = MAX_BACKWARD_COST, row_share: float = FP4_COST_ROW_SHARE,
        loss_cost: float = MAX_LOSS_COST, scope: str = "gemm") -> dict[str, Any]:
    step, model, policy, ctl = trainer(model_name, config, seed, steps, backward_cost, row_share, loss_cost, scope)
    offsets = batch_offsets(len(data), steps, batch, SEQ, seed)
    counter = GemmCounter(model, policy.fp8_rule.recipe_for, batch * SEQ) if policy is not None else None
    losses = []
    start = time.perf_counter()
    for i in range(steps):
        loss = step(*make_batch(data, offsets[i], SEQ, torch.device("cpu")))
        if counter is not None:
            counter.record()
        if ctl is not None:
            ctl.step()
        losses.append(loss.item())
    tail = max(1, steps // 10)
    out = {"final": statistics.fmean(losses[-tail:]), "seconds": time.perf_counter() - start,
           "fp4_share": counter.to_json()["fp4_share"] if counter is not None else 0.0}
    if ctl is not None:
        out["decisions"] = [f"{d.step} {d.layer} {d.gemm} {d.action} {d.from_}->{d.to}: {d.reason}" for d in ctl.log]
    return out


def summarize(results: dict[str, dict[int, dict[str, Any]]]) -> dict[str, Any]:
    base = {s: r["final"] for s, r in results["fp32"].items()}
    spread = statistics.stdev(base.values()) if len(base) > 1 else 0.0
    rows = {}
    for config, runs in results.items():
        diffs = [r["final"] - base[s] for s, r in runs.items() if s in base]
        gap = statistics.fmean(diffs)
        rows[config] = {"gap": gap, "gap_sd": statistics.stdev(diffs) if len(diffs) > 1 else 0.0,
                        "gaps": {str(s): r["final"] - base[s] for s, r in runs.items() if s in base},
                        "gap_median": statistics.median(diffs),
                        "share": statistics.fmean(r["fp4_share"] for r in runs.values()),
                        "within": abs(gap) <= spread, "seconds": statistics.fmean(r["seconds"] for r in runs.values())}
    return {"spread": spread, "base": statistics.fmean(base.values()), "rows": rows}


def verdict(summary: dict[str, Any], controller: str = "controller") -> str:
    """The issue's bar in words: the controller's fp4 share at least the best hand recipe's (the
    one with the most fp4 among those within fp32's spread, else the one with the smallest gap)
    with a loss gap no worse, and >= 85% of GEMM FLOPs in fp4 within fp32's spread; beside the
    two gaps, their difference seed by seed (mean and standard error: what the seeds resolve)."""
    rows = summary["rows"]
    if controller not in rows:
        return ""
    c = rows[controller]
    hands = {h: rows[h] for h in HAND if h in rows}
    if not hands:
        return "no hand recipe ran (--configs): no bar to compare with"
    within = [h for h, r in hands.items() if r["within"]]
    best = max(within, key=lambda h: hands[h]["share"]) if within else min(hands, key=lambda h: hands[h]["gap"])
    b = hands[best]
    beats = c["share"] >= b["share"] and c["gap"] <= b["gap"]
    bar = c["share"] >= 0.85 and c["within"]
    seeds = sorted(set(c.get("gaps", {})) & set(b.get("gaps", {})))
    paired = [c["gaps"][s] - b["gaps"][s] for s in seeds]
    noise = (f" (paired, seed by seed: {statistics.fmean(paired):+.4f} ± "
             f"{statistics.stdev(paired) / len(paired) ** 0.5:.4f} standard error)") if len(paired) > 1 else ""
    return (f"best hand recipe {best} ({b['share']:.1%}, {b['gap']:+.4f}); {controller}: {c['share']:.1%}, "
            f"{c['gap']:+.4f}{noise}: {'beats it' if beats else 'does NOT beat it'}; >= 85% within fp32's spread: "
            f"{'met' if bar else 'NOT met'}")


def table(model: str, summary: dict[str, Any]) -> str:
    lines = [f"{model}: fp32 final {summary['base']:.4f}, seed spread (sd) {summary['spread']:.4f}",
             "| config | loss - fp32 (mean ± sd) | median | within spread | fp4 share of GEMM FLOPs | s/run |",
             "| --- | --- | --- | --- | --- | --- |"]
    for config, r in summary["rows"].items():
        lines.append(f"| {config} | {r['gap']:+.4f} ± {r['gap_sd']:.4f} | {r['gap_median']:+.4f} | {'yes' if r['within'] else 'no'} | "
                     f"{r['share']:.1%} | {r['seconds']:.0f} |")
    for ctl in CONTROLLERS:
        if ctl in summary["rows"]:
            lines.append(f"{ctl}: " + verdict(summary, ctl))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tiny,small,llama")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=None, help="every model's steps (default: STEPS, per model)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--json", default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-loss-cost", type=float, default=MAX_LOSS_COST,
                    help="the controller configs' Controller.max_loss_cost (nats; the demo's 1e-3); without "
                         "--max-backward-cost, max_backward_cost follows it as the demo's does")
    ap.add_argument("--max-backward-cost", type=float, default=None,
                    help="the controller config's Controller.max_backward_cost (nats per step; default "
                         "max_loss_cost / (every * horizon), the demo's 3.3e-5)")
    ap.add_argument("--cost-row-share", type=float, default=FP4_COST_ROW_SHARE,
                    help="the controller configs' Controller.cost_row_share (1: every row)")
    ap.add_argument("--cost-scope", default="gemm", choices=("gemm", "model"),
                    help="the controller configs' Controller.cost_scope (model: the limits are the whole model's, "
                         "shared out by FLOPs)")
    args = ap.parse_args(argv)
    if args.max_backward_cost is None:
        args.max_backward_cost = args.max_loss_cost * MAX_BACKWARD_COST / MAX_LOSS_COST
    models = args.models.split(",")
    for m in models:
        try:
            llama_hidden(m)
        except ValueError as e:
            ap.error(str(e))
    unknown = [m for m in models if steps_of(m) is None]
    if unknown:
        ap.error(f"unknown model(s) {', '.join(unknown)}: choose from {', '.join(STEPS)} (or llama-<hidden>)")
    torch.set_num_threads(args.threads)
    train, _ = load_tokens()
    seeds = [int(s) for s in args.seeds.split(",")]
    configs = args.configs.split(",")
    if "fp32" not in configs:
        configs = ["fp32", *configs]
    out: dict[str, Any] = {"steps": {m: args.steps or steps_of(m) for m in models}, "batch": args.batch, "seeds": seeds,
                           "models": {}, "max_loss_cost": args.max_loss_cost, "max_backward_cost": args.max_backward_cost,
                           "cost_row_share": args.cost_row_share, "cost_scope": args.cost_scope}
    for model in models:
        results: dict[str, dict[int, dict[str, Any]]] = {c: {} for c in configs}
        for seed in seeds:
            for config in configs:
                results[config][seed] = run(model, config, seed, out["steps"][model], args.batch, train,
                                            args.max_backward_cost, args.cost_row_share, args.max_loss_cost,
                                            args.cost_scope)
                print(f"# {model} seed {seed} {config}: {results[config][seed]['final']:.4f} "
                      f"fp4 {results[config][seed]['fp4_share']:.1%} ({results[config][seed]['seconds']:.0f} s)",
                      flush=True)
        summary = summarize(results)
        out["models"][model] = {"summary": summary, "runs": results}
        print(table(model, summary), flush=True)
        for ctl in CONTROLLERS:
            for seed in seeds[:1]:
                for d in results.get(ctl, {}).get(seed, {}).get("decisions", []):
                    print(f"  {ctl} seed {seed}: {d}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
