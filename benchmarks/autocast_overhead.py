"""mixprec.autocast vs torch.autocast: model step and tiny-op overhead, measured side by side.

Interleaved runs in one process, median of per-round ratios. Prints a table; ``run()`` returns
the figures for ``python -m benchmarks``.

    .venv/bin/python benchmarks/autocast_overhead.py [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import mixprec


class SmallTransformer(nn.Module):
    def __init__(self, d: int = 64, layers: int = 2, vocab: int = 256, heads: int = 4):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(n)
        return self.head(self.blocks(self.emb(tokens), mask=mask, is_causal=True))


def _time(fn, repeats: int) -> float:
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def _interleaved(fns: dict, rounds: int, repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():  # warm-up (registers kernels, fills caches)
        fn()
    for _ in range(rounds):
        for k, fn in fns.items():
            times[k].append(_time(fn, repeats))
    return {k: statistics.median(v) for k, v in times.items()}, times


def run(quick: bool = False, dtype: torch.dtype = torch.bfloat16) -> dict:
    torch.manual_seed(0)
    rounds, repeats = (9, 2) if quick else (15, 3)
    model = SmallTransformer()
    tokens = torch.randint(0, 256, (8, 32))
    targets = torch.randint(0, 256, (8, 32))
    loss_fn = nn.CrossEntropyLoss()

    def step(ctx):
        def f():
            with ctx("cpu", dtype=dtype):
                loss = loss_fn(model(tokens).flatten(0, 1), targets.flatten())
            loss.backward()
            model.zero_grad(set_to_none=True)
        return f

    med, raw = _interleaved({"torch": step(torch.autocast), "mixprec": step(mixprec.autocast)},
                            rounds, repeats)
    step_ratios = [m / t for m, t in zip(raw["mixprec"], raw["torch"])]

    a = torch.randn(8, 8)

    def tiny(ctx):
        def f():
            with ctx("cpu", dtype=dtype):
                for _ in range(100):
                    torch.mm(a, a)
        return f

    tmed, traw = _interleaved({"torch": tiny(torch.autocast), "mixprec": tiny(mixprec.autocast)},
                              rounds, repeats * 5)
    tiny_ratios = [m / t for m, t in zip(traw["mixprec"], traw["torch"])]
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "step_ms_torch": med["torch"] * 1e3,
        "step_ms_mixprec": med["mixprec"] * 1e3,
        "step_ratio": statistics.median(step_ratios),
        "tiny_op_us_torch": tmed["torch"] / 100 * 1e6,
        "tiny_op_us_mixprec": tmed["mixprec"] / 100 * 1e6,
        "tiny_op_ratio": statistics.median(tiny_ratios),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    for dtype in (torch.bfloat16, torch.float16):
        r = run(args.quick, dtype)
        print(f"[{r['dtype']}] model step (fwd+bwd, 2-layer transformer): torch {r['step_ms_torch']:.1f} ms,"
              f" mixprec {r['step_ms_mixprec']:.1f} ms, median ratio {r['step_ratio']:.3f} (target <= 1.10)")
        print(f"[{r['dtype']}] tiny op (8x8 mm): torch {r['tiny_op_us_torch']:.1f} us, mixprec "
              f"{r['tiny_op_us_mixprec']:.1f} us, median ratio {r['tiny_op_ratio']:.2f}")


if __name__ == "__main__":
    main()
