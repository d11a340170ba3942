"""Data x tensor parallel programs on the pool's 4 ranks: the blocks of ``_adv_tp.TPNet`` sharded
colwise/rowwise over the ``tp`` dimension of a 2x2 mesh, then ``fully_shard`` (FSDP2) over ``dp``
(each block, then the root), with a recipe, the policy route or ``fp8.convert`` (tensorwise with
FSDP2's fp8 all-gather where drawn), a Guard or a Controller, blocks skipped on some steps, empty
micro-batches, an outlier on one data-parallel rank, a data-parallel rank that lags.

:func:`run_rank` trains the program over the mesh, and in one process: both data-parallel
ranks' batches as the micro-batches of one step (FSDP2 averages the gradients over ``dp``; one
process halves each loss), each cast on its own (as each data-parallel rank casts its own), so
a check's MAX over every rank is the one process's. Each run with and without the recipe (the
run's own gap between the mesh and one process, and the recipe's own error)."""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from _adv_tp import TPProgram, _batch, _model, _plan, fp8_setup, train_steps

DP = 2  # the mesh is (dp, tp) = (2, 2)


@dataclass(frozen=True)
class DPTPProgram:
    tp: TPProgram  # the model, steps, recipe, route, supervisor and schedule (``sequence`` False)
    fp8_all_gather: bool = False  # fp8.convert's fsdp_fp8_all_gather (tensorwise, convert route)
    lag: tuple[int, float] | None = None  # (step, seconds) data-parallel rank 1 sleeps before its forward
    outlier_rank: int = 0  # the data-parallel rank whose batch carries the program's outlier


def _dp_batch(p: DPTPProgram, step: int, micro: int, rows: int, dp_rank: int) -> torch.Tensor:
    q = p.tp
    x = _batch(TPProgram(**{**q.__dict__, "seed": q.seed * 7 + dp_rank, "outlier": None}), step, micro, rows)
    if q.outlier is not None and dp_rank == p.outlier_rank and q.outlier[0] == step and micro == 0 and rows:
        x[0, 0, 1] = q.outlier[1]
    return x


def _train(p: DPTPProgram, base: nn.Module, mesh_run: bool, fp8_on: bool) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    import mixprec

    q = p.tp
    model, policy, sup = fp8_setup(q, base, fp8_on, p.fp8_all_gather and mesh_run)
    dp_rank = None
    if mesh_run:
        mesh = init_device_mesh("cpu", (DP, dist.get_world_size() // DP), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], _plan(q))
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        dp_rank = mesh["dp"].get_local_rank()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def micro_batches(t: int, step: Any) -> None:
        if mesh_run and p.lag is not None and p.lag[0] == t and dp_rank == 1:
            time.sleep(p.lag[1])
        for r in ([dp_rank] if mesh_run else range(DP)):  # one process: every data-parallel rank's batches
            for m, rows in enumerate(step.rows):
                with mixprec.autocast("cpu", policy=policy):
                    y = model(_dp_batch(p, t, m, rows, r), step.skip)
                loss = y.float().square().sum() / 64
                (loss if mesh_run else loss / DP).backward()  # (FSDP2 averages over dp)

    return train_steps(q, model, opt, sup, fp8_on, micro_batches)


def run_rank(rank: int, p: DPTPProgram) -> dict[str, Any]:
    """The program's four runs on this rank (in the pool); plain data for the parent."""
    torch.manual_seed(1234 + rank)  # the ranks' global generators apart: nothing may depend on them
    base = _model(p.tp)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {"single": _train(p, base, False, True), "mesh": _train(p, base, True, True),
                "single_plain": _train(p, base, False, False), "mesh_plain": _train(p, base, True, False)}
