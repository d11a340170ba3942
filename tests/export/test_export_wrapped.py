"""A wrapped model (torch.compile, DataParallel) exports as the bare model: its names, its tensors."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import mixprec
from mixprec import fp8
from mixprec.export import Recorder, ScaleRule, load_static
from test_export_nonfinite import _Block

pytest.importorskip("safetensors", reason="safetensors is not installed")

BATCHES = [torch.randn(8, 32, generator=torch.Generator().manual_seed(i)) * (8.0 if i == 0 else 1.0) for i in range(2)]
#: the last window only: the LayerState's window (the max over both) would give other input scales
RULE = ScaleRule(windows=1)
SERIES = ["0:input", "1.k_proj:input", "1.v_proj:input", "1.up:input", "1.down:input", "2:input", "1:k", "1:v"]


def _snapshot(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_a_wrapped_model_exports_bitwise_as_the_bare_model(tmp_path):
    """Two compiled forwards, recorded by Recorders made on the torch.compile wrapper, on the bare model
    and on a model whose attention block is wrapped: every export of a wrapped model, with any of them,
    writes the bare model's files byte for byte (safetensors keys and tensors, config.json's ignore
    list, the manifest)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    model = fp8.convert(nn.Sequential(nn.Linear(32, 32), _Block(), nn.Linear(32, 32)))
    compiled = torch.compile(model, backend="eager")  # Dynamo traces the hooks; no Inductor build (slow on CPU)
    inner = {name: nn.Sequential(model[0], wrap(model[1]), model[2])
             for name, wrap in [("inner-compiled", torch.compile), ("inner-checkpoint-wrapper", checkpoint_wrapper)]}
    recs = {"compiled": Recorder(compiled), "bare": Recorder(model), "inner": Recorder(inner["inner-compiled"])}
    for x in BATCHES:
        with torch.no_grad():
            compiled(x)
        for rec in recs.values():
            rec.step()
    for name, rec in recs.items():
        assert rec.names == SERIES, name
        assert torch.equal(rec.history, recs["bare"].history), name

    q = mixprec.export(model, tmp_path / "bare", stats=recs["bare"], rule=RULE)
    assert sorted(q.layers) == ["1.down", "1.k_proj", "1.up", "1.v_proj"] and set(q.kv_scales) == {"1"}
    assert q.layers["1.up"].source == "recorded windows"
    assert torch.equal(q.layers["1.up"].input_scale, RULE.scale(recs["bare"].series()["1.up:input"]))
    expected = _snapshot(tmp_path / "bare")
    cases = [("compiled", compiled, recs["compiled"]), ("compiled-bare-recorder", compiled, recs["bare"]),
             ("dataparallel", nn.DataParallel(model), recs["compiled"]),
             *[(name, wrapped, recs["inner"]) for name, wrapped in inner.items()]]
    for name, wrapped, rec in cases:
        mixprec.export(wrapped, tmp_path / name, stats=rec, rule=RULE)
        assert _snapshot(tmp_path / name) == expected, name

    x = torch.randn(4, 32)
    served = load_static(fp8.unconvert(copy.deepcopy(model)), tmp_path / "compiled")
    served_wrapped = load_static(nn.DataParallel(fp8.unconvert(copy.deepcopy(model))), tmp_path / "compiled")
    with torch.no_grad():
        assert torch.equal(served_wrapped(x), served(x))
    assert type(served[1].up).__name__ == type(served_wrapped.module[1].up).__name__ == "StaticFloat8Linear"
