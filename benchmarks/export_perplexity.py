"""Perplexity of every export route on the demo corpus's validation split, each read back as served.

Trains the demo's model (``mixprec.demo``: ``TransformerLM``, byte tokens, the demo's AdamW and
learning-rate schedule) three times from the same seed and batches: under ``fp8.convert`` with the
tensorwise recipe, with NVFP4 and with MXFP4 (the layers ``fp8.select_layers`` picks: first layer
and head kept), each with a ``mixprec.export.Recorder``. Every route is exported with
``mixprec.export`` (compressed-tensors) into a folder and read back from it:

* fp8 routes with ``mixprec.export.load_static`` (fp8 weights, static input scales: bitwise
  transformers' compressed-tensors forward, tests/export/test_export.py);
* the fp8 KV cache (vLLM turns it on when a folder carries ``k_scale``/``v_scale``): the same
  static model with the keys and values quantized to e4m3 as the cache stores them
  (``fake_quantize``, vLLM's ``x / scale`` cast) with the folder's scales, and with 1.0 (what vLLM
  uses without them). The demo's attention rotates nothing: its cached keys and values are the
  ``qkv`` output's last two thirds, where the Recorder measured them;
* fp4 routes with compressed-tensors' own reader, as transformers runs them
  (``apply_quantization_config(run_compressed=False)``, ``compress_model``, load, ``decompress_model``;
  its forward then quantizes each fp4 layer's input dynamically, NVFP4 with the stored
  ``input_global_scale``); the decompressed weights (bf16, exact) run in float32 like the rest.

Perplexity = exp(mean next-token cross-entropy) over ``--val-batches`` batches of the validation
split (the same batches for every row). Prints the table, the CPU model and the load.

    TQDM_DISABLE=1 PYTHONPATH=src python -m benchmarks.export_perplexity [--steps 120] [--val-batches 8]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import math
import resource
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn

from benchmarks._machine import machine
from mixprec import export as ex
from mixprec import fp8
from mixprec.demo.corpus import batch_offsets, load_tokens, make_batch
from mixprec.demo.model import TransformerLM, lm_loss
from mixprec.demo.settings import Settings, lr_factor
from mixprec.fp8 import Float8Recipe

__all__ = ["ROUTES", "Row", "measure", "format_table", "main"]

#: the rows of the table, in order: (route, training recipe, how the folder is read back)
ROUTES = (
    ("fp32 weights, no quantization", "fp8 tensorwise", "the trained model, fp8.unconvert"),
    ("fp8 dynamic scales (as trained)", "fp8 tensorwise", "the trained model"),
    ("fp8 static, training scales", "fp8 tensorwise", "load_static"),
    ("fp8 static, 512-sample calibration", "fp8 tensorwise", "load_static"),
    ("fp8 static + fp8 KV, training k/v scales", "fp8 tensorwise", "load_static + e4m3 KV"),
    ("fp8 static + fp8 KV, k/v scales 1.0", "fp8 tensorwise", "load_static + e4m3 KV"),
    ("NVFP4 (trained in NVFP4)", "nvfp4", "compressed-tensors decompress_model"),
    ("MXFP4 (trained in MXFP4)", "mxfp4", "compressed-tensors decompress_model"),
)
RECIPES = {
    "fp8 tensorwise": Float8Recipe.tensorwise(),
    # Transformer Engine's recipe (16x16 weight blocks, Hadamard and stochastic rounding in the backward):
    # the export is the forward's cast
    "nvfp4": Float8Recipe.nvfp4(),
    "mxfp4": Float8Recipe.mxfp4(),
}


@dataclass(frozen=True)
class Row:
    """One line of the table: ``route`` (a :data:`ROUTES` name), the recipe the model trained in, how
    the folder was read back, the validation perplexity, and that model's fp32-weights perplexity."""

    route: str
    trained: str
    reader: str
    ppl: float
    fp32_ppl: float


def _train(recipe: Float8Recipe, settings: Settings, train: torch.Tensor) -> tuple[nn.Module, ex.Recorder, float]:
    """The demo's model converted to ``recipe`` and trained as the demo trains (AdamW, warm-up then cosine)."""
    cfg = settings.model
    torch.manual_seed(settings.seed)
    model = fp8.convert(TransformerLM(cfg), recipe)
    opt = torch.optim.AdamW(model.parameters(), lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(step, settings.steps))
    rec = ex.Recorder(model, every=10)
    offs = batch_offsets(len(train), settings.steps, settings.batch_size, cfg.seq_len, settings.seed)
    t0 = time.perf_counter()
    for o in offs:
        x, y = make_batch(train, o, cfg.seq_len, torch.device("cpu"))
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        schedule.step()
        rec.step()
    rec.close()
    return model.eval(), rec, time.perf_counter() - t0


def _perplexity(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    with torch.no_grad():
        return math.exp(sum(float(lm_loss(model(x), y)) for x, y in batches) / len(batches))


@contextlib.contextmanager
def _kv_fp8(model: TransformerLM, scales: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> Iterator[None]:
    """Quantize each block's cached keys and values (the ``qkv`` output's last two thirds) to e4m3
    with ``scales[block] = (k_scale, v_scale)``, as an fp8 KV cache stores them."""
    hooks = []
    for i, block in enumerate(model.blocks):
        k_scale, v_scale = scales[f"blocks.{i}"]
        d = model.cfg.d_model

        def hook(mod: nn.Module, args: tuple, out: torch.Tensor, k_scale=k_scale, v_scale=v_scale, d=d) -> torch.Tensor:
            q, k, v = out.split(d, dim=-1)
            return torch.cat([q, ex.fake_quantize(k, k_scale), ex.fake_quantize(v, v_scale)], dim=-1)
        hooks.append(block.qkv.register_forward_hook(hook))
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def _read_compressed_tensors(folder: Path, fresh: nn.Module) -> nn.Module:
    """compressed-tensors' own reader of ``folder`` into ``fresh`` (an unconverted model of the same
    shape), as transformers' integration runs it on CPU; the decompressed weights in float32."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from safetensors.torch import load_file

    qconfig = QuantizationConfig.model_validate(json.loads((folder / "config.json").read_text())["quantization_config"])
    apply_quantization_config(fresh, qconfig, run_compressed=False)
    compressor = ModelCompressor(quantization_config=qconfig)
    compressor.compress_model(fresh)
    stored = load_file(str(folder / "model.safetensors"))
    kv = {k for k in stored if k.endswith(("k_scale", "v_scale"))}  # the demo's attention takes no cache
    missing, unexpected = fresh.load_state_dict({k: v for k, v in stored.items() if k not in kv}, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"{folder}: compressed-tensors' layout does not match the export "
                           f"(missing {missing}, unexpected {unexpected})")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tqdm / deprecation chatter
        compressor.decompress_model(fresh)
    for m in fresh.modules():
        if isinstance(m, nn.Linear) and m.weight.dtype != torch.float32:
            m.weight.data = m.weight.data.float()  # bf16 -> float32: exact
    return fresh.eval()


def measure(steps: int | None = None, seed: int = 0, val_batches: int = 8, calib_samples: int = 512,
            log: Callable[[str], None] = lambda line: None) -> dict:
    """Train (``steps``: default the demo's tiny preset, 120), export every route, read each back and
    measure it. Returns ``{"rows": [Row, ...],
    "train_s": {recipe: seconds}, "kv_scales": {block: (k_scale, v_scale)}, "settings": Settings}``."""
    settings = Settings.for_size("tiny", steps=steps, seed=seed)
    if calib_samples < settings.batch_size or val_batches < 1:
        raise ValueError(f"export_perplexity: calib_samples must be >= the batch size {settings.batch_size} and "
                         f"val_batches >= 1, got {calib_samples} and {val_batches}")
    cfg = settings.model
    train, val = load_tokens()
    val_offs = batch_offsets(len(val), val_batches, settings.batch_size, cfg.seq_len, seed=123)
    batches = [make_batch(val, o, cfg.seq_len, torch.device("cpu")) for o in val_offs]
    rows: list[Row] = []
    train_s: dict[str, float] = {}
    kv_scales: dict[str, tuple[float, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, recipe in RECIPES.items():
            log(f"training the demo's tiny model in {name}, {settings.steps} steps ...")
            model, rec, train_s[name] = _train(recipe, settings, train)
            plain = fp8.unconvert(copy.deepcopy(model))
            fp32_ppl = _perplexity(plain, batches)

            def row(route: str, ppl: float) -> None:
                spec = next(r for r in ROUTES if r[0] == route)
                rows.append(Row(route, spec[1], spec[2], ppl, fp32_ppl))

            folder = Path(tmp) / name.replace(" ", "-")
            q = ex.export(model, folder, stats=rec)
            if name != "fp8 tensorwise":
                row(next(r[0] for r in ROUTES if r[1] == name),
                    _perplexity(_read_compressed_tensors(folder, copy.deepcopy(plain)), batches))
                continue
            row(ROUTES[0][0], fp32_ppl)
            row(ROUTES[1][0], _perplexity(model, batches))
            static = ex.load_static(copy.deepcopy(plain), folder)
            row(ROUTES[2][0], _perplexity(static, batches))
            calib = copy.deepcopy(plain)
            coffs = batch_offsets(len(train), calib_samples // settings.batch_size, settings.batch_size, cfg.seq_len,
                                  seed=seed + 1)
            with ex.calibrate(calib) as crec:
                for o in coffs:
                    calib(make_batch(train, o, cfg.seq_len, torch.device("cpu"))[0])
            ex.export(calib, Path(tmp) / "calibration", stats=crec, layers=sorted(q.layers),
                      rule=ex.ScaleRule(windows=None))
            row(ROUTES[3][0], _perplexity(ex.load_static(copy.deepcopy(plain), Path(tmp) / "calibration"), batches))
            scales = {a: (s["k_scale"], s["v_scale"]) for a, s in q.kv_scales.items()}
            ones = {a: (torch.ones(1), torch.ones(1)) for a in scales}
            for route, kv in ((ROUTES[4][0], scales), (ROUTES[5][0], ones)):
                with _kv_fp8(static, kv):
                    row(route, _perplexity(static, batches))
            kv_scales = {a: (float(k), float(v)) for a, (k, v) in scales.items()}
    order = [r[0] for r in ROUTES]
    return {"rows": sorted(rows, key=lambda r: order.index(r.route)), "train_s": train_s, "kv_scales": kv_scales,
            "settings": settings}


def format_table(rows: list[Row]) -> str:
    """The markdown table: perplexity and its ratio to the fp32 weights of the same training."""
    lines = ["| route | trained in | read back with | perplexity | vs its fp32 weights |",
             "|---|---|---|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.route} | {r.trained} | {r.reader} | {r.ppl:.4f} | {r.ppl / r.fp32_ppl:.4f} |")
    return "\n".join(lines)


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.export_perplexity", description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per training (default: the demo's, 120)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--val-batches", type=int, default=8, help="validation batches (of the demo's batch size)")
    ap.add_argument("--calib-samples", type=int, default=512, help="sequences of the calibration pass (default 512)")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    res = measure(args.steps, args.seed, args.val_batches, args.calib_samples, log=lambda line: print(line, flush=True))
    s = res["settings"]
    info = machine()
    trained = ", ".join(f"{k} {v:.1f} s" for k, v in res["train_s"].items())
    fp32 = {r.trained: r.fp32_ppl for r in res["rows"]}
    print(f"\n# export perplexity: demo tiny model ({s.model.n_layers} layers, d={s.model.d_model}), {s.steps} steps "
          f"of {s.batch_size} x {s.model.seq_len} byte tokens, seed {s.seed}; validation: {args.val_batches} batches; "
          f"training {trained}; total {time.perf_counter() - start:.0f} s wall, {_cpu_s():.0f} s CPU")
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; CPU {info['cpu']}; load {info['load']}; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("# fp32-weights perplexity of each training: " + ", ".join(f"{k} {v:.4f}" for k, v in fp32.items()))
    print("# k/v scales written (training): " + ", ".join(f"{a} {k:.5f}/{v:.5f}" for a, (k, v) in res["kv_scales"].items()))
    print()
    print(format_table(res["rows"]))


if __name__ == "__main__":
    main()
