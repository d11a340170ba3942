"""The format that ran is the format exported: recorded on the layer (Policy.fp8, convert,
Controller) and in the saved statistics, so the CLI writes what the Python call writes."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import mixprec
from mixprec import Policy, fp8
from mixprec.export import Recorder
from mixprec.fp8 import Controller

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed (pip install mixprec[export])")
safetensors_torch = pytest.importorskip("safetensors.torch", reason="safetensors is not installed")


def _policy_run(policy, model: nn.Module, ctl=None, steps: int = 2, ids=None) -> Recorder:
    g = torch.Generator().manual_seed(2)
    with Recorder(model) as rec:
        for _ in range(steps):
            with mixprec.autocast("cpu", policy=policy):
                if ids is None:
                    loss = model(torch.randn(16, 32, generator=g)).float().square().mean()
                else:
                    batch = torch.randint(0, 64, (2, 8), generator=g)
                    loss = model(batch, labels=batch).loss
            loss.backward()
            model.zero_grad()
            if ctl is not None:
                ctl.step()
            rec.step()
    return rec


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4"])
def test_policy_fp4_routed_layers_export_in_the_format_they_ran(tmp_path, name):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(3)])
    rec = _policy_run(Policy.parse("compute=bf16").fp8(name, first_last="fp8"), model)
    assert fp8.layer_state(model[1]).policy_recipe.name == name  # recorded on the layer
    q = mixprec.export(model, tmp_path / "a", stats=rec)
    assert not q.layers and sorted(q.fp4) == ["0", "1", "2"] and {l.format for l in q.fp4.values()} == {name}
    with pytest.warns(UserWarning, match=r"recipe='tensorwise' contradicts what 3 layers ran \(0 ran " + name):
        q2 = mixprec.export(model, tmp_path / "b", stats=rec, recipe="tensorwise")
    assert sorted(q2.fp4) == ["0", "1", "2"] and not q2.layers


def _llama() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                   max_position_embeddings=32, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg).float()


def _written(folder) -> tuple[dict, dict, dict]:
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    manifest = json.loads((folder / "mixprec_export.json").read_text())
    return safetensors_torch.load_file(str(folder / "model.safetensors")), qc, manifest


def test_cli_writes_what_the_python_call_writes_for_a_controller_trained_model(tmp_path, capsys):
    from mixprec.cli import main

    model = _llama()
    ctl = Controller(every=5, ladder=("nvfp4", "tensorwise", "compute"))
    rec = _policy_run(Policy.parse("compute=bf16").fp8("nvfp4", controller=ctl), model, ctl, ids=True)
    for i in range(2):  # as the Controller's promotions leave them: down_proj on the fp8 rung
        fp8.layer_state(model.get_submodule(f"model.layers.{i}.mlp.down_proj")).recipe = fp8.as_recipe("tensorwise")
    fp8.layer_state(model.get_submodule("model.layers.1.self_attn.o_proj")).fallback = True  # on the compute rung
    with pytest.warns(UserWarning):  # layer 0's q_proj is kept (first_last="keep"): its k/v with it
        q = mixprec.export(model, tmp_path / "py", stats=rec)
    assert sorted(q.layers) == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    assert len(q.fp4) == 8 and {l.format for l in q.fp4.values()} == {"nvfp4"}
    assert q.kept["model.layers.1.self_attn.o_proj"].startswith("in fallback")
    rec.save(tmp_path / "stats.pt")
    model.save_pretrained(tmp_path / "trained")
    args = ["export", str(tmp_path / "trained"), str(tmp_path / "cli"), "--stats", str(tmp_path / "stats.pt")]
    assert main(args) == 0, capsys.readouterr().err
    assert "2 fp8 layers, 8 fp4 layers" in capsys.readouterr().out
    py, cli = _written(tmp_path / "py"), _written(tmp_path / "cli")
    assert py[1] == cli[1] and py[2] == cli[2]
    assert py[0].keys() == cli[0].keys()
    for k, t in py[0].items():
        assert torch.equal(t.view(torch.uint8) if t.dtype.itemsize == 1 else t, cli[0][k].view(torch.uint8)
                           if t.dtype.itemsize == 1 else cli[0][k]), k
    with pytest.warns(UserWarning, match=r"recipe='nvfp4' contradicts what 2 layers ran \(model.layers.0.mlp.down_proj "
                                         r"ran tensorwise"):
        assert main(args[:2] + [str(tmp_path / "cli2")] + args[3:] + ["--recipe", "nvfp4"]) == 0
    assert _written(tmp_path / "cli2")[1] == py[1]


# -- load_static and the CLI's answers to bad input ------------------------------------------------

def test_load_static_refuses_an_fp4_export_naming_a_layer(tmp_path):
    from mixprec.export import load_static

    model = fp8.convert(_llama(), fp8.Float8Recipe.mxfp4(), filter_fn=lambda m, n: n.endswith("down_proj"))
    with Recorder(model) as rec:
        model(torch.arange(16).reshape(2, 8))
        rec.step()
    mixprec.export(model, tmp_path, stats=rec)
    plain = fp8.unconvert(model)
    before = {k: v.clone() for k, v in plain.state_dict().items()}
    with pytest.raises(ValueError, match=r"load_static runs fp8 layers only, and 2 layers of this export are fp4 "
                                         r"\(NVFP4/MXFP4: 'model.layers.0.mlp.down_proj' \.\.\.\)"):
        load_static(plain, tmp_path)
    assert all(torch.equal(before[k], v) for k, v in plain.state_dict().items())  # untouched


def _one_error_line(capsys, *fragments: str) -> None:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("mixprec export: error: "), err
    assert "Traceback" not in err and all(f in lines[0] for f in fragments), err


def test_cli_answers_bad_input_with_one_error_line(tmp_path, capsys):
    from mixprec.cli import main

    model = fp8.convert(_llama(), filter_fn=lambda m, n: ".layers." in n)
    with Recorder(model) as rec:
        model(torch.arange(16).reshape(2, 8))
        rec.step()
    rec.save(tmp_path / "stats.pt")
    fp8.unconvert(model).save_pretrained(tmp_path / "trained")
    capsys.readouterr()  # save_pretrained's progress bars
    (tmp_path / "afile").write_text("x")
    base = ["export", str(tmp_path / "trained")]
    assert main(base + [str(tmp_path / "afile" / "out"), "--stats", str(tmp_path / "stats.pt")]) == 1
    _one_error_line(capsys, "afile is a file, not a folder")
    (tmp_path / "notes.txt").write_text("not statistics")
    assert main(base + [str(tmp_path / "o"), "--stats", str(tmp_path / "notes.txt")]) == 1
    _one_error_line(capsys, "notes.txt is not a statistics file written by mixprec.export.Recorder.save")
    torch.save([1, 2, 3], tmp_path / "list.pt")
    assert main(base + [str(tmp_path / "o"), "--stats", str(tmp_path / "list.pt")]) == 1
    _one_error_line(capsys, "must be what mixprec.export.Recorder.save wrote")
    assert main(base + [str(tmp_path / "trained"), "--stats", str(tmp_path / "stats.pt")]) == 1  # onto the model
    _one_error_line(capsys, "holds another checkpoint's files (config.json")
    assert not (tmp_path / "o").exists()
    assert main(base + [str(tmp_path / "o"), "--stats", str(tmp_path / "stats.pt")]) == 0
    out = capsys.readouterr().out
    assert "note: transformers reports k_scale/v_scale as UNEXPECTED" in out
    assert json.loads((tmp_path / "o" / "mixprec_export.json").read_text())["kv_scales_note"] == mixprec.export.KV_NOTE
