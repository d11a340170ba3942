"""The fp4 and fp8 casts with mixprec's C++ kernels against their torch code, side by side (not a test).

:func:`mixprec.formats._fp4.quantize` and ``Fp4Tensor.dequantize`` run C++ kernels on the CPU
(``csrc/fp4_kernel.cpp``) and their torch code where the kernels are off
(``MIXPREC_NATIVE_KERNELS=0``, read at every cast): the same bits, checked here on every
operand before it is timed. Figures, one thread:

* **casts**: the operands ``mixprec-fp4-all`` casts in one step of the demo's model (``small``:
  2048 tokens, width 128, MLP 512), NVFP4 as the demo runs it: the input (bfloat16, 1x16), a
  weight (16x16), the transposed input after the Hadamard transform (float32, 1x16), the output
  gradient and its transpose (stochastic rounding, a layer's RoundingKey), and an MXFP4 input (1x32);
  ``dequantize`` to float32 (the demo's GEMMs) and bfloat16. Every round times each cast once
  with the kernels and once without, interleaved; the figure is the median of the per-round
  ratios (torch code / kernels: the speed-up).
* **fp8 casts**: the tensor- and row-scaled fp8 casts (``cast_to_fp8``, ``csrc/fp8_kernel.cpp``)
  of the same layer's operands as ``mixprec-fp8`` and ``mixprec-fp8-rowwise`` cast them: the
  input (bfloat16, e4m3, tensor / row, power-of-2 scales), the weight as ``W.t()`` (row scales
  over its first dimension), the output gradient (e5m2, tensor / row), each with its
  dequantization (``_quant.dequantize``: the emulated GEMM's float32 operand), the same rounds.
* **step**: one training step of ``mixprec-fp4-all`` with the kernels, without them, and of
  ``mixprec-fp8`` (the demo's fp8 tensorwise mode, its reference in issue 28), in alternation on
  one batch (:func:`mixprec.demo.alternate.pair_ratio`: median and quartiles of the per-round ratios).

The CPU and the load average are recorded before and after (``benchmarks/_machine.py``).

    .venv/bin/python benchmarks/fp4_cast.py [--quick] [--json fp4_cast.json]

``--quick``: the ``tiny`` model, 3 rounds (a smoke run).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._machine import machine  # noqa: E402
from benchmarks.run import NotMeasurable  # noqa: E402
from mixprec import _native, fp8  # noqa: E402
from mixprec.demo.alternate import _stepper, pair_ratio  # noqa: E402
from mixprec.demo.corpus import batch_offsets, load_tokens, make_batch  # noqa: E402
from mixprec.demo.settings import Settings  # noqa: E402
from mixprec.formats._fp4 import RoundingKey, quantize  # noqa: E402
from mixprec.formats._hadamard import hadamard, hadamard_matrix  # noqa: E402
from mixprec.formats._quant import cast_to_fp8, dequantize  # noqa: E402

_CPU = torch.device("cpu")
NV, NV_2D, MX = fp8.Cast("e2m1", "1x16"), fp8.Cast("e2m1", "16x16"), fp8.Cast("e2m1", "1x32")


@contextlib.contextmanager
def _torch_code() -> Iterator[None]:
    """The casts' torch code (``MIXPREC_NATIVE_KERNELS=0``, read at every cast; the other kernels,
    loaded by then, stay)."""
    old = os.environ.get("MIXPREC_NATIVE_KERNELS")
    os.environ["MIXPREC_NATIVE_KERNELS"] = "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["MIXPREC_NATIVE_KERNELS"]
        else:
            os.environ["MIXPREC_NATIVE_KERNELS"] = old


def _operands(size: str) -> dict[str, tuple[torch.Tensor, fp8.Cast, bool]]:
    """name -> (operand, cast, stochastic rounding), shaped as ``size``'s MLP input layer casts them."""
    s = Settings.for_size(size)
    tokens, width, hidden = s.batch_size * s.model.seq_len, s.model.d_model, s.model.hidden
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, width, generator=gen).to(torch.bfloat16)
    w = torch.randn(hidden, width, generator=gen) * 0.02
    go = (torch.randn(tokens, hidden, generator=gen) * 1e-4).to(torch.bfloat16)
    h = hadamard_matrix(0)
    return {
        f"input {tokens}x{width} bf16, 1x16": (x, NV, False),
        f"weight {hidden}x{width}, 16x16": (w, NV_2D, False),
        f"input^T {width}x{tokens}, Hadamard, 1x16": (hadamard(x.t(), h).contiguous(), NV, False),
        f"grad_output {tokens}x{hidden} bf16, 1x16 SR": (go, NV, True),
        f"grad_output^T {hidden}x{tokens}, Hadamard, 1x16 SR": (hadamard(go.t(), h).contiguous(), NV, True),
        f"input {tokens}x{width} bf16, MXFP4 1x32": (x, MX, False),
    }


def _same(a: Any, b: Any) -> bool:
    return all(torch.equal(getattr(a, f).view(torch.uint8), getattr(b, f).view(torch.uint8))
               for f in ("codes", "scales")) and torch.equal(a.amax, b.amax)


def _interleaved(fn: Callable[[], Any], rounds: int) -> dict[str, Any]:
    """``fn`` timed with the kernels and with the torch code, alternately: the median per-round
    ratio (torch code / kernels) and both median times."""
    fn()
    with _torch_code():
        fn()
    kernel, torch_code = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        kernel.append(time.perf_counter() - start)
        with _torch_code():
            start = time.perf_counter()
            fn()
            torch_code.append(time.perf_counter() - start)
    return {"speedup": statistics.median(t / k for t, k in zip(torch_code, kernel)),
            "kernel_ms": statistics.median(kernel) * 1e3, "torch_ms": statistics.median(torch_code) * 1e3}


def _casts(size: str, rounds: int) -> dict[str, dict[str, Any]]:
    out = {}
    for name, (t, cast, sr) in _operands(size).items():
        def cast_it(t=t, cast=cast, sr=sr) -> Any:
            return quantize(t, cast, generator=RoundingKey(0, 1, 0) if sr else None)

        q = cast_it()
        values = [q.dequantize(d) for d in (torch.float32, torch.bfloat16)]
        with _torch_code():
            ref = cast_it()
            ref_values = [ref.dequantize(d) for d in (torch.float32, torch.bfloat16)]
        if not _same(q, ref) or not all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                                        for a, b in zip(values, ref_values)):
            raise RuntimeError(f"{name}: the kernels and the torch code differ")
        out[name] = {"quantize": _interleaved(cast_it, rounds),
                     "dequantize float32": _interleaved(lambda q=q: q.dequantize(torch.float32), rounds),
                     "dequantize bfloat16": _interleaved(lambda q=q: q.dequantize(torch.bfloat16), rounds)}
    return out


def _fp8_operands(size: str) -> dict[str, tuple[torch.Tensor, fp8.Cast, int, bool]]:
    """name -> (operand, cast, the dimension a row scale is taken over, power-of-2 scales), shaped
    as ``size``'s MLP input layer casts them in the fp8 modes."""
    s = Settings.for_size(size)
    tokens, width, hidden = s.batch_size * s.model.seq_len, s.model.d_model, s.model.hidden
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, width, generator=gen).to(torch.bfloat16)
    wt = (torch.randn(hidden, width, generator=gen) * 0.02).t()
    go = (torch.randn(tokens, hidden, generator=gen) * 1e-4).to(torch.bfloat16)
    e4m3, e5m2 = "e4m3fn", "e5m2"
    return {
        f"input {tokens}x{width} bf16, e4m3 tensor": (x, fp8.Cast(e4m3, "tensor"), -1, False),
        f"input {tokens}x{width} bf16, e4m3 row, pow2": (x, fp8.Cast(e4m3, "row"), -1, True),
        f"weight^T {width}x{hidden}, e4m3 tensor": (wt, fp8.Cast(e4m3, "tensor"), 0, False),
        f"weight^T {width}x{hidden}, e4m3 row (dim 0), pow2": (wt, fp8.Cast(e4m3, "row"), 0, True),
        f"grad_output {tokens}x{hidden} bf16, e5m2 tensor": (go, fp8.Cast(e5m2, "tensor"), -1, False),
        f"grad_output {tokens}x{hidden} bf16, e5m2 row, pow2": (go, fp8.Cast(e5m2, "row"), -1, True),
    }


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _fp8_casts(size: str, rounds: int) -> dict[str, dict[str, Any]]:
    out = {}
    for name, (t, cast, row_dim, pow2) in _fp8_operands(size).items():
        def cast_it(t=t, cast=cast, row_dim=row_dim, pow2=pow2) -> Any:
            return cast_to_fp8(t, cast, row_dim, pow2)

        q, scale, amax = cast_it()
        with _torch_code():
            ref = cast_it()
            ref_values = dequantize(ref[0], ref[1])
        ours = (q, scale, amax, dequantize(q, scale))
        if not all(torch.equal(_bytes(a), _bytes(b)) for a, b in zip(ours, (*ref, ref_values))):
            raise RuntimeError(f"{name}: the kernels and the torch code differ")
        out[name] = {"cast": _interleaved(cast_it, rounds),
                     "dequantize": _interleaved(lambda q=q, scale=scale: dequantize(q, scale), rounds)}
    return out


def _steps(size: str, rounds: int) -> dict[str, Any]:
    """One step of mixprec-fp4-all with and without the kernels and one of mixprec-fp8, alternated."""
    settings = Settings.for_size(size)
    train = load_tokens()[0]
    offsets = batch_offsets(len(train), 1, settings.batch_size, settings.model.seq_len, settings.seed)
    x, y = make_batch(train, offsets[0], settings.model.seq_len, _CPU)
    fp4_kernel, fp4_torch = _stepper("mixprec-fp4-all", settings, _CPU), _stepper("mixprec-fp4-all", settings, _CPU)
    fp8_step = _stepper("mixprec-fp8", settings, _CPU)

    def torch_code_step(x: torch.Tensor, y: torch.Tensor) -> None:
        with _torch_code():
            fp4_torch(x, y)

    runs = {"kernels": fp4_kernel, "torch code": torch_code_step, "fp8": fp8_step}
    for step in runs.values():
        step(x, y)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for round_ in range(rounds):
        for name in (list(runs) if round_ % 2 == 0 else list(reversed(runs))):
            start = time.perf_counter()
            runs[name](x, y)
            times[name].append(time.perf_counter() - start)
    return {"torch code / kernels": pair_ratio(times["torch code"], times["kernels"]),
            "kernels / mixprec-fp8": pair_ratio(times["kernels"], times["fp8"]),
            "torch code / mixprec-fp8": pair_ratio(times["torch code"], times["fp8"])}


def run(quick: bool = False) -> dict[str, Any]:
    """The figures (see the module's docstring) and ``rows`` for ``python -m benchmarks``.

    Raises:
        NotMeasurable: the C++ kernels are not available (``MIXPREC_NATIVE_KERNELS=0``, or no build).
        RuntimeError: they and the torch code differ.
    """
    if _native.load() is None:
        raise NotMeasurable("the C++ kernels are not available here (MIXPREC_NATIVE_KERNELS=0, or no build)")
    torch.set_num_threads(1)
    size = "tiny" if quick else "small"
    out: dict[str, Any] = {"machine_before": machine(), "threads": 1, "size": size}
    start = time.perf_counter()
    out["casts"] = _casts(size, 3 if quick else 15)
    out["fp8_casts"] = _fp8_casts(size, 3 if quick else 15)
    out["steps"] = _steps(size, 3 if quick else 5)
    out["machine_after"] = machine()
    out["seconds"] = time.perf_counter() - start
    out["rows"] = _rows(out)
    return out


def _rows(res: dict[str, Any]) -> list[tuple[str, str, float, str, str]]:
    """``(benchmark, figure, ratio, reference, detail)``: kernels' time / torch code's (lower is better)."""
    rows = []
    for name, kinds in res["casts"].items():
        for kind, t in kinds.items():
            rows.append(("fp4_cast", f"{kind}, {name}", 1 / t["speedup"], "its torch code (MIXPREC_NATIVE_KERNELS=0)",
                         f"{t['kernel_ms']:.2f} vs {t['torch_ms']:.2f} ms"))
    for name, kinds in res["fp8_casts"].items():
        for kind, t in kinds.items():
            rows.append(("fp4_cast", f"fp8 {kind}, {name}", 1 / t["speedup"], "its torch code (MIXPREC_NATIVE_KERNELS=0)",
                         f"{t['kernel_ms']:.2f} vs {t['torch_ms']:.2f} ms"))
    steps = res["steps"]
    rows.append(("fp4_cast", f"training step, mixprec-fp4-all, {res['size']}",
                 1 / steps["torch code / kernels"]["ratio"],
                 "the same step with the casts' torch code",
                 f"{steps['kernels / mixprec-fp8']['ratio']:.2f}x mixprec-fp8's step "
                 f"(torch code: {steps['torch code / mixprec-fp8']['ratio']:.2f}x)"))
    return rows


def format_table(res: dict[str, Any]) -> str:
    """The cast speed-ups as a markdown table, the step ratios under it, and the machine."""
    lines = [f"### fp4 casts, {res['size']} model's operands, 1 thread", "",
             "| operand | quantize | dequantize float32 | dequantize bfloat16 |", "|---|---:|---:|---:|"]
    for name, kinds in res["casts"].items():
        cells = [f"{t['speedup']:.1f}x ({t['kernel_ms']:.2f} vs {t['torch_ms']:.2f} ms)" for t in kinds.values()]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", f"### fp8 casts, {res['size']} model's operands, 1 thread", "",
              "| operand | cast | dequantize |", "|---|---:|---:|"]
    for name, kinds in res["fp8_casts"].items():
        cells = [f"{t['speedup']:.1f}x ({t['kernel_ms']:.2f} vs {t['torch_ms']:.2f} ms)" for t in kinds.values()]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Speed-up: the torch code's time over the kernels' (median of interleaved rounds).", ""]
    for name, t in res["steps"].items():
        lines.append(f"- step, {name}: {t['ratio']:.2f}x (quartiles {t['low']:.2f}-{t['high']:.2f}, "
                     f"{t['rounds']} rounds; "
                     f"{t['mode_s']:.2f} s vs {t['reference_s']:.2f} s)")
    before, after = res["machine_before"], res["machine_after"]
    lines.append(f"\nCPU: {before['cpu']}; load average before {before['load']}, after {after['load']}; "
                 f"{res['seconds']:.0f} s.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tiny model, 3 rounds (a smoke run)")
    parser.add_argument("--json", default=None, help="also write every figure to this JSON file")
    args = parser.parse_args()
    res = run(quick=args.quick)
    print(format_table(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
