"""pytest starts without pytest-timeout (pyproject's ``timeout`` is then untimed, and the header
says what to install) and, with it, every test has pyproject's 600 s limit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from _pytest_setup import NO_TIMEOUT

ROOT = Path(__file__).resolve().parent.parent


def _collect(*args: str) -> subprocess.CompletedProcess[str]:
    """``pytest --collect-only`` of this file from the project root, in a fresh process."""
    return subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-p", "no:cacheprovider", *args,
                           "tests/test_pytest_setup.py"], cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_pytest_runs_without_pytest_timeout_and_says_what_to_install() -> None:
    run = _collect("-p", "no:timeout")  # as if pytest-timeout were not installed
    assert run.returncode == 0, run.stdout + run.stderr
    assert NO_TIMEOUT in run.stdout and "Unknown config option" not in run.stdout + run.stderr


@pytest.mark.slow
def test_with_pytest_timeout_the_tests_have_pyprojects_limit() -> None:
    pytest.importorskip("pytest_timeout")
    run = _collect()
    assert run.returncode == 0, run.stdout + run.stderr
    assert "timeout: 600.0s" in run.stdout and NO_TIMEOUT not in run.stdout
