"""FP8 on Hugging Face models: transformers' Conv1D (GPT-2's projections, a Linear with its weight
stored transposed) runs in fp8 under ``Policy.fp8`` and ``fp8.convert``, bitwise torchao's
emulated Float8Linear on the equivalent nn.Linear; a GPT-2 from a small config trains with fp8
layers; ``unconvert`` gives the Conv1D back."""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch
from torch import nn

import mixprec
from mixprec import Policy, fp8

torchao_float8 = pytest.importorskip("torchao.float8")
transformers = pytest.importorskip("transformers")
from transformers.pytorch_utils import Conv1D  # noqa: E402

RECIPES = ["tensorwise", "rowwise", "rowwise_with_gw_hp"]


def _conv1d(nx: int, nf: int, seed: int = 0) -> Conv1D:
    torch.manual_seed(seed)
    layer = Conv1D(nf, nx)
    with torch.no_grad():
        layer.bias.normal_()
    return layer


def _torchao_equivalent(layer: Conv1D, recipe: str) -> nn.Module:
    """torchao's emulated Float8Linear on the nn.Linear equivalent to ``layer`` (weight transposed)."""
    lin = nn.Linear(layer.nx, layer.nf)
    with torch.no_grad():
        lin.weight.copy_(layer.weight.t())
        lin.bias.copy_(layer.bias)
    config = dataclasses.replace(torchao_float8.Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    return torchao_float8.convert_to_float8_training(nn.Sequential(lin), config=config)[0]


def _grads(module: nn.Module, region, x: torch.Tensor, grad: torch.Tensor):
    x = x.detach().clone().requires_grad_()
    with region():
        y = module(x)
    y.backward(grad)
    return y, x.grad, module.weight.grad, module.bias.grad


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("route", ["policy", "convert"])
def test_conv1d_is_bitwise_torchao_on_the_equivalent_linear(recipe: str, route: str) -> None:
    layer = _conv1d(32, 48)
    g = torch.Generator().manual_seed(1)
    # bf16 inputs, as a layer inside a bf16 region gets them (torchao casts none on CPU)
    x, grad = (torch.randn(2, 5, 32, generator=g) * 3).bfloat16(), torch.randn(2, 5, 48, generator=g).bfloat16()
    ref = _grads(_torchao_equivalent(layer, recipe), lambda: torch.autocast("cpu", dtype=torch.bfloat16), x, grad)
    if route == "policy":
        policy = Policy.parse("compute=bf16").fp8(recipe, first_last="fp8")
        ours = _grads(layer, lambda: mixprec.autocast("cpu", policy=policy), x, grad)
        assert type(layer) is Conv1D and set(fp8.layer_states(layer)) == {""}
    else:
        converted = fp8.convert(layer, recipe, filter_fn=lambda m, fqn: True)
        assert type(converted) is fp8.Float8Conv1D and converted.weight is layer.weight
        ours = _grads(converted, lambda: mixprec.autocast("cpu", dtype=torch.bfloat16), x, grad)
    out, gx, gw, gb = ours
    assert out.dtype == ref[0].dtype == torch.bfloat16 and out.shape == (2, 5, 48)
    assert torch.equal(out, ref[0]) and torch.equal(gx, ref[1])
    assert gw.shape == (32, 48) and torch.equal(gw, ref[2].t())  # Conv1D's weight is (in, out)
    assert torch.equal(gb, ref[3])


def test_conv1d_policy_compiles_fullgraph_bitwise_eager() -> None:
    policy = Policy.parse("compute=bf16").fp8(first_last="fp8")
    model = nn.Sequential(_conv1d(32, 64), nn.GELU(), _conv1d(64, 32, seed=1))
    x = torch.randn(4, 32)

    def run(m):
        with mixprec.autocast("cpu", policy=policy):
            return m(x)

    eager = run(model)
    compiled = torch.compile(lambda: run(model), fullgraph=True, backend="aot_eager")()
    assert torch.equal(eager, compiled)
    plain = nn.Sequential(*model)  # the same layers, no fp8: a different result
    with mixprec.autocast("cpu", policy="compute=bf16"):
        assert not torch.equal(plain(x), eager)


def _gpt2(seed: int = 0) -> nn.Module:
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=16,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config)


def _train(model: nn.Module, region, steps: int = 2) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(step))
        with region():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


CONV1D_FP8 = [f"transformer.h.{i}.{p}" for i in range(2) for p in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
              ][1:]  # the first (h.0.attn.c_attn) and the last (lm_head, an nn.Linear) stay


def test_gpt2_trains_with_fp8_layers_under_the_policy_and_convert() -> None:
    policy = Policy.parse("compute=bf16").fp8("tensorwise")
    bf16 = _train(_gpt2(), lambda: mixprec.autocast("cpu", policy="compute=bf16"))
    model = _gpt2()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # GPT-2's layers are all eligible: no warning
        losses = _train(model, lambda: mixprec.autocast("cpu", policy=policy))
    assert sorted(fp8.layer_states(model)) == sorted(CONV1D_FP8)
    rows = fp8.stats(model).to_list()
    assert {r["layer"] for r in rows} == set(CONV1D_FP8) and all(r["amax"] > 0 for r in rows)
    assert losses != bf16 and abs(losses[-1] - bf16[-1]) < 0.05  # fp8, not a no-op nor a different model

    converted = fp8.convert(_gpt2())
    keys = {k: v.shape for k, v in _gpt2().state_dict().items()}
    assert {k: v.shape for k, v in converted.state_dict().items()} == keys  # Conv1D's (in, out) kept
    assert sorted(n for n, m in converted.named_modules() if isinstance(m, fp8.Float8Conv1D)) == sorted(CONV1D_FP8)
    assert _train(converted, lambda: mixprec.autocast("cpu", dtype=torch.bfloat16)) == losses  # the same fp8 GEMMs
    back = fp8.unconvert(converted)
    assert sum(type(m) is Conv1D for m in back.modules()) == 8
    assert {k: v.shape for k, v in back.state_dict().items()} == keys
    assert fp8.layer_states(back) == {}


def test_train_with_convert_then_quantize_for_inference_with_torchao() -> None:
    """torchao's inference route, quantize_(Float8WeightOnlyConfig()), after fp8 training: through
    fp8.unconvert; the result is torchao's own on the plain layers with the trained weights."""
    from torchao.quantization import Float8WeightOnlyConfig, quantize_

    torch.manual_seed(0)
    model = fp8.convert(nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)]), filter_fn=lambda m, fqn: True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 32)
    model(x).square().mean().backward()
    opt.step()
    plain = nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)])
    plain.load_state_dict(model.state_dict())

    direct = copy.deepcopy(model)
    quantize_(direct, Float8WeightOnlyConfig())  # without unconvert: runs as torchao's, training state dropped
    torchao_plain = copy.deepcopy(plain)  # a model never converted, quantized the same way
    quantize_(torchao_plain, Float8WeightOnlyConfig())
    with pytest.warns(UserWarning, match="their fp8 training state .* is dropped") as caught:
        with torch.no_grad():
            assert torch.equal(direct(x), torchao_plain(x))
    assert len([w for w in caught if "quantize_" in str(w.message)]) == 1  # one note for the model
    assert fp8.layer_states(direct) == {} and type(direct[0].weight).__name__ == "Float8Tensor"
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(direct(x), torchao_plain(x))

    model = fp8.unconvert(model)
    assert all(type(m) is nn.Linear for m in model) and model[0].weight is not None
    quantize_(model, Float8WeightOnlyConfig())
    quantize_(plain, Float8WeightOnlyConfig())
    assert type(model[0].weight).__name__ == "Float8Tensor"
    with torch.no_grad():
        assert torch.equal(model(x), plain(x))


def test_audit_recommends_gpt2_conv1d_layers() -> None:
    model = _gpt2()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    report = mixprec.audit(model, ids, lambda m, b: m(input_ids=b, labels=b).loss, dtypes=(torch.bfloat16,),
                           fp8="tensorwise")
    assert set(report.fp8.layers) <= set(CONV1D_FP8) and report.fp8.layers  # Conv1D layers are candidates
    assert set(report.fp8.layers) | set(report.fp8.stay) == {*CONV1D_FP8, "transformer.h.0.attn.c_attn", "lm_head"}


def test_a_selected_layer_whose_forward_is_not_routed_warns_once() -> None:
    """transformers' FalconLinear computes ``input @ weight.T``: selected (an nn.Linear), but not
    an op the policy routes; it says so instead of running in bf16 unnoticed."""
    from transformers.models.falcon.modeling_falcon import FalconLinear

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), FalconLinear(32, 32), FalconLinear(32, 32), nn.Linear(32, 32),
                          nn.Linear(32, 32))
    policy = Policy.parse("compute=bf16").fp8(first_last="fp8")
    with pytest.warns(UserWarning, match=r"a selected transformers\.models\.falcon\.modeling_falcon\.FalconLinear "
                                         r"layer ran in the compute dtype, not in fp8") as caught:
        for _ in range(2):
            with mixprec.autocast("cpu", policy=policy):
                model(torch.randn(4, 32))
    assert sum("ran in the compute dtype" in str(w.message) for w in caught) == 1
    assert [n for n, st in fp8.layer_states(model).items() if st.routed] == ["0", "3", "4"]


def test_multihead_attention_out_proj_is_left_out_with_a_reason() -> None:
    layer = nn.TransformerEncoderLayer(32, 2, dim_feedforward=64, dropout=0.0, batch_first=True)
    model = nn.Sequential(nn.Linear(32, 32), layer, nn.Linear(32, 32))
    with pytest.warns(UserWarning, match=r"'1.self_attn.out_proj': nn.MultiheadAttention's out_proj \(the "
                                         r"attention uses its weight without calling it\)"):
        chosen = fp8.select_layers(model)
    assert chosen == ["1.linear1", "1.linear2"]
