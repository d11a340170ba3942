"""Pipeline parallelism (``torch.distributed.pipelining``: a model split by hand into 2 stages on 2
gloo ranks, ``PipelineStage``, ``ScheduleGPipe`` and ``Schedule1F1B``, 2 micro-batches) under
``mixprec.autocast``.

* fp16 compute with a :class:`mixprec.GradScaler` on each stage over the pipeline's group, the
  loss scaled on the last stage by the schedule's ``loss_fn`` (:class:`mixprec.scaling.ScaledLoss`):
  an inf planted in one stage's gradient skips the step on both stages, and the scales and weights
  are those of ``torch.amp.GradScaler`` on the unsplit model in one process (the oracle, run in
  each rank before any mixprec region: same micro-batches, gradients divided by their count as
  the schedule does).
* an fp8 policy route, with a Controller on each stage over the stage's data-parallel ranks (a
  DeviceMesh dimension, one rank here) while both stages' layers have the same local names, and
  with a Guard over the default group (the world) on stages that keep the full model's names:
  a large weight in one stage's layer moves that layer only, the other stage's layer of the same
  local name stays (a union of the stages' layers over the world would have mixed them up).
* per-layer scaling on a stage without the loss that watches its module, not its PipelineStage,
  says what to do (per-layer scaling across stages: test_pipeline_layerwise.py).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec import Controller, Policy, fp8
from mixprec.scaling import ScaledLoss

from _distributed import gloo_group, spawn

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

STEPS, MICRO, BATCH = 4, 2, 8
INF = {1: (1, "6.weight"), 2: (0, "0.weight")}  # step -> (stage, the full model's parameter) given an inf
SPLIT = 4  # stage 0: the full model's modules [0, 4), stage 1: [4, 7)


def _full_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 16))


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, 16, generator=g), torch.randn(BATCH, 16, generator=g)


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output.float(), target)


def _plant(step: int, stage: int | None, params: dict[str, nn.Parameter]) -> None:
    """The planted inf of ``step`` when it is in ``stage``'s parameters (None: the full model)."""
    where = INF.get(step)
    if where is not None and (stage is None or where[0] == stage):
        params[where[1]].grad.view(-1)[0] = float("inf")


def _oracle() -> dict[str, Any]:
    """torch.amp.GradScaler on the unsplit model, one process."""
    model = _full_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    params = dict(model.named_parameters())
    scales, skipped = [], []
    for step in range(STEPS):
        opt.zero_grad()
        x, y = _data(step)
        for xm, ym in zip(x.chunk(MICRO), y.chunk(MICRO)):
            with torch.autocast("cpu", torch.float16):
                out = model(xm)
            scaler.scale(_loss(out, ym)).backward()
        for p in model.parameters():
            p.grad.div_(MICRO)  # the schedule's scale_grads
        _plant(step, None, params)
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped.append(scaler.get_scale() < before)
        scales.append(scaler.get_scale())
    return {"scales": scales, "skipped": skipped, "weights": {n: p.detach().clone() for n, p in params.items()}}


class _Autocast(nn.Module):
    """A stage's module: ``inner`` under ``mixprec.autocast`` (fp16 compute, ``policy``)."""

    def __init__(self, inner: nn.Module, policy: Policy | None = None) -> None:
        super().__init__()
        self.inner, self.policy = inner, policy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with mixprec.autocast("cpu", torch.float16, policy=self.policy):
            return self.inner(x)


def _stage_module(rank: int, keep_names: bool) -> nn.Sequential:
    """This rank's stage of the full model: its modules renumbered (local names ``0``, ``1``, ...,
    the same on both stages), or a slice of the full model (its names: ``4``, ``5``, ``6``)."""
    full = _full_model()
    part = full[:SPLIT] if rank == 0 else full[SPLIT:]
    return part if keep_names else nn.Sequential(*part)


def _schedule(kind: str, rank: int, module: nn.Module, loss: ScaledLoss) -> Any:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    # static metadata: without it the first step runs a metadata forward (and, on the last stage,
    # loss_fn and a backward) on uninitialized tensors, which an fp8 layer's statistics would see
    micro = BATCH // MICRO
    # (stage 0's output is fp16: what stage 1 receives, and the gradient it sends back)
    inputs = torch.empty(micro, 16) if rank == 0 else torch.empty(micro, 32, dtype=torch.float16, requires_grad=True)
    outputs = torch.empty(micro, 32 if rank == 0 else 16, dtype=torch.float16, requires_grad=True)
    stage = PipelineStage(module, rank, 2, torch.device("cpu"), input_args=inputs, output_args=outputs)
    return (ScheduleGPipe if kind == "gpipe" else Schedule1F1B)(stage, MICRO, loss_fn=loss)


def _train(kind: str, rank: int, module: nn.Module, scaler: mixprec.GradScaler, steps: int,
           live: Any = None) -> dict[str, Any]:
    loss = ScaledLoss(scaler, _loss)
    schedule = _schedule(kind, rank, module, loss)
    opt = torch.optim.SGD(module.parameters(), lr=0.5)
    params = {n.removeprefix("inner."): p for n, p in module.named_parameters()}
    scales, skipped, losses = [], [], []
    for step in range(steps):
        opt.zero_grad()
        x, y = _data(step)
        schedule.step(x) if rank == 0 else schedule.step(target=y)
        if live is None:  # the fp16 run: the planted infs
            _plant(step, rank, {n if rank == 0 else str(int(n[0]) + SPLIT) + n[1:]: p for n, p in params.items()})
        scaler.step(opt)
        skipped.append(bool(scaler.last_step_skipped))
        scaler.update()
        scales.append(scaler.get_scale())
        losses.append([float(v) for v in loss.take()])
        if live is not None:
            live.step()
    return {"scales": scales, "skipped": skipped, "losses": losses,
            "weights": {n: p.detach().clone() for n, p in params.items()}}


def _spike(module: nn.Module, layer: str) -> None:
    """One large weight in ``layer``: its fp8 weight underflows (the layer's own statistic only)."""
    with torch.no_grad():
        module.get_submodule(layer).weight[0, 0] = 1e4


def _worker(rank: int, port: int, out_dir: str, kind: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    result: dict[str, Any] = {"oracle": _oracle()}  # before any mixprec region in this process
    with gloo_group(rank, port):
        mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "dp"))
        pipeline = mesh.get_group("pp")
        # fp16 compute, one GradScaler per stage over the pipeline's group
        scaler = mixprec.GradScaler("cpu", init_scale=2.0**10, growth_interval=2, process_group=pipeline)
        plain = _stage_module(rank, keep_names=False)
        result["fp16"] = _train(kind, rank, _Autocast(plain), scaler, STEPS)
        # the fp8 route, a Controller per stage over its data-parallel ranks; local names collide
        module = _stage_module(rank, keep_names=False)
        ctl = Controller(every=1, process_group=(mesh, "dp")).attach(module)
        policy = Policy.parse("compute=fp16").fp8("tensorwise", first_last="fp8", controller=ctl.settings)
        scaler = mixprec.GradScaler("cpu", init_scale=2.0**10, growth_interval=2, process_group=(mesh, "pp"))
        if rank == 1:
            _spike(module, "0")
        run = _train(kind, rank, _Autocast(module, policy), scaler, 2, live=ctl)
        result["controller"] = {"log": [(d.step, d.layer, d.action, d.to) for d in ctl.log],
                                "layers": sorted(ctl.precisions()), "scales": run["scales"]}
        # a Guard over the world, on stages that keep the full model's names (the union is both stages')
        module = _stage_module(rank, keep_names=True)
        guard = fp8.Guard(every=1).attach(module)
        policy = Policy.parse("compute=fp16").fp8("tensorwise", first_last="fp8", guard=guard.settings)
        scaler = mixprec.GradScaler("cpu", init_scale=2.0**10, growth_interval=2, process_group="default")
        if rank == 1:
            _spike(module, str(SPLIT))
        _train(kind, rank, _Autocast(module, policy), scaler, 2, live=guard)
        result["guard"] = {"decisions": sorted(guard.decisions),
                           "fallback": {n: s.fallback for n, s in fp8.layer_states(module).items()}}
        # per-layer scaling on a stage without the loss needs the stage watched
        if rank == 0:
            layerwise = mixprec.GradScaler("cpu", per_layer=True, process_group=pipeline).watch(plain)
            try:
                layerwise.step(torch.optim.SGD(plain.parameters(), lr=0.1))
            except ValueError as exc:
                result["per_layer"] = str(exc)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_two_stages_skip_together_and_decide_on_their_own_layers(tmp_path, kind: str) -> None:
    try:
        spawn(_worker, str(tmp_path), kind, timeout=300)  # a hang fails sooner: gloo times out at 120 s
    except TimeoutError:
        pytest.fail("the stages hung: their collectives did not match")
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    oracle = ranks[0]["oracle"]
    assert oracle["skipped"] == [False, True, True, False]  # the planted infs, one in each stage
    assert oracle["scales"] == [1024.0, 512.0, 256.0, 256.0]
    for rank, result in enumerate(ranks):
        fp16 = result["fp16"]
        assert fp16["skipped"] == oracle["skipped"] and fp16["scales"] == oracle["scales"]
        for name, weight in fp16["weights"].items():
            full = name if rank == 0 else str(int(name[0]) + SPLIT) + name[1:]
            assert torch.equal(weight, oracle["weights"][full]), (rank, name)
        assert [len(step) for step in fp16["losses"]] == ([0] * STEPS if rank == 0 else [MICRO] * STEPS)
        # the fp8 route: the spike is stage 1's layer '0' (the full model's '4'); stage 0's '0' stays
        ctl = result["controller"]
        assert ctl["layers"] == ["0", "2"]  # each stage's own, under the same local names
        assert [(step, layer, action) for step, layer, action, _ in ctl["log"]] == (
            [] if rank == 0 else [(1, "0", "promote")])
        assert ctl["scales"] == [1024.0, 2048.0]
        guard = result["guard"]
        assert guard["decisions"] == ["4"]  # both stages: the union over the world, one layer
        assert guard["fallback"] == ({"0": False, "2": False} if rank == 0 else {"4": True, "6": False})
    assert "scaler.watch(pipeline_stage)" in ranks[0]["per_layer"]  # tests/scaling/test_pipeline_layerwise.py


def test_scaled_loss_scales_and_keeps_the_unscaled_losses() -> None:
    scaler = mixprec.GradScaler("cpu", init_scale=8.0)
    scaled = ScaledLoss(scaler, _loss)
    out, target = torch.ones(2, 4, dtype=torch.float16), torch.zeros(2, 4)
    assert scaled(out, target).item() == 8.0 and scaled(out * 2, target).item() == 32.0
    assert [v.item() for v in scaled.take()] == [1.0, 4.0] and scaled.take() == []
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        ScaledLoss(scaler, "mse")
