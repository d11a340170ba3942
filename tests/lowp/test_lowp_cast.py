"""to_low_precision: what is cast, what is kept, in every rule form."""

import pytest
import torch
from torch import nn

import mixprec
from mixprec import ModuleRule
from mixprec.lowp import to_low_precision


def _model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 8),
        nn.BatchNorm1d(8),
        nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)),
        nn.Linear(8, 2),
    )


def _dtypes(model):
    return {name: t.dtype for name, t in [*model.named_parameters(), *model.named_buffers()]}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_default_keeps_norms_in_fp32(dtype):
    model = _model()
    before = {n: t.clone() for n, t in model.state_dict().items()}
    params = list(model.parameters())
    assert to_low_precision(model, dtype) is model
    assert all(a is b for a, b in zip(params, model.parameters()))  # same Parameter objects
    d = _dtypes(model)
    for name in ("0.weight", "0.bias", "2.0.weight", "3.weight"):
        assert d[name] == dtype
    for name in ("1.weight", "1.running_mean", "1.running_var", "2.1.weight", "2.1.bias"):
        assert d[name] == torch.float32
    assert d["1.num_batches_tracked"] == torch.int64
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name].to(value.dtype))


def test_gradients_are_cast_along():
    model = nn.Linear(3, 3)
    model(torch.randn(2, 3)).sum().backward()
    to_low_precision(model)
    assert model.weight.grad.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "keep,kept",
    [
        (None, set()),
        ((), set()),
        (nn.Linear, {"0", "2.0", "3"}),
        ((nn.BatchNorm1d, nn.LayerNorm), {"1", "2.1"}),
        (r"^3$", {"3"}),
        (r"^2$", {"2.0", "2.1"}),  # a kept module keeps everything inside it
        (lambda module, name: name.startswith("2"), {"2.0", "2.1"}),
        (ModuleRule(torch.float32, names=r"^0$"), {"0"}),
        ([ModuleRule(torch.float32, types=(nn.LayerNorm,)), r"^3$"], {"2.1", "3"}),
        ((nn.LayerNorm, r"^0$", lambda m, n: n == "3"), {"0", "2.1", "3"}),
    ],
)
def test_keep_forms(keep, kept):
    model = to_low_precision(_model(), keep=keep)
    for name, module in model.named_modules():
        own = [*module.parameters(recurse=False)]
        if not own:
            continue
        expected = torch.float32 if name in kept else torch.bfloat16
        assert all(p.dtype == expected for p in own), (name, [p.dtype for p in own])


def test_module_rule_dtype_is_honoured():
    model = to_low_precision(_model(), torch.bfloat16, keep=ModuleRule(torch.float16, names=r"^3$"))
    assert model[3].weight.dtype == torch.float16
    assert model[1].weight.dtype == torch.bfloat16  # keep replaces the default


def test_model_runs_after_cast():
    model = to_low_precision(_model(), keep=None).eval()
    assert model(torch.randn(5, 4, dtype=torch.bfloat16)).dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int8, "bfloat16"])
def test_bad_dtype(dtype):
    with pytest.raises(ValueError, match="bfloat16 or torch.float16"):
        to_low_precision(_model(), dtype)


def test_bad_arguments():
    with pytest.raises(TypeError, match="nn.Module"):
        to_low_precision(torch.randn(3))
    with pytest.raises(TypeError, match="keep="):
        to_low_precision(_model(), keep=[3])
    with pytest.raises(ValueError, match="regex"):
        to_low_precision(_model(), keep="(")


def test_public_names():
    assert mixprec.to_low_precision is mixprec.lowp.to_low_precision is to_low_precision
    assert mixprec.MasterWeights is mixprec.lowp.MasterWeights
    assert set(mixprec.lowp.__all__) == {"MasterWeights", "memory_bytes", "to_low_precision"}


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.mid(self.emb(ids)))


@pytest.mark.parametrize("keep", [r"^emb$", r"^head$"])
def test_tied_weight_of_a_kept_module_stays_fp32_in_any_order(keep):
    model = _Tied()
    model(torch.tensor([1, 2])).sum().backward()
    before = model.emb.weight.detach().clone()
    to_low_precision(model, keep=keep)
    assert model.head.weight is model.emb.weight
    assert model.emb.weight.dtype == torch.float32 and model.emb.weight.grad.dtype == torch.float32
    assert torch.equal(model.emb.weight, before)  # never rounded through bf16
    assert model.mid.weight.dtype == torch.bfloat16


def test_policy_rules_and_order():
    policy = mixprec.Policy().keep(types=(nn.LayerNorm,))
    for keep in (policy, policy.module_rules, policy.module_rules[0]):
        d = _dtypes(to_low_precision(_model(), keep=keep))
        assert d["2.1.weight"] == torch.float32 and d["1.weight"] == torch.bfloat16
    # the first match wins, types included
    model = to_low_precision(_model(), keep=[ModuleRule(torch.float16, names=r"^3$"), nn.Linear])
    assert model[3].weight.dtype == torch.float16 and model[0].weight.dtype == torch.float32


def test_buffers_on_a_kept_batchnorm_and_a_cast_one():
    model = nn.Sequential(nn.BatchNorm1d(3), nn.Sequential(nn.BatchNorm1d(3)))
    to_low_precision(model, keep=r"^0$")
    assert model[0].running_mean.dtype == torch.float32 and model[1][0].running_var.dtype == torch.bfloat16
    assert model[0].num_batches_tracked.dtype == model[1][0].num_batches_tracked.dtype == torch.int64


@pytest.mark.parametrize("keep", [3, 2.5, object()])
def test_keep_that_is_not_a_rule(keep):
    with pytest.raises(TypeError, match="keep= takes"):
        to_low_precision(_model(), keep=keep)
