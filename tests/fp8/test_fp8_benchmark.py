"""benchmarks/fp8.py runs end to end (quick mode) and its rows fit the benchmark runner."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

pytest.importorskip("torchao.float8")


@pytest.mark.slow
def test_fp8_benchmark_quick_run():
    from benchmarks import fp8 as bench
    from benchmarks.run import BENCHMARKS, format_table

    res = bench.run(quick=True)
    assert set(res["step_ms"]) == {"fp32", "bf16", "torchao", "mixprec", "mixprec+stats"}
    assert res["saved_ratio_linear"] == pytest.approx(0.25, abs=0.01)
    assert res["saved_bytes"]["torchao"] == res["saved_bytes"]["fp32"]
    rows = BENCHMARKS["fp8"](res)
    assert [r.figure for r in rows][:2] == ["training step, fp8 tensorwise", "training step, fp8 + guard statistics"]
    assert "torchao emulate" in format_table(rows)
