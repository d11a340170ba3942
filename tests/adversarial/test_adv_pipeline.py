"""Pipeline programs on 2 gloo ranks (``_adv_pp.py``): 2 stages, ``ScheduleGPipe`` or
``Schedule1F1B``, the micro-batch count, the split point, the scaler's initial scale and growth
interval, the pipeline's group (``"default"`` or ``(mesh, "pp")``) and the data's scale (fp16
overflowing on its own) drawn, infs planted in a stage's gradients at drawn steps, and per-layer
scaling drawn (every stage's scaler watching its stage).

Invariants: the stages skip the same steps (the found-inf all-reduce over the pipeline's group)
and hold the same scale; the scales, the skipped steps and every weight are bitwise those of
``torch.amp.GradScaler`` on the unsplit model in one process (computed on each rank); with
per-layer scaling, those and the factors after every step are mixprec's
``GradScaler(per_layer=True)``'s on the unsplit model; no hang.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from _adv_pp import PPProgram, run_rank
from _adv_profile import profile
from _adv_ranks import RankPool

pytestmark = [pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
              pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def pool() -> Iterator[RankPool]:
    ranks = RankPool(world=2, hang_after=60.0)
    try:
        yield ranks
    finally:
        ranks.close()


@st.composite
def pp_programs(draw: st.DrawFn) -> PPProgram:
    schedule = draw(st.sampled_from(["gpipe", "1f1b"]))
    steps = draw(st.integers(2, 5))
    infs = draw(st.lists(st.tuples(st.integers(0, steps - 1), st.integers(0, 1)), max_size=2, unique=True))
    return PPProgram(schedule=schedule, micro=draw(st.sampled_from([1, 2, 4] if schedule == "gpipe" else [2, 4])),
                     steps=steps, infs=tuple(infs), split=draw(st.sampled_from([2, 4, 6])),
                     init_scale=draw(st.sampled_from([2.0**10, 2.0**16])),
                     growth_interval=draw(st.sampled_from([1, 2, 3])), group=draw(st.sampled_from(["default", "mesh"])),
                     gain=draw(st.sampled_from([1.0, 1.0, 300.0])), seed=draw(st.integers(0, 3)),
                     per_layer=draw(st.booleans()))


def check(pool: RankPool, p: PPProgram) -> None:
    results = pool.run(run_rank, p)
    for rank, r in enumerate(results):
        assert r["error"] is None, f"rank {rank} raised:\n{r['error']}"
    oracle = results[0]["oracle"]
    assert results[1]["oracle"]["scales"] == oracle["scales"]
    for rank, r in enumerate(results):
        assert r["skipped"] == oracle["skipped"], f"stage {rank} skipped {r['skipped']}, the oracle {oracle['skipped']}"
        assert r["scales"] == oracle["scales"], f"stage {rank}: scales {r['scales']}, the oracle {oracle['scales']}"
        assert r["factors"] == oracle["factors"], f"stage {rank}: factors {r['factors']}, the oracle {oracle['factors']}"
        for name, weight in r["weights"].items():
            assert torch.equal(weight, oracle["weights"][name]), f"stage {rank}: {name} is not the oracle's"
    for at, _ in p.infs:
        assert oracle["skipped"][at], f"the inf planted at step {at} skipped nothing"


#: An inf in stage 0 at step 0 and in stage 1 at step 2, 1F1B over 4 micro-batches, a growth every step.
KNOWN = PPProgram(schedule="1f1b", micro=4, steps=4, infs=((0, 0), (2, 1)), growth_interval=1, group="mesh")


#: The same with per-layer scaling, split after the second block: stage 0 holds cut point '0', stage 1 '2', '4'.
KNOWN_PER_LAYER = PPProgram(schedule="gpipe", micro=2, steps=4, infs=((1, 0), (2, 1)), split=2, per_layer=True)


def test_known_pipeline_program(pool: RankPool) -> None:
    check(pool, KNOWN)


def test_known_per_layer_pipeline_program(pool: RankPool) -> None:
    check(pool, KNOWN_PER_LAYER)


@profile(fast_examples=4)
@given(program=pp_programs())
def test_pipeline_programs_match_the_unsplit_oracle(pool: RankPool, program: PPProgram) -> None:
    check(pool, program)
