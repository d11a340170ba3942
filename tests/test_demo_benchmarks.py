"""The benchmark runner (``python -m benchmarks``) and the GPU benchmark's CPU smoke run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.run import Row, format_table, run_all  # noqa: E402


def test_run_all_reports_missing_and_failing_benchmarks(tmp_path: Path, monkeypatch) -> None:
    pkg = tmp_path / "fakebench"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "good.py").write_text("def run(quick=False):\n    return {'x': 0.5 if quick else 2.0}\n")
    (pkg / "bad.py").write_text("def run(quick=False):\n    raise RuntimeError('boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    adapters = {
        name: (lambda res, name=name: [Row(name, k, v, "ref") for k, v in res.items()])
        for name in ("good", "bad", "absent")
    }
    logged: list[str] = []
    rows, problems = run_all(quick=True, benchmarks=adapters, package="fakebench", log=logged.append)
    assert rows == [Row("good", "x", 0.5, "ref")]
    assert problems == [
        "fakebench.bad: failed (RuntimeError: boom)",
        "fakebench.absent: not available (ModuleNotFoundError: No module named 'fakebench.absent')",
    ]
    assert all(p in logged for p in problems)


def test_format_table_text_and_markdown() -> None:
    rows = [Row("scaler_overhead", "sgd", 1.0234, "torch.amp.GradScaler", "")]
    text = format_table(rows).splitlines()
    assert text[0].split() == ["benchmark", "figure", "ratio", "reference", "detail"]
    assert "1.023" in text[2]
    md = format_table(rows, markdown=True).splitlines()
    assert md[1] == "|---|---|---:|---|---|" and md[2].startswith("| scaler_overhead | sgd | 1.023 |")


def test_python_m_benchmarks_quick_runs_every_benchmark() -> None:
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--quick"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    names = {line.split()[0] for line in proc.stdout.splitlines()[2:] if line.strip()}
    assert names == {"autocast_overhead", "scaler_overhead", "lowp_memory", "diagnostics_overhead"}


def test_gpu_benchmark_smoke_run_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu.md"
    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu.py", "--device", "cpu", "--tiny", "--steps", "2", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    table = out.read_text().splitlines()
    assert table[0].startswith("| mode | tokens/s | vs fp32 | vs torch.amp | peak memory (MiB)")
    modes = [line.split("|")[1].strip() for line in table[2:7]]
    assert modes == ["fp32", "torch-amp", "mixprec-fp16", "torch-amp-bf16", "mixprec-bf16"]
    assert table[4].split("|")[4].strip().endswith("x")  # mixprec-fp16 against torch-amp
    assert "2 AdamW steps per mode" in table[-1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_gpu_benchmark_refuses_cuda_without_cuda() -> None:
    proc = subprocess.run([sys.executable, "benchmarks/gpu.py", "--device", "cuda"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "CUDA is not available" in proc.stderr
