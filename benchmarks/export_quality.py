"""Export quality on the demo's model: static scales from training vs dynamic vs a calibration pass.

Trains the demo's tiny model (``mixprec.demo``) under ``fp8.convert`` (tensorwise) with a
``mixprec.export.Recorder`` (windows of 10 steps), then compares validation loss for: the fp32
weights (no quantization), fp8 with dynamic (current) scaling as trained, the compressed-tensors
export with static input scales from training (max over the last 8 windows), and the same export
with scales from a 512-sample post-training calibration pass (max over its batches, the
llm-compressor minmax style). KV cache: the SQNR of the keys and values quantized to fp8 e4m3 with
the training-derived ``k_scale``/``v_scale`` vs a scale of 1.0 (vLLM's default without one).
Prints a table, the CPU model and the load.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/export_quality.py [--steps 300]
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._machine import machine  # noqa: E402
from mixprec import export as ex  # noqa: E402
from mixprec import fp8  # noqa: E402
from mixprec.demo.corpus import batch_offsets, load_tokens, make_batch  # noqa: E402
from mixprec.demo.model import SIZES, TransformerLM, lm_loss  # noqa: E402

BATCH = 16


def _val_loss(model: torch.nn.Module, val: torch.Tensor, seq: int) -> float:
    offs = batch_offsets(len(val), 8, BATCH, seq, seed=123)
    total = 0.0
    with torch.no_grad():
        for o in offs:
            x, y = make_batch(val, o, seq, torch.device("cpu"))
            total += float(lm_loss(model(x), y))
    return total / len(offs)


def _sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    err = torch.linalg.vector_norm((ref - approx).double())
    return math.inf if err == 0 else float(20 * torch.log10(torch.linalg.vector_norm(ref.double()) / err))


def _kv(model: torch.nn.Module, val: torch.Tensor, seq: int) -> dict[str, torch.Tensor]:
    """The keys and values of every block on the validation batches (fp32 model)."""
    caught: dict[str, list[torch.Tensor]] = {}
    hooks = []
    for i, block in enumerate(model.blocks):
        d = block.qkv.out_features // 3

        def hook(mod, args, out, i=i, d=d):
            caught.setdefault(f"blocks.{i}:k", []).append(out[..., d:2 * d].detach())
            caught.setdefault(f"blocks.{i}:v", []).append(out[..., 2 * d:].detach())
        hooks.append(block.qkv.register_forward_hook(hook))
    _val_loss(model, val, seq)
    for h in hooks:
        h.remove()
    return {k: torch.cat(v) for k, v in caught.items()}


def _recorder_overhead(model: torch.nn.Module, train: torch.Tensor, seq: int, steps: int = 15) -> float:
    """Time of ``steps`` forward+backward passes with a Recorder over the time without (median of 3)."""
    offs = batch_offsets(len(train), steps, BATCH, seq, seed=7)
    batches = [make_batch(train, o, seq, torch.device("cpu")) for o in offs]

    def run(record: bool) -> float:
        rec = ex.Recorder(model) if record else None
        t0 = time.perf_counter()
        for x, y in batches:
            lm_loss(model(x), y).backward()
            if rec is not None:
                rec.step()
        dt = time.perf_counter() - t0
        if rec is not None:
            rec.close()
        model.zero_grad(set_to_none=True)
        return dt

    ratios = sorted(run(True) / run(False) for _ in range(3))
    return ratios[1]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    cfg = SIZES["tiny"]
    train, val = load_tokens()
    torch.manual_seed(args.seed)
    model = fp8.convert(TransformerLM(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rec = ex.Recorder(model, every=10)
    offs = batch_offsets(len(train), args.steps, BATCH, cfg.seq_len, seed=args.seed)
    t0 = time.perf_counter()
    for o in offs:
        x, y = make_batch(train, o, cfg.seq_len, torch.device("cpu"))
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        rec.step()
    train_s = time.perf_counter() - t0
    rec.close()
    overhead = _recorder_overhead(model, train, cfg.seq_len)
    plain = fp8.unconvert(copy.deepcopy(model))
    fp8_layers = [n for n, m in model.named_modules() if isinstance(m, fp8.Float8Linear)]
    rows = [("fp32 weights, no quantization", _val_loss(plain, val, cfg.seq_len), "-")]
    rows.append(("fp8 dynamic scales (as trained)", _val_loss(model, val, cfg.seq_len), "-"))
    with tempfile.TemporaryDirectory() as tmp:
        q_train = ex.export(model, Path(tmp) / "train", stats=rec)
        static = ex.load_static(copy.deepcopy(plain), Path(tmp) / "train")
        rows.append((f"fp8 static, training windows ({q_train.rule.describe()})", _val_loss(static, val, cfg.seq_len), "0 s"))
        calib = copy.deepcopy(plain)
        t0 = time.perf_counter()
        coffs = batch_offsets(len(train), 512 // BATCH, BATCH, cfg.seq_len, seed=args.seed + 1)
        with ex.calibrate(calib) as crec:
            for o in coffs:
                calib(make_batch(train, o, cfg.seq_len, torch.device("cpu"))[0])
        calib_s = time.perf_counter() - t0
        q_cal = ex.export(calib, Path(tmp) / "calib", stats=crec, layers=fp8_layers, rule=ex.ScaleRule(windows=None))
        cal_model = ex.load_static(copy.deepcopy(plain), Path(tmp) / "calib")
        rows.append(("fp8 static, 512-sample calibration pass (max)", _val_loss(cal_model, val, cfg.seq_len), f"{calib_s:.2f} s"))
    kv = _kv(plain, val, cfg.seq_len)
    kv_rows = []
    for name, t in kv.items():
        block, which = name.split(":")
        s_train = q_train.kv_scales[block][f"{which}_scale"]
        s_cal = q_cal.kv_scales[block][f"{which}_scale"]
        kv_rows.append((name, float(t.abs().max()), _sqnr_db(t, ex.fake_quantize(t, s_train)),
                        _sqnr_db(t, ex.fake_quantize(t, s_cal)), _sqnr_db(t, ex.fake_quantize(t, torch.ones(1)))))
    info = machine()
    print(f"# export quality: demo tiny model, {args.steps} fp8 (tensorwise) steps, seed {args.seed}; "
          f"training {train_s:.1f} s; Recorder overhead on a training step {overhead:.3f}x; CPU {info['cpu']}; load {info['load']}; torch {torch.__version__}")
    print("\n| inference | validation loss | vs fp32 | extra pass |\n|---|---:|---:|---:|")
    for what, loss, cost in rows:
        print(f"| {what} | {loss:.4f} | {loss / rows[0][1]:.4f} | {cost} |")
    print("\n| KV tensor | amax | SQNR dB, training scale | SQNR dB, calibration scale | SQNR dB, scale 1.0 |"
          "\n|---|---:|---:|---:|---:|")
    for name, amax, a, b, c in kv_rows:
        print(f"| {name} | {amax:.3f} | {a:.1f} | {b:.1f} | {c:.1f} |")


if __name__ == "__main__":
    main()
