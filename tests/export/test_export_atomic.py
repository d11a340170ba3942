"""An export is written atomically: an interrupted one leaves the target as it was, and files of an
earlier checkpoint in the target are removed or refused."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import mixprec
from mixprec import fp8
from mixprec.export import Recorder, ScaleRule

pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed (pip install mixprec[export])")
safetensors_torch = pytest.importorskip("safetensors.torch", reason="safetensors is not installed")


def _trained() -> tuple[nn.Module, Recorder]:
    torch.manual_seed(0)
    model = fp8.convert(nn.Sequential(*[nn.Linear(32, 32) for _ in range(3)]), filter_fn=lambda m, n: True)
    with Recorder(model) as rec:
        for i in range(3):
            model(torch.randn(4, 32) * (i + 1)).sum().backward()
            rec.step()
    return model, rec


def _snapshot(folder) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_interrupted_reexport_leaves_the_earlier_export_as_it_was(tmp_path, monkeypatch):
    model, rec = _trained()
    out = tmp_path / "served"
    mixprec.export(model, out, stats=rec, rule=ScaleRule(windows=1))
    before = _snapshot(out)
    real = safetensors_torch.save_file

    def save_then_interrupt(*args, **kwargs):  # the weights are written, then the user hits Ctrl-C
        real(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors_torch, "save_file", save_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        mixprec.export(model, out, stats=rec, rule=ScaleRule(windows=None, margin=2.0))
    assert _snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["served"]  # nothing left beside it
    monkeypatch.undo()
    with pytest.raises(KeyboardInterrupt):  # into a new folder: nothing a reader could take
        monkeypatch.setattr(safetensors_torch, "save_file", save_then_interrupt)
        mixprec.export(model, tmp_path / "new", stats=rec)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["served"]


def test_reexport_replaces_the_earlier_export_and_keeps_other_files(tmp_path):
    model, rec = _trained()
    out = tmp_path / "served"
    mixprec.export(model, out, stats=rec, rule=ScaleRule(windows=1))
    (out / "tokenizer.json").write_text("{}")
    (out / "model-00001-of-00002.safetensors").write_bytes(b"stale")  # left there by hand
    (out / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    q = mixprec.export(model, out, stats=rec, rule=ScaleRule(windows=None, margin=2.0))
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "mixprec_export.json", "model.safetensors",
                                                       "tokenizer.json"]
    stored = safetensors_torch.load_file(str(out / "model.safetensors"))
    manifest = json.loads((out / "mixprec_export.json").read_text())
    for fqn, layer in q.layers.items():
        assert torch.equal(stored[f"{fqn}.input_scale"], layer.input_scale)
        assert manifest["layers"][fqn]["input_scale"] == float(stored[f"{fqn}.input_scale"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["served"]


def test_folder_with_another_checkpoint_or_under_a_file_is_refused_by_name(tmp_path, monkeypatch):
    model, rec = _trained()
    other = tmp_path / "trained"
    other.mkdir()
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                 "model.safetensors.index.json", "config.json"):
        (other / name).write_text("x")
    (other / "tokenizer.json").write_text("{}")
    before = _snapshot(other)
    with pytest.raises(ValueError, match=r"holds another checkpoint's files \(config.json, "
                                         r"model-00001-of-00002.safetensors, .*model.safetensors.index.json\)"):
        mixprec.export(model, other, stats=rec)
    assert _snapshot(other) == before
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match=r"afile is a file, not a folder"):
        mixprec.export(model, tmp_path / "afile" / "out", stats=rec)
    with pytest.raises(ValueError, match=r"afile is a file, not a folder"):
        mixprec.export(model, tmp_path / "afile", stats=rec)
    empty = tmp_path / "empty"
    empty.mkdir()
    with monkeypatch.context() as mp:  # the current folder would be replaced under the process
        mp.chdir(empty)
        with pytest.raises(ValueError, match=r"is the current folder \(or contains it\)"):
            mixprec.export(model, ".", stats=rec)
    mixprec.export(model, empty, stats=rec)  # an empty folder is fine
    assert (empty / "model.safetensors").is_file()
