"""Tensor-parallel programs on the pool's 2 ranks: blocks of ``Linear(w, 2w) -> Tanh -> Linear(2w, w)``
between a head and an output layer, each block's pair sharded with ``ColwiseParallel`` /
``RowwiseParallel`` (or left replicated; with ``sequence``: every block sequence-parallel, its input
and output sharded along the sequence), a recipe, the policy route or ``fp8.convert``, a Guard or a
Controller, blocks skipped on some steps, empty micro-batches, an outlier, a drifting feature.

:func:`run_rank` runs the program four times on each rank: in one process (the whole model on
the rank, no DTensor; both ranks read the same data, so a check's MAX over the group is the one
process's) and over the TP mesh, each with and without the recipe (the run's own gap between a
sharded and an unsharded run, and the recipe's own error)."""

from __future__ import annotations

import copy
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

#: recipe name -> (Guard's underflow limit, the Controller's ladder settings)
TP_RECIPES: dict[str, tuple[float, dict[str, Any]]] = {
    "tensorwise": (0.05, {}), "rowwise": (0.05, {}),
    "mxfp8": (0.05, {"ladder": ("tensorwise", "rowwise", "mxfp8", "compute", "fp32")}),
    "mxfp4": (0.15, {"ladder": ("mxfp4", "tensorwise", "rowwise", "compute")}),
    "nvfp4": (0.15, {"ladder": ("nvfp4", "tensorwise", "rowwise", "compute")}),
}
SEQ = 4  # the sequence length (2 tokens a shard under sequence parallelism)
FORWARD = (0, 1)  # the window rows of the input and the weight
AMAX, PREVIOUS = 0, 4  # the window columns of the amax and the previous cast's amax


@dataclass(frozen=True)
class TPStep:
    skip: frozenset[int] = frozenset()  # blocks left out on this step (the same on both ranks)
    rows: tuple[int, ...] = (2,)  # the batch rows of each micro-batch (0: an empty one)


@dataclass(frozen=True)
class TPProgram:
    width: int  # w: 32 (a multiple of every recipe's block on each shard of 2w)
    blocks: int
    steps: tuple[TPStep, ...]
    recipe: str = "tensorwise"
    route: str = "policy"  # or "convert"
    supervisor: str = "guard"  # or "controller"
    schedule: tuple[tuple[str, Any], ...] = ()  # the supervisor's settings (every, windows, dwell...)
    replicated: frozenset[int] = frozenset()  # blocks not sharded (input and weight replicated)
    sequence: bool = False  # every block sequence-parallel
    outlier: tuple[int, float] | None = None  # (step, value) at element (0, 0, 1) of that step's first batch
    drift: float = 1.0  # input feature 0 grows drift ** step (the casts underflow: decisions)
    seed: int = 0


class TPNet(nn.Module):
    """A head, the blocks (``up``, ``act``, ``down``), an output layer; ``skip``: blocks left out."""

    def __init__(self, w: int, blocks: int) -> None:
        super().__init__()
        self.head, self.out = nn.Linear(w, w), nn.Linear(w, w)
        self.blocks = nn.ModuleList(nn.Sequential(OrderedDict(up=nn.Linear(w, 2 * w), act=nn.Tanh(),
                                                              down=nn.Linear(2 * w, w))) for _ in range(blocks))

    def forward(self, x: torch.Tensor, skip: frozenset[int] = frozenset()) -> torch.Tensor:
        h = self.head(x)
        for i, block in enumerate(self.blocks):
            if i not in skip:
                h = block(h)
        return self.out(h)


def _model(p: TPProgram) -> nn.Module:
    torch.manual_seed(p.seed)
    return TPNet(p.width, p.blocks)


def tp_layers(p: TPProgram) -> list[str]:
    return [f"blocks.{i}.{n}" for i in range(p.blocks) if i not in p.replicated for n in ("up", "down")]


def _plan(p: TPProgram) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                                   RowwiseParallel)

    plan: dict[str, Any] = {}
    for i in range(p.blocks):
        if i in p.replicated:
            continue
        if p.sequence:
            plan[f"blocks.{i}.up"] = ColwiseParallel(input_layouts=Shard(1))
            plan[f"blocks.{i}.down"] = RowwiseParallel(output_layouts=Shard(1))
        else:
            plan[f"blocks.{i}.up"], plan[f"blocks.{i}.down"] = ColwiseParallel(), RowwiseParallel()
    if p.sequence:
        plan["head"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))
        plan["out"] = PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate(),
                                         use_local_output=True)
    return plan


def _batch(p: TPProgram, step: int, micro: int, rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(p.seed * 1000 + step * 10 + micro)
    x = torch.randn(rows, SEQ, p.width, generator=g)
    x[..., 0] *= p.drift ** step
    if p.outlier is not None and p.outlier[0] == step and micro == 0 and rows:
        x[0, 0, 1] = p.outlier[1]
    return x


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _decisions(kind: str, sup: Any) -> list[tuple]:
    if kind == "controller":
        return [(d.step, d.layer, d.operand, d.action, d.to) for d in sup.log]
    return sorted((f.step, f.layer, f.operand, "fallback", f.statistic) for f in sup.decisions.values())


def fp8_setup(p: TPProgram, base: nn.Module, fp8_on: bool, fsdp_fp8_all_gather: bool = False
              ) -> tuple[nn.Module, Any, Any]:
    """A copy of ``base``, the region's policy and the supervisor: ``p``'s recipe on its blocks
    (policy route or ``fp8.convert``, with FSDP2's fp8 all-gather if asked) under a Guard or a
    Controller; without ``fp8_on``, the plain copy, a bf16 policy and no supervisor."""
    from mixprec import Controller, Policy, fp8

    model = copy.deepcopy(base)
    policy = Policy.parse("compute=bf16")
    sup = None
    if fp8_on:
        limit, ladder = TP_RECIPES[p.recipe]
        settings = dict(p.schedule)
        sup = (fp8.Guard(max_underflow=limit, **settings) if p.supervisor == "guard"
               else Controller(**settings, **ladder))
        if p.route == "convert":
            fp8.convert(model, p.recipe, filter_fn=lambda m, fqn: fqn.startswith("blocks."),
                        fsdp_fp8_all_gather=fsdp_fp8_all_gather, **{p.supervisor: sup})
        else:
            sup.attach(model)
            policy = policy.fp8(p.recipe, names=r"^blocks\.", **{p.supervisor: sup.settings})
    return model, policy, sup


def _train(p: TPProgram, base: nn.Module, sharded: bool, fp8_on: bool) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    import mixprec

    model, policy, sup = fp8_setup(p, base, fp8_on)
    if sharded:
        parallelize_module(model, init_device_mesh("cpu", (dist.get_world_size(),)), _plan(p))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def micro_batches(t: int, step: TPStep) -> None:
        for m, rows in enumerate(step.rows):
            with mixprec.autocast("cpu", policy=policy):
                y = model(_batch(p, t, m, rows), step.skip)
            (y.float().square().sum() / 64).backward()

    return train_steps(p, model, opt, sup, fp8_on, micro_batches)


def train_steps(p: TPProgram, model: nn.Module, opt: torch.optim.Optimizer, sup: Any, fp8_on: bool,
                micro_batches: Any) -> dict[str, Any]:
    """Run ``p``'s steps (``micro_batches(t, step)``: the forwards and backwards of step ``t``),
    each followed by the optimizer's and the supervisor's step; what the parent compares."""
    from mixprec import fp8

    windows: list[dict[str, torch.Tensor]] = []
    first: dict[str, torch.Tensor] = {}
    for t, step in enumerate(p.steps):
        micro_batches(t, step)
        if t == 0 and fp8_on:  # the first step's windows, before any check resets them
            states = {n: fp8.layer_state(model.get_submodule(n), create=False) for n in tp_layers(p)}
            windows.append({n: s.window.clone() for n, s in states.items() if s is not None})
        opt.step()
        opt.zero_grad()
        if t == 0:
            first = {n: _full(q.detach()).float().clone() for n, q in model.named_parameters()}
        if sup is not None:
            sup.step()
    weights = {n: _full(q.detach()).float().clone() for n, q in model.named_parameters()}
    return {"weights": weights, "first": first, "windows": windows,
            "decisions": _decisions(p.supervisor, sup) if sup is not None else []}


def run_rank(rank: int, p: TPProgram) -> dict[str, Any]:
    """The program's four runs on this rank (in the pool); plain data for the parent."""
    torch.manual_seed(1234 + rank)  # the ranks' global generators apart: nothing may depend on them
    base = _model(p)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {"single": _train(p, base, False, True), "tp": _train(p, base, True, True),
                "single_plain": _train(p, base, False, False), "tp_plain": _train(p, base, True, False)}
