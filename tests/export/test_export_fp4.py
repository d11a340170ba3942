"""mixprec.export of fp4 layers (NVFP4, MXFP4): read back by compressed-tensors' own decompressors."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import mixprec
from mixprec import fp8
from mixprec.export import Recorder, ScaleRule
from mixprec.fp8 import Float8Recipe
from mixprec.fp8.internals import fp4_quantize

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed (pip install mixprec[export])")
pytest.importorskip("safetensors", reason="safetensors is not installed")

IDS = torch.arange(16).reshape(2, 8) % 64
NVFP4_TE = Float8Recipe.nvfp4()  # 16x16 weight blocks, Hadamard, stochastic rounding (backward only)
NVFP4_1D = Float8Recipe.nvfp4(hadamard=False, stochastic_rounding=False, weight_block=(1, 16))
MXFP4 = Float8Recipe.mxfp4()
#: (name, recipe, compressed-tensors format, stored tensors)
NV_KEYS = {"weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"}
CASES = [
    ("nvfp4", NVFP4_TE, "nvfp4-pack-quantized", NV_KEYS),
    ("nvfp4_1x16", NVFP4_1D, "nvfp4-pack-quantized", NV_KEYS),
    ("mxfp4", MXFP4, "mxfp4-pack-quantized", {"weight_packed", "weight_scale"}),
]


def _llama() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=32, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg).float().eval()


def _train(model: nn.Module, steps: int = 3) -> Recorder:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = Recorder(model)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, 64, (2, 8), generator=g)
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        rec.step()
    rec.close()
    return rec


def _decompressed(folder, model_config) -> nn.Module:
    """compressed-tensors' own path: its config schema, layout, load, then ``decompress_model``."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from safetensors.torch import load_file

    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    qconfig = QuantizationConfig.model_validate(qc)
    fresh = transformers.LlamaForCausalLM(model_config).float()
    apply_quantization_config(fresh, qconfig)
    compressor = ModelCompressor(quantization_config=qconfig)
    compressor.compress_model(fresh)
    stored = load_file(str(folder / "model.safetensors"))
    kv = {k for k in stored if k.endswith(("k_scale", "v_scale"))}  # fp8 KV cache scales: see test_export.py
    missing, unexpected = fresh.load_state_dict({k: v for k, v in stored.items() if k not in kv}, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    fresh.stored = stored
    compressor.decompress_model(fresh)
    return fresh


def _ref(weight: torch.Tensor, recipe: Float8Recipe, dtype: torch.dtype) -> torch.Tensor:
    return fp4_quantize(weight.detach(), recipe.weight, subnormal_scales=recipe.subnormal_scales).dequantize(dtype)


#: the shards a serving engine fuses in a Llama: cast as one layer (test_export_fused.py)
_FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _ref_layer(model: nn.Module, fqn: str, recipe: Float8Recipe, exported: set[str]) -> torch.Tensor:
    """mixprec's fp4 cast of layer ``fqn`` as exported: of its fused group's stacked weights when the
    whole group is in ``exported``, the layer's rows of it."""
    parent, _, name = fqn.rpartition(".")
    group = next((g for g in _FUSED if name in g and all(f"{parent}.{n}" in exported for n in g)), (name,))
    weights = [model.get_submodule(f"{parent}.{n}").weight for n in group]
    start = sum(w.shape[0] for w in weights[:group.index(name)])
    return _ref(torch.cat([w.detach() for w in weights]), recipe, dtype=torch.bfloat16)[start:start + weights[
        group.index(name)].shape[0]]


@pytest.mark.parametrize("name,recipe,ct_format,keys", CASES, ids=[c[0] for c in CASES])
def test_compressed_tensors_decompresses_fp4_to_mixprec_own_cast(tmp_path, name, recipe, ct_format, keys):
    model = fp8.convert(_llama(), recipe, filter_fn=lambda m, n: ".layers." in n)
    rec = _train(model)
    rule = ScaleRule(windows=2, margin=1.25)
    q = mixprec.export(model, tmp_path, stats=rec, rule=rule)
    assert not q.layers and len(q.fp4) == 14 and set(q.kept) == {"lm_head"}
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qc["format"] == ct_format and qc["ignore"] == ["lm_head"]
    (group,) = qc["config_groups"].values()
    assert group["format"] == ct_format and sorted(group["targets"]) == sorted(q.fp4)
    fresh = _decompressed(tmp_path, model.config)
    hist = rec.series()
    for fqn, layer in q.fp4.items():
        lin = model.get_submodule(fqn)
        stored = {k.rsplit(".", 1)[1] for k in fresh.stored if k.startswith(fqn + ".")}
        assert stored == keys | {"bias"} & stored, (fqn, stored)
        w = fresh.get_submodule(fqn).weight.data
        assert w.dtype == torch.bfloat16  # compressed-tensors decompresses fp4 to bf16
        assert torch.equal(w, _ref_layer(model, fqn, recipe, set(q.fp4))), fqn
        if "input_global_scale" in keys:
            amax = rule.amax(hist[f"{fqn}:input"]).double() * 1.25
            assert torch.equal(layer.input_global_scale, (448 * 6 / amax).float().reshape(1))
            assert fresh.stored[f"{fqn}.weight_global_scale"].dtype == torch.float32
    assert torch.equal(fresh.lm_head.weight.data, model.lm_head.weight.data)  # kept: as it was


def test_nvfp4_global_scale_is_the_reciprocal_of_mixprec_tensor_scale_fp32(tmp_path):
    """compressed-tensors' own ``dequantize`` in float32 (codes * (block_scale / global_scale)) is within
    one float32 rounding of mixprec's (codes * (tensor_scale * block_scale)), bitwise after bf16."""
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    model = fp8.convert(_llama(), NVFP4_1D, filter_fn=lambda m, n: n.endswith("mlp.down_proj"))
    rec = _train(model, steps=1)
    q = mixprec.export(model, tmp_path, stats=rec)
    args = QuantizationArgs.model_validate(json.loads((tmp_path / "config.json").read_text())
                                           ["quantization_config"]["config_groups"]["nvfp4"]["weights"])
    for fqn, layer in q.fp4.items():
        t = fp4_quantize(model.get_submodule(fqn).weight.detach(), NVFP4_1D.weight)
        assert torch.equal(layer.weight_global_scale, (1 / t.tensor_scale.double()).float().reshape(1))
        m, n = layer.weight_packed.shape
        codes = unpack_fp4_from_uint8(layer.weight_packed, m, 2 * n, dtype=torch.float32)
        theirs = dequantize(codes, layer.weight_scale.float(), args=args, global_scale=layer.weight_global_scale,
                            dtype=torch.float32)
        ours = t.dequantize(torch.float32)
        assert torch.allclose(theirs, ours, rtol=2 ** -22, atol=0)
        assert torch.equal(theirs.bfloat16(), ours.bfloat16())


def test_mixed_fp8_nvfp4_mxfp4_and_kept_layers_each_in_its_format(tmp_path):
    model = _llama()
    fp8.convert(model, "tensorwise", filter_fn=lambda m, n: ".self_attn." in n)
    fp8.convert(model, NVFP4_TE, filter_fn=lambda m, n: n.endswith(("up_proj", "gate_proj")))
    fp8.convert(model, MXFP4, filter_fn=lambda m, n: n == "model.layers.0.mlp.down_proj")
    rec = _train(model)
    q = mixprec.export(model, tmp_path, stats=rec)
    assert len(q.layers) == 8 and {l.format for l in q.fp4.values()} == {"nvfp4", "mxfp4"} and len(q.fp4) == 5
    assert set(q.kept) == {"lm_head", "model.layers.1.mlp.down_proj"}
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "mixed-precision"
    assert {g["format"] for g in qc["config_groups"].values()} == {"float-quantized", "nvfp4-pack-quantized",
                                                                   "mxfp4-pack-quantized"}
    assert qc["config_groups"]["mxfp4"]["targets"] == ["model.layers.0.mlp.down_proj"]
    fresh = _decompressed(tmp_path, model.config)
    for fqn in q.fp4:
        recipe = model.get_submodule(fqn).recipe
        assert torch.equal(fresh.get_submodule(fqn).weight.data, _ref_layer(model, fqn, recipe, set(q.fp4))), fqn
    for fqn, layer in q.layers.items():  # fp8: q * weight_scale, as in the fp8-only export
        assert torch.equal(fresh.get_submodule(fqn).weight.data, layer.q.float() * layer.weight_scale), fqn
    kept = "model.layers.1.mlp.down_proj"
    assert torch.equal(fresh.get_submodule(kept).weight.data, model.get_submodule(kept).weight.data)
    manifest = json.loads((tmp_path / "mixprec_export.json").read_text())
    assert manifest["fp4_layers"]["model.layers.0.mlp.down_proj"]["format"] == "mxfp4"


def test_fp4_layer_to_torchao_raises_naming_the_layer(tmp_path):
    model = fp8.convert(_llama(), MXFP4, filter_fn=lambda m, n: n == "model.layers.1.mlp.down_proj")
    rec = _train(model, steps=1)
    with pytest.raises(ValueError, match=r"layer 'model.layers.1.mlp.down_proj' is mxfp4 .*format='compressed-tensors'"):
        mixprec.export(model, tmp_path, "torchao", stats=rec)


def test_nvfp4_without_input_statistics_and_odd_widths_raise_by_name(tmp_path):
    model = fp8.convert(_llama(), NVFP4_1D, filter_fn=lambda m, n: n == "model.layers.0.mlp.down_proj")
    with pytest.raises(ValueError, match=r"no statistics for the input of layer 'model.layers.0.mlp.down_proj'"):
        mixprec.export(model, tmp_path)
    # fp8.convert and fp8.linear refuse such a layer; export refuses one built by hand too
    odd = nn.Sequential(fp8.Float8Linear.from_linear(nn.Linear(48, 32), fp8.as_recipe(MXFP4)), nn.Linear(32, 32))
    with pytest.raises(ValueError, match=r"whose features are not multiples of 32, the 'mxfp4' recipe's blocks"):
        odd(torch.randn(2, 48))
    with pytest.raises(ValueError, match=r"layer '0' is mxfp4 but its 48 input features are not a multiple of 32"):
        mixprec.export(odd, tmp_path)


def test_fp8_only_export_config_unchanged_by_fp4_support(tmp_path):
    model = fp8.convert(_llama(), "tensorwise", filter_fn=lambda m, n: ".layers." in n)
    rec = _train(model, steps=1)
    q = mixprec.export(model, tmp_path, stats=rec)
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert not q.fp4 and qc["format"] == "float-quantized" and list(qc["config_groups"]) == ["group_0"]
    assert qc["config_groups"]["group_0"]["targets"] == ["Linear"]
    assert "fp4_layers" not in json.loads((tmp_path / "mixprec_export.json").read_text())


def _policy_run(policy, model: nn.Module, ctl=None, steps: int = 3) -> Recorder:
    g = torch.Generator().manual_seed(2)
    with Recorder(model) as rec:
        for _ in range(steps):
            with mixprec.autocast("cpu", policy=policy):
                loss = model(torch.randn(16, 32, generator=g)).float().square().mean()
            loss.backward()
            model.zero_grad()
            if ctl is not None:
                ctl.step()
            rec.step()
    return rec


def test_controller_rungs_and_policy_recipe_choose_each_layer_format(tmp_path):
    from mixprec import Policy
    from mixprec.fp8 import Controller

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(3)])
    ctl = Controller(every=5, ladder=("nvfp4", "tensorwise", "compute"))
    rec = _policy_run(Policy.parse("compute=bf16").fp8("nvfp4", controller=ctl, first_last="fp8"), model, ctl)
    assert all(fp8.layer_state(m).recipe is not None for m in model)  # on the controller's nvfp4 rung
    q = mixprec.export(model, tmp_path / "ctl", stats=rec)
    assert sorted(q.fp4) == ["0", "1", "2"] and {l.format for l in q.fp4.values()} == {"nvfp4"}
    fp8.layer_state(model[1]).recipe = fp8.as_recipe("tensorwise")  # as a promotion to the fp8 rung leaves it
    fp8.layer_state(model[2]).fallback = True  # and one to the compute rung
    q = mixprec.export(model, tmp_path / "ctl2", stats=rec)
    assert sorted(q.fp4) == ["0"] and sorted(q.layers) == ["1"] and "2" in q.kept

    torch.manual_seed(0)
    routed = nn.Sequential(*[nn.Linear(32, 32) for _ in range(3)])
    rec = _policy_run(Policy.parse("compute=bf16").fp8("mxfp4", first_last="fp8"), routed)
    q = mixprec.export(routed, tmp_path / "p4", stats=rec)  # the layers keep the recipe they ran (policy_recipe)
    assert sorted(q.fp4) == ["0", "1", "2"] and {l.format for l in q.fp4.values()} == {"mxfp4"}
    assert torch.equal(_decompressed_plain(tmp_path / "p4", routed)[1].weight.data,
                       _ref(routed[1].weight, MXFP4, torch.bfloat16))


def _decompressed_plain(folder, model: nn.Module) -> nn.Module:
    """compressed-tensors' decompression of an export of a plain ``nn.Module`` (no transformers config)."""
    import copy

    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from safetensors.torch import load_file

    qconfig = QuantizationConfig.model_validate(json.loads((folder / "config.json").read_text())["quantization_config"])
    fresh = fp8.unconvert(copy.deepcopy(model))
    apply_quantization_config(fresh, qconfig)
    compressor = ModelCompressor(quantization_config=qconfig)
    compressor.compress_model(fresh)
    missing, unexpected = fresh.load_state_dict(load_file(str(folder / "model.safetensors")), strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    compressor.decompress_model(fresh)
    return fresh


@pytest.mark.parametrize("recipe", [NVFP4_1D, MXFP4], ids=["nvfp4", "mxfp4"])
def test_transformers_loads_fp4_export_in_bf16_close_to_mixprec_fp4_forward(tmp_path, recipe):
    """transformers' compressed-tensors integration decompresses fp4 weights to bf16, so it runs the
    folder with dtype=bf16 (an fp32 model fails in F.linear on the dtype mismatch); its logits are
    within 20 dB of mixprec's own fp4 forward (fp32 activations, dynamic scales)."""
    model = fp8.convert(_llama(), recipe, filter_fn=lambda m, n: ".layers." in n)
    with Recorder(model) as rec:
        model(IDS)
        rec.step()
    mixprec.export(model, tmp_path, stats=rec)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert loaded.model.layers[0].mlp.up_proj.weight_packed.dtype == torch.uint8
    with torch.no_grad():
        theirs, ours = loaded(IDS).logits.double(), model(IDS).logits.double()
    plain = fp8.unconvert(model)(IDS).logits.double()
    sqnr = float(20 * torch.log10(ours.norm() / (theirs - ours).norm()))
    assert sqnr > 20 and not torch.equal(ours, plain)


def test_cli_recipe_exports_the_saved_layers_in_fp4(tmp_path, capsys):
    from mixprec.cli import main
    from safetensors.torch import load_file

    model = fp8.convert(_llama(), MXFP4, filter_fn=lambda m, n: ".layers." in n)
    rec = _train(model, steps=1)
    rec.save(tmp_path / "stats.pt")
    fp8.unconvert(model).save_pretrained(tmp_path / "trained")
    args = ["export", str(tmp_path / "trained"), str(tmp_path / "out"), "--stats", str(tmp_path / "stats.pt")]
    assert main(args + ["--recipe", "mxfp4"]) == 0, capsys.readouterr().err
    assert "0 fp8 layers, 14 fp4 layers" in capsys.readouterr().out
    stored = load_file(str(tmp_path / "out" / "model.safetensors"))
    lay = "model.layers.0.mlp.up_proj"
    assert stored[f"{lay}.weight_scale"].dtype == torch.uint8 and f"{lay}.weight" not in stored
    assert main(args[:2] + [str(tmp_path / "o2")] + args[3:] + ["--recipe", "fp2"]) == 1
    assert "unknown fp8 recipe 'fp2'" in capsys.readouterr().err


@pytest.mark.parametrize("recipe", [NVFP4_TE, MXFP4], ids=["nvfp4", "mxfp4"])
def test_recorder_reads_the_input_amax_the_fp4_cast_measured(recipe):
    model = fp8.convert(nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32)), recipe, filter_fn=lambda m, n: True)
    assert isinstance(model[1], fp8.Float8Linear)  # its window: the amax its fp4 input cast measured
    seen = []
    model[1].register_forward_hook(lambda m, args, out: seen.append(args[0].detach().abs().max()))
    g = torch.Generator().manual_seed(3)
    with Recorder(model, every=2) as rec:
        for _ in range(4):
            model(torch.randn(4, 32, generator=g) * 3)
            rec.step()
    assert torch.equal(rec.series()["1:input"], torch.stack([max(seen[0:2]), max(seen[2:4])]))
