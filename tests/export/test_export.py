"""mixprec.export: statistics -> static scales, read back by compressed-tensors' and transformers' own code."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
from torch import nn

import mixprec
from mixprec import fp8
from mixprec.export import Recorder, ScaleRule, calibrate, load_static, quantize_weight

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
ct = pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed (pip install mixprec[export])")
pytest.importorskip("safetensors", reason="safetensors is not installed")


def _llama(tie: bool = False) -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                   max_position_embeddings=32, tie_word_embeddings=tie)
    return transformers.LlamaForCausalLM(cfg).float().eval()


def _gpt2() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg).float().eval()


def _trained(model: nn.Module, steps: int = 4, every: int = 1) -> tuple[nn.Module, Recorder]:
    """fp8 training of the decoder layers (fp8.convert) with a Recorder, a few SGD steps."""
    model = fp8.convert(model, filter_fn=lambda m, n: ".layers." in n or n.startswith("transformer.h."))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = Recorder(model, every=every)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, 64, (2, 8), generator=g)
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        rec.step()
    rec.close()
    return model, rec


IDS = torch.arange(16).reshape(2, 8) % 64


# -- statistics and rules ----------------------------------------------------------------------

@pytest.mark.parametrize("converted", [False, True])
def test_recorder_windows_are_the_amax_of_inputs_and_kv(converted):
    model = _gpt2()
    if converted:  # the amax comes from the fp8 cast's own LayerState
        model = fp8.convert(model, filter_fn=lambda m, n: n.endswith("c_attn"))
        assert isinstance(model.transformer.h[0].attn.c_attn, fp8.Float8Conv1D)
    ins, outs = [], []
    attn = model.transformer.h[0].attn

    def hook(module, args, output):
        ins.append(args[0].abs().max())
        outs.append(output.detach())

    attn.c_attn.register_forward_hook(hook)
    with Recorder(model, every=2) as rec:
        for i in range(4):
            model(IDS + i)
            rec.step()
    assert rec.history.shape == (2, len(rec.names))
    s = rec.series()
    e = 32
    expect_in = torch.stack([torch.stack(ins[0:2]).max(), torch.stack(ins[2:4]).max()])
    assert torch.equal(s["transformer.h.0.attn.c_attn:input"], expect_in)
    k = torch.stack([torch.stack([o[..., e:2 * e].abs().max() for o in outs[w:w + 2]]).max() for w in (0, 2)])
    v = torch.stack([torch.stack([o[..., 2 * e:].abs().max() for o in outs[w:w + 2]]).max() for w in (0, 2)])
    assert torch.equal(s["transformer.h.0.attn:k"], k) and torch.equal(s["transformer.h.0.attn:v"], v)


def test_scale_rule_max_percentile_margin_and_errors():
    h = torch.tensor([8.0, 1.0, 2.0, 3.0])
    assert ScaleRule(windows=3).amax(h) == 3.0
    assert ScaleRule(windows=None).amax(h) == 8.0
    assert torch.allclose(ScaleRule(windows=None, percentile=50).amax(h), torch.tensor(2.5))
    s = ScaleRule(windows=2, margin=2.0).scale(h)
    assert s.dtype == torch.float32 and s.shape == (1,) and s.item() == pytest.approx(6.0 / 448)
    for bad in (dict(windows=0), dict(percentile=0), dict(percentile=101), dict(margin=-1.0), dict(margin=float("inf"))):
        with pytest.raises(ValueError, match="ScaleRule"):
            ScaleRule(**bad)
    with pytest.raises(ValueError, match="no window"):
        ScaleRule().amax(torch.zeros(0))


# -- compressed-tensors: its own loader ---------------------------------------------------------

@pytest.mark.parametrize("strategy", ["tensor", "channel"])
def test_compressed_tensors_decompresses_mixprec_bytes_and_scales(tmp_path, strategy):
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from safetensors.torch import load_file

    model, rec = _trained(_llama())
    rule = ScaleRule(windows=2, margin=1.25)
    q = mixprec.export(model, tmp_path, stats=rec, rule=rule, weight_strategy=strategy)
    assert len(q.layers) == 14 and set(q.kept) == {"lm_head"}
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qc["ignore"] == ["lm_head"] and qc["kv_cache_scheme"]["type"] == "float"
    qconfig = QuantizationConfig.model_validate(qc)  # compressed-tensors' schema accepts it

    fresh = transformers.LlamaForCausalLM(model.config).float()
    apply_quantization_config(fresh, qconfig)
    compressor = ModelCompressor(quantization_config=qconfig)
    compressor.compress_model(fresh)
    stored = load_file(str(tmp_path / "model.safetensors"))
    kv = {k for k in stored if k.endswith(("k_scale", "v_scale"))}
    missing, unexpected = fresh.load_state_dict({k: v for k, v in stored.items() if k not in kv}, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    lin = dict(fp8.unconvert(model).named_modules())
    hist = rec.series()
    for fqn in q.layers:
        mod = fresh.get_submodule(fqn)
        ref_q, ref_s = quantize_weight(lin[fqn].weight, strategy)
        assert mod.weight.dtype == torch.float8_e4m3fn
        assert torch.equal(mod.weight.view(torch.uint8), ref_q.view(torch.uint8)), fqn
        assert torch.equal(mod.weight_scale.data, ref_s)
        assert torch.equal(mod.input_scale.data, rule.scale(hist[f"{fqn}:input"]))
    compressor.decompress_model(fresh)
    for fqn in q.layers:
        ref_q, ref_s = quantize_weight(lin[fqn].weight, strategy)
        assert torch.equal(fresh.get_submodule(fqn).weight.data, ref_q.float() * ref_s), fqn
    assert torch.equal(fresh.lm_head.weight.data, model.lm_head.weight.data)  # kept: as it was
    assert torch.equal(fresh.model.embed_tokens.weight.data, model.model.embed_tokens.weight.data)
    for i in range(2):
        for which in "kv":
            assert torch.equal(stored[f"model.layers.{i}.self_attn.{which}_scale"],
                               rule.scale(hist[f"model.layers.{i}.self_attn:{which}"]))


# -- transformers' compressed-tensors integration, CPU ------------------------------------------

@pytest.mark.parametrize("strategy", ["tensor", "channel"])
def test_transformers_loads_llama_and_logits_equal_mixprec_static_forward(tmp_path, strategy):
    model, rec = _trained(_llama(tie=True))
    mixprec.export(model, tmp_path, stats=rec, weight_strategy=strategy)
    ours = load_static(fp8.unconvert(copy.deepcopy(model)), tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    with torch.no_grad():
        a, b = ours(IDS).logits, loaded(IDS).logits
        plain = fp8.unconvert(model)(IDS).logits
    assert torch.equal(a, b)
    assert not torch.equal(a, plain)  # the static fp8 path did run


def test_config_names_the_architecture_as_save_pretrained_does(tmp_path):
    """A model built from a config and trained in process has ``config.architectures = None``; readers
    that build the model from it (vLLM) then pick the base model (``LlamaModel``: no LM head). The
    export names it as transformers' own ``save_pretrained`` does."""
    model, rec = _trained(_llama())
    assert model.config.architectures is None
    mixprec.export(model, tmp_path / "export", stats=rec)
    fp8.unconvert(copy.deepcopy(model)).save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    assert exported["architectures"] == saved["architectures"] == ["LlamaForCausalLM"]


def _sqnr_db(ref: torch.Tensor, x: torch.Tensor) -> float:
    ref, x = ref.double(), x.double()
    return float(20 * torch.log10(ref.norm() / (ref - x).norm()))


def test_transformers_bf16_model_reads_scales_in_bf16(tmp_path):
    """transformers' integration creates the scale parameters in the model's dtype: with the scales read
    in bf16, mixprec's forward is bitwise transformers'; with float32 scales (vLLM's), above 25 dB."""
    torch.manual_seed(0)
    cfg = _llama().config
    model = fp8.convert(transformers.LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16),
                        filter_fn=lambda m, n: ".layers." in n)
    with Recorder(model) as rec:
        model(IDS)
        rec.step()
    q = mixprec.export(model, tmp_path, stats=rec)
    plain = fp8.unconvert(model)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    lay = "model.layers.0.mlp.up_proj"
    assert loaded.get_submodule(lay).input_scale.dtype == torch.bfloat16
    assert torch.equal(loaded.get_submodule(lay).input_scale.data, q.layers[lay].input_scale.to(torch.bfloat16))
    with torch.no_grad():
        theirs = loaded(IDS).logits
        bf16_scales = load_static(copy.deepcopy(plain), tmp_path, scale_dtype=torch.bfloat16)(IDS).logits
        f32_scales = load_static(copy.deepcopy(plain), tmp_path)(IDS).logits
    assert torch.equal(bf16_scales, theirs)
    assert _sqnr_db(f32_scales, theirs) > 25


def test_gpt2_conv1d_layers_are_refused_by_name_then_kept(tmp_path):
    model, rec = _trained(_gpt2())
    with pytest.raises(ValueError, match=r"'transformer.h.0.attn.c_attn' is a Float8Conv1D"):
        mixprec.export(model, tmp_path / "a", stats=rec)
    plain = fp8.unconvert(model)
    with pytest.raises(ValueError, match=r"'lm_head' shares its weight with 'transformer.wte.weight'"):
        mixprec.export(plain, tmp_path / "b", stats=rec, layers=["lm_head"])
    q = mixprec.export(plain, tmp_path / "b", stats=rec, layers=[])
    assert set(q.kv_scales) == {"transformer.h.0.attn", "transformer.h.1.attn"}
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "b")
    ours = load_static(copy.deepcopy(plain), tmp_path / "b")
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, ours(IDS).logits)
    for name, t in plain.transformer.state_dict().items():  # untouched tensors as they were
        if name.endswith(".weight"):
            assert torch.equal(loaded.transformer.state_dict()[name], t), name


# -- which layers ---------------------------------------------------------------------------------

def test_fallback_layer_stays_high_precision_in_ignore(tmp_path):
    from safetensors.torch import load_file

    model, rec = _trained(_llama())
    lay = "model.layers.1.mlp.down_proj"
    guard = fp8.Guard(min_sqnr_db=1000.0, every=1)  # a real Guard decision: no fp8 GEMM reaches 1000 dB
    with pytest.warns(fp8.Float8FallbackWarning, match="down_proj"):
        for _ in range(2):
            model(IDS)
            guard.step({lay: fp8.layer_state(model.get_submodule(lay))})
    assert fp8.layer_state(model.get_submodule(lay)).fallback
    q = mixprec.export(model, tmp_path, stats=rec)
    assert "model.layers.1.mlp.down_proj" in q.kept and "model.layers.1.mlp.down_proj" not in q.layers
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert "model.layers.1.mlp.down_proj" in qc["ignore"]
    stored = load_file(str(tmp_path / "model.safetensors"))
    assert torch.equal(stored["model.layers.1.mlp.down_proj.weight"], model.model.layers[1].mlp.down_proj.weight)
    assert "model.layers.1.mlp.down_proj.input_scale" not in stored


def test_without_recorder_input_scale_from_layer_state_and_kv_warning(tmp_path):
    model = fp8.convert(_llama(), filter_fn=lambda m, n: ".layers." in n)
    model(IDS)
    with pytest.warns(UserWarning, match="no k_scale/v_scale written"):
        q = mixprec.export(model, tmp_path)
    lay = "model.layers.0.mlp.up_proj"
    amax = fp8.layer_state(model.get_submodule(lay)).stats[0, 0]
    assert torch.equal(q.layers[lay].input_scale, mixprec.export.static_scale(amax))
    assert q.layers[lay].source.startswith("fp8 LayerState") and not q.kv_scales


def test_calibrated_bf16_model_and_errors(tmp_path):
    model = _llama()
    with pytest.raises(ValueError, match="no fp8 layer"):
        mixprec.export(model, tmp_path)
    with pytest.raises(ValueError, match="no statistics for the input of layer 'model.layers.0.mlp.down_proj'"):
        mixprec.export(model, tmp_path, layers=["model.layers.0.mlp.down_proj"])
    with pytest.raises(ValueError, match="not nn.Linear/Conv1D layers"):
        mixprec.export(model, tmp_path, layers=["model.norm"])
    with pytest.raises(ValueError, match="format must be one of"):
        mixprec.export(model, tmp_path, format="gguf")
    with calibrate(model) as rec:
        for i in range(3):
            model(IDS + i)
    assert rec.history.shape[0] == 3
    lay = ["model.layers.0.mlp.down_proj", "model.layers.1.self_attn.o_proj"]  # no fused shard: see test_export_fused
    q = mixprec.export(model, tmp_path, stats=rec, layers=lay, rule=ScaleRule(windows=None, percentile=50))
    assert sorted(q.layers) == sorted(lay)
    h = rec.series()["model.layers.0.mlp.down_proj:input"]
    assert torch.equal(q.layers[lay[0]].input_scale, mixprec.export.static_scale(torch.quantile(h.double(), 0.5).float()))


def test_cli_export_from_saved_model_and_stats(tmp_path, capsys):
    from mixprec.cli import main
    from safetensors.torch import load_file

    model, rec = _trained(_llama())
    rec.save(tmp_path / "stats.pt")
    fp8.unconvert(model).save_pretrained(tmp_path / "trained")
    rc = main(["export", str(tmp_path / "trained"), str(tmp_path / "out"), "--stats", str(tmp_path / "stats.pt"),
               "--windows", "2", "--margin", "1.5"])
    assert rc == 0, capsys.readouterr().err
    assert "14 fp8 layers" in capsys.readouterr().out
    stored = load_file(str(tmp_path / "out" / "model.safetensors"))
    h = rec.series()["model.layers.0.self_attn.k_proj:input"]
    assert torch.equal(stored["model.layers.0.self_attn.k_proj.input_scale"], ScaleRule(windows=2, margin=1.5).scale(h))
    assert main(["export", str(tmp_path / "nope"), str(tmp_path / "o2"), "--stats", str(tmp_path / "stats.pt")]) == 1
    assert "not a saved transformers model" in capsys.readouterr().err


@pytest.mark.cuda
def test_torchao_route_logits_bitwise_torchao_own_quantize(tmp_path):
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)):
        pytest.skip("torchao's float8 inference configs need a CUDA device of capability 8.9+")
    from torchao.prototype.quantization.quant_api import Float8StaticActivationFloat8WeightConfig
    from torchao.quantization import PerTensor, quantize_

    model, rec = _trained(_llama())
    model = fp8.unconvert(model).cuda().to(torch.bfloat16)
    lay = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and ".layers." in n]
    q = mixprec.export(model, tmp_path, "torchao", stats=rec, layers=lay)
    ref = copy.deepcopy(model)
    for fqn, layer in q.layers.items():
        quantize_(ref, Float8StaticActivationFloat8WeightConfig(act_quant_scale=layer.input_scale.cuda(),
                                                                  granularity=PerTensor()),
                  filter_fn=lambda m, n, t=fqn: n == t)
    loaded = copy.deepcopy(ref)
    loaded.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=False), assign=True)
    with torch.no_grad():
        assert torch.equal(loaded(IDS.cuda()).logits, ref(IDS.cuda()).logits)


def test_torchao_route_refuses_off_fp8_gpu_with_reason(tmp_path):
    model, rec = _trained(_llama())
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9):
        pytest.skip("an fp8 GPU is present")
    with pytest.raises(ValueError, match="CUDA device of compute capability 8.9"):
        mixprec.export(model, tmp_path, "torchao", stats=rec)


def test_policy_fp8_trained_model_exports_its_routed_layers(tmp_path):
    from mixprec import Policy

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)])
    policy = Policy.parse("compute=bf16").fp8("tensorwise")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with Recorder(model) as rec:
        for _ in range(3):
            with mixprec.autocast("cpu", policy=policy):
                loss = model(torch.randn(4, 32)).float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            rec.step()
    q = mixprec.export(model, tmp_path, stats=rec)
    assert sorted(q.layers) == ["1", "2"] and set(q.kept) == {"0", "3"}  # first and last stayed out of fp8
    assert torch.equal(q.layers["1"].input_scale, ScaleRule().scale(rec.series()["1:input"]))


@pytest.mark.slow
def test_import_stays_light():
    import subprocess
    import sys

    code = ("import sys, mixprec; mixprec.export.ScaleRule; "
            "print(sorted(m for m in ('safetensors', 'compressed_tensors', 'torchao') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"
