"""The runs the tensor-parallel tests compare: a Linear -> (Linear, ReLU, Linear) -> Linear model,
its block sharded with ColwiseParallel ("1.up") and RowwiseParallel ("1.down"), trained 3 SGD
steps in bf16 with an fp8/fp4 recipe (or none), beside the same model in one process (each rank
runs that reference itself: same seed, same data)."""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any

import torch
from torch import nn

import mixprec
from mixprec import Policy, fp8
from mixprec.fp8 import Float8Recipe

STEPS = 3
TP_LAYERS = ("1.up", "1.down")


def recipe_of(name: str) -> Float8Recipe | None:
    """``"fp32"`` (no fp8: None), a recipe name, or ``nvfp4+hadamard`` / ``nvfp4+sr``."""
    if name.startswith("fp32"):
        return None
    base, _, extra = name.partition("+")
    if base == "nvfp4" and extra:
        return Float8Recipe.nvfp4(hadamard=extra == "hadamard", stochastic_rounding=extra == "sr")
    return Float8Recipe.from_name(base)


def features(name: str) -> int:
    """The model's width for case ``name`` (a recipe's, or ``fp32`` / ``fp32-128``: none):
    large enough for the recipe's blocks on 2 shards."""
    recipe = recipe_of(name)
    return 128 if name == "fp32-128" or (recipe is not None and recipe.block_multiple > 32) else 32


def model_for(d: int, seed: int = 0) -> nn.Module:
    """The model, ``d`` features wide (its block ``2 * d``)."""
    torch.manual_seed(seed)
    block = nn.Sequential(OrderedDict(up=nn.Linear(d, 2 * d), act=nn.ReLU(), down=nn.Linear(2 * d, d)))
    return nn.Sequential(nn.Linear(d, d), block, nn.Linear(d, d))


def tp_plan(sequence: bool | str = False) -> dict[str, Any]:
    """The block colwise then rowwise; ``sequence``: its input and output sharded along the
    sequence (dimension 1), gathered before the last layer; ``"fp8"``: the colwise layer gathers
    it itself (``fp8.colwise_sequence_parallel``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                                   RowwiseParallel)

    if not sequence:
        return {"1.up": ColwiseParallel(), "1.down": RowwiseParallel()}
    return {"0": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1)),
            "1.up": fp8.colwise_sequence_parallel() if sequence == "fp8" else ColwiseParallel(input_layouts=Shard(1)),
            "1.down": RowwiseParallel(output_layouts=Shard(1)),
            "2": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate(), use_local_output=True)}


def train(model: nn.Module, recipe: Float8Recipe | None, route: str, d: int) -> dict[str, Any]:
    """3 SGD steps; per step the output, the gradients (full tensors), the windows of the
    block's layers (then reset), and at the end the parameters (full tensors)."""
    policy = Policy.parse("compute=bf16")
    if route == "policy" and recipe is not None:
        policy = policy.fp8(recipe)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    outputs, windows, grads = [], [], []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(1000 + step)
        x = torch.randn(2, 8, d, generator=g)
        x[..., 0] *= 8  # an outlier feature
        with mixprec.autocast("cpu", policy=policy):
            y = model(x)
        y.float().square().mean().backward()
        grads.append({n: _full(p.grad).clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        outputs.append(y.detach().float())
        states = {n: fp8.layer_state(model.get_submodule(n), create=False) for n in TP_LAYERS}
        windows.append({n: st.window.clone() for n, st in states.items() if st is not None})
        for st in states.values():
            if st is not None:
                st.reset()
    params = {n: _full(p.detach()).clone() for n, p in model.named_parameters()}
    return {"outputs": outputs, "windows": windows, "grads": grads, "params": params}


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def compare_case(name: str, route: str, sequence: bool | str = False) -> dict[str, Any]:
    """Both runs of one case on this rank (inside an initialized 2-rank group)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    recipe = recipe_of(name)
    d = features(name)
    single = model_for(d)
    if route == "convert" and recipe is not None:
        fp8.convert(single, recipe, filter_fn=lambda m, fqn: fqn in TP_LAYERS)
    sharded = copy.deepcopy(single)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    parallelize_module(sharded, mesh, tp_plan(sequence))
    ref = train(single, recipe, route, d)
    gathered: list[torch.dtype] = []  # what the layer's own sequence all-gathers moved
    original = dist.all_gather_into_tensor
    dist.all_gather_into_tensor = lambda out, t, *a, **k: gathered.append(t.dtype) or original(out, t, *a, **k)
    try:
        got = train(sharded, recipe, route, d)
    finally:
        dist.all_gather_into_tensor = original
    return {"single": ref, "tp": got, "gathered": gathered}


__all__ = ["compare_case", "recipe_of", "features", "model_for", "train", "tp_plan", "STEPS", "TP_LAYERS"]
