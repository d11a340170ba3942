"""scripts/gpu-check.sh without a GPU, and benchmarks/gpu.py's every section as a CPU smoke run."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_benchmark_quick_smoke_run_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu.md"
    proc = subprocess.run([sys.executable, "benchmarks/gpu.py", "--device", "cpu", "--quick", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    rows = {line.split("|")[1].strip() for line in text.splitlines() if line.startswith("| ")}
    assert {"mixprec-fp16", "mixprec-bf16", "mixprec-fp16-layerwise", "mixprec-fp8-rowwise", "mixprec-tensorwise",
            "torchao-tensorwise", "mixprec-rowwise", "torchao-rowwise", "mixprec-tensorwise-controller"} <= rows
    assert "| mixprec-rowwise |" in text and "emulated |" in text  # no GPU: emulated GEMMs, said so
    assert "2 fused AdamW steps per mode" in text.splitlines()[-1]


@pytest.mark.slow
def test_gemm_table_quick_smoke_run_on_cpu(tmp_path: Path) -> None:
    """benchmarks/gemm_table.py (gpu-check.sh's GEMM table) on the CPU: every recipe, emulated, said so."""
    out = tmp_path / "gpu.md"
    out.write_text("# before\n")
    proc = subprocess.run([sys.executable, "benchmarks/gemm_table.py", "--device", "cpu", "--quick", "--out", str(out),
                           "--append"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    assert text.startswith("# before\n") and "## GEMM table: CPU" in text
    rows = [line.split("|")[1:-1] for line in text.splitlines() if line.startswith("| ") and "recipe" not in line]
    assert {r[0].strip() for r in rows} == {"tensorwise", "rowwise", "blockwise", "mxfp8", "mxfp4", "nvfp4"}
    assert {r[2].strip() for r in rows} == {"emulated"} and {r[3].strip() for r in rows} == {"-"}
    assert all(0 < float(r[7]) < 0.5 for r in rows)  # relative error against fp32: fp4 about 0.15


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="checks the no-GPU mode")
def test_gpu_check_without_gpu_runs_the_fake_tier_and_exits_0() -> None:
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["bash", "scripts/gpu-check.sh"], cwd=ROOT, capture_output=True, text=True,
                          timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("gpu-check: fake-CUDA tier passed") and "needs a CUDA GPU" in last


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="checks the no-GPU mode")
def test_gpu_check_with_a_python_without_torch_says_what_to_do(tmp_path: Path) -> None:
    """Issue 38: a Python without torch ran the fake tier and failed with 'No module named torch'."""
    bare = tmp_path / "python"
    bare.write_text("#!/bin/sh\nexec env -u PYTHONPATH python3 -S -I \"$@\"\n")
    bare.chmod(0o755)
    proc = subprocess.run(["bash", "scripts/gpu-check.sh"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHON": str(bare)})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "has no torch or pytest; run bash scripts/venv.sh or set PYTHON" in proc.stderr
