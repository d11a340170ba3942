"""Several threads training at once, each with its own model, policy and scaler: plain bf16
autocast, a policy with an op edit (through JSON), an fp8 policy with a Guard, per-layer scaling,
an NVFP4 policy (Hadamard, stochastic rounding), a per-GEMM Controller on an fp4 ladder
(``mxfp4`` or ``nvfp4``, then ``tensorwise``, ``rowwise``, ``compute``).

Reference: each thread's program run alone, first, in the main thread. Run concurrently (the
threads released together by a barrier), every program must end with bitwise the same weights,
loss scale and fp8 decisions: a region's policy, kernels and statistics belong to its thread.

The regions of programs with a weight used twice in one forward run with ``cache_enabled=False``; the others draw the
cache on or off, and their reference, alone, runs with it off (the cache must change nothing). PyTorch's cast cache is one map for the process
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

@dataclass(frozen=True)
class Kind:
    """One feature combination a thread trains with, as data (``run_job`` reads the fields, it
    never branches on the name): ``fp32_ops`` an op edit of the policy (through JSON), ``recipe``
    an fp8/fp4 policy on the blocks, ``watcher`` its Guard or per-GEMM Controller (on the fp4
    ladder ``(recipe, tensorwise, rowwise, compute)``), ``per_layer`` per-layer scaling of a
    float32 model (no region), ``widths`` the widths its layers may have (fp4 blocks: mxfp4 32)."""

    name: str
    fp32_ops: tuple[str, ...] = ()
    recipe: str | None = None
    watcher: str | None = None  # None | "guard" | "controller"
    per_layer: bool = False
    widths: tuple[int, ...] = (16, 32)

    @property
    def region(self) -> bool:
        return not self.per_layer


KINDS = {k.name: k for k in (
    Kind("bf16"),
    Kind("tanh_fp32_json", fp32_ops=("tanh",)),
    Kind("fp8_guard", recipe="tensorwise", watcher="guard"),
    Kind("per_layer_fp32", per_layer=True),
    Kind("nvfp4", recipe="nvfp4"),
    Kind("mxfp4_controller", recipe="mxfp4", watcher="controller", widths=(32,)),
    Kind("nvfp4_controller", recipe="nvfp4", watcher="controller"),
)}


@dataclass(frozen=True)
class Job:
    """A thread's program. ``cache``: its region keeps PyTorch's cast cache on (the default of
    ``autocast``); drawn only for shapes without a weight used twice in one forward (see the
    module's docstring). Its reference, run alone, is the same program with the cache off: the
    cache must change nothing, alone or beside other threads."""

    kind: Kind
    shape: Shape
    steps: tuple[Step, ...]
    cache: bool = False


#: Net() seeds torch's global generator: threads build their models one at a time.
_BUILD = threading.Lock()


def _watcher(kind: Kind) -> Any:
    if kind.watcher == "guard":
        return fp8.Guard(every=1)
    if kind.watcher == "controller":
        return mixprec.Controller(every=1, ladder=(kind.recipe, "tensorwise", "rowwise", "compute"), per_gemm=True,
                                  trend_windows=1, min_dwell=2, demote_windows=1)
    return None


def _policy(kind: Kind, watcher: Any) -> Policy | None:
    """The kind's policy; None: plain bf16 autocast (``dtype=``)."""
    if not (kind.fp32_ops or kind.recipe):
        return None
    policy = Policy.parse("compute=bf16")
    if kind.fp32_ops:
        policy = Policy.from_json(policy.with_ops(fp32=list(kind.fp32_ops)).to_json())
    if kind.recipe is not None:
        attach = {"guard": {"guard": watcher}, "controller": {"controller": watcher}}.get(kind.watcher, {})
        policy = policy.fp8(kind.recipe, names=r"^blocks\.", first_last="fp8", **attach)
    return policy


def run_job(job: Job, start: threading.Barrier | None = None, cache: bool | None = None) -> dict[str, Any]:
    """Train ``job`` (``cache``: override the job's cache flag, for its reference)."""
    kind, cache = job.kind, job.cache if cache is None else cache
    with _BUILD:
        model = Net(job.shape)
    guard = _watcher(kind)
    policy = _policy(kind, guard)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = mixprec.GradScaler("cpu", init_scale=2.0**6, growth_interval=2, per_layer=kind.per_layer).watch(model)
    if start is not None:
        start.wait()
    for t, step in enumerate(job.steps):
        for m, rows in enumerate(step.rows[0]):
            x = batch(job.shape, job.shape.seed, t, 0, m, rows, drift=2.0)
            if not kind.region:
                loss = loss_of(model(x, step, 0, m))
            else:
                region = (mixprec.autocast("cpu", policy=policy, cache_enabled=cache) if policy is not None
                          else mixprec.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache))
                with region:
                    loss = loss_of(model(x, step, 0, m))
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
        kind = KINDS[draw(st.sampled_from(sorted(KINDS)))]
        # per-layer scaling refuses a block run twice per step (documented): no shared blocks there
        shape = draw(shapes(widths=kind.widths, max_blocks=3, sharing=not kind.per_layer))
        # the cache on only where no weight is used twice in one forward (the module's docstring)
        cache = kind.region and shape.shared is None and shape.tied is None and draw(st.booleans())
        out.append(Job(kind, shape, draw(steps(shape.blocks, max_steps=5)), cache))
    return tuple(out)


def run_threads(program: tuple[Job, ...]) -> None:
    alone = [run_job(job, cache=False) for job in program]
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
        assert not isinstance(got, BaseException), f"thread {i} ({job.kind.name}) raised {got!r}"
        assert got is not None, f"thread {i} ({job.kind.name}) did not finish in 120 s"
        assert got["scale"] == ref["scale"] and got["decisions"] == ref["decisions"], (i, job.kind.name, job.cache, got, ref)
        differ = [n for n in ref["weights"] if not torch.equal(ref["weights"][n], got["weights"][n])]
        assert not differ, f"thread {i} ({job.kind.name}, cache {job.cache}): weights differ from the program run alone: {differ}"


@profile(fast_examples=4)
@given(program=jobs())
def test_threads_train_as_if_alone(program: tuple[Job, ...]) -> None:
    run_threads(program)



#: fp4 in 3 threads at once, beside fp8: NVFP4 with stochastic rounding (its draws seeded per
#: layer and step, not from a shared generator), both per-GEMM Controllers on fp4 ladders (drift
#: makes them promote), a skipped block, an early exit, accumulation and an empty micro-batch.
_FP4_STEPS = (Step(rows=((8, 4),)), Step(skip=frozenset({1}), rows=((8,),)), Step(rows=((0, 8),)),
              Step(depth=1, rows=((8, 8),)), Step(rows=((8,),)))
FP4_JOBS = (Job(KINDS["nvfp4"], Shape(width=16, blocks=2, gain=0.3, seed=1), _FP4_STEPS),
            Job(KINDS["mxfp4_controller"], Shape(width=32, blocks=2, gain=0.3, seed=2), _FP4_STEPS),
            Job(KINDS["nvfp4_controller"], Shape(width=32, blocks=3, gain=1.0, seed=3), _FP4_STEPS),
            Job(KINDS["fp8_guard"], Shape(width=16, blocks=2, seed=0), _FP4_STEPS))


def test_fp4_threads_train_as_if_alone() -> None:
    """Part of the fast profile (the generated test above is long-only for now)."""
    run_threads(FP4_JOBS)


#: The cast cache on (autocast's default) in 3 threads at once: plain bf16, an op edit through
#: JSON, an fp8 policy with a Guard; no weight used twice in one forward. Each reference runs
#: alone with the cache off, so a cache that keeps a cast past its region (the previous step's
#: weights) or that another thread's region fills or clears wrongly shows as different weights.
_CACHE_STEPS = (Step(rows=((8, 4),)), Step(skip=frozenset({1}), rows=((8,),)), Step(rows=((0, 8),)),
                Step(depth=1, rows=((8, 8),)), Step(rows=((8,),)))
CACHE_JOBS = (Job(KINDS["bf16"], Shape(width=32, blocks=3, gain=0.3, seed=4), _CACHE_STEPS, cache=True),
              Job(KINDS["tanh_fp32_json"], Shape(width=16, blocks=2, gain=1.0, seed=5), _CACHE_STEPS, cache=True),
              Job(KINDS["fp8_guard"], Shape(width=16, blocks=2, gain=0.3, seed=6), _CACHE_STEPS, cache=True))


def test_threads_with_the_cast_cache_on_train_as_if_alone_without_it() -> None:
    run_threads(CACHE_JOBS)
