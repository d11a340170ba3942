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
from _train_cases import RECIPES, Supervisor

#: a quick Controller's schedule (the default ``DistProgram.controller`` is a slow one)
QUICK = (("trend_windows", 1), ("min_dwell", 2), ("demote_windows", 1))


@dataclass(frozen=True)
class DistProgram:
    shape: Shape
    steps: tuple[Step, ...]
    supervisor: str = "guard"  # a key of _train_cases.SUPERVISORS
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
    controller: tuple[tuple[str, Any], ...] = (("trend_windows", 3), ("min_dwell", 30), ("demote_windows", 3))
    #  ^ the Controller's schedule settings (QUICK: a quick one)
    per_gemm: bool = False  # the Controller decides per GEMM
    same_data: bool = False  # every rank reads rank 0's data, its global generator seeded by rank
    backend: str = "auto"  # or "emulate_fp32" (every emulated GEMM in float32)
    loss_cost: float | None = None  # the Controller's max_loss_cost (its step gets the scaler's scale)
    backward_cost: float | None = None  # the per-GEMM Controller's max_backward_cost (reach walks, gains)
    row_share: float = 1.0  # the Controller's cost_row_share (the loss costs' rows drawn from the step count)
    cost_scope: str = "gemm"  # the Controller's cost_scope ("model": the limits shared out by each layer's size)
    stages: bool = False  # rank r puts only the blocks i with i % 2 == r in fp8 (as pipeline stages own
    #                       different layers): the ranks know different layers, as many with an even count


@dataclass(frozen=True)
class FsdpMode:
    """How the ranks shard the model: ``sharded`` (FSDP2 on each block and the model: the ranks
    must run the same forwards, and no module is shared or tied), ``fp8_all_gather`` (the weights
    gathered in fp8: ``fp8.convert`` with the tensorwise recipe only)."""

    key: str
    sharded: bool = False
    fp8_all_gather: bool = False


FSDP_MODES = {m.key: m for m in (FsdpMode("none"), FsdpMode("fsdp", sharded=True),
                                 FsdpMode("fsdp_fp8", sharded=True, fp8_all_gather=True))}

#: the fp4 recipes the ranks run (named: the Controller's ladder starts with them).
FP4 = tuple(k for k, r in RECIPES.items() if r.fp4 and r.named)


def digest(model: torch.nn.Module) -> str:
    """A hash of the model's parameters' bytes (equal digests: bitwise equal weights); not under FSDP2."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class ProgramError(Exception):
    """What a rank raised, with the step (-1: while setting up) in ``adv_step``."""


#: a program's supervisor settings, by kind (the Guard's fp4 limit is the Controller's: fp8's
#: 0.05 falls back at once; the Controller on the fp4 ladder with an fp4 recipe)
SETTINGS = {
    "guard": lambda p: {"every": p.every, "max_underflow": RECIPES[p.recipe].guard_underflow},
    "controller": lambda p: {"every": p.every, **dict(p.controller), "per_gemm": p.per_gemm,
                             "max_loss_cost": p.loss_cost, "max_backward_cost": p.backward_cost,
                             "cost_row_share": p.row_share, "cost_scope": p.cost_scope,
                             **RECIPES[p.recipe].ladder},
}


def supervisor_of(program: DistProgram) -> Supervisor:
    """The program's Guard or Controller as data (tests/_train_cases.py)."""
    return Supervisor(program.supervisor, tuple(SETTINGS[program.supervisor](program).items()))


def _fp8_blocks(program: DistProgram, rank: int) -> str:
    """The regular expression of the blocks rank ``rank`` puts in fp8 (``stages``: every second
    one, by the name its module goes by: a block shared with an earlier one is named as that one)."""
    if not program.stages:
        return r"^blocks\."
    shared = program.shape.shared
    named = {shared[0] if shared is not None and i == shared[1] else i
             for i in range(program.shape.blocks) if i % 2 == rank}
    return rf"^blocks\.({'|'.join(str(i) for i in sorted(named))})\."


def _setup(program: DistProgram, rank: int = 0) -> tuple[torch.nn.Module, Any, Any, Any, Any]:
    """model, optimizer, scaler, supervisor, region factory."""
    import mixprec
    from mixprec import Policy, fp8

    model = Net(program.shape)
    watch = supervisor_of(program)
    supervisor, kind = watch.build(), watch.feature.keyword
    if program.route == "convert":
        names = re.compile(_fp8_blocks(program, rank))
        model = fp8.convert(model, program.recipe, filter_fn=lambda m, fqn: bool(names.search(fqn)),
                            fsdp_fp8_all_gather=FSDP_MODES[program.fsdp].fp8_all_gather,
                            backend=program.backend,
                            **{kind: supervisor})

        def region() -> Any:
            return mixprec.autocast("cpu", dtype=torch.bfloat16)
    else:
        policy = Policy.parse("compute=bf16").fp8(program.recipe, names=_fp8_blocks(program, rank), first_last="fp8",
                                                  backend=program.backend, **{kind: supervisor})
        if program.json:
            policy = Policy.from_json(policy.to_json())
            supervisor = getattr(policy.fp8_rule, kind)

        def region() -> Any:
            return mixprec.autocast("cpu", policy=policy)
    if FSDP_MODES[program.fsdp].sharded:
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
                    loss = loss_of(model(x, step, rank, m))
                (scaler.scale(loss) if scaler is not None else loss).backward()
            costed = supervisor_of(program).costed
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
