"""2 gloo ranks running generated fp8 and fp4 programs with a Guard or a Controller (policy
route, also through JSON, or ``fp8.convert``; FSDP2 with and without fp8 all-gather; a GradScaler
agreeing over the group; ``mxfp4``/``nvfp4`` with the Controller per GEMM on an fp4 ladder), with
asymmetric data, uneven micro-batch counts, a rank with no forward on a step, a lagging rank.

Invariants: no rank hangs (the pool's watchdog fails the test with every rank's stacks); the
ranks issue the same collectives in the same order (name, shape, dtype); every rank takes the
same decisions at the same steps; nothing raises, except a ``ValueError``/``TypeError`` while
setting up or on the first step (a configuration refused up front). Ranks that read the same
data (``same_data``, their global generators seeded differently) end with bitwise the same
weights: NVFP4's stochastic rounding draws the same on every rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from _adv_dist import FP4, FSDP_MODES, QUICK, DistProgram, run_rank
from _adv_profile import profile
from _adv_programs import Shape, Step, shapes, steps
from _adv_ranks import RankPool
from _train_cases import RECIPES

pytestmark = [pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
              pytest.mark.distributed, pytest.mark.slow]

DOCUMENTED = ("ValueError", "TypeError")


@pytest.fixture(scope="module")
def pool() -> Iterator[RankPool]:
    ranks = RankPool(world=2, hang_after=30.0)
    try:
        yield ranks
    finally:
        ranks.close()


def check(pool: RankPool, program: DistProgram) -> list[dict]:
    """Run ``program`` on 2 ranks and assert the invariants (module docstring); the ranks' results."""
    results = pool.run(run_rank, program)
    errors = [(rank, r) for rank, r in enumerate(results) if r["error"] is not None]
    for rank, r in errors:
        refused_up_front = r["error_type"] in DOCUMENTED and r["error_step"] is not None and r["error_step"] <= 0
        assert refused_up_front, f"rank {rank} raised after setup:\n{r['error']}"
    if errors:
        assert len(errors) == len(results), f"only rank(s) {[e[0] for e in errors]} refused the program"
        return results
    calls = [r["collectives"] for r in results]
    assert len(calls[0]) == len(calls[1]) and all(
        a[:3] == b[:3] for a, b in zip(*calls)), _first_difference(calls)
    for t, (d0, d1) in enumerate(zip(results[0]["decisions"], results[1]["decisions"])):
        assert d0 == d1, f"step {t}: rank 0 decided {d0}, rank 1 {d1}"
    assert results[0]["scale"] == results[1]["scale"]
    if program.same_data:
        assert results[0]["weights"] == results[1]["weights"], "ranks on the same data: weights differ"
    return results


def _first_difference(calls: list[list[tuple]]) -> str:
    for i, (a, b) in enumerate(zip(*calls)):
        if a[:3] != b[:3]:
            return f"collective {i} differs: rank 0 {a}, rank 1 {b}"
    return (f"rank 0 issued {len(calls[0])} collectives, rank 1 {len(calls[1])}; the extra ones: "
            f"{calls[0][len(calls[1]):][:4] or calls[1][len(calls[0]):][:4]}")


@st.composite
def controller_schedules(draw: st.DrawFn) -> tuple[tuple[str, int], ...]:
    """A Controller's schedule settings: trend and demotion windows, dwell, shadow steps, horizon."""
    return (("trend_windows", draw(st.sampled_from([1, 3]))), ("min_dwell", draw(st.sampled_from([2, 30]))),
            ("demote_windows", draw(st.sampled_from([1, 2, 3]))), ("shadow_steps", draw(st.sampled_from([1, 2]))),
            ("horizon", draw(st.sampled_from([1, 3]))))


@st.composite
def dist_programs(draw: st.DrawFn) -> DistProgram:
    mode = FSDP_MODES[draw(st.sampled_from(["none", "none", "fsdp", "fsdp_fp8"]))]
    route = "convert" if mode.fp8_all_gather else draw(st.sampled_from(["policy", "convert"]))
    shape = draw(shapes(widths=(16, 32), max_blocks=3, sharing=not mode.sharded))
    same_calls = mode.sharded  # FSDP2 needs the same forwards on every rank
    schedule = draw(steps(shape.blocks, ranks=2, max_steps=12, min_steps=3, uneven=not same_calls,
                          skips=draw(st.booleans()), ))
    supervisor = draw(st.sampled_from(["guard", "controller"]))
    recipe = "tensorwise" if mode.fp8_all_gather else draw(st.sampled_from(["tensorwise", "rowwise"]))
    drift = draw(st.sampled_from([(1.0, 1.0), (2.0, 1.0), (1.0, 1.6), (2.0, 2.0)]))
    outlier = draw(st.one_of(st.none(), st.tuples(st.integers(0, 1), st.integers(0, len(schedule) - 1))))
    return DistProgram(
        shape=shape, steps=schedule, supervisor=supervisor, every=draw(st.sampled_from([1, 2, 3])), route=route,
        json=route == "policy" and draw(st.booleans()), recipe=recipe, fsdp=mode.key, drift=drift, outlier=outlier,
        lag_rank=draw(st.sampled_from([None, 0, 1])), scaler=draw(st.booleans()),
        controller=draw(controller_schedules()), stages=not mode.sharded and draw(st.booleans()))


@st.composite
def fp4_programs(draw: st.DrawFn) -> DistProgram:
    """fp4 recipes with a Guard or a Controller (per GEMM or whole-layer, on the fp4 ladder), no
    FSDP2 fp8 all-gather (tensorwise only), widths that are multiples of the recipe's blocks."""
    recipe = draw(st.sampled_from(FP4))
    mode = FSDP_MODES[draw(st.sampled_from(["none", "none", "fsdp"]))]
    shape = draw(shapes(widths=RECIPES[recipe].widths, max_blocks=3, sharing=not mode.sharded))
    same_data = not mode.sharded and draw(st.booleans())
    schedule = draw(steps(shape.blocks, ranks=2, max_steps=10, min_steps=3, uneven=not mode.sharded and not same_data,
                          skips=draw(st.booleans())))
    if same_data:
        schedule = tuple(dataclasses.replace(s, rows=(s.rows[0], s.rows[0])) for s in schedule)
    route = draw(st.sampled_from(["policy", "convert"]))
    supervisor = draw(st.sampled_from(["controller", "controller", "guard"]))
    per_gemm = draw(st.booleans())
    loss_cost = draw(st.sampled_from([None, 1e-3, 0.0]))
    return DistProgram(
        shape=shape, steps=schedule, supervisor=supervisor, every=draw(st.sampled_from([1, 2, 3])), route=route,
        json=route == "policy" and draw(st.booleans()), recipe=recipe, fsdp=mode.key,
        drift=draw(st.sampled_from([(1.0, 1.0), (2.0, 1.0), (1.0, 1.6)])),
        outlier=draw(st.one_of(st.none(), st.tuples(st.integers(0, 1), st.integers(0, len(schedule) - 1)))),
        lag_rank=draw(st.sampled_from([None, 0, 1])), scaler=draw(st.booleans()),
        controller=draw(controller_schedules()), per_gemm=per_gemm, same_data=same_data,
        stages=not mode.sharded and not same_data and draw(st.booleans()),
        backend=draw(st.sampled_from(["auto", "emulate_fp32"])), loss_cost=loss_cost,
        backward_cost=draw(st.sampled_from([None, 1e-4, 0.0])) if per_gemm else None,
        row_share=draw(st.sampled_from([1.0, 0.5, 0.25])) if loss_cost is not None else 1.0,
        cost_scope=draw(st.sampled_from(["gemm", "model"])) if loss_cost is not None else "gemm")


_BLOCKS = Shape(width=32, blocks=3, gain=1.0, out=1)
_STEADY = tuple(Step(rows=((8,), (8,))) for _ in range(8))

#: Issue 25, item 2: rank 1 skips its first micro-batch; the Guard's check all-reduce on the
#: ranks then pair with each other's previous call: decisions move, then a hang.
ITEM2_GUARD = DistProgram(shape=_BLOCKS, steps=(Step(rows=((8,), ())),) + _STEADY, supervisor="guard",
                          every=1, route="policy", drift=(1.6, 1.0))
#: The same with a Controller.
ITEM2_CONTROLLER = DistProgram(shape=_BLOCKS, steps=(Step(rows=((8,), ())),) + _STEADY, supervisor="controller",
                               every=1, route="policy", drift=(1.6, 1.0), controller=QUICK)
#: Uneven gradient-accumulation micro-batch counts per rank (2 against none, then 3 against 1).
ITEM2_UNEVEN = DistProgram(shape=_BLOCKS, steps=(Step(rows=((8, 8), ())),) + tuple(
    Step(rows=((8, 8, 8), (8,))) for _ in range(8)), supervisor="controller", every=2, route="policy",
    drift=(1.6, 1.0), controller=QUICK)
#: Issue 25, item 3: FSDP2 fp8 all-gather with a Controller; a drifting input feature promotes a
#: layer to rowwise (step 10 in the issue) and the next forward raised ValueError.
ITEM3 = DistProgram(shape=Shape(width=32, blocks=3, gain=1.0, out=1),
                    steps=tuple(Step(rows=((8,), (8,))) for _ in range(14)), supervisor="controller", every=2,
                    route="convert", recipe="tensorwise", fsdp="fsdp_fp8", drift=(2.0, 2.0), controller=QUICK)


#: The per-GEMM Controller on the NVFP4 ladder (stochastic rounding on), rank 0's data drifting,
#: uneven micro-batches (rank 1 none on the first step, then 3 against 1).
FP4_UNEVEN = DistProgram(shape=_BLOCKS, steps=(Step(rows=((8, 8), ())),) + tuple(
    Step(rows=((8, 8, 8), (8,))) for _ in range(7)), supervisor="controller", every=2, route="policy",
    recipe="nvfp4", drift=(1.6, 1.0), controller=QUICK, per_gemm=True)
#: The same on MXFP4 through fp8.convert (GEMMs in float32), a GradScaler over the group (whose
#: scale the loss cost divides out), skipped blocks and an early exit.
FP4_CONVERT = DistProgram(shape=_BLOCKS, steps=(Step(skip=frozenset({1}), rows=((8,), (8, 8))), Step(
    depth=2, rows=((), (8,)))) + tuple(Step(rows=((8, 4), (8,))) for _ in range(6)), supervisor="controller",
    every=1, route="convert", recipe="mxfp4", drift=(1.0, 2.0), controller=QUICK, per_gemm=True, scaler=True,
    backend="emulate_fp32", loss_cost=1e-4)
#: The uneven NVFP4 program with the backward GEMMs' loss cost (a reach walked on each rank over
#: its own graph, gains from uneven micro-batches, every layer measured: a 0 limit).
FP4_BACKWARD = dataclasses.replace(FP4_UNEVEN, backend="emulate_fp32", scaler=True, loss_cost=1e-3, backward_cost=0.0)
#: The same on a quarter of the rows (cost_row_share=0.25: every rank draws the step's rows, its
#: micro-batches of 8 rows two each, the empty one none)
FP4_BACKWARD_ROWS = dataclasses.replace(FP4_BACKWARD, row_share=0.25)
#: The backward-cost program on ranks that know different layers (stages): the input gradients'
#: costs sum the gains of the layers before them, in an order every rank must agree on (found:
#: each rank's own tracking order, its peer's layers last: the ranks decided apart at step 6)
FP4_BACKWARD_STAGES = dataclasses.replace(FP4_BACKWARD, stages=True)
#: The same with the limits the model's, shared out by each layer's size (a rank takes its
#: peer's layers' sizes from their metadata)
FP4_MODEL_SCOPE_STAGES = dataclasses.replace(FP4_BACKWARD_STAGES, cost_scope="model")
#: Both ranks on rank 0's data, their global generators seeded apart: NVFP4's stochastic
#: rounding must draw the same (bitwise equal weights).
FP4_SAME_DATA = DistProgram(shape=_BLOCKS, steps=tuple(Step(rows=((8, 8), (8, 8))) for _ in range(6)),
                            supervisor="controller", every=2, route="policy", recipe="nvfp4", drift=(1.6, 1.6),
                            controller=QUICK, per_gemm=True, same_data=True)

#: The ranks know different layers, as many on each (pipeline-like stages: rank 0 puts block 0 in
#: fp8, rank 1 block 1), and rank 0's first batch has an outlier that its fp8 layer sees. The
#: check must reduce the rows of the same layers (the header compares the names' CRC, not only
#: their count): both ranks agree that block 0 falls back, and no rank decides on block 1.
STAGES = DistProgram(shape=Shape(width=32, blocks=2, gain=1.0, out=1), steps=_STEADY[:4], supervisor="guard",
                     every=1, route="policy", outlier=(0, 0), stages=True)

#: A bad sample (NaN) on rank 1 at step 2, a GradScaler over the group: the overflow flag is
#: all-reduced, so both ranks skip that step and back off alike (equal loss scales).
NAN_ON_ONE_RANK = DistProgram(shape=_BLOCKS, steps=_STEADY[:5], supervisor="guard", every=1, route="policy",
                              outlier=(1, 2), outlier_value=float("nan"), scaler=True)

KNOWN = [pytest.param(NAN_ON_ONE_RANK, id="nan-batch-on-one-rank-scaler-over-the-group"),
         pytest.param(ITEM2_GUARD, id="item2-guard-first-microbatch-skipped"),
         pytest.param(ITEM2_CONTROLLER, id="item2-controller-first-microbatch-skipped"),
         pytest.param(ITEM2_UNEVEN, id="item2-guard-uneven-microbatches"),
         pytest.param(ITEM3, id="item3-fsdp-fp8-all-gather-controller")]


@pytest.mark.parametrize("program", KNOWN)
def test_known_programs(pool: RankPool, program: DistProgram) -> None:
    check(pool, program)


def test_ranks_that_know_different_layers_of_the_same_count(pool: RankPool) -> None:
    results = check(pool, STAGES)
    assert all(r["error"] is None for r in results)
    assert [d["layer"] for d in results[0]["decisions"][0]] == ["blocks.0.0"], results[0]["decisions"]


@pytest.mark.parametrize("program", [pytest.param(FP4_UNEVEN, id="nvfp4-per-gemm-uneven-drift"),
                                     pytest.param(FP4_CONVERT, id="mxfp4-per-gemm-convert-scaler-skips"),
                                     pytest.param(FP4_SAME_DATA, id="nvfp4-sr-same-data"),
                                     pytest.param(FP4_BACKWARD, id="nvfp4-per-gemm-backward-cost-uneven"),
                                     pytest.param(FP4_BACKWARD_ROWS, id="nvfp4-per-gemm-backward-cost-uneven-quarter-rows"),
                                     pytest.param(FP4_BACKWARD_STAGES, id="nvfp4-per-gemm-backward-cost-stages"),
                                     pytest.param(FP4_MODEL_SCOPE_STAGES, id="nvfp4-per-gemm-model-scope-stages")])
def test_fp4_per_gemm_controller(pool: RankPool, program: DistProgram) -> None:
    """The per-GEMM Controller on an fp4 ladder over 2 ranks: it decides (promotions away from
    fp4, per GEMM) and the ranks agree (same decisions, same collectives, no hang)."""
    results = check(pool, program)
    assert all(r["error"] is None for r in results)
    decided = [d for step in results[0]["decisions"] for d in step]
    assert decided and {d["gemm"] for d in decided} - {None}, f"no per-GEMM decision: {decided}"
    if program.backward_cost is not None:  # (the ranks agreed on decisions their reaches and gains shaped)
        assert any(d.get("statistic") == "backward_cost" for d in decided), decided


@profile(fast_examples=2)
@given(program=fp4_programs())
def test_fp4_ranks_agree_and_stay_aligned(pool: RankPool, program: DistProgram) -> None:
    check(pool, program)


@profile(fast_examples=6)
@given(program=dist_programs())
def test_ranks_agree_and_stay_aligned(pool: RankPool, program: DistProgram) -> None:
    check(pool, program)
