"""Several threads training at once, each with its own model, policy and scaler: plain bf16
autocast, a policy with an op edit (through JSON), an fp8 policy with a Guard, per-layer scaling,
an NVFP4 policy (Hadamard, stochastic rounding), a per-GEMM Controller on an fp4 ladder
(``mxfp4`` or ``nvfp4``, then ``tensorwise``, ``rowwise``, ``compute``).

Reference: each thread's program run alone, first, in the main thread. Run concurrently (the
threads released together by a barrier), every program must end with bitwise the same weights,
loss scale and fp8 decisions: a region's policy, kernels and statistics belong to its thread.

The regions run with ``cache_enabled=False``. PyTorch's cast cache is one map for the process
(``autocast_mode.cpp``: a static map under a mutex) while the nesting count that clears it is per
thread, so any thread leaving its outermost region clears every thread's cached casts. A weight
used twice in one forward (a shared or tied block) is then sometimes cast twice instead of once,
and its two gradients are summed in float32 instead of bf16: not bitwise the lone run, with plain
``torch.autocast`` and ``torch.amp.GradScaler`` too (5 of 60 two-thread runs of one program here,
0 of 60 in float32). Without the cache every use casts, alone and in threads alike.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mixprec
from _adv_profile import profile
from _adv_programs import Net, Shape, Step, batch, loss_of, shapes, steps
from mixprec import Policy, fp8

KINDS = ("bf16", "tanh_fp32_json", "fp8_guard", "per_layer_fp32", "nvfp4", "mxfp4_controller",
         "nvfp4_controller")
#: the widths a kind's layers may have: fp4 ones multiples of their blocks (mxfp4: 32).
WIDTHS = {"mxfp4_controller": (32,)}


@dataclass(frozen=True)
class Job:
    kind: str
    shape: Shape
    steps: tuple[Step, ...]


#: Net() seeds torch's global generator: threads build their models one at a time.
_BUILD = threading.Lock()


def run_job(job: Job, start: threading.Barrier | None = None) -> dict[str, Any]:
    with _BUILD:
        model = Net(job.shape)
    guard: Any = None
    policy: Any = None
    if job.kind == "tanh_fp32_json":
        policy = Policy.from_json(Policy.parse("compute=bf16").with_ops(fp32=["tanh"]).to_json())
    elif job.kind == "fp8_guard":
        guard = fp8.Guard(every=1)
        policy = Policy.parse("compute=bf16").fp8("tensorwise", names=r"^blocks\.", first_last="fp8", guard=guard)
    elif job.kind == "nvfp4":
        policy = Policy.parse("compute=bf16").fp8("nvfp4", names=r"^blocks\.", first_last="fp8")
    elif job.kind.endswith("_controller"):
        recipe = job.kind.split("_")[0]
        guard = mixprec.Controller(every=1, ladder=(recipe, "tensorwise", "rowwise", "compute"), per_gemm=True,
                                   trend_windows=1, min_dwell=2, demote_windows=1)
        policy = Policy.parse("compute=bf16").fp8(recipe, names=r"^blocks\.", first_last="fp8", controller=guard)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = mixprec.GradScaler("cpu", init_scale=2.0**6, growth_interval=2,
                                per_layer=job.kind == "per_layer_fp32").watch(model)
    if start is not None:
        start.wait()
    for t, step in enumerate(job.steps):
        for m, rows in enumerate(step.rows[0]):
            x = batch(job.shape, job.shape.seed, t, 0, m, rows, drift=2.0)
            if job.kind == "per_layer_fp32":
                loss = loss_of(model(x, step))
            else:
                region = (mixprec.autocast("cpu", policy=policy, cache_enabled=False) if policy is not None
                          else mixprec.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False))
                with region:
                    loss = loss_of(model(x, step))
            scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        if guard is not None:
            guard.step()
    return {"weights": {n: p.detach().clone() for n, p in model.named_parameters()}, "scale": scaler.get_scale(),
            "decisions": None if guard is None else sorted(str(d) for d in (
                guard.decisions.values() if isinstance(guard, fp8.Guard) else guard.log))}


@st.composite
def jobs(draw: st.DrawFn) -> tuple[Job, ...]:
    out = []
    for _ in range(draw(st.integers(2, 4))):
        kind = draw(st.sampled_from(KINDS))
        # per-layer scaling refuses a block run twice per step (documented): no shared blocks there
        shape = draw(shapes(widths=WIDTHS.get(kind, (16, 32)), max_blocks=3, sharing=kind != "per_layer_fp32"))
        out.append(Job(kind, shape, draw(steps(shape.blocks, max_steps=5))))
    return tuple(out)


def run_threads(program: tuple[Job, ...]) -> None:
    alone = [run_job(job) for job in program]
    results: list[Any] = [None] * len(program)
    start = threading.Barrier(len(program))

    def work(i: int) -> None:
        try:
            results[i] = run_job(program[i], start)
        except BaseException as exc:  # reported below, with the job
            results[i] = exc

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(program))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    for i, (job, ref, got) in enumerate(zip(program, alone, results)):
        assert not isinstance(got, BaseException), f"thread {i} ({job.kind}) raised {got!r}"
        assert got is not None, f"thread {i} ({job.kind}) did not finish in 120 s"
        assert got["scale"] == ref["scale"] and got["decisions"] == ref["decisions"], (i, job.kind, got, ref)
        differ = [n for n in ref["weights"] if not torch.equal(ref["weights"][n], got["weights"][n])]
        assert not differ, f"thread {i} ({job.kind}): weights differ from the program run alone: {differ}"


@profile(fast_examples=4)
@given(program=jobs())
def test_threads_train_as_if_alone(program: tuple[Job, ...]) -> None:
    run_threads(program)



#: fp4 in 3 threads at once, beside fp8: NVFP4 with stochastic rounding (its draws seeded per
#: layer and step, not from a shared generator), both per-GEMM Controllers on fp4 ladders (drift
#: makes them promote), a skipped block, an early exit, accumulation and an empty micro-batch.
_FP4_STEPS = (Step(rows=((8, 4),)), Step(skip=frozenset({1}), rows=((8,),)), Step(rows=((0, 8),)),
              Step(depth=1, rows=((8, 8),)), Step(rows=((8,),)))
FP4_JOBS = (Job("nvfp4", Shape(width=16, blocks=2, gain=0.3, seed=1), _FP4_STEPS),
            Job("mxfp4_controller", Shape(width=32, blocks=2, gain=0.3, seed=2), _FP4_STEPS),
            Job("nvfp4_controller", Shape(width=32, blocks=3, gain=1.0, seed=3), _FP4_STEPS),
            Job("fp8_guard", Shape(width=16, blocks=2, seed=0), _FP4_STEPS))


def test_fp4_threads_train_as_if_alone() -> None:
    """Part of the fast profile (the generated test above is long-only for now)."""
    run_threads(FP4_JOBS)
