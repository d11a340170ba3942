"""The ``mixprec`` command: usage errors, an unwritable output folder, and a real short demo run."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mixprec.cli import build_parser, main


@pytest.mark.parametrize(
    "argv, match",
    [
        (["demo", "--size", "huge"], "invalid choice: 'huge'"),
        (["demo", "--steps", "0"], "expected a positive integer up to 1,000,000, got 0"),
        (["demo", "--steps", "-3"], "expected a positive integer up to 1,000,000, got -3"),
        (["demo", "--steps", "1.5"], "expected a positive integer, got '1.5'"),
        (["demo", "--steps", "many"], "expected a positive integer, got 'many'"),
        (["demo", "--steps", "10000000000000000"], "up to 1,000,000, got 10000000000000000"),
        (["demo", "--seed", "-1"], "expected a seed from 0 to 2**63 - 1, got -1"),
        (["demo", "--seed", str(2**64)], f"expected a seed from 0 to 2**63 - 1, got {2**64}"),
        (["demo", "--seed", "x"], "expected an integer seed, got 'x'"),
        (["demo", "--modes", "fp32,fp8"], "unknown mode(s) fp8"),
        (["demo", "--modes", ""], "no modes given; choose from fp32, torch-amp"),
        (["demo", "--modes", " , "], "no modes given"),
        (["demo", "--modes", "fp32,torch-amp,fp32"], "given more than once: fp32"),
        (["demo", "--device", "nonsense"], "not a device: 'nonsense'"),
        (["demo", "--device", "meta"], "the demo runs on cpu or cuda"),
        (["demo", "--out", ""], "expected a folder, got an empty path"),
        (["demo", "--seeds", "0"], "argument --seeds: expected a positive integer up to 100, got 0"),
        (["demo", "--threads", "two"], "argument --threads: expected a positive integer, got 'two'"),
        (["demo", "--bogus"], "unrecognized arguments: --bogus"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        ([], "required: {demo,audit,build-kernels,export}"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(argv, match, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and match in err and err.startswith("mixprec")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_cuda_device_without_cuda_is_a_usage_error(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--device", "cuda"])
    assert exc.value.code == 2
    assert "CUDA is not available here; use --device cpu" in capsys.readouterr().err


@pytest.mark.parametrize(
    "where, match",
    [
        ("file", "is a file, not a folder; give a folder for the report"),
        ("file/report", "cannot create the report folder"),
        ("file/a/b", "is a file, not a folder"),
    ],
)
def test_unwritable_output_folder_fails_before_training(where: str, match: str, tmp_path: Path, capsys) -> None:
    (tmp_path / "file").write_text("not a folder")
    assert main(["demo", "--modes", "fp32", "--steps", "1", "--out", str(tmp_path / where)]) == 1
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1
    assert captured.err.startswith("mixprec demo: error: ") and match in captured.err
    assert "training" not in captured.out + captured.err
    assert (tmp_path / "file").read_text() == "not a folder"


def test_cuda_device_index_out_of_range(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--device", "cuda:2"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "2 CUDA device(s), cuda:0 to cuda:1" in err
    assert build_parser().parse_args(["demo", "--device", "cuda:1"]).device == torch.device("cuda:1")


def _console_script() -> str | None:
    """The installed ``mixprec`` console script next to this interpreter, else on PATH."""
    here = Path(sys.executable).with_name("mixprec")
    return str(here) if here.exists() else shutil.which("mixprec")


COMMANDS = {
    "python -m mixprec": [sys.executable, "-m", "mixprec"],
    "console script": [_console_script() or "mixprec"],
}


@pytest.mark.parametrize(
    "command, args, status, match",
    [
        ("python -m mixprec", ["--modes", ","], 2, "argument --modes: no modes given"),
        ("console script", ["--steps", "0"], 2, "argument --steps: expected a positive integer"),
        ("console script", ["--out", "{file}"], 1, "is a file, not a folder"),
    ],
)
@pytest.mark.slow
def test_errors_from_the_commands_are_one_line(command: str, args, status, match, tmp_path: Path) -> None:
    if command == "console script" and _console_script() is None:
        pytest.skip("the mixprec console script is not installed")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    argv = COMMANDS[command] + ["demo", "--device", "cpu"] + [a.format(file=blocker) for a in args]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == status
    assert proc.stderr.count("\n") == 1 and match in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_missing_mixprec_api_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys) -> None:
    from mixprec.demo.train import MODES, Mode

    fake = Mode("fp32", "fp32 that needs an API that is not there", ("no_such_api",), MODES["fp32"].setup)
    monkeypatch.setitem(MODES, "fp32", fake)
    assert main(["demo", "--modes", "fp32", "--steps", "1", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "fp32 needs mixprec.no_such_api" in err


def test_audit_is_registered() -> None:
    parser = build_parser()
    args = parser.parse_args(["audit", "some.module:factory"])
    assert callable(args.func) and args.target == "some.module:factory"


@pytest.mark.slow
def test_python_m_mixprec_demo_writes_the_report(tmp_path: Path) -> None:
    out = tmp_path / "report"
    proc = subprocess.run(
        [sys.executable, "-m", "mixprec", "demo", "--modes", "fp32,torch-amp,mixprec-bf16",
         "--steps", "3", "--device", "cpu", "--seed", "5", "--seeds", "1", "--no-speed-panel", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "fp32: training 3 steps" in proc.stderr  # plain progress lines when not a terminal
    assert proc.stdout.startswith("mixprec demo: 3 modes x 3 steps x 1 seed on cpu (")
    assert "expected duration: about" in proc.stderr.splitlines()[0]
    table = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(table) if line.startswith("mode "))
    assert [line.split()[0] for line in table[header + 2: header + 5]] == ["fp32", "torch-amp", "mixprec-bf16"]
    assert sorted(p.name for p in out.iterdir()) == [
        "index.html", "loss.png", "memory.png", "results.json", "scale.png", "throughput.png"]
    data = json.loads((out / "results.json").read_text())
    assert data["settings"]["seed"] == 5 and data["device"] == "cpu"
    assert all(len(m["losses"]) == 3 for m in data["modes"])


def test_version(capsys) -> None:
    import mixprec

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"mixprec {mixprec.__version__} (torch {torch.__version__})\n"


@pytest.mark.slow
def test_demo_sh_says_it_is_installing_and_shows_why_it_failed(tmp_path: Path) -> None:
    # a fresh checkout (no .venv) whose Python cannot create one: the first line says what is
    # being installed before the installer runs, and a failure shows the installer's own output
    root = Path(__file__).resolve().parents[1]
    (tmp_path / "scripts").mkdir()
    for name in ("demo.sh", "venv.sh"):
        shutil.copy(root / "scripts" / name, tmp_path / "scripts" / name)
    fake = tmp_path / "python-that-fails"
    fake.write_text("#!/bin/sh\necho 'no venv module here' >&2\nexit 3\n")
    fake.chmod(0o755)
    proc = subprocess.run(["bash", str(tmp_path / "scripts" / "demo.sh")], capture_output=True, text=True,
                          timeout=60, env={"PATH": "/usr/bin:/bin", "PYTHON": str(fake)})
    assert proc.returncode == 1
    assert proc.stdout.startswith("mixprec demo: first run: creating .venv and installing torch==2.13.0")
    assert "setting up .venv failed" in proc.stderr and "no venv module here" in proc.stderr


@pytest.mark.slow
def test_demo_prints_the_computed_check_and_its_threads(tmp_path: Path, capsys) -> None:
    threads = torch.get_num_threads()
    try:
        assert main(["demo", "--modes", "torch-amp,mixprec-fp16", "--steps", "2", "--device", "cpu",
                     "--threads", "1", "--seeds", "1", "--no-speed-panel", "--out", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("mixprec demo: 2 modes x 2 steps x 1 seed on cpu (1 thread: --threads)")
    assert "mixprec-fp16 = torch-amp: identical (losses, scales, skipped steps)" in out


def test_demo_makes_openmp_threads_sleep_unless_told_otherwise(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    # read by OpenMP when torch loads: `mixprec demo` sets it before anything imports torch
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    with pytest.raises(SystemExit):
        main(["demo", "--steps", "0"])
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    with pytest.raises(SystemExit):
        main(["demo", "--steps", "0"])
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    monkeypatch.delenv("OMP_WAIT_POLICY")
    with pytest.raises(SystemExit):
        main(["audit"])
    assert "OMP_WAIT_POLICY" not in os.environ


@pytest.mark.slow
def test_ctrl_c_writes_the_report_of_the_modes_that_finished(tmp_path: Path) -> None:
    # SIGINT once the first mode has finished: the report of that mode, one line, status 130.
    # The child takes SIGINT's default action (a KeyboardInterrupt): a run started in the
    # background (`cmd &` in a script) ignores SIGINT, children inherit that, and the demo then
    # trained on and exited 0
    out = tmp_path / "report"
    proc = subprocess.Popen(
        [sys.executable, "-m", "mixprec", "demo", "--modes", "fp32,mixprec-fp8-rowwise", "--steps", "60",
         "--seeds", "1", "--no-speed-panel", "--device", "cpu", "--threads", "1", "--out", str(out)],
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stderr is not None
        seen = []
        for line in proc.stderr:
            seen.append(line)
            if line.startswith("mixprec-fp8-rowwise: training"):  # fp32 has finished and been kept
                break
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=300)  # (the report after the signal: slow beside other suites)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = "".join(seen) + stderr
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    assert stderr.splitlines()[-1] == ("mixprec demo: interrupted (Ctrl-C): finished fp32; not run: "
                                       f"mixprec-fp8-rowwise; report of those: {out / 'index.html'}")
    data = json.loads((out / "results.json").read_text())
    assert [m["mode"] for m in data["modes"]] == ["fp32"]
    assert data["interrupted"] == "finished fp32; not run: mixprec-fp8-rowwise"
    assert "<b>Interrupted</b> (Ctrl-C): finished fp32" in (out / "index.html").read_text()
    assert "INTERRUPTED: finished fp32; not run: mixprec-fp8-rowwise." in stdout
