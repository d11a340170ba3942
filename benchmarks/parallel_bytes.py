"""Tensor and sequence parallelism with fp8 on gloo processes (127.0.0.1): the bytes each rank puts
into collectives per training step, and the step time, for a transformer-like MLP block
(``Linear(D, 4D)`` colwise, GELU, ``Linear(4D, D)`` rowwise) between two replicated Linears.

Modes (all bf16 compute):
* ``tp-bf16``: ColwiseParallel / RowwiseParallel, no fp8;
* ``tp-fp8``: the same, the block in fp8 ``tensorwise`` (the policy route);
* ``sp-bf16``: sequence parallelism (``ColwiseParallel(input_layouts=Shard(1))``,
  ``RowwiseParallel(output_layouts=Shard(1))``), no fp8;
* ``sp-fp8-gather-bf16``: the same in fp8 tensorwise, the sequence all-gathered in bf16 (torch's
  ColwiseParallel) before the cast;
* ``sp-fp8``: in fp8 tensorwise, the sequence all-gathered in fp8 by the layer
  (``fp8.colwise_sequence_parallel()``);
* ``sp-rowwise``: the block in fp8 ``rowwise`` with ``fp8.colwise_sequence_parallel()``: a
  training step gathers the sequence in bf16 (the weight-gradient GEMM casts the input again,
  over the tokens);
* ``infer-sp-bf16``, ``infer-sp-rowwise``, ``infer-sp-mxfp8``: forwards under ``torch.no_grad``
  (no weight gradient) with sequence parallelism, no fp8 (torch's gather) and the block in
  ``rowwise`` / ``mxfp8`` with ``fp8.colwise_sequence_parallel()``: the layer gathers the fp8
  bytes plus the scales of each token's row or blocks.

Bytes: per step and rank (a step after the first, counted apart from the timed ones), the sum
of the tensors this rank hands to the collectives (``c10d`` and functional ops, counted by a
dispatch mode), split into all-gathers and reductions (all-reduce, reduce-scatter: the
activations' partial sums and the amaxes). Step time: the median over interleaved rounds of rank
0's steps, as a ratio to ``tp-bf16``. Prints the CPU (``lscpu``) and the load (``uptime``): the
ranks share the machine's cores.

    .venv/bin/python benchmarks/parallel_bytes.py [--quick] [--ranks 2 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from benchmarks._machine import machine  # noqa: E402

MODES = ("tp-bf16", "tp-fp8", "sp-bf16", "sp-fp8-gather-bf16", "sp-fp8", "sp-rowwise", "infer-sp-bf16",
         "infer-sp-rowwise", "infer-sp-mxfp8")


class _Bytes:
    """Sums the bytes of the tensors this rank hands to collectives while active: torch.distributed's
    (``all_gather_into_tensor``, ``all_reduce``, ``reduce_scatter_tensor``: mixprec's) and the
    functional ones DTensor's redistributions call (``all_gather_single``, ``all_reduce``,
    ``reduce_scatter_single``), patched for the block."""

    def __init__(self) -> None:
        import torch.distributed._functional_collectives as funcol

        self.gather = self.reduce = 0
        gathers = [(dist, "all_gather_into_tensor", 1), (funcol, "all_gather_single", 0)]
        reduces = [(dist, "all_reduce", 0), (dist, "reduce_scatter_tensor", 1), (funcol, "all_reduce", 0),
                   (funcol, "reduce_scatter_single", 0)]
        self._patches = [(m, n, i, "gather") for m, n, i in gathers] + [(m, n, i, "reduce") for m, n, i in reduces]
        self._saved: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> "_Bytes":
        for module, name, index, kind in self._patches:
            original = getattr(module, name)

            def counted(*args: Any, _f: Any = original, _i: int = index, _k: str = kind, **kwargs: Any) -> Any:
                setattr(self, _k, getattr(self, _k) + args[_i].nbytes)
                return _f(*args, **kwargs)
            self._saved.append((module, name, original))
            setattr(module, name, counted)
        return self

    def __exit__(self, *exc: Any) -> None:
        for module, name, original in self._saved:
            setattr(module, name, original)


def _model(d: int) -> nn.Module:
    torch.manual_seed(0)
    block = nn.Sequential(OrderedDict(up=nn.Linear(d, 4 * d), act=nn.GELU(), down=nn.Linear(4 * d, d)))
    return nn.Sequential(nn.Linear(d, d), block, nn.Linear(d, d))


def _plan(mode: str) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                                   RowwiseParallel)

    from mixprec import fp8

    if mode.startswith("tp"):
        return {"1.up": ColwiseParallel(), "1.down": RowwiseParallel()}
    ours = mode in ("sp-fp8", "sp-rowwise", "infer-sp-rowwise", "infer-sp-mxfp8")
    up = fp8.colwise_sequence_parallel() if ours else ColwiseParallel(input_layouts=Shard(1))
    return {"0": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1)),
            "1.up": up, "1.down": RowwiseParallel(output_layouts=Shard(1)),
            "2": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate(), use_local_output=True)}


def _worker(rank: int, world: int, port: int, out: str, d: int, seq: int, rounds: int) -> None:
    import mixprec
    from mixprec import Policy
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    mesh = init_device_mesh("cpu", (world,))
    runs = {}
    for mode in MODES:
        model = _model(d)
        parallelize_module(model, mesh, _plan(mode))
        policy = Policy.parse("compute=bf16")
        recipe = next((r for r in ("rowwise", "mxfp8") if mode.endswith(r)), "tensorwise" if "fp8" in mode else None)
        if recipe is not None:
            policy = policy.fp8(recipe, first_last="keep")
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        x = torch.randn(2, seq, d, generator=torch.Generator().manual_seed(0))

        def step(model: nn.Module = model, policy: Any = policy, opt: Any = opt, x: torch.Tensor = x,
                 train: bool = not mode.startswith("infer")) -> None:
            with torch.set_grad_enabled(train), mixprec.autocast("cpu", policy=policy):
                y = model(x)
            if not train:
                return
            y.float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        runs[mode] = step
    counts = {}
    for mode, step in runs.items():
        step()
        counter = _Bytes()
        with counter:
            step()
        counts[mode] = (counter.gather, counter.reduce)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(rounds):
        for mode, step in runs.items():
            dist.barrier()
            t0 = time.perf_counter()
            step()
            times[mode].append(time.perf_counter() - t0)
    if rank == 0:
        torch.save({"bytes": counts, "times": {m: statistics.median(t) for m, t in times.items()}}, out)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model, few rounds")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    d, seq, rounds = (64, 64, 3) if args.quick else (256, 512, 7)
    print(machine())
    print(f"D={d}, hidden {4 * d}, batch 2 x sequence {seq}, bf16 compute, fp8 tensorwise (else named); bytes per "
          f"step and rank (infer-: a forward)")
    from _distributed import free_port

    for world in args.ranks:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "r.pt")
            torch.multiprocessing.spawn(_worker, args=(world, free_port(), out, d, seq, rounds), nprocs=world)
            r = torch.load(out)
        base_time = r["times"]["tp-bf16"]
        print(f"\n{world} ranks: mode, all-gather bytes, reduction bytes, step time / tp-bf16")
        for mode in MODES:
            g, red = r["bytes"][mode]
            print(f"  {mode:20s} {g:>10,d} {red:>10,d}   {r['times'][mode] / base_time:5.2f}x")


if __name__ == "__main__":
    main()
