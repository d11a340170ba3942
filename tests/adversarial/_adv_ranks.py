"""A pool of 2 gloo ranks that runs one generated program after another, with a watchdog.

Spawning 2 processes costs seconds (importing torch), so the ranks stay up between programs
and share one process group; after a program that failed (an error, a hang, misaligned
collectives) the pool is restarted, since the group may be out of step.

The watchdog turns a hang into a failure with the stacks: each rank arms
``faulthandler.dump_traceback_later(hang_after, exit=True)`` around a program, which writes the
stacks of all its threads to a file and ends the process; the parent, waiting ``hang_after`` plus
a margin for the results, kills what is left and raises :class:`RankFailure` with those stacks.
The gloo timeout is longer than ``hang_after``, so the watchdog fires first and the stacks show
where each rank waits.

Each rank records the collectives it issues (``all_reduce``, ``all_gather_into_tensor``,
``reduce_scatter_tensor``, ``all_gather_single``... on ``torch.distributed``: name, shape, dtype
and the calling function) so the test can compare the ranks' sequences directly: two
sequences that differ are a failure even when the calls happen to pair.
"""

from __future__ import annotations

import datetime
import faulthandler
import importlib
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from _distributed import free_port

STARTUP_TIMEOUT = 300.0
COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather", "broadcast")


class RankFailure(AssertionError):
    """A rank hung (the watchdog fired) or died; the message holds every rank's stacks."""


def _record_collectives(log: list[tuple[str, tuple[int, ...], str, str]]) -> None:
    import torch.distributed as dist

    for name in COLLECTIVES:
        original = getattr(dist, name)
        if getattr(original, "_adv_original", None) is not None:
            original = original._adv_original

        def recorded(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
            tensor = args[0] if args else next(iter(kwargs.values()), None)
            if isinstance(tensor, list):
                tensor = tensor[0] if tensor else None
            shape = tuple(tensor.shape) if hasattr(tensor, "shape") else ()
            dtype = str(getattr(tensor, "dtype", ""))
            caller = sys._getframe(1)
            log.append((_name, shape, dtype, f"{Path(caller.f_code.co_filename).name}:{caller.f_code.co_name}"))
            return _original(*args, **kwargs)

        recorded._adv_original = original  # type: ignore[attr-defined]
        setattr(dist, name, recorded)


def _warm_up() -> None:
    """Import and load what the programs use before the first watchdog is armed (an optimizer's
    first construction imports torch._dynamo, a policy's first region loads or builds mixprec's
    kernels: each can take half a minute on a loaded machine)."""
    import torch
    import torch.distributed.fsdp  # noqa: F401

    import mixprec
    from mixprec import fp8

    layer = fp8.convert(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)), "tensorwise",
                        filter_fn=lambda m, fqn: True)
    torch.optim.SGD(layer.parameters(), lr=0.0)
    with mixprec.autocast("cpu", dtype=torch.bfloat16):
        layer(torch.ones(16, 16)).float().sum().backward()
    policy = mixprec.Policy.parse("compute=bf16").fp8("tensorwise", first_last="fp8")
    with mixprec.autocast("cpu", policy=policy):  # builds or loads mixprec's kernels
        fp8.unconvert(layer)(torch.ones(16, 16)).float().sum().backward()
    for recipe in ("mxfp4", "nvfp4"):  # fp4's casts, the Hadamard transform, stochastic rounding
        fp4 = fp8.convert(torch.nn.Sequential(torch.nn.Linear(32, 32)), recipe, filter_fn=lambda m, fqn: fqn == "0")
        with mixprec.autocast("cpu", dtype=torch.bfloat16):
            fp4(torch.ones(8, 32)).float().sum().backward()


def _rank_main(rank: int, world: int, port: int, conn: Connection, stack_dir: str, hang_after: float) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=2 * hang_after + 30))
    _warm_up()
    conn.send("ready")
    while True:
        message = conn.recv()
        if message is None:
            break
        target, program = message
        log: list[tuple[str, tuple[int, ...], str, str]] = []
        _record_collectives(log)
        with open(Path(stack_dir) / f"rank{rank}.txt", "w") as stacks:
            faulthandler.dump_traceback_later(hang_after, exit=True, file=stacks)
            try:
                module, name = target.split(":")
                result = getattr(importlib.import_module(module), name)(rank, program)
                result["error"] = None
            except BaseException as exc:  # reported to the parent, which decides
                result = {"error": "".join(traceback.format_exception(exc)), "error_type": getattr(exc, "adv_type", type(exc).__name__),
                          "error_step": getattr(exc, "adv_step", None)}
            finally:
                faulthandler.cancel_dump_traceback_later()
        result["collectives"] = log
        conn.send(result)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter finalization with a live gloo group (tests/_distributed.py)


class RankPool:
    """``world`` ranks in one gloo group; :meth:`run` runs ``target(rank, program)`` on each.

    ``target`` is ``"module:function"`` (importable in the ranks: the test directory is on the
    spawned processes' ``sys.path``); it returns a dict of plain data (sent to the parent).
    """

    def __init__(self, world: int = 2, hang_after: float = 30.0) -> None:
        self.world, self.hang_after = world, hang_after
        self.stack_dir = tempfile.mkdtemp(prefix="mixprec-adv-")
        self.processes: list[Any] = []
        self.conns: list[Connection] = []
        self.restarts = 0

    def _start(self) -> None:
        context = mp.get_context("spawn")
        port = free_port()
        for rank in range(self.world):
            parent, child = context.Pipe()
            process = context.Process(target=_rank_main, daemon=True,
                                      args=(rank, self.world, port, child, self.stack_dir, self.hang_after))
            process.start()
            self.processes.append(process)
            self.conns.append(parent)
        for rank, conn in enumerate(self.conns):  # importing torch on a loaded machine: minutes
            if not conn.poll(STARTUP_TIMEOUT) or conn.recv() != "ready":
                self._kill()
                raise RankFailure(f"rank {rank} did not start within {STARTUP_TIMEOUT} s")

    def close(self) -> None:
        """Stop the ranks (politely, then by kill) and remove their stack files' folder."""
        for conn in self.conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + 5
        for process in self.processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        self._kill()
        shutil.rmtree(self.stack_dir, ignore_errors=True)

    def _kill(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.kill()
            process.join(timeout=5)
        for conn in self.conns:
            conn.close()
        self.processes, self.conns = [], []

    def _stacks(self) -> str:
        out = []
        for rank in range(self.world):
            path = Path(self.stack_dir) / f"rank{rank}.txt"
            text = path.read_text() if path.exists() else ""
            out.append(f"--- rank {rank} stacks ---\n{text or '(none written: the rank did not hang)'}")
        return "\n".join(out)

    def run(self, target: Callable[..., dict[str, Any]] | str, program: Any) -> list[dict[str, Any]]:
        """Run ``program`` on every rank; the per-rank results, in rank order. Raises
        :class:`RankFailure` (with the stacks) when a rank hangs or dies; restarts the pool after
        any rank reported an error."""
        if not isinstance(target, str):
            target = f"{target.__module__}:{target.__name__}"
        if not self.processes:
            self._start()
        for conn in self.conns:
            conn.send((target, program))
        results: list[dict[str, Any] | None] = [None] * self.world
        deadline = time.monotonic() + self.hang_after + 20
        while any(r is None for r in results) and time.monotonic() < deadline:
            for rank, conn in enumerate(self.conns):
                if results[rank] is None and conn.poll(0.05):
                    try:
                        results[rank] = conn.recv()
                    except EOFError:
                        deadline = min(deadline, time.monotonic() + 3)  # died: let the stacks land
            if any(not p.is_alive() for p in self.processes):
                deadline = min(deadline, time.monotonic() + 3)
        if any(r is None for r in results):
            missing = [rank for rank, r in enumerate(results) if r is None]
            self._kill()
            self.restarts += 1
            stacks = self._stacks()
            raised = "".join(f"\n--- rank {rank} raised (the others then wait on it) ---\n{r['error']}"
                             for rank, r in enumerate(results) if r is not None and r["error"] is not None)
            raise RankFailure(f"rank(s) {missing} hung or died running {program!r} (watchdog {self.hang_after:.0f} s)"
                              f"{raised}\n{stacks}")
        if any(r["error"] is not None for r in results):  # type: ignore[index]
            self._kill()
            self.restarts += 1
        return results  # type: ignore[return-value]
