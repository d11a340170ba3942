"""``first_last="keep"``: the model's first and last matmul layers (with parallel siblings), never one
projection of three, nor a layer in the middle when the real head is not eligible."""

import pytest
import torch
from torch import nn

import mixprec
from mixprec import Policy, fp8

transformers = pytest.importorskip("transformers")


def test_vit_with_a_small_head_keeps_no_inner_projection():
    cfg = transformers.ViTConfig(hidden_size=192, num_hidden_layers=4, num_attention_heads=3,
                                 intermediate_size=768, image_size=32, patch_size=8, num_labels=10)
    model = transformers.ViTForImageClassification(cfg)
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    selected = fp8.select_layers(model)
    # the real first matmul (patch-embedding Conv2d) and head (10 classes) are not eligible: both
    # run in the compute dtype already; every encoder projection goes to fp8, q/k/v alike
    assert [n for n in linears if n not in selected] == ["classifier"]
    attention = sorted(n for n in selected if ".layers.0.attention." in n or ".layer.0.attention." in n)
    assert len(attention) >= 3 and all(n in selected for n in attention)


def test_gpt2_keeps_its_first_projection_and_no_middle_layer():
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=64, n_layer=2, n_head=2, vocab_size=100, n_positions=32, bos_token_id=0, eos_token_id=0))
    from mixprec.formats._like import is_linear_like

    layers = [n for n, m in model.named_modules() if is_linear_like(m)]
    selected = fp8.select_layers(model)
    assert [n for n in layers if n not in selected] == ["transformer.h.0.attn.c_attn", "lm_head"]


class Attention(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        a = torch.softmax(self.q_proj(x) @ self.k_proj(x).transpose(-1, -2), -1) @ self.v_proj(x)
        return self.o_proj(a)


class Model(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.attention, self.mlp = Attention(d), nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, d))
        self.head = nn.Linear(d, d)

    def forward(self, x):
        return self.head(self.mlp(self.attention(x)))


def test_the_first_projection_keeps_its_siblings_fed_by_the_same_input():
    model = Model()
    # q/k/v (and o_proj, of the same shape beside them: kept too, the safe side) and the head
    assert fp8.select_layers(model) == ["mlp.0", "mlp.2"]
    policy = Policy.parse("bf16").fp8("tensorwise")
    with mixprec.autocast("cpu", policy=policy):
        model(torch.randn(2, 4, 32))
    assert sorted(fp8.layer_states(model)) == ["mlp.0", "mlp.2"]
