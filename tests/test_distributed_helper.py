"""The 2-process helper's watchdog (tests/_distributed.py): a hang fails with every rank's stacks."""

from __future__ import annotations

import time

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
