"""pytest starts without pytest-timeout (pyproject's ``timeout`` is then untimed, and the header
says what to install) and, with it, every test has pyproject's 600 s limit; every test starts from
its own seed (tests/conftest.py)."""

from __future__ import annotations

import random
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

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


@pytest.mark.parametrize("case", ["a", "b"])
def test_each_test_starts_from_its_node_ids_seed(request: pytest.FixtureRequest, case: str) -> None:
    """torch seeds its generator from the OS at start: unseeded, a test's inputs would change
    from run to run and with the tests before it. Each test's seed is its node id's CRC32."""
    seed = zlib.crc32(request.node.nodeid.encode())
    draws = torch.rand(3), random.random()
    assert torch.initial_seed() == seed
    torch.manual_seed(seed)
    random.seed(seed)
    assert torch.equal(draws[0], torch.rand(3)) and draws[1] == random.random()
