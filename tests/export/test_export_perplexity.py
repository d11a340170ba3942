"""benchmarks/export_perplexity.py (the quality table of docs/export.md) at a smoke size: every route
is exported, read back and measured, and each quantization read back took effect."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed (pip install mixprec[export])")
pytest.importorskip("safetensors", reason="safetensors is not installed")

from benchmarks import export_perplexity as bench  # noqa: E402


def _table(out: str) -> dict[str, tuple[str, str, float, float]]:
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0] in {r[0] for r in bench.ROUTES}:
            rows[cells[0]] = (cells[1], cells[2], float(cells[3]), float(cells[4]))
    return rows


def test_table_has_every_route_read_back_and_each_quantization_took_effect(capsys) -> None:
    bench.main(["--steps", "3", "--val-batches", "1", "--calib-samples", "16"])
    out = capsys.readouterr().out
    rows = _table(out)
    assert list(rows) == [r[0] for r in bench.ROUTES], out
    for route, trained, reader in bench.ROUTES:
        assert rows[route][:2] == (trained, reader)
        assert math.isfinite(rows[route][2]) and rows[route][2] > 1.0, (route, rows[route])
    assert "CPU " in out and "load " in out and " UTC" in out
    # every quantized route differs from the fp32 weights of its training (nothing silently not quantized),
    # and the fp8 KV cache from the static model it runs on
    fp32 = rows[bench.ROUTES[0][0]][2]
    for route, *_ in bench.ROUTES[1:6]:
        assert rows[route][2] != fp32, route
    static = rows[bench.ROUTES[2][0]][2]
    for route, *_ in bench.ROUTES[4:6]:
        assert rows[route][2] != static, route
    for route, *_ in bench.ROUTES[6:]:
        assert rows[route][3] != 1.0, route


def test_measure_rejects_a_calibration_smaller_than_one_batch() -> None:
    with pytest.raises(ValueError, match="calib_samples must be >= the batch size 8"):
        bench.measure(steps=1, calib_samples=4)
