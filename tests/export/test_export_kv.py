"""KV scales: measured on the keys and values the KV cache stores (after RoPE and any k_norm), as
compressed-tensors' own KV hooks observe them."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

import mixprec
from mixprec import fp8
from mixprec.export import Recorder, ScaleRule

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed (pip install mixprec[export])")
pytest.importorskip("safetensors", reason="safetensors is not installed")

_SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
              max_position_embeddings=32)
#: (name, model class, config): Llama (RoPE), Qwen3 (k_norm then RoPE), Phi-3 (fused qkv_proj, RoPE),
#: GPT-2 (fused c_attn, no RoPE)
MODELS = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**_SMALL, num_key_value_heads=1,
                                                                             head_dim=16)),
    "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**_SMALL, num_key_value_heads=1,
                                                                           head_dim=16)),
    "phi3": lambda: transformers.Phi3ForCausalLM(transformers.Phi3Config(**_SMALL, num_key_value_heads=1,
                                                                         pad_token_id=0, bos_token_id=0,
                                                                         eos_token_id=0)),
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32,
                                                                         n_layer=2, n_head=2, bos_token_id=0,
                                                                         eos_token_id=0)),
}
BATCHES = [torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(i)) for i in range(4)]


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    model = MODELS[name]().float().eval()
    if name == "qwen3":  # a k_norm that changes the keys' amax: its weight is 1.0 at init
        for layer in model.model.layers:
            layer.self_attn.k_norm.weight.data.uniform_(0.5, 4.0)
    return model


def _ct_kv_amax(model: nn.Module) -> dict[str, torch.Tensor]:
    """Per attention module, the (calls, 2) amaxes of the keys and values compressed-tensors' own
    ``register_key_hook``/``register_value_hook`` see (its ``QuantizedKVCache``, which the attention
    calls in place of its cache). compressed-tensors 0.20 passes its cache as ``past_key_value``
    (transformers 5.24 takes ``cache``): two test hooks rename the argument around its hook."""
    from compressed_tensors.modeling.kvcache import initialize_hooked_kv_cache, register_key_hook, register_value_hook

    model = copy.deepcopy(model)
    seen: dict[str, list[list[torch.Tensor]]] = {}

    def to_ct(module, args, kwargs):
        kwargs["past_key_value"] = kwargs.pop("cache", None)
        return args, kwargs

    def from_ct(module, args, kwargs):
        kwargs["cache"] = kwargs.pop("past_key_value")
        return args, kwargs

    for fqn, mod in model.named_modules():
        if type(mod).__name__.endswith("Attention"):
            mod.register_forward_pre_hook(to_ct, with_kwargs=True)
            initialize_hooked_kv_cache(model, mod)
            mod.register_forward_pre_hook(from_ct, with_kwargs=True)
            calls = seen.setdefault(fqn, [])
            register_key_hook(mod, lambda m, k, c=calls: c.append([k.detach().abs().amax()]))
            register_value_hook(mod, lambda m, v, c=calls: c[-1].append(v.detach().abs().amax()))
    with torch.no_grad():
        for ids in BATCHES:
            model(ids)
    assert seen and all(len(c) == len(BATCHES) for c in seen.values()), "compressed-tensors' hooks did not run"
    return {fqn: torch.stack([torch.stack(c) for c in calls]) for fqn, calls in seen.items()}


@pytest.mark.parametrize("name", list(MODELS))
def test_recorded_kv_amax_is_what_compressed_tensors_kv_hooks_observe(name):
    model = _model(name)
    oracle = _ct_kv_amax(model)
    proj = {}  # the projections' outputs: what the keys were before RoPE / k_norm
    for fqn, mod in model.named_modules():
        if fqn.endswith(("k_proj", "qkv_proj")):
            mod.register_forward_hook(lambda m, a, out, f=fqn: proj.setdefault(f, []).append(out.detach()))
    with Recorder(model, every=2) as rec, torch.no_grad():
        for ids in BATCHES:
            model(ids)
            rec.step()
    s = rec.series()
    assert {n.rsplit(":", 1)[0] for n in s if n.endswith(":k")} == set(oracle)
    for attn, calls in oracle.items():
        expect = torch.stack([calls[0:2].amax(0), calls[2:4].amax(0)])  # windows of 2 calls: (2, [k, v])
        assert torch.equal(s[f"{attn}:k"], expect[:, 0]), attn
        assert torch.equal(s[f"{attn}:v"], expect[:, 1]), attn
        # GPT-2 uses its cache beyond update() (is_updated...): measured at c_attn's output, the same (no RoPE)
        assert ("KV cache" if name != "gpt2" else "output of") in rec.kv_sites[f"{attn}:k"]
    if name in ("llama", "qwen3"):  # RoPE (and k_norm) change the keys: the k_proj output is not them
        pre = torch.stack([o.abs().amax() for o in proj["model.layers.0.self_attn.k_proj"]])
        assert not torch.equal(pre.max(), oracle["model.layers.0.self_attn"][:, 0].max())


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_k_scale_is_compressed_tensors_own_qparams_of_the_cached_keys(tmp_path, name):
    """The written k_scale/v_scale are compressed-tensors' ``calculate_qparams`` of the cached keys'
    and values' amax under the export's own ``kv_cache_scheme``: bitwise, and no cached key saturates."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import load_file

    model = fp8.convert(_model(name), filter_fn=lambda m, n: ".layers." in n)
    oracle = _ct_kv_amax(model)
    with Recorder(model) as rec, torch.no_grad():
        for ids in BATCHES:
            model(ids)
            rec.step()
    q = mixprec.export(model, tmp_path, stats=rec, rule=ScaleRule(windows=None))
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    args = QuantizationArgs.model_validate(qc["kv_cache_scheme"])
    stored = load_file(str(tmp_path / "model.safetensors"))
    manifest = json.loads((tmp_path / "mixprec_export.json").read_text())
    for attn, calls in oracle.items():
        amax = calls.amax(0)
        for i, which in enumerate("kv"):
            theirs, _ = calculate_qparams(-amax[i].reshape(1), amax[i].reshape(1), args)
            assert torch.equal(stored[f"{attn}.{which}_scale"], theirs.float()), (attn, which)
            assert torch.equal(q.kv_scales[attn][f"{which}_scale"], theirs.float())
            assert "KV cache" in manifest["kv_statistics"][f"{attn}:{which}"]


def test_statistics_saved_before_kv_sites_write_no_kv_scales(tmp_path):
    model = fp8.convert(_model("llama"), filter_fn=lambda m, n: ".layers." in n)
    with Recorder(model) as rec, torch.no_grad():
        model(BATCHES[0])
        rec.step()
    state = rec.state_dict()
    del state["kv_sites"]  # what an earlier mixprec saved: keys measured at k_proj, before RoPE
    torch.save(state, tmp_path / "old.pt")
    with pytest.warns(UserWarning, match="measured the keys before RoPE"):
        q = mixprec.export(model, tmp_path / "out", stats=mixprec.export.load_stats(tmp_path / "old.pt"))
    assert not q.kv_scales and len(q.layers) == 14


class _RopeAttention(nn.Module):
    """An attention that uses its cache beyond update() and rotates its keys: not measurable in the cache."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(16, 16) for _ in range(3))

    def forward(self, x, position_embeddings=None, cache=None):
        k = self.k_proj(x)
        if cache is not None:
            k = k + cache.get_seq_length()
        return self.q_proj(x) + torch.roll(k, 1, -1) + self.v_proj(x)


def test_an_attention_whose_keys_cannot_be_read_in_the_cache_warns():
    with pytest.warns(UserWarning, match=r"keys of 0 are measured at its projection's output"):
        rec = Recorder(nn.Sequential(_RopeAttention()))
    assert rec.kv_sites["0:k"] == "output of 0.k_proj"
    rec.close()
