"""Helpers of the 2-process gloo tests: spawning the ranks, joining and leaving the group.

A worker is ``worker(rank, port, *args)`` and runs its collectives inside
``with gloo_group(rank, port):``; :func:`spawn` runs it on every rank. Teardown, which is where
these tests used to abort now and then on a busy machine ("process 0 terminated with signal
SIGABRT", "terminate called without an active exception"):

* on leaving the group cleanly the ranks meet at a barrier, so no rank destroys its process group
  (and its sockets, and rank 0 the TCPStore) while another is still inside a collective;
* then each rank destroys the group and the process ends with ``os._exit(0)``, skipping the
  interpreter's finalization. A DTensor (FSDP2 ``fully_shard``, ``distribute_tensor``) leaves a
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
import os
import socket
import sys
import time
from collections.abc import Iterator
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


def _entry(rank: int, worker: Callable[..., None], port: int, args: tuple[Any, ...]) -> None:
    worker(rank, port, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter finalization: see the module docstring


def spawn(worker: Callable[..., None], *args: Any, nprocs: int = 2, timeout: float = 90.0) -> None:
    """Run ``worker(rank, port, *args)`` in ``nprocs`` processes (``port``: a free one for
    :func:`gloo_group`). Raises what a worker raised (``ProcessRaisedException``, with its
    traceback) or ``TimeoutError`` after killing the workers at ``timeout`` seconds."""
    context = mp.spawn(_entry, args=(worker, free_port(), args), nprocs=nprocs, join=False)
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"{worker.__name__} workers did not finish in {timeout:.0f} s")
