"""Per-layer scaling across pipeline stages (``torch.distributed.pipelining``: a model split by hand
into 2 stages on 2 gloo ranks, ``ScheduleGPipe`` and ``Schedule1F1B``, 2 micro-batches, fp16
compute on the CPU).

Every stage's ``GradScaler(per_layer=True)`` watches its ``PipelineStage`` with the pipeline's
group; the last stage scales the loss (:class:`mixprec.scaling.ScaledLoss`). The oracle is
mixprec's own ``GradScaler(per_layer=True)`` on the unsplit model in one process (same
micro-batches, gradients divided by their count as the schedule does), run in each rank before
joining the group: the factors after every step, the loss scale, the skipped steps and the trained
weights must be its own bit for bit, with

* an inf planted in stage 1's layer at one step and in stage 0's at another (each moves the one
  cut point's factor the unsplit model moves, on both stages);
* a block skipped on some steps: stage 1's lowest (the gradient it sends back must still carry
  its canonical scale, and stage 0's regions below it are not measured that step), and stage 0's
  top one;
* and clear errors: a group that lacks a stage, a rank outside the group, no group.

Also on 4 ranks, 2 stages x 2 data-parallel replicas with the world as the scaler's group (an inf
in one replica skips everywhere), and in one process with the layout faked: a micro-batch that
runs other blocks than its step's first, a stage input that bypasses the cut points, a
checkpoint, and an inf below a cut point with a process group.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.scaling import ScaledLoss

from _distributed import gloo_group, spawn

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

STEPS, MICRO, BATCH = 7, 2, 8
SPLIT = 4  # stage 0: the unsplit model's modules [0, 4), stage 1: [4, 9)
INF = {2: (1, "6.weight"), 5: (0, "0.weight")}  # step -> (stage, parameter) given an inf
SKIP = {3: {"4"}, 4: {"2"}, 6: {"4"}}  # step -> the blocks not run (every micro-batch)
CUTS = ["0", "2", "4", "6"]  # the unsplit model's cut points


class Chain(nn.Sequential):
    """An ``nn.Sequential`` that skips the children named in ``skip`` (LayerDrop-like)."""

    skip: frozenset[str] = frozenset()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for name, module in self._modules.items():
            if name not in self.skip:
                x = module(x)
        return x


def _full_model() -> Chain:
    torch.manual_seed(0)
    model = Chain(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                  nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 16))
    with torch.no_grad():  # gradients that span some binades: factors other than 1
        model[4].weight.mul_(8.0)
        model[8].weight.mul_(0.125)
        model[2].weight.mul_(0.25)
    return model


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, 16, generator=g), torch.randn(BATCH, 16, generator=g)


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output.float(), target)


def _scaler(**kwargs: Any) -> mixprec.GradScaler:
    return mixprec.GradScaler("cpu", per_layer=True, init_scale=2.0**10, growth_interval=2, **kwargs)


def _plant(step: int, stage: int | None, params: dict[str, nn.Parameter]) -> None:
    where = INF.get(step)
    if where is not None and (stage is None or where[0] == stage):
        params[where[1]].grad.view(-1)[0] = float("inf")


def _record(scaler: mixprec.GradScaler, log: dict[str, list[Any]]) -> None:
    log["factors"].append(list(scaler.layer_scales().values()))
    log["scales"].append(scaler.get_scale())
    log["skipped"].append(bool(scaler.last_step_skipped))


def _oracle() -> dict[str, Any]:
    """mixprec's GradScaler(per_layer=True) on the unsplit model, one process."""
    model = _full_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = _scaler().watch(model)
    params = dict(model.named_parameters())
    log: dict[str, list[Any]] = {"factors": [], "scales": [], "skipped": []}
    for step in range(STEPS):
        opt.zero_grad()
        model.skip = frozenset(SKIP.get(step, ()))
        x, y = _data(step)
        for xm, ym in zip(x.chunk(MICRO), y.chunk(MICRO)):
            with mixprec.autocast("cpu", torch.float16):
                out = model(xm)
            scaler.scale(_loss(out, ym)).backward()
        for p in model.parameters():
            if p.grad is not None:  # (a skipped block's have none)
                p.grad.div_(MICRO)  # the schedule's scale_grads
        _plant(step, None, params)
        scaler.step(opt)
        scaler.update()
        _record(scaler, log)
    assert scaler.layer_scales().keys() == set(CUTS)
    return {**log, "weights": {n: p.detach().clone() for n, p in params.items()}}


class _Autocast(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with mixprec.autocast("cpu", torch.float16):
            return self.inner(x)


def _stage(rank: int, part: nn.Module, pp: Any = None) -> Any:
    from torch.distributed.pipelining import PipelineStage

    micro = BATCH // MICRO
    inputs = torch.empty(micro, 16) if rank == 0 else torch.empty(micro, 32, dtype=torch.float16, requires_grad=True)
    outputs = torch.empty(micro, 32 if rank == 0 else 16, dtype=torch.float16, requires_grad=True)
    return PipelineStage(_Autocast(part), rank, 2, torch.device("cpu"), input_args=inputs, output_args=outputs,
                         group=pp)


def _train(kind: str, rank: int, group: Any, pp: Any = None, plant: bool = True) -> dict[str, Any]:
    """Stage ``rank`` (over the pipeline group ``pp``, default the world) trained with a per-layer
    scaler over ``group``; ``plant``: this rank plants its stage's infs."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    full = _full_model()
    part = full[:SPLIT] if rank == 0 else full[SPLIT:]  # a Chain with the unsplit model's names
    stage = _stage(rank, part, pp)
    scaler = _scaler(process_group=group).watch(stage)
    schedule = (ScheduleGPipe if kind == "gpipe" else Schedule1F1B)(stage, MICRO, loss_fn=ScaledLoss(scaler, _loss))
    opt = torch.optim.SGD(part.parameters(), lr=0.05)
    params = dict(part.named_parameters())
    log: dict[str, list[Any]] = {"factors": [], "scales": [], "skipped": []}
    for step in range(STEPS):
        opt.zero_grad()
        part.skip = frozenset(SKIP.get(step, ())) & set(part._modules)
        x, y = _data(step)
        schedule.step(x) if rank == 0 else schedule.step(target=y)
        if plant:
            _plant(step, rank, params)
        scaler.step(opt)
        scaler.update()
        _record(scaler, log)
    return {**log, "names": list(scaler.layer_scales()), "weights": {n: p.detach().clone() for n, p in params.items()}}


def _errors(rank: int) -> dict[str, str]:
    """The errors of a group that lacks a stage (rank 0 alone) and of a rank outside it."""
    errors = {}
    lonely = dist.new_group([0])  # every rank calls new_group; rank 1 is outside
    part = _full_model()[:SPLIT] if rank == 0 else _full_model()[SPLIT:]
    stage = _stage(rank, part)
    try:
        _scaler(process_group=lonely).watch(stage)
    except ValueError as exc:
        errors["group"] = str(exc)
    try:
        _scaler().watch(stage)
    except ValueError as exc:
        errors["none"] = str(exc)
    return errors


def _worker(rank: int, port: int, out_dir: str, kind: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    result: dict[str, Any] = {"oracle": _oracle()}  # before any collective
    with gloo_group(rank, port):
        mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "dp"))
        result["run"] = _train(kind, rank, (mesh, "pp") if kind == "gpipe" else "default")
        result["errors"] = _errors(rank)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_stages_scale_per_layer_as_the_unsplit_model(tmp_path, kind: str) -> None:
    try:
        spawn(_worker, str(tmp_path), kind, timeout=300)
    except TimeoutError:
        pytest.fail("the stages hung: their collectives did not match")
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    oracle = ranks[0]["oracle"]
    factors = oracle["factors"]
    # the oracle has teeth: factors other than 1 in every region, both planted infs skip and
    # each moves one cut point's factor (stage 1's '6', stage 0's '0'), the loss scale stays
    assert oracle["skipped"] == [step in INF for step in range(STEPS)]
    assert all(any(f[k] != 1.0 for f in factors) for k in range(len(CUTS)))
    for step, (_, param) in INF.items():
        moved = [CUTS[k] for k in range(len(CUTS)) if factors[step][k] != factors[step - 1][k]]
        assert moved == [param.split(".")[0]], (step, factors[step - 1], factors[step])
        assert oracle["scales"][step] == oracle["scales"][step - 1]
    for rank, result in enumerate(ranks):
        run = result["run"]
        assert run["names"] == [f"inner.{c}" for c in CUTS]  # every stage holds every cut point
        assert run["factors"] == factors, rank
        assert run["scales"] == oracle["scales"] and run["skipped"] == oracle["skipped"]
        for name, weight in run["weights"].items():
            assert torch.equal(weight, oracle["weights"][name]), (rank, name)
        errors = result["errors"]
        if rank == 0:
            assert "holds stages [0] of 2" in errors["group"]
        else:
            assert "not in" in errors["group"] or "outside" in errors["group"], errors["group"]
        assert "needs process_group" in errors["none"]


def test_scaled_loss_needs_a_watched_stage() -> None:
    model = Chain(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1))
    scaler = mixprec.GradScaler("cpu", per_layer=True).watch(model)
    scaled = ScaledLoss(scaler, _loss)  # building it is fine: the stage may be watched later
    with pytest.raises(ValueError, match=r"scaler.watch\(pipeline_stage\)"):
        scaled(model(torch.ones(2, 4)), torch.zeros(2, 1))
    with pytest.raises(ValueError, match=r"scaler.watch\(pipeline_stage\)"):
        mixprec.GradScaler("cpu", per_layer=True, process_group="default").watch(model).step(
            torch.optim.SGD(model.parameters(), lr=0.1))


def test_a_stage_before_the_last_keeps_its_last_block() -> None:
    from mixprec.scaling.layerwise import choose_cut_points

    part = Chain(OrderedDict((str(i), nn.Linear(4, 4)) for i in range(3)))
    assert choose_cut_points(part) == ["0", "1"]
    assert choose_cut_points(part, keep_last=True) == ["0", "1", "2"]


def test_an_overflow_below_a_cut_point_survives_the_all_reduce(tmp_path) -> None:
    """With a process group (here of one rank), the statistics' all-reduce kept an inf as
    float32's largest value, so the cut point whose region overflowed did not back off and the
    loss scale did: the same step must do what it does without a group."""
    from datetime import timedelta

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    try:
        runs = []
        for group in (None, "default"):
            torch.manual_seed(0)
            model = Chain(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Linear(4, 1))
            scaler = mixprec.GradScaler("cpu", per_layer=True, init_scale=2.0**10, process_group=group).watch(model)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            scaler.scale(model(torch.ones(2, 4)).square().mean()).backward()
            model[0].weight.grad[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update()
            runs.append((scaler.get_scale(), scaler.layer_scales(), scaler.last_overflow_cuts))
    finally:
        dist.destroy_process_group()
    assert runs[0] == (2.0**10, {"0": 0.5, "2": 1.0}, ("0",))  # cut point '0' absorbed it
    assert runs[1] == runs[0]


def _fake_last_stage(monkeypatch, module: nn.Module) -> mixprec.GradScaler:
    """A per-layer scaler watching ``module`` as the last of 2 stages, stage 0 holding '0' and
    '2' (the layout faked: no process group)."""
    from mixprec.scaling.layerwise import scaler as layerwise_scaler
    from mixprec.scaling.layerwise.stages import StageLayout

    layout = StageLayout(1, 2, 2, ["inner.4", "inner.6"], ["inner.0", "inner.2", "inner.4", "inner.6"], 0, 3)
    monkeypatch.setattr(layerwise_scaler, "pipeline_stage", lambda obj: (module, 1, 2))
    monkeypatch.setattr(layerwise_scaler, "stage_layout", lambda *args: layout)
    return _scaler().watch(object())


def test_every_micro_batch_of_a_step_runs_the_same_blocks(monkeypatch) -> None:
    """The last of 2 stages: a micro-batch that runs other blocks than the step's first is
    refused at its scale(); the next step may differ. A checkpoint loads into the same stage."""
    part = _full_model()[SPLIT:]
    module = _Autocast(part)
    scaler = _fake_last_stage(monkeypatch, module)
    assert scaler.layer_scales() == {"inner.0": 1.0, "inner.2": 1.0, "inner.4": 1.0, "inner.6": 1.0}
    opt = torch.optim.SGD(part.parameters(), lr=0.05)
    x = torch.randn(4, 32, dtype=torch.float16, requires_grad=True)
    scaler.scale(_loss(module(x), torch.zeros(4, 16)))
    part.skip = frozenset({"4"})
    with pytest.raises(ValueError, match="every micro-batch of a step must run the same blocks"):
        scaler.scale(_loss(module(x), torch.zeros(4, 16)))
    opt.zero_grad()
    scaler.scale(_loss(module(x), torch.zeros(4, 16))).backward()  # after unscale: a new step
    scaler.unscale_(opt)
    part.skip = frozenset()
    scaler.scale(_loss(module(x), torch.zeros(4, 16))).backward()  # every block again: fine
    scaler.step(opt)
    scaler.update()
    assert set(scaler.layer_scales().values()) != {1.0}
    again = _fake_last_stage(monkeypatch, module)
    again.load_state_dict(scaler.state_dict())
    assert again.layer_scales() == scaler.layer_scales()


class _Around(nn.Module):
    """A stage whose input also bypasses its blocks (a skip connection around its cut points)."""

    def __init__(self, part: nn.Module) -> None:
        super().__init__()
        self.inner = part

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with mixprec.autocast("cpu", torch.float16):
            return self.inner(x) + x[:, :16]


def test_a_stage_input_that_bypasses_its_cut_points_is_refused(monkeypatch) -> None:
    part = _full_model()[SPLIT:]
    module = _Around(part)
    scaler = _fake_last_stage(monkeypatch, module)
    x = torch.randn(4, 32, dtype=torch.float16, requires_grad=True)
    with pytest.raises(ValueError, match="does not cross all its cut points"):
        scaler.scale(_loss(module(x), torch.zeros(4, 16)))


def _replicas_worker(rank: int, port: int, out_dir: str) -> None:
    """4 ranks: 2 stages x 2 data-parallel replicas (same data); only replica 1 plants the infs."""
    from torch.distributed.device_mesh import init_device_mesh

    result: dict[str, Any] = {"oracle": _oracle()}
    with gloo_group(rank, port, 4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        stage, replica = divmod(rank, 2)
        result["run"] = _train("1f1b", stage, "default", pp=mesh.get_group("pp"), plant=replica == 1)
        try:  # one stage's data-parallel group lacks the other stage
            part = _full_model()[:SPLIT] if stage == 0 else _full_model()[SPLIT:]
            _scaler(process_group=(mesh, "dp")).watch(_stage(stage, part, mesh.get_group("pp")))
        except ValueError as exc:
            result["dp_only"] = str(exc)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.slow
@pytest.mark.distributed
def test_replicas_of_the_stages_agree_over_the_whole_group(tmp_path) -> None:
    """pp x dp = 2 x 2 with the world as the scaler's group: an inf in one replica skips the step
    on all four ranks, whose factors, scales and weights are the unsplit model's."""
    try:
        spawn(_replicas_worker, str(tmp_path), nprocs=4, timeout=400)
    except TimeoutError:
        pytest.fail("the ranks hung: their collectives did not match")
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(4)]
    oracle = ranks[0]["oracle"]
    for rank, result in enumerate(ranks):
        run = result["run"]
        assert run["factors"] == oracle["factors"] and run["scales"] == oracle["scales"], rank
        assert run["skipped"] == oracle["skipped"], rank
        for name, weight in run["weights"].items():
            assert torch.equal(weight, oracle["weights"][name]), (rank, name)
        assert f"holds stages [{rank // 2}] of 2" in result["dp_only"]
