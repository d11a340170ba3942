"""Helpers of the 2-process gloo tests: a free port on 127.0.0.1 and joining the group."""

from __future__ import annotations

import os
import socket

import torch.distributed as dist


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int, port: int, world_size: int = 2) -> None:
    """Join the gloo process group of ``world_size`` processes rendezvousing on ``port``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
