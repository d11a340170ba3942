"""mixprec.GradScaler across 2 processes (gloo, 127.0.0.1): an inf on one rank makes every rank
skip; scales and weights stay identical. DDP and FSDP2 ``fully_shard``."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from mixprec.scaling import GradScaler

from _distributed import gloo_group, spawn
from _models import mlp

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
]

STEPS = 5
BAD_STEP = 2  # rank 1 alone gets an inf gradient at this step
WORLD = 2


def _model() -> nn.Module:
    # Linear(8, 1): under fully_shard its (1, 8) weight and (1,) bias live on rank 0 only, so
    # rank 1 has empty local gradients for them.
    return mlp(8, 8, 1, act=nn.Tanh)


def _train(model: nn.Module, params: list[nn.Parameter], scaler: GradScaler, rank: int, fsdp: bool) -> dict:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scales, skipped = [], []
    for step in range(STEPS):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))
        loss = model(x).pow(2).mean()
        scaler.scale(loss).backward()
        if step == BAD_STEP and rank == 1:
            grad = params[0].grad
            (grad.to_local() if fsdp else grad).view(-1)[0] = float("inf")
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        scales.append(scaler.get_scale())
        skipped.append(bool(scaler.last_step_skipped))
    weights = [(p.full_tensor() if fsdp else p).detach().clone() for p in params]
    return {"scales": scales, "skipped": skipped, "weights": weights, "skipped_steps": int(scaler.skipped_steps)}


def _worker(rank: int, port: int, scenario: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    with gloo_group(rank, port, WORLD):
        results = {}
        if scenario == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            for group in ("default", None):  # None: the control, ranks are expected to diverge
                model = DDP(_model())
                scaler = GradScaler("cpu", init_scale=2.0**8, growth_interval=2, process_group=group)
                results[group] = _train(model, list(model.parameters()), scaler, rank, fsdp=False)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (WORLD,))
            # process_group=None: DTensor's own rule for the unscale op all-reduces found_inf.
            for group in (dist.group.WORLD, None):
                model = _model()
                for layer in (model[0], model[2]):
                    fully_shard(layer, mesh=mesh)
                fully_shard(model, mesh=mesh)
                scaler = GradScaler("cpu", init_scale=2.0**8, growth_interval=2, process_group=group)
                params = list(model.parameters())
                key = "fsdp" if group is not None else "fsdp-dtensor"
                results[key] = _train(model, params, scaler, rank, fsdp=True)
                results["local_numel"] = [p.to_local().numel() for p in params]
            # A model of which rank 1 holds no element at all: the inf is on rank 0 this time.
            torch.manual_seed(0)
            tiny = nn.Linear(8, 1)
            fully_shard(tiny, mesh=mesh)
            scaler = GradScaler("cpu", init_scale=2.0**8, growth_interval=2, process_group="default")
            results["empty-rank"] = _train(tiny, list(tiny.parameters()), scaler, 1 - rank, fsdp=True)
            results["empty-rank-numel"] = [p.to_local().numel() for p in tiny.parameters()]
        torch.save(results, os.path.join(out_dir, f"{rank}.pt"))


def _spawn(scenario: str, tmp_path) -> list[dict]:
    spawn(_worker, scenario, str(tmp_path), nprocs=WORLD)
    return [torch.load(tmp_path / f"{rank}.pt") for rank in range(WORLD)]


def _check_agreement(r0: dict, r1: dict) -> None:
    expected = [step == BAD_STEP for step in range(STEPS)]
    assert r0["skipped"] == r1["skipped"] == expected
    assert r0["scales"] == r1["scales"]
    assert r0["scales"][BAD_STEP] == r0["scales"][BAD_STEP - 1] / 2
    assert r0["skipped_steps"] == r1["skipped_steps"] == 1
    for a, b in zip(r0["weights"], r1["weights"]):
        assert torch.equal(a, b)
        assert torch.isfinite(a).all()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ddp_ranks_skip_together(tmp_path):
    r0, r1 = _spawn("ddp", tmp_path)
    _check_agreement(r0["default"], r1["default"])
    # Control without a process group: only rank 1 skips and the replicas drift apart.
    c0, c1 = r0[None], r1[None]
    assert c0["skipped"] != c1["skipped"]
    assert not all(torch.equal(a, b) for a, b in zip(c0["weights"], c1["weights"]))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_fsdp2_ranks_skip_together_with_an_empty_local_shard(tmp_path):
    r0, r1 = _spawn("fsdp", tmp_path)
    assert 0 in r1["local_numel"]  # rank 1 holds no elements of the last layer
    _check_agreement(r0["fsdp"], r1["fsdp"])
    _check_agreement(r0["fsdp-dtensor"], r1["fsdp-dtensor"])
    assert r1["empty-rank-numel"] == [0, 0] and 0 not in r0["empty-rank-numel"]
    _check_agreement(r0["empty-rank"], r1["empty-rank"])


def test_pickling_with_a_process_group_says_what_to_do(tmp_path):
    """A ProcessGroup belongs to one process: pickling refuses it (it used to be dropped
    silently), while "default" and the state dict travel."""
    import pickle

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        scaler = GradScaler("cpu", init_scale=8.0, process_group=dist.group.WORLD)
        with pytest.raises(TypeError, match="ProcessGroup.*state_dict"):
            pickle.dumps(scaler)
        restored = GradScaler("cpu", process_group=dist.group.WORLD)
        restored.load_state_dict(scaler.state_dict())
        assert restored.get_scale() == 8.0
        default = pickle.loads(pickle.dumps(GradScaler("cpu", process_group="default")))
        assert default._process_group == "default"
    finally:
        dist.destroy_process_group()


def _dtensor_then_fail(rank: int, port: int, fail: bool) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    with gloo_group(rank, port, WORLD):
        # A DTensor keeps the process group alive inside torch past destroy_process_group: the
        # teardown in _distributed.py must end the process cleanly all the same.
        mesh = init_device_mesh("cpu", (WORLD,))
        assert distribute_tensor(torch.arange(4.0), mesh, [Shard(0)]).full_tensor().tolist() == [0, 1, 2, 3]
        if fail and rank == 1:
            raise RuntimeError("rank 1 fails on purpose")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_workers_end_cleanly_and_a_failing_rank_is_reported():
    spawn(_dtensor_then_fail, False, nprocs=WORLD)
    with pytest.raises(mp.ProcessRaisedException, match="rank 1 fails on purpose"):
        spawn(_dtensor_then_fail, True, nprocs=WORLD)
