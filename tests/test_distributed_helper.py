"""The 2-process helper's watchdog (tests/_distributed.py): a hang fails with every rank's stacks."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from _distributed import spawn


def _hang(rank: int, port: int) -> None:
    if rank == 1:
        time.sleep(600)  # (rank 0 returns; rank 1 hangs here)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_hung_rank_fails_with_its_stack():
    start = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        spawn(_hang, timeout=20.0)
    message = str(info.value)
    assert "--- rank 1 ---" in message and "in _hang" in message, message  # where it waits
    assert time.monotonic() - start < 60


class _HangsWhenFreed:
    def __del__(self) -> None:
        time.sleep(600)


def _returns_holding_a_hang(rank: int, port: int, out_dir: str) -> None:
    from _distributed import gloo_group

    held = _HangsWhenFreed()  # (a DDP module whose ProcessGroupGloo hangs in its destructor)
    with gloo_group(rank, port):
        pass
    Path(out_dir, f"{rank}.txt").write_text("after the block")  # code after the block still runs


def _raises_after_the_block(rank: int, port: int) -> None:
    from _distributed import gloo_group

    with gloo_group(rank, port):
        pass
    raise ValueError(f"rank {rank} raised after the block")


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_rank_ends_when_its_worker_returns(tmp_path):
    """A worker's locals are not freed: their destructors (gloo's sockets and threads under a DDP
    module) once hung a rank after its worker had returned."""
    start = time.monotonic()
    spawn(_returns_holding_a_hang, str(tmp_path), timeout=60.0)
    assert time.monotonic() - start < 50
    assert [Path(tmp_path, f"{r}.txt").read_text() for r in range(2)] == ["after the block"] * 2


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_worker_that_raises_after_the_block_still_fails():
    with pytest.raises(Exception, match="raised after the block"):
        spawn(_raises_after_the_block, timeout=60.0)
