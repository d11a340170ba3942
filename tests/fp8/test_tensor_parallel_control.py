"""A Controller or a Guard over tensor-parallel fp8 layers decides the same on every rank: 2 gloo ranks
(ColwiseParallel and RowwiseParallel, the policy route), and 4 ranks on a 2x2 FSDP2 x TP mesh
(``fp8.convert`` with FSDP2's fp8 all-gather, whose weight scale is reduced over both mesh
dimensions), one data-parallel rank lagging behind the others (a sleep: no hang). An input
feature drifts up until the layers' grad_output underflows or overflows: every rank promotes (the
Controller) or falls back (the Guard) the same layers at the same step. Also what is refused: a block that would straddle two shards, a layout other
than colwise or rowwise."""

from __future__ import annotations

import os
import re
import time
import warnings

import pytest
import torch
import torch.distributed as dist

from _distributed import gloo_group, spawn

pytestmark = [pytest.mark.slow, pytest.mark.distributed,
              pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")]

STEPS = 10


def _refusals() -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from mixprec import fp8

    mesh = init_device_mesh("cpu", (2,))
    x, w = torch.randn(4, 32), torch.randn(32, 32)
    errors = []
    for xp, wp, recipe in ((Replicate(), Shard(0), "mxfp8"), (Shard(1), Shard(0), "tensorwise")):
        try:
            fp8.linear(distribute_tensor(x, mesh, [xp]), distribute_tensor(w, mesh, [wp]),
                       recipe=fp8.Float8Recipe.from_name(recipe))
        except ValueError as e:
            errors.append(str(e))
    return errors


def _worker(rank: int, port: int, out_dir: str, two_d: bool, kind: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    import mixprec
    from mixprec import Controller, Policy, fp8
    from mixprec.fp8 import Guard
    from _tp_cases import TP_LAYERS, model_for, tp_plan

    world = 4 if two_d else 2
    with gloo_group(rank, port, world):
        torch.set_num_threads(1)
        warnings.simplefilter("ignore")
        model = model_for(32)
        ctl = (Controller(every=1, trend_windows=1, min_dwell=1, demote_windows=1) if kind == "controller"
               else Guard(every=1))
        policy = Policy.parse("compute=bf16")
        gathered = []
        if two_d:
            from torch.distributed.fsdp import fully_shard

            fp8.convert(model, "tensorwise", filter_fn=lambda m, fqn: fqn in TP_LAYERS, fsdp_fp8_all_gather=True,
                        **{kind: ctl})
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            parallelize_module(model, mesh["tp"], tp_plan())
            fully_shard(model[1], mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
            model[1].up.register_forward_pre_hook(
                lambda m, args: gathered.append(type(m.weight._local_tensor).__name__))
            dp_rank = mesh["dp"].get_local_rank()
        else:
            ctl.attach(model)
            policy = policy.fp8("tensorwise", **{kind: ctl.settings})
            parallelize_module(model, init_device_mesh("cpu", (2,)), tp_plan())
            dp_rank = 0
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        for step in range(STEPS):
            x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(step + 100 * dp_rank))
            x[..., 0] *= 4.0 ** step  # a drifting input feature
            if two_d and dp_rank == 1 and step == 3:
                time.sleep(2)  # a lagging data-parallel rank
            with mixprec.autocast("cpu", policy=policy):
                y = model(x)
            y.float().square().mean().backward()
            opt.step()
            opt.zero_grad()
            ctl.step()
        if kind == "controller":
            log, precisions = [(d.step, d.layer, d.operand, d.action, d.to) for d in ctl.log], ctl.precisions()
        else:
            log = sorted((f.step, f.layer, f.operand, "fallback", f.statistic) for f in ctl.decisions.values())
            precisions = sorted(ctl.decisions)
        result = {"log": log, "precisions": precisions, "gathered": gathered,
                  "refusals": [] if two_d else _refusals()}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.parametrize("two_d, kind", [(False, "controller"), (True, "controller"), (False, "guard"), (True, "guard")],
                         ids=["tp2-controller", "fsdp2x2tp-controller", "tp2-guard", "fsdp2x2tp-guard"])
def test_decisions_are_the_same_on_every_rank(tmp_path, two_d: bool, kind: str) -> None:
    world = 4 if two_d else 2
    spawn(_worker, str(tmp_path), two_d, kind, nprocs=world, timeout=300)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    log = ranks[0]["log"]
    assert any(action in ("promote", "fallback") for *_, action, _ in log), log
    for r in ranks[1:]:
        assert r["log"] == log and r["precisions"] == ranks[0]["precisions"]
    if two_d:  # the layer read the weight FSDP2's fp8 all-gather brought, on every step
        assert all(r["gathered"] == ["GatheredFloat8Weight"] * STEPS for r in ranks), ranks[0]["gathered"]
    else:
        straddle, layout = ranks[0]["refusals"]
        assert "16 out features per shard, not a multiple of 32" in straddle and "mesh" in straddle
        assert "straddle" in straddle
        assert "RowwiseParallel" in layout and "got input S(1), weight S(0)" in layout


#: ``(recipe, ladder, floor, per_gemm, sample)``: the rung below a layer's recipe measured by its
#: probe: tensorwise's tensor scales (every element sampled), rowwise's row scales over the in
#: features (strided rows), NVFP4's tensor scale and blocks, and each GEMM's own casts and the
#: rung below's (``per_gemm``)
SHADOW_CASES = (("rowwise", ("tensorwise", "rowwise", "compute", "fp32"), "tensorwise", False, 100000),
                ("rowwise_with_gw_hp", ("tensorwise", "rowwise", "rowwise_with_gw_hp", "compute", "fp32"), "tensorwise",
                 False, 256),
                ("tensorwise", ("nvfp4", "tensorwise", "rowwise", "compute", "fp32"), "nvfp4", False, 256),
                ("rowwise", ("tensorwise", "rowwise", "compute", "fp32"), "tensorwise", True, 256))


def _shadow_worker(rank: int, port: int, out_dir: str) -> None:
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    import mixprec
    from mixprec import Controller, Policy
    from _tp_cases import model_for, tp_plan

    with gloo_group(rank, port, 2):
        torch.set_num_threads(1)
        warnings.simplefilter("ignore")
        results = []
        for recipe, ladder, floor, per_gemm, sample in SHADOW_CASES:
            single = model_for(32)
            with torch.no_grad():  # shards of unequal range: each rank's own scales differ from the whole's
                single[1].up.weight[:8] *= 50.0
                single[1].down.weight[:, 32:] *= 1e-3
            sharded = copy.deepcopy(single)
            parallelize_module(sharded, init_device_mesh("cpu", (2,)), tp_plan())
            windows = []
            for model in (single, sharded):
                seen = {}  # each layer's output gradient (the sharded colwise layer's: its shard's columns)
                for name in ("up", "down"):
                    model[1].get_submodule(name).register_forward_hook(
                        lambda m, args, out, name=name: out.register_hook(
                            lambda g: seen.__setitem__(f"1.{name}", g.detach().clone())) and None)
                ctl = Controller(every=2, ladder=ladder, floor=floor, per_gemm=per_gemm, sample=sample).attach(model)
                policy = Policy.parse("compute=bf16").fp8(recipe, controller=ctl.settings)
                x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(7))
                with mixprec.autocast("cpu", policy=policy):
                    y = model(x)
                # a linear loss: the output's gradient does not see the rowwise reduce order's last bits
                (y.float() * torch.randn(y.shape, generator=torch.Generator().manual_seed(8))).sum().backward()
                recs = {n: ctl._layers[n] for n in ("1.up", "1.down")}
                windows.append({n: ((r.gemm_windows if per_gemm else r.shadow).clone(), seen[n]) for n, r in recs.items()})
            results.append(windows)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.parametrize("run", range(3))
def test_probe_shadows_are_one_process_s(tmp_path, run: int) -> None:
    """A Controller's probe on a ColwiseParallel and a RowwiseParallel layer measures the rung
    below's casts (and, per GEMM, its own) as one process measures them on the whole operands:
    the whole tensor's amax in a tensor scale (also NVFP4's), whole rows in a row scale over the
    sharded in features, the one process's sample of rows. Every rank's shadow windows are bitwise
    those of the same model in one process, though each shard alone has another range."""
    spawn(_shadow_worker, str(tmp_path), nprocs=2, timeout=300)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    grads = 0
    for case, *per_rank in zip(SHADOW_CASES, *ranks):
        for rank, (single, sharded) in enumerate(per_rank):
            for name in ("1.up", "1.down"):
                (want, grad_single), (got, grad_tp) = single[name], sharded[name]
                if name == "1.up":
                    grad_single = grad_single.chunk(2, dim=-1)[rank]
                assert want.abs().sum() > 0, (case, name)  # (measured)
                # the gradient's entries: where the gradient itself is the one process's (a sharded
                # GEMM after the layer may round a last bit otherwise)
                grad = torch.zeros_like(want, dtype=torch.bool)
                if case[3]:
                    grad[:, 1:, 0] = True  # (kind, gemm, side): grad_input's and grad_weight's left operand
                else:
                    grad[2] = True
                assert torch.equal(got[~grad], want[~grad]), (case, name, got, want)
                if torch.equal(grad_tp, grad_single):
                    grads += 1
                    assert torch.equal(got[grad], want[grad]), (case, name, got, want)
    assert grads >= 8, grads  # (most gradients are the one process's: their shadows were compared)


def _loss_cost_worker(rank: int, port: int, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from mixprec import Controller, fp8
    from _tp_cases import TP_LAYERS, model_for, tp_plan

    with gloo_group(rank, port, 2):
        torch.set_num_threads(1)
        warnings.simplefilter("ignore")
        costs = {}
        for sharded, rows in ((False, None), (True, None), (False, 4), (True, 4)):  # (rows: of the 16)
            # float32 (no autocast): the outputs' errors differ between the runs only in summation order
            # on rowwise above a tensorwise floor: the first window measures its casts and the rung below's
            # on every step (its plan is made at the check, step 3); with cost_row_share=0.25, on 4 of the 16
            # rows, those the step draws, the same on both ranks
            ctl = Controller(every=3, max_loss_cost=1.0, ladder=("tensorwise", "rowwise", "compute"), floor="tensorwise",
                             cost_row_share=1.0 if rows is None else rows / 16)
            model = fp8.convert(model_for(32), "rowwise", filter_fn=lambda m, fqn: fqn in TP_LAYERS, controller=ctl)
            if sharded:
                parallelize_module(model, init_device_mesh("cpu", (2,)), tp_plan())
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for step in range(2):
                x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(step))
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
                ctl.step()
            layers = ctl.state_dict()["layers"]
            costs[sharded, rows] = {n: torch.tensor(layers[n]["loss_cost"]) for n in TP_LAYERS}
            costs[f"rungs{sharded}{rows}"] = ctl.precisions()
        torch.save(costs, os.path.join(out_dir, f"rank{rank}.pt"))


def test_a_tensor_parallel_layers_loss_cost_is_one_process_s(tmp_path) -> None:
    """``max_loss_cost`` on a colwise and a rowwise fp8 layer: each output row's ``g . e`` summed
    over the TP group, the rung below's error cast with the whole layer's scales, so the cost's
    window (the estimate summed over the steps, and their count) is one process's up to the
    summation order, for the layer's own casts and for the rung below, on both ranks; with
    ``cost_row_share`` too (every rank draws the step's rows; a cost that differs from all rows')."""
    spawn(_loss_cost_worker, str(tmp_path), nprocs=2, timeout=300)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for rows in (None, 4):
            assert got[f"rungsTrue{rows}"] == got[f"rungsFalse{rows}"]
            measured = 0
            for name, single in got[False, rows].items():
                sharded = got[True, rows][name]
                assert torch.equal(sharded[:, 4], single[:, 4]) and single[0, 4] > 0, (name, single)
                assert torch.allclose(sharded[:, 3], single[:, 3], rtol=1e-3, atol=1e-12), (name, sharded, single)
                measured += int(single[1, 4] > 0)
                if rows is not None:  # (the sample took effect)
                    assert not torch.allclose(single[:, 3], got[False, None][name][:, 3], rtol=1e-3), name
            assert measured == 2, "the rung below's cost was not measured on both layers"


def _backward_cost_worker(rank: int, port: int, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    import mixprec
    from mixprec import Controller, Policy
    from _tp_cases import model_for, tp_plan

    with gloo_group(rank, port, 2):
        torch.set_num_threads(1)
        model = model_for(32)
        ctl = Controller(every=2, per_gemm=True, max_backward_cost=1e-3).attach(model)
        parallelize_module(model, init_device_mesh("cpu", (2,)), tp_plan())
        policy = Policy.parse("compute=bf16").fp8("tensorwise", names=r"^1\.", controller=ctl.settings)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                with mixprec.autocast("cpu", policy=policy):
                    model(torch.randn(2, 8, 32)).float().square().mean().backward()
                ctl.step()
        torch.save([str(w.message) for w in caught], os.path.join(out_dir, f"rank{rank}.pt"))


def test_a_tensor_parallel_layers_backward_cost_is_said_to_be_its_shards(tmp_path) -> None:
    """The backward GEMMs' loss cost of a tensor-parallel layer is measured on each rank's shard
    (an underestimate): the Controller says so once per layer, naming it, rather than silently."""
    spawn(_backward_cost_worker, str(tmp_path), nprocs=2, timeout=300)
    for rank in range(2):
        said = [m for m in torch.load(tmp_path / f"rank{rank}.pt") if "on each rank's shard" in m]
        assert sorted(re.search(r"loss cost of '([^']+)'", m).group(1) for m in said) == ["1.down", "1.up"], said
