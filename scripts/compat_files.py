"""Write the files tests/test_compat_files.py loads: pickles, JSON and state_dicts made by one
version of mixprec (run it with that version first on ``PYTHONPATH``).

    PYTHONPATH=/path/to/mixprec-1067028/src python scripts/compat_files.py tests/data/compat_1067028

Each file comes from a tiny model trained a few steps on fixed data (CPU, bfloat16 compute), so a
newer mixprec can load it and check what it holds.
"""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path

import torch
from torch import nn

import mixprec
from mixprec import fp8


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)])


def _train(model: nn.Module, policy: mixprec.Policy | None, live, steps: int = 6) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, 32, generator=g)
        if policy is not None:
            with mixprec.autocast("cpu", torch.bfloat16, policy=policy):
                loss = model(x).float().square().mean()
        else:
            with mixprec.autocast("cpu", torch.bfloat16):
                loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        live.step()


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    ctl = mixprec.Controller(every=2, ladder=("tensorwise", "rowwise", "compute"), sample=64, min_dwell=2)
    policy = mixprec.Policy.parse("compute=bf16").keep(types=nn.LayerNorm).fp8("tensorwise", controller=ctl)
    model = _model()
    _train(model, policy, ctl)
    policy.save(out / "policy_controller.json")
    mixprec.Policy.fp8("rowwise", guard=fp8.Guard(every=3, max_underflow=0.2)).save(out / "policy_guard.json")
    (out / "policy_plain.pkl").write_bytes(pickle.dumps(
        mixprec.Policy.parse("compute=bf16").with_ops(fp32=["exp"]).fp8("rowwise", names="1|2", recipes={"2": "mxfp8"})))
    torch.save(ctl.state_dict(), out / "controller_state.pt")
    (out / "controller.pkl").write_bytes(pickle.dumps(ctl))
    (out / "controller_config.json").write_text(json.dumps(ctl.config(), indent=1))
    gemm = mixprec.Controller(every=2, per_gemm=True, ladder=("nvfp4", "tensorwise", "compute"), sample=64)
    gmodel = _model()
    _train(gmodel, mixprec.Policy.fp8("nvfp4", controller=gemm, first_last="fp8"), gemm)
    torch.save(gemm.state_dict(), out / "controller_per_gemm_state.pt")
    guard = fp8.Guard(every=2, max_underflow=0.5)
    converted = fp8.convert(_model(), "tensorwise", guard=guard)
    _train(converted, None, guard)
    torch.save(guard.state_dict(), out / "guard_state.pt")
    (out / "guard.pkl").write_bytes(pickle.dumps(guard))
    torch.save(converted, out / "converted_model.pt")
    torch.save(converted.state_dict(), out / "converted_state.pt")
    (out / "VERSION").write_text(f"written by mixprec at {sys.argv[2] if len(sys.argv) > 2 else 'unknown'}, "
                                 f"torch {torch.__version__}\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
