"""The benchmark runner (``python -m benchmarks``) and the GPU benchmark's CPU smoke run."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch

from mixprec.demo.train import MODES

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.run import Row, format_table, run_all  # noqa: E402


def test_run_all_reports_missing_and_failing_benchmarks(tmp_path: Path, monkeypatch) -> None:
    pkg = tmp_path / "fakebench"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "good.py").write_text("def run(quick=False):\n    return {'x': 0.5 if quick else 2.0}\n")
    (pkg / "bad.py").write_text("def run(quick=False):\n    raise RuntimeError('boom')\n")
    (pkg / "unmeasurable.py").write_text("from benchmarks.run import NotMeasurable\n"
                                         "def run(quick=False):\n    raise NotMeasurable('no kernels here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    adapters = {
        name: (lambda res, name=name: [Row(name, k, v, "ref") for k, v in res.items()])
        for name in ("good", "bad", "unmeasurable", "absent")
    }
    logged: list[str] = []
    rows, problems = run_all(quick=True, benchmarks=adapters, package="fakebench", log=logged.append)
    assert rows == [Row("good", "x", 0.5, "ref")]
    assert problems == [
        "fakebench.bad: failed (RuntimeError: boom)",
        "fakebench.absent: not available (ModuleNotFoundError: No module named 'fakebench.absent')",
    ]
    assert logged[0] == "running good (quick) ..." and "running bad (quick) ..." in logged
    assert "  unmeasurable: skipped (no kernels here)" in logged  # (no failure: logged, with its reason)
    assert not any(p in logged for p in problems)  # reported once, by the caller


def test_each_benchmark_runs_in_a_fresh_process(tmp_path: Path, monkeypatch) -> None:
    """A reference must be PyTorch's own: no benchmark runs where mixprec has registered kernels."""
    pkg = tmp_path / "pidbench"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    code = "import os, sys\ndef run(quick=False):\n    return {'pid': os.getpid(), 'mixprec': 'mixprec' in sys.modules}\n"
    for name in ("one", "two"):
        (pkg / f"{name}.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    import mixprec  # noqa: F401  # loaded here, absent there
    seen = []
    adapters = {name: (lambda res: seen.append(res) or []) for name in ("one", "two")}
    rows, problems = run_all(quick=True, benchmarks=adapters, package="pidbench", log=lambda line: None)
    assert problems == [] and len(seen) == 2
    assert len({r["pid"] for r in seen} | {os.getpid()}) == 3
    assert not any(r["mixprec"] for r in seen)


def test_main_exits_1_and_prints_one_line_per_failing_benchmark(monkeypatch, capsys) -> None:
    from benchmarks import run

    monkeypatch.setattr(run, "BENCHMARKS", {"no_such_benchmark": lambda res: []})
    assert run.main(["--quick"]) == 1
    captured = capsys.readouterr()
    assert captured.err == ("python -m benchmarks: error: benchmarks.no_such_benchmark: not available "
                            "(ModuleNotFoundError: No module named 'benchmarks.no_such_benchmark')\n")
    assert len(captured.out.splitlines()) == 2  # the (empty) table's header and rule


def test_format_table_text_and_markdown() -> None:
    rows = [Row("scaler_overhead", "sgd", 1.0234, "torch.amp.GradScaler", "")]
    text = format_table(rows).splitlines()
    assert text[0].split() == ["benchmark", "figure", "ratio", "reference", "detail"]
    assert "1.023" in text[2]
    md = format_table(rows, markdown=True).splitlines()
    assert md[1] == "|---|---|---:|---|---|" and md[2].startswith("| scaler_overhead | sgd | 1.023 |")


def _group(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid``, from /proc."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state, ppid, pgrp, ...
        if fields[0] != "Z" and int(fields[2]) == pgid:
            pids.append(int(entry.name))
    return pids


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (killed, not yet reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:].split()[0] != "Z"


def _stop(proc: subprocess.Popen) -> None:
    """Kill ``proc``'s whole process group (it leads its own session: its workers, and theirs,
    are in it) and wait until none of them is left."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    deadline = time.monotonic() + 30
    while _group(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)


@pytest.fixture
def grouped() -> Iterator[Callable[..., subprocess.Popen]]:
    """Starts commands each in its own session (a process group of its own); every group is
    killed at teardown, whatever ended the test (an assertion, its timeout, pytest-timeout)."""
    started: list[subprocess.Popen] = []

    def start(args: list[str], **kwargs) -> subprocess.Popen:
        proc = subprocess.Popen(args, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, **kwargs)
        started.append(proc)
        return proc

    try:
        yield start
    finally:
        for proc in started:
            _stop(proc)


def _group_cpu_s(pgid: int) -> float:
    """CPU seconds used by process group ``pgid``: its live members' own and their reaped
    children's (so a worker that ended still counts through its parent)."""
    ticks = 0
    for pid in _group(pgid):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        ticks += sum(int(f) for f in fields[11:15])  # utime, stime, cutime, cstime
    return ticks / os.sysconf("SC_CLK_TCK")


def _communicate(proc: subprocess.Popen, timeout: float, cpu_limit: float | None = None) -> tuple[str, str]:
    """``proc``'s output. Past ``timeout`` seconds of wall time, or ``cpu_limit`` seconds of CPU
    time of its process group, the whole group is killed and the test fails."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return proc.communicate(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            pass
        used = _group_cpu_s(proc.pid) if cpu_limit is not None else 0.0
        if time.monotonic() >= deadline or (cpu_limit is not None and used > cpu_limit):
            _stop(proc)
            why = f"{timeout:g} s" if time.monotonic() >= deadline else f"{used:.0f} s of CPU (limit {cpu_limit:g})"
            pytest.fail(f"{proc.args} timed out after {why}; its process group was killed")


# The quick run's limits. On a shared machine its wall time is its CPU time times the load over the
# cores, so the test bounds the CPU time (a runaway) tightly and the wall time (a hang) loosely,
# inside pytest-timeout's limit, so that it, not pytest-timeout, reports a slow run and kills the
# group. Measured 2026-12-01 on 2 cores of an AMD EPYC (AVX2, no native bf16) at load 10-15: about
# 150 s of CPU and 478 to 636 s of wall time (README, Benchmarks).
QUICK_CPU_S = 400
QUICK_TIMEOUT_S = 2400


@pytest.mark.slow
@pytest.mark.timeout(QUICK_TIMEOUT_S + 60)
def test_python_m_benchmarks_quick_runs_every_benchmark(grouped) -> None:
    from benchmarks.run import BENCHMARKS

    from mixprec import _native

    proc = grouped([sys.executable, "-m", "benchmarks", "--quick"], cwd=ROOT)
    out, err = _communicate(proc, QUICK_TIMEOUT_S, cpu_limit=QUICK_CPU_S)
    assert proc.returncode == 0, out + err
    names = {line.split()[0] for line in out.splitlines()[2:] if line.strip()}
    skipped = set(re.findall(r"^  (\w+): skipped \(", err, re.M))
    # (only the C++ kernels' own benchmark may skip, and only where they are off: MIXPREC_NATIVE_KERNELS=0)
    assert skipped == (set() if _native.load() is not None else {"fp4_cast"}), err
    assert names == set(BENCHMARKS) - skipped


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process groups from /proc")
def test_a_timed_out_benchmark_run_leaves_no_process_behind(grouped) -> None:
    """The quick run used to die at pytest's timeout and leave its spawn worker running: the
    runner, its worker and the worker's own children must all go with the test."""
    proc = grouped([sys.executable, "-m", "benchmarks", "--quick"], cwd=ROOT)
    deadline = time.monotonic() + 120
    while len(_group(proc.pid)) < 3 and time.monotonic() < deadline:  # runner, resource tracker, worker
        time.sleep(0.2)
    members = _group(proc.pid)
    assert len(members) >= 3 and proc.poll() is None, members
    with pytest.raises(pytest.fail.Exception, match=r"timed out after \d+ s of CPU \(limit 0\.01\); its process group was killed"):
        _communicate(proc, 60, cpu_limit=0.01)
    assert _group(proc.pid) == []
    assert not [pid for pid in members if _alive(pid)]  # none left, in this group or another


@pytest.mark.slow
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
    assert "2 fused AdamW steps per mode (1 timed)" in table[-1]


def test_gpu_benchmark_settings_and_bad_counts(capsys) -> None:
    from benchmarks import gpu

    big = gpu.settings(tiny=False)
    assert (big.model.n_layers, big.model.d_model, big.model.n_heads) == (12, 768, 12)
    assert (big.model.seq_len, big.model.vocab_size) == (1024, 50257)
    assert big.fused and big.timed_steps == range(5, 30)
    assert gpu.settings(tiny=True, steps=4, warmup=0).timed_steps == range(0, 4)
    for argv, match in [(["--steps", "0"], "expected an integer >= 1, got 0"),
                        (["--warmup", "-1"], "expected an integer >= 0, got -1"),
                        (["--batch-size", "x"], "expected an integer, got 'x'")]:
        with pytest.raises(SystemExit) as exc:
            gpu.main(["--device", "cpu", "--tiny", *argv])
        assert exc.value.code == 2 and match in capsys.readouterr().err
    assert gpu.main(["--device", "cpu", "--tiny", "--modes", "fp32,fp8"]) == 2
    assert capsys.readouterr().err == (
        f"gpu.py: error: unknown mode(s) fp8; choose from {', '.join(MODES)}\n")


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_gpu_benchmark_refuses_cuda_without_cuda() -> None:
    proc = subprocess.run([sys.executable, "benchmarks/gpu.py", "--device", "cuda"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "CUDA is not available" in proc.stderr


def test_layerwise_controller_and_fp8_formats_are_registered_with_their_rows() -> None:
    from benchmarks.run import BENCHMARKS

    layerwise = BENCHMARKS["layerwise"]({"ratio": 1.04, "ratio_of_fastest": 1.02, "pinned_ratio": 1.01,
                                         "cpu_ratio": 1.03, "step_ms": 60.0, "skipped": (3, 5)})
    assert [(r.figure, r.ratio) for r in layerwise] == [
        ("training step, per-layer scaling", 1.04), ("training step, per-layer factors pinned at 1", 1.01)]
    assert "CPU time 1.030" in layerwise[0].detail
    controller = BENCHMARKS["controller"]({"controller": 1.03, "promoted": 1.3, "fp8_step_ms": 150.0,
                                           "ctl_step_ms": 0.04, "ops": 1.007, "host_reads": 0})
    assert [r.ratio for r in controller] == [1.03, 1.007, 1.3] and "0 host reads" in controller[0].detail
    recipe = {"mixprec_ms": 50.0, "torchao_ms": 70.0, "step_ratio": 50 / 70, "vs_fp32": 3.0,
              "saved_activations": 2**20, "saved_ratio": 0.75}
    formats = BENCHMARKS["fp8_formats"]({"recipes": {
        "tensorwise": recipe, "blockwise": {**recipe, "torchao_ms": None, "step_ratio": None, "saved_ratio": None}}})
    assert [(r.figure, r.ratio) for r in formats] == [
        ("training step, fp8 tensorwise", 50 / 70), ("saved activations, fp8 tensorwise", 0.75),
        ("training step, fp8 blockwise", 3.0)]
    assert formats[-1].reference == "fp32 step (no torchao CPU reference)"


def test_fp8_fsdp_is_registered_with_bytes_and_step_rows() -> None:
    from benchmarks.run import BENCHMARKS

    def mode(bytes_: int, ms: float, reduces: int) -> dict:
        return {"gather_bytes": bytes_, "gather_ratio": bytes_ / 4096, "step_ms": ms, "step_ratio": ms / 10.0,
                "reduces": reduces}

    rows = BENCHMARKS["fp8_fsdp"]({"results": {"fp32": {
        "weight dtype": mode(4096, 10.0, 0), "fp8": mode(1024, 11.0, 8), "fp8 + precompute": mode(1024, 10.5, 1)}}})
    assert [(r.figure, r.ratio) for r in rows] == [
        ("all-gather bytes, fp32 params, fp8", 0.25), ("training step, fp32 params, fp8", 1.1),
        ("all-gather bytes, fp32 params, fp8 + precompute", 0.25), ("training step, fp32 params, fp8 + precompute", 1.05)]
    assert rows[0].reference == "FSDP2 all-gather in fp32" and "1 all-reduces" in rows[3].detail


@pytest.mark.slow
def test_vit_fp16_script_records_losses_skips_and_scales() -> None:
    """benchmarks/vit_fp16.py (issue 30 item 5) at a smoke size: every mode, the skipped steps
    that fp32-skips replays, and the bitwise check of mixprec-fp16 against torch-amp."""
    pytest.importorskip("transformers")
    from benchmarks import vit_fp16

    res = vit_fp16.run(seeds=1, steps=3, image_size=8)
    assert [r["mode"] for r in res["runs"]] == list(vit_fp16.MODES)
    by = {r["mode"]: r for r in res["runs"]}
    assert len(by["torch-amp"]["scales"]) == 3 and not by["fp32"]["scales"]
    assert by["torch-amp-2^10"]["scales"][0] in (2.0**10, 2.0**9)
    for r in res["runs"]:
        assert len(r["losses"]) == 3 and r["final"] == pytest.approx(sum(r["losses"]) / 3)
    table = vit_fp16.format_table(res).splitlines()
    assert table[0].startswith("| mode | final loss (mean) |") and len(table) == 2 + len(vit_fp16.MODES) + 2
    assert table[-1].startswith("mixprec-fp16 = torch-amp bitwise (losses and scales, every seed): True.")
    assert res["machine"]["cpu"]
