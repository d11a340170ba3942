"""Which ranks agree is explicit: a 4-rank gloo world split into two 2-rank groups, A = {0, 1} and
B = {2, 3}. A GradScaler, a Guard and a Controller given a group (a ProcessGroup, or a DeviceMesh
dimension) run every collective over it: each group decides on its own, and one group's overflow
or outlier never reaches the other (over the world, the default, every rank would take both). A
rank outside the group it is given gets a ValueError naming the group, never a hang; a shell
holding a group refuses to be pickled (the group is a live object of its process)."""

from __future__ import annotations

import copy
import os
import pickle
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import mixprec
from mixprec import Controller, Policy, fp8

from _distributed import gloo_group, spawn
from _models import fp8_stack

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

GROUPS = ([0, 1], [2, 3])
OUTLIER = {0: "2", 2: "4"}  # rank -> the layer whose input gets an outlier (one rank of each group)
INF = {0: 1, 3: 2}  # rank -> the step at which one of its gradients gets an inf


def _inject(module: nn.Module, args: tuple) -> tuple:
    h = args[0].clone()
    h[0, 0] = 1e6
    return (h,)


def _run_fp8(rank: int, build: Any) -> tuple[nn.Module, Any]:
    """Two steps of ``fp8_stack`` under ``build()``'s Guard or Controller, with this rank's outlier."""
    model = fp8_stack()
    live = build().attach(model)
    kind = "guard" if isinstance(live, fp8.Guard) else "controller"
    policy = Policy.parse("compute=bf16").fp8("tensorwise", first_last="fp8", **{kind: live.settings})
    for step in range(2):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(step))
        layer = OUTLIER.get(rank) if step == 0 else None
        handle = layer and model.get_submodule(layer).register_forward_pre_hook(_inject)
        with mixprec.autocast("cpu", policy=policy):
            model(x).float().square().mean().backward()
        if handle:
            handle.remove()
        model.zero_grad()
        live.step()
    return model, live


def _run_scaler(rank: int, group: Any) -> dict[str, Any]:
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = mixprec.GradScaler("cpu", init_scale=2.0**8, growth_interval=2, process_group=group)
    scales, skipped = [], []
    for step in range(3):
        opt.zero_grad()
        scaler.scale(model(torch.ones(2, 4)).sum()).backward()
        if INF.get(rank) == step:
            model.weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        skipped.append(bool(scaler.last_step_skipped))
        scaler.update()
        scales.append(scaler.get_scale())
    return {"scales": scales, "skipped": skipped}


def _outside_errors(rank: int, other: Any, mesh: Any) -> list[str]:
    """The messages of every shell built on this rank with a group it is not in."""
    messages = []
    for build in (lambda: mixprec.GradScaler("cpu", process_group=other), lambda: fp8.Guard(process_group=other),
                  lambda: Controller(process_group=other), lambda: Controller(process_group=(mesh, "dp"))):
        try:
            build()
        except ValueError as exc:
            messages.append(str(exc))
    return messages


def _worker(rank: int, port: int, out_dir: str) -> None:
    with gloo_group(rank, port, world_size=4):
        groups = [dist.new_group(ranks) for ranks in GROUPS]  # every rank creates every group
        mine, other = (groups[0], groups[1]) if rank < 2 else (groups[1], groups[0])
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))  # dp: {0, 1} and {2, 3}
        half = DeviceMesh("cpu", [[0, 1]], mesh_dim_names=("pp", "dp"))  # ranks 2 and 3 are outside it
        result: dict[str, Any] = {"scaler": _run_scaler(rank, mine)}
        guard_model, guard = _run_fp8(rank, lambda: fp8.Guard(every=1, process_group=mine))
        result["guard"] = sorted(guard.decisions)
        result["guard_flags"] = {n: s.fallback for n, s in fp8.layer_states(guard_model).items()}
        _, ctl = _run_fp8(rank, lambda: Controller(every=1, process_group=(mesh, "dp")))
        result["controller"] = [(d.step, d.layer, d.action, d.to) for d in ctl.log]
        result["outside"] = _outside_errors(rank, other, half) if rank >= 2 else []
        try:
            pickle.dumps(ctl)
        except TypeError as exc:
            result["pickle"] = str(exc)
        result["copy_group"] = copy.deepcopy(ctl).process_group[0] is mesh
        result["default_pickles"] = pickle.loads(pickle.dumps(Controller(every=3))).process_group
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.slow
@pytest.mark.distributed
def test_two_groups_of_a_four_rank_world_decide_on_their_own(tmp_path) -> None:
    try:
        spawn(_worker, str(tmp_path), nprocs=4, timeout=300)  # a hang fails sooner: gloo times out at 120 s
    except TimeoutError:
        pytest.fail("the ranks hung: a collective ran over another group than its peers'")
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(4)]
    for rank, result in enumerate(ranks):
        group_a = rank < 2
        # the scaler: found-inf agrees inside the group, never across (growth_interval=2)
        if group_a:
            assert result["scaler"] == {"skipped": [False, True, False], "scales": [256.0, 128.0, 128.0]}
        else:
            assert result["scaler"] == {"skipped": [False, False, True], "scales": [256.0, 512.0, 256.0]}
        # the guard: the group's outlier only (over the world both layers would fall back)
        layer = "2" if group_a else "4"
        assert result["guard"] == [layer]
        assert result["guard_flags"] == {n: n == layer for n in ("0", "2", "4", "6")}
        # the controller, over the mesh's dp dimension: the same
        assert [(step, name) for step, name, _, _ in result["controller"]] == [(1, layer)]
        assert result["controller"][0][2] == "promote"
        assert "cannot be pickled" in result["pickle"] and "dimension 'dp'" in result["pickle"]
        assert result["copy_group"] and result["default_pickles"] == "default"
    for rank in (2, 3):
        outside = ranks[rank]["outside"]
        assert len(outside) == 4, outside
        for message in outside:
            assert f"global rank {rank}) is not in" in message and "give each rank the group it belongs to" in message
        assert "NON_GROUP_MEMBER" in outside[0] and "DeviceMesh [[0, 1]]" in outside[3]


def test_a_group_in_a_process_without_torch_distributed_says_so() -> None:
    with pytest.raises(TypeError, match=r"process_group=\.\.\.\) must be 'default', a torch.distributed.ProcessGroup"):
        Controller(process_group=[0, 1])
    with pytest.raises(ValueError, match="process_group must be a ProcessGroup, \\(DeviceMesh, dim_name\\)"):
        mixprec.GradScaler("cpu", process_group="world")
    assert Controller().process_group == "default" and fp8.Guard().process_group == "default"
