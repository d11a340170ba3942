"""Pipeline programs on the pool's 2 ranks: the model split in 2 stages (``PipelineStage`` with
static shapes), ``ScheduleGPipe`` or ``Schedule1F1B``, a drawn number of micro-batches, fp16
compute under ``mixprec.autocast`` with a ``mixprec.GradScaler`` per stage over the pipeline's
group and the loss scaled by ``mixprec.scaling.ScaledLoss``, infs planted in a stage's gradients
at drawn steps; with ``per_layer``, every stage's ``GradScaler(per_layer=True)`` watches its
``PipelineStage``. :func:`run_rank` also runs the oracle on the rank: ``torch.amp.GradScaler``
(with ``per_layer``: mixprec's ``GradScaler(per_layer=True)``) on the unsplit model under
``torch.autocast`` (same micro-batches, gradients divided by their count as the schedule does)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

BATCH, IN, HIDDEN = 8, 16, 32


@dataclass(frozen=True)
class PPProgram:
    schedule: str  # "gpipe" or "1f1b"
    micro: int  # micro-batches a step (divides BATCH)
    steps: int
    infs: tuple[tuple[int, int], ...]  # (step, stage): an inf planted in that stage's first weight's gradient
    split: int = 4  # stage 0 holds the full model's modules [0, split) (2, 4 or 6), stage 1 the rest
    init_scale: float = 2.0**10
    growth_interval: int = 2
    group: str = "default"  # or "mesh": the pipeline's group as (mesh, "pp")
    gain: float = 1.0  # the data's scale (large: fp16 overflows on its own)
    seed: int = 0
    per_layer: bool = False  # a factor per cut point ('0', '2', '4'), agreed across the stages


def _full(p: PPProgram) -> nn.Sequential:
    torch.manual_seed(p.seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(),
                         nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, IN))


def _data(p: PPProgram, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(p.seed * 100 + step)
    return p.gain * torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, IN, generator=g)


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output.float(), target)


def _first_weight(p: PPProgram, stage: int) -> str:
    """The full model's name of ``stage``'s first weight."""
    return "0.weight" if stage == 0 else f"{p.split}.weight"


def _plant(p: PPProgram, step: int, stage: int | None, params: dict[str, nn.Parameter]) -> None:
    for at, where in p.infs:
        if at == step and (stage is None or stage == where):
            params[_first_weight(p, where)].grad.view(-1)[0] = float("inf")


def oracle(p: PPProgram) -> dict[str, Any]:
    model = _full(p)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if p.per_layer:
        import mixprec

        scaler: Any = mixprec.GradScaler("cpu", init_scale=p.init_scale, growth_interval=p.growth_interval,
                                         per_layer=True).watch(model)
    else:
        scaler = torch.amp.GradScaler("cpu", init_scale=p.init_scale, growth_interval=p.growth_interval)
    params = dict(model.named_parameters())
    scales, skipped, factors = [], [], []
    for step in range(p.steps):
        opt.zero_grad()
        x, y = _data(p, step)
        for xm, ym in zip(x.chunk(p.micro), y.chunk(p.micro)):
            with torch.autocast("cpu", torch.float16):
                out = model(xm)
            scaler.scale(_loss(out, ym)).backward()
        for q in model.parameters():
            q.grad.div_(p.micro)
        _plant(p, step, None, params)
        before = scaler.get_scale()
        scaler.step(opt)
        # (per-layer: an overflow a cut point absorbs skips the step and keeps the scale)
        absorbed = bool(scaler.last_step_skipped) if p.per_layer else False
        scaler.update()
        skipped.append(absorbed or scaler.get_scale() < before)
        scales.append(scaler.get_scale())
        factors.append(list(scaler.layer_scales().values()) if p.per_layer else [])
    return {"scales": scales, "skipped": skipped, "factors": factors,
            "weights": {n: q.detach().clone() for n, q in params.items()}}


class _Autocast(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import mixprec

        with mixprec.autocast("cpu", torch.float16):
            return self.inner(x)


def run_rank(rank: int, p: PPProgram) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    import mixprec
    from mixprec.scaling import ScaledLoss

    result: dict[str, Any] = {"oracle": oracle(p)}
    full = _full(p)
    part = full[:p.split] if rank == 0 else full[p.split:]  # a slice: the full model's names
    if p.group == "mesh":
        from torch.distributed.device_mesh import init_device_mesh

        group: Any = (init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("pp",)), "pp")
    else:
        group = "default"
    scaler = mixprec.GradScaler("cpu", init_scale=p.init_scale, growth_interval=p.growth_interval,
                                process_group=group, per_layer=p.per_layer)
    loss = ScaledLoss(scaler, _loss)
    rows = BATCH // p.micro
    width_in = IN if rank == 0 else HIDDEN
    inputs = (torch.empty(rows, IN) if rank == 0
              else torch.empty(rows, width_in, dtype=torch.float16, requires_grad=True))
    outputs = torch.empty(rows, HIDDEN if rank == 0 else IN, dtype=torch.float16, requires_grad=True)
    stage = PipelineStage(_Autocast(part), rank, 2, torch.device("cpu"), input_args=inputs, output_args=outputs)
    if p.per_layer:
        scaler.watch(stage)  # collective: every stage's cut points
    schedule = (ScheduleGPipe if p.schedule == "gpipe" else Schedule1F1B)(stage, p.micro, loss_fn=loss)
    opt = torch.optim.SGD(part.parameters(), lr=0.1)
    params = dict(part.named_parameters())  # a slice keeps the full model's names
    scales, skipped, factors = [], [], []
    for step in range(p.steps):
        opt.zero_grad()
        x, y = _data(p, step)
        schedule.step(x) if rank == 0 else schedule.step(target=y)
        _plant(p, step, rank, params)
        scaler.step(opt)
        skipped.append(bool(scaler.last_step_skipped))
        scaler.update()
        scales.append(scaler.get_scale())
        factors.append(list(scaler.layer_scales().values()) if p.per_layer else [])
        loss.take()
    result.update(scales=scales, skipped=skipped, factors=factors, weights={n: q.detach().clone() for n, q in params.items()})
    return result
