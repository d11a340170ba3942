"""FSDP2 with fp8 layers on 2 gloo processes (127.0.0.1): all-gather bytes and step time, the
weights all-gathered in their own dtype against in fp8 (``fp8.convert(...,
fsdp_fp8_all_gather=True)``, with and without ``fp8.precompute_fsdp_scales``) and torchao's
``enable_fsdp_float8_all_gather`` (``emulate=True``).

Model: 4 x ``Linear(D, D)`` + GELU, all in fp8 tensorwise, each Linear its own ``fully_shard``
group, batch of ``BATCH`` x D per rank; fp32 parameters, and fp32 parameters with
``MixedPrecisionPolicy(param_dtype=bf16)``. A step is forward, backward and an SGD update.
Per step and rank (the second step, counted apart from the timed ones): the bytes this rank passes to ``dist.all_gather_single``
(FSDP2's all-gather), and the all-reduces (the amaxes; ``CommDebugMode`` counts torchao's
functional ones too). Interleaved rounds, one thread per rank, median of
rank 0's per-round step times. Prints the CPU model (``lscpu``) and the load (``uptime``): the
machine may be shared, and the 2 ranks share its cores.

    .venv/bin/python benchmarks/fp8_fsdp.py [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._machine import machine  # noqa: E402

D, LAYERS, BATCH = 512, 4, 64
MODES = ("weight dtype", "fp8", "fp8 + precompute", "torchao fp8")


def _model(mode: str, param_dtype: torch.dtype | None) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from mixprec import fp8

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(LAYERS):
        layers += [nn.Linear(D, D), nn.GELU()]
    model = nn.Sequential(*layers)
    if mode == "torchao fp8":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=True)
        model = convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: True)
    else:
        model = fp8.convert(model, filter_fn=lambda m, fqn: True, fsdp_fp8_all_gather=mode != "weight dtype")
    kwargs = {"mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype)} if param_dtype else {}
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


class _Count:
    """While active: the bytes of this rank's inputs to ``dist.all_gather_single``, and the
    number of all-reduces (c10d and functional)."""

    def __init__(self) -> None:
        self.gather = self.reduces = 0

    def __enter__(self) -> _Count:
        from torch.distributed.tensor.debug import CommDebugMode

        self._saved = dist.all_gather_single
        self._mode = CommDebugMode().__enter__()

        def gather(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.gather += input.numel() * input.element_size()
            return self._saved(output, input, *args, **kwargs)

        dist.all_gather_single = gather
        return self

    def __exit__(self, *exc: Any) -> None:
        dist.all_gather_single = self._saved
        self._mode.__exit__(*exc)
        self.reduces = sum(n for op, n in self._mode.get_comm_counts().items() if "all_reduce" in str(op)
                           or "allreduce" in str(op))


def _worker(rank: int, port: int, quick: bool, out: str) -> None:
    import warnings

    from mixprec import fp8

    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=300))
    torch.set_num_threads(1)
    rounds, steps = (1, 1) if quick else (7, 3)
    res: dict[str, Any] = {}
    for dtype_name, param_dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        models = {m: _model(m, param_dtype) for m in MODES}
        opts = {m: torch.optim.SGD(model.parameters(), lr=1e-3) for m, model in models.items()}
        x = torch.randn(BATCH, D, generator=torch.Generator().manual_seed(rank))
        times: dict[str, list[float]] = {m: [] for m in MODES}
        counts: dict[str, _Count] = {}

        def step(mode: str) -> None:
            models[mode](x).square().mean().backward()
            opts[mode].step()
            opts[mode].zero_grad()
            if mode == "fp8 + precompute":
                fp8.precompute_fsdp_scales(models[mode])

        for r in range(rounds + 1):  # round 0 warms up, then counts one step (not timed: CommDebugMode costs)
            for mode in MODES:
                dist.barrier()
                if r == 0:
                    step(mode)
                    with _Count() as counts[mode]:
                        step(mode)
                    continue
                start = time.perf_counter()
                for _ in range(steps):
                    step(mode)
                times[mode].append((time.perf_counter() - start) / steps * 1e3)
        res[dtype_name] = {m: {"step_ms": statistics.median(times[m]), "gather_bytes": counts[m].gather,
                               "reduces": counts[m].reduces} for m in MODES}
    if rank == 0:
        torch.save({"results": res, "rounds": rounds}, out)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # no interpreter teardown with live DTensor process-group references (tests/_distributed.py)


def run(quick: bool = False) -> dict[str, Any]:
    """Per parameter dtype and mode: all-gather and all-reduce bytes per step and rank, median
    step ms, and ratios against all-gathering in the weight dtype."""
    before = machine()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "fp8_fsdp.pt")
        mp.spawn(_worker, args=(port, quick, out), nprocs=2, join=True)
        data = torch.load(out, weights_only=True)
    for per_mode in data["results"].values():
        base = per_mode["weight dtype"]
        for r in per_mode.values():
            r["gather_ratio"] = r["gather_bytes"] / base["gather_bytes"]
            r["step_ratio"] = r["step_ms"] / base["step_ms"]
    return {**data, "machine": before, "load_after": machine()["load"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (noisier)")
    res = run(quick=parser.parse_args().quick)
    m = res["machine"]
    print(f"CPU: {m['cpu']}; load average before: {m['load']}, after: {res['load_after']}; torch {torch.__version__}, "
          f"2 gloo ranks, 1 thread each, {LAYERS} x Linear({D}, {D}) fp8 tensorwise, batch {BATCH} per rank, "
          f"median of {res['rounds']} rounds")
    print(f"{'params':<6} {'all-gather':<17} {'gathered KiB':>12} {'vs dtype':>8} {'all-reduces':>11} "
          f"{'step ms':>8} {'vs dtype':>8}")
    for dtype_name, per_mode in res["results"].items():
        for mode, r in per_mode.items():
            print(f"{dtype_name:<6} {mode:<17} {r['gather_bytes'] / 1024:>12.1f} {r['gather_ratio']:>8.3f} "
                  f"{r['reduces']:>11} {r['step_ms']:>8.1f} {r['step_ratio']:>8.2f}")


if __name__ == "__main__":
    main()
