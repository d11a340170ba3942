"""The ``mixprec`` command: usage errors, an unwritable output folder, and a real short demo run."""

from __future__ import annotations

import json
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
        (["demo", "--steps", "0"], "expected a positive integer, got 0"),
        (["demo", "--steps", "many"], "expected a positive integer, got 'many'"),
        (["demo", "--modes", "fp32,fp8"], "unknown mode(s) fp8"),
        (["demo", "--device", "nonsense"], "not a device: 'nonsense'"),
        (["demo", "--device", "meta"], "the demo runs on cpu or cuda"),
        (["demo", "--bogus"], "unrecognized arguments: --bogus"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        ([], "required: {demo,audit}"),
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


def test_unwritable_output_folder_fails_before_training(tmp_path: Path, capsys) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    assert main(["demo", "--modes", "fp32", "--steps", "1", "--out", str(blocker / "report")]) == 1
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1
    assert captured.err.startswith("mixprec demo: error: cannot write the report to")
    assert "training" not in captured.out + captured.err


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


def test_python_m_mixprec_demo_writes_the_report(tmp_path: Path) -> None:
    out = tmp_path / "report"
    proc = subprocess.run(
        [sys.executable, "-m", "mixprec", "demo", "--modes", "fp32,torch-amp,mixprec-bf16",
         "--steps", "3", "--device", "cpu", "--seed", "5", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "fp32: training 3 steps" in proc.stderr  # plain progress lines when not a terminal
    table = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(table) if line.startswith("mode "))
    assert [line.split()[0] for line in table[header + 2: header + 5]] == ["fp32", "torch-amp", "mixprec-bf16"]
    assert sorted(p.name for p in out.iterdir()) == [
        "index.html", "loss.png", "memory.png", "results.json", "scale.png", "throughput.png"]
    data = json.loads((out / "results.json").read_text())
    assert data["settings"]["seed"] == 5 and data["device"] == "cpu"
    assert all(len(m["losses"]) == 3 for m in data["modes"])
