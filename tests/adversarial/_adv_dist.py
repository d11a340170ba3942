"""Distributed fp8 and fp4 programs: 2 gloo ranks with their own data, a Guard or a Controller
(whole-layer or per GEMM; on an fp4 ladder ``(mxfp4 or nvfp4, tensorwise, rowwise, compute)``
for an fp4 recipe), the policy route or ``fp8.convert``, optionally FSDP2 (with fp8 all-gather)
and a GradScaler that agrees over the group; :func:`run_rank` is what each rank of the pool runs.

What may differ between the ranks is what users' ranks do differ in: the data (a feature that
drifts on one rank only, an outlier on one rank), the number of micro-batches of a step (none on
some steps: a rank whose data loader ran dry or that skips a batch), a rank that lags (sleeps).
What must not differ: every call the documentation says to make once per optimizer step on
every rank is made so; the model's calls are the same on every rank under FSDP2 (it needs that).
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import time
from dataclasses import dataclass
from typing import Any

import torch

from _adv_programs import Net, Shape, Step, batch, loss_of


@dataclass(frozen=True)
class DistProgram:
    shape: Shape
    steps: tuple[Step, ...]
    supervisor: str = "guard"  # "guard" | "controller"
    every: int = 1
    route: str = "policy"  # "policy" (autocast, Policy.fp8, optionally through JSON) | "convert"
    json: bool = False  # the policy goes through Policy.to_json / from_json first
    recipe: str = "tensorwise"
    fsdp: str = "none"  # "none" | "fsdp" | "fsdp_fp8" (fp8.convert(..., fsdp_fp8_all_gather=True))
    drift: tuple[float, float] = (1.0, 1.0)  # feature 0 of rank r's inputs grows drift[r] ** step
    outlier: tuple[int, int] | None = None  # (rank, step): element (0, 1) of that batch is outlier_value
    outlier_value: float = 1e6  # or inf/nan: a bad sample, the gradients of that rank overflow
    lag_rank: int | None = None  # this rank sleeps 20 ms before each step
    scaler: bool = False  # GradScaler("cpu", process_group="default")
    controller: tuple[int, int, int] = (3, 30, 3)  # trend_windows, min_dwell, demote_windows
    per_gemm: bool = False  # the Controller decides per GEMM
    same_data: bool = False  # every rank reads rank 0's data, its global generator seeded by rank
    backend: str = "auto"  # or "emulate_fp32" (every emulated GEMM in float32)
    loss_cost: float | None = None  # the Controller's max_loss_cost (its step gets the scaler's scale)
    stages: bool = False  # rank r puts only the blocks i with i % 2 == r in fp8 (as pipeline stages own
    #                       different layers): the ranks know different layers, as many with an even count


#: the fp4 recipes (their Controller's ladder starts with them).
FP4 = ("mxfp4", "nvfp4")


def digest(model: torch.nn.Module) -> str:
    """A hash of the model's parameters' bytes (equal digests: bitwise equal weights); not under FSDP2."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class ProgramError(Exception):
    """What a rank raised, with the step (-1: while setting up) in ``adv_step``."""


def _supervisor(program: DistProgram) -> Any:
    import mixprec
    from mixprec import fp8

    fp4 = program.recipe in FP4
    if program.supervisor == "guard":  # fp4: the Controller's fp4 limit (fp8's 0.05 falls back at once)
        return fp8.Guard(every=program.every, max_underflow=0.15 if fp4 else 0.05)
    trend, dwell, demote = program.controller
    ladder = {"ladder": (program.recipe, "tensorwise", "rowwise", "compute")} if fp4 else {}
    return mixprec.Controller(every=program.every, trend_windows=trend, min_dwell=dwell, demote_windows=demote,
                              per_gemm=program.per_gemm, max_loss_cost=program.loss_cost, **ladder)


def _fp8_blocks(program: DistProgram, rank: int) -> str:
    """The regular expression of the blocks rank ``rank`` puts in fp8."""
    if not program.stages:
        return r"^blocks\."
    return rf"^blocks\.({'|'.join(str(i) for i in range(program.shape.blocks) if i % 2 == rank)})\."


def _setup(program: DistProgram, rank: int = 0) -> tuple[torch.nn.Module, Any, Any, Any, Any]:
    """model, optimizer, scaler, supervisor, region factory."""
    import mixprec
    from mixprec import Policy, fp8

    model = Net(program.shape)
    supervisor = _supervisor(program)
    if program.route == "convert":
        kind = "guard" if program.supervisor == "guard" else "controller"
        names = re.compile(_fp8_blocks(program, rank))
        model = fp8.convert(model, program.recipe, filter_fn=lambda m, fqn: bool(names.search(fqn)),
                            fsdp_fp8_all_gather=program.fsdp == "fsdp_fp8",
                            backend=program.backend,
                            **{kind: supervisor})

        def region() -> Any:
            return mixprec.autocast("cpu", dtype=torch.bfloat16)
    else:
        kind = "guard" if program.supervisor == "guard" else "controller"
        policy = Policy.parse("compute=bf16").fp8(program.recipe, names=_fp8_blocks(program, rank), first_last="fp8",
                                                  backend=program.backend, **{kind: supervisor})
        if program.json:
            policy = Policy.from_json(policy.to_json())
            supervisor = getattr(policy.fp8_rule, kind)

        def region() -> Any:
            return mixprec.autocast("cpu", policy=policy)
    if program.fsdp != "none":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = mixprec.GradScaler("cpu", process_group="default") if program.scaler else None
    return model, optimizer, scaler, supervisor, region


def _plain(decision: Any) -> dict[str, Any]:
    return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in dataclasses.asdict(decision).items()}


def run_rank(rank: int, program: DistProgram) -> dict[str, Any]:
    """Run ``program`` as rank ``rank``; returns the decisions per step and the supervisor's
    final state. Raises :class:`ProgramError` (``adv_step``: where) on any error."""
    step_index = -1
    try:
        model, optimizer, scaler, supervisor, region = _setup(program, rank)
        if program.same_data:  # anything drawn from the global generator would differ between ranks
            torch.manual_seed(1000 + rank)
        source = 0 if program.same_data else rank
        decisions = []
        for step_index, step in enumerate(program.steps):
            if program.lag_rank == rank:
                time.sleep(0.02)
            # with a scaler a rank must scale() before step(): no micro-batch -> an empty one
            micro = step.rows[source] or ((0,) if scaler is not None else ())
            for m, rows in enumerate(micro):
                outlier = program.outlier_value if program.outlier == (source, step_index) else None
                x = batch(program.shape, program.shape.seed, step_index, source, m, rows,
                          drift=program.drift[source], outlier=outlier)
                with region():
                    loss = loss_of(model(x, step, rank))
                (scaler.scale(loss) if scaler is not None else loss).backward()
            costed = program.supervisor == "controller" and program.loss_cost is not None
            loss_scale = {"loss_scale": scaler.get_scale() if scaler is not None else 1.0} if costed else {}
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad()
            decisions.append([_plain(d) for d in supervisor.step(**loss_scale)])
        return {"decisions": decisions, "steps": supervisor.steps,
                "scale": scaler.get_scale() if scaler is not None else None,
                "weights": digest(model) if program.same_data else None}
    except Exception as exc:
        error = ProgramError(f"rank {rank}, step {step_index}: {type(exc).__name__}: {exc}")
        error.adv_step = step_index  # type: ignore[attr-defined]
        error.adv_type = type(exc).__name__  # type: ignore[attr-defined]
        raise error from exc
