"""Layers a serving engine fuses (q/k/v, gate/up) export in one scheme; NVFP4 shards share one global scale."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import mixprec
from mixprec import Policy, fp8
from mixprec.export import Recorder
from mixprec.fp8 import Float8Recipe
from mixprec.fp8.internals import fp4_quantize

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed (pip install mixprec[export])")
pytest.importorskip("safetensors", reason="safetensors is not installed")

NVFP4_1D = Float8Recipe.nvfp4(hadamard=False, stochastic_rounding=False, weight_block=(1, 16))
NVFP4_TE = Float8Recipe.nvfp4()
#: the shards vLLM fuses in a Llama (its packed_modules_mapping)
GROUPS = [("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj"))]


def _llama() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                   max_position_embeddings=32, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg).float()
    with torch.no_grad():  # shards of different magnitudes: their own NVFP4 tensor scales would differ
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.k_proj.weight.mul_(1.7 + i)
            layer.mlp.up_proj.weight.mul_(0.45)
    return model


def _groups(model: nn.Module) -> list[list[str]]:
    return [[f"model.layers.{i}.{parent}.{n}" for n in names] for i in range(len(model.model.layers))
            for parent, names in GROUPS]


def _train(model: nn.Module, policy=None, ctl=None, steps: int = 2) -> Recorder:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    with Recorder(model) as rec:
        for _ in range(steps):
            ids = torch.randint(0, 64, (2, 8), generator=g)
            if policy is None:
                loss = model(ids, labels=ids).loss
            else:
                with mixprec.autocast("cpu", policy=policy):
                    loss = model(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            if ctl is not None:
                ctl.step()
            rec.step()
    return rec


def _ct_schemes(folder, model: nn.Module) -> nn.Module:
    """A fresh model with compressed-tensors' own ``apply_quantization_config`` of the export's config:
    each module's ``quantization_scheme`` is what its matching (targets, ignore) chose."""
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

    qc = QuantizationConfig.model_validate(json.loads((folder / "config.json").read_text())["quantization_config"])
    fresh = transformers.LlamaForCausalLM(model.config).float()
    apply_quantization_config(fresh, qc)
    return fresh


def _assert_one_scheme_per_group(folder, model):
    fresh = _ct_schemes(folder, model)
    for group in _groups(model):
        schemes = [getattr(fresh.get_submodule(n), "quantization_scheme", None) for n in group]
        assert all(s == schemes[0] for s in schemes), (group, schemes)


def test_policy_fp8_first_layer_keep_widens_kept_to_its_fused_group(tmp_path):
    """first_last="keep" keeps the first linear (layer 0's q_proj) out of fp8; vLLM fuses it with
    k_proj/v_proj, so they are kept too, with a warning naming them."""
    model = _llama()
    rec = _train(model, Policy.parse("compute=bf16").fp8("tensorwise"))
    with pytest.warns(UserWarning, match=r"model.layers.0.self_attn.k_proj, model.layers.0.self_attn.v_proj "
                                         r"export as high precision"):
        q = mixprec.export(model, tmp_path, stats=rec)
    first = ["model.layers.0.self_attn." + n for n in ("q_proj", "k_proj", "v_proj")]
    assert all(n in q.kept and n not in q.layers for n in first)
    assert q.kept["model.layers.0.self_attn.k_proj"].startswith("fused with model.layers.0.self_attn.q_proj")
    assert "model.layers.1.self_attn.k_proj" in q.layers
    _assert_one_scheme_per_group(tmp_path, model)


def test_controller_promotion_inside_a_fused_group_moves_the_group_to_fp8(tmp_path):
    from mixprec.fp8 import Controller

    model = _llama()
    ctl = Controller(every=5, ladder=("nvfp4", "tensorwise", "compute"))
    rec = _train(model, Policy.parse("compute=bf16").fp8("nvfp4", controller=ctl, first_last="fp8"), ctl)
    up = "model.layers.1.mlp.up_proj"
    fp8.layer_state(model.get_submodule(up)).recipe = fp8.as_recipe("tensorwise")  # as a promotion leaves it
    with pytest.warns(UserWarning, match=r"model.layers.1.mlp.gate_proj export as fp8, as model.layers.1.mlp.up_proj"):
        q = mixprec.export(model, tmp_path, stats=rec)
    assert {up, "model.layers.1.mlp.gate_proj"} <= set(q.layers)
    assert "model.layers.0.mlp.gate_proj" in q.fp4
    _assert_one_scheme_per_group(tmp_path, model)


def test_layers_naming_one_shard_narrows_it_to_its_group(tmp_path):
    model = _llama()
    with mixprec.export.calibrate(model) as rec:
        model(torch.arange(16).reshape(2, 8))
    with pytest.warns(UserWarning, match="model.layers.0.self_attn.q_proj export as high precision"):
        q = mixprec.export(model, tmp_path, stats=rec, layers=["model.layers.0.self_attn.q_proj",
                                                               "model.layers.0.mlp.down_proj"])
    assert sorted(q.layers) == ["model.layers.0.mlp.down_proj"]
    _assert_one_scheme_per_group(tmp_path, model)


@pytest.mark.parametrize("recipe", [NVFP4_1D, NVFP4_TE], ids=["1x16", "16x16"])
def test_nvfp4_fused_shards_share_one_global_scale_bitwise_the_fused_cast(tmp_path, recipe):
    """Every shard of a fused layer stores the same weight_global_scale, so vLLM's one global scale
    per fused layer (the max over the shards) is it; compressed-tensors' decompression of the shards,
    stacked, is bitwise mixprec's NVFP4 cast of the stacked weight (the fused layer)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from safetensors.torch import load_file

    model = fp8.convert(_llama(), recipe, filter_fn=lambda m, n: ".layers." in n)
    rec = _train(model)
    q = mixprec.export(model, tmp_path, stats=rec)
    stored = load_file(str(tmp_path / "model.safetensors"))
    qc = QuantizationConfig.model_validate(json.loads((tmp_path / "config.json").read_text())["quantization_config"])
    fresh = transformers.LlamaForCausalLM(model.config).float()
    apply_quantization_config(fresh, qc)
    compressor = ModelCompressor(quantization_config=qc)
    compressor.compress_model(fresh)
    kv = {k for k in stored if k.endswith(("k_scale", "v_scale"))}
    fresh.load_state_dict({k: v for k, v in stored.items() if k not in kv}, strict=False)
    compressor.decompress_model(fresh)
    for group in _groups(model):
        gs = torch.stack([stored[f"{n}.weight_global_scale"] for n in group])
        assert torch.equal(gs.amax(0).expand_as(gs), gs), (group, gs.flatten().tolist())  # vLLM's max: each one's
        igs = torch.stack([stored[f"{n}.input_global_scale"] for n in group])
        assert torch.equal(igs.amax(0).expand_as(igs), igs)
        fused = torch.cat([model.get_submodule(n).weight.detach() for n in group])
        ref = fp4_quantize(fused, recipe.weight, subnormal_scales=recipe.subnormal_scales).dequantize(torch.bfloat16)
        theirs = torch.cat([fresh.get_submodule(n).weight.data for n in group])
        assert torch.equal(theirs, ref), group
    assert torch.equal(q.fp4["model.layers.0.mlp.down_proj"].weight_global_scale,  # alone: its own cast
                       (1 / fp4_quantize(model.model.layers[0].mlp.down_proj.weight.detach(),
                                         recipe.weight).tensor_scale.double()).float().reshape(1))
