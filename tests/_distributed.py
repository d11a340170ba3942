"""Helpers of the 2-process gloo tests: spawning the ranks, joining and leaving the group.

A worker is ``worker(rank, port, *args)`` and runs its collectives inside
``with gloo_group(rank, port):``; :func:`spawn` runs it on every rank. Teardown, which is where
these tests used to abort now and then on a busy machine ("process 0 terminated with signal
SIGABRT", "terminate called without an active exception"):

* on leaving the group cleanly the ranks meet at a barrier, so no rank destroys its process group
  (and its sockets, and rank 0 the TCPStore) while another is still inside a collective;
* then each rank destroys the group and the process ends with ``os._exit(0)`` as soon as the
  worker returns, before the worker's locals are freed, skipping the interpreter's finalization too.
  Freeing a DDP module after ``destroy_process_group`` destroys the ProcessGroupGloo it holds,
  which hung a rank now and then (CI at 47d6e79: rank 1 in ``_entry`` with no worker frame, its
  peer gone). A DTensor (FSDP2 ``fully_shard``, ``distribute_tensor``) leaves a
  reference to the ProcessGroup inside torch that neither ``destroy_process_group`` nor
  ``gc.collect`` releases; the ProcessGroupGloo (with its threads, and the TCPStore server on
  rank 0) was then destroyed while the interpreter was being torn down, which aborts the process
  when a thread of it still needs the interpreter.

A worker that raises skips both (the peers see its sockets close and fail too); ``torch.multiprocessing``
reports its traceback.
"""

from __future__ import annotations

import contextlib
import datetime
import dis
import faulthandler
import os
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp

#: A collective waiting longer than this for a peer fails instead of hanging the test.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int, port: int, world_size: int = 2) -> None:
    """Join the gloo process group of ``world_size`` processes rendezvousing on ``port``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT)


@contextlib.contextmanager
def gloo_group(rank: int, port: int, world_size: int = 2) -> Iterator[None]:
    """Join the gloo group for the block; on a clean exit wait for every rank (a barrier), then
    destroy the group (also when the block raises)."""
    init_gloo(rank, port, world_size)
    try:
        yield
        dist.barrier()
    finally:
        dist.destroy_process_group()
    _exit_when_the_worker_returns()


#: the frame of :func:`_entry` in a rank spawned by :func:`spawn` (None elsewhere)
_entry_frame: FrameType | None = None


def _exit_when_the_worker_returns() -> None:
    """In a rank of :func:`spawn`, end the process with ``os._exit(0)`` when the worker returns,
    before its frame frees its locals (a DDP module, a sharded model: their destructors tear down
    gloo's sockets and threads). Code after the ``gloo_group`` block still runs."""
    entry = _entry_frame
    if entry is None:
        return

    def on_return(frame: FrameType, event: str, arg: Any) -> None:
        # (a worker that raises unwinds through here too: it keeps the ordinary path, its traceback)
        if event == "return" and frame.f_back is entry and _returning(frame):
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)

    sys.setprofile(on_return)


def _returning(frame: FrameType) -> bool:
    """Whether ``frame`` leaves by a return statement, not by an exception unwinding through it."""
    return dis.opname[frame.f_code.co_code[frame.f_lasti]].startswith("RETURN")


#: how long before :func:`spawn`'s deadline each rank's watchdog writes its stacks and ends it
#: (importing torch in a fresh process takes seconds: the ranks start after the deadline's clock)
WATCHDOG_MARGIN = 10.0


def _entry(rank: int, worker: Callable[..., None], port: int, args: tuple[Any, ...], stacks: str, hang_after: float) -> None:
    global _entry_frame
    _entry_frame = sys._getframe()
    with open(os.path.join(stacks, f"rank{rank}.txt"), "w") as file:
        faulthandler.dump_traceback_later(hang_after, exit=True, file=file)  # a hang: every thread's stack, then exit
        worker(rank, port, *args)
        faulthandler.cancel_dump_traceback_later()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter finalization: see the module docstring


def spawn(worker: Callable[..., None], *args: Any, nprocs: int = 2, timeout: float = 90.0) -> None:
    """Run ``worker(rank, port, *args)`` in ``nprocs`` processes (``port``: a free one for
    :func:`gloo_group`). Raises what a worker raised (``ProcessRaisedException``, with its
    traceback) or, for a hang, ``TimeoutError`` with every rank's stacks: each rank's watchdog
    (``faulthandler``) writes them and ends it :data:`WATCHDOG_MARGIN` seconds before
    ``timeout``, and the workers left are killed at ``timeout``."""
    with tempfile.TemporaryDirectory() as stacks:
        hang_after = max(timeout - WATCHDOG_MARGIN, 1.0)
        context = mp.spawn(_entry, args=(worker, free_port(), args, stacks, hang_after), nprocs=nprocs, join=False)
        deadline, died = time.monotonic() + timeout, None
        while died is None and time.monotonic() <= deadline:
            try:
                if context.join(timeout=1.0):
                    return
            except mp.ProcessExitedException as exc:  # (a watchdog ended a rank, or a rank died without a traceback)
                died = exc
        for process in context.processes:
            process.kill()
        dumps = "".join(f"\n--- rank {r} ---\n" + Path(stacks, f"rank{r}.txt").read_text() for r in range(nprocs)
                        if Path(stacks, f"rank{r}.txt").exists())
        raise TimeoutError(f"{worker.__name__} workers did not finish in {timeout:.0f} s"
                           f"{f' ({died})' if died else ''}; their stacks:{dumps or ' none written'}") from died
