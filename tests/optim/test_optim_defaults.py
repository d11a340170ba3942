"""mixprec.optim's default ``compensation="auto"``: exact for bfloat16, Kahan for float16,
nothing for float32 (bitwise torch); ``None``/``"none"`` is naive rounding, by choice."""

import pytest
import torch

from mixprec.optim import SGD, AdamW
from mixprec.optim.exact import exact_value

LR = 2.0**-18  # far below half a bfloat16 gap of 1.5 (2**-8)
STEPS = 1536  # 1536 * 2**-18 = 1.5 * 2**-8: the float32 weight moves past the rounding midpoint


def _run(cls, dtype, steps=STEPS, **kwargs):
    p = torch.full((4,), 1.5, dtype=dtype, requires_grad=True)
    opt = cls([p], lr=LR, **kwargs)
    for _ in range(steps):
        p.grad = torch.ones_like(p)
        opt.step()
    return p, opt


def _reference(torch_cls, steps=STEPS, **kwargs):
    ref = torch.full((4,), 1.5, requires_grad=True)
    opt = torch_cls([ref], lr=LR, **kwargs)
    for _ in range(steps):
        ref.grad = torch.ones_like(ref)
        opt.step()
    return ref.detach()


@pytest.mark.parametrize("cls,torch_cls,kwargs", [(SGD, torch.optim.SGD, {}), (AdamW, torch.optim.AdamW, dict(weight_decay=0.0))])
def test_default_moves_bf16_weights_by_tiny_updates_exactly(cls, torch_cls, kwargs):
    """The old default (naive rounding) never moved the weight: each update is lost."""
    naive, _ = _run(cls, torch.bfloat16, compensation=None, **kwargs)
    assert torch.equal(naive, torch.full((4,), 1.5, dtype=torch.bfloat16))
    p, opt = _run(cls, torch.bfloat16, **kwargs)
    assert opt.param_groups[0]["compensation"] == "exact" and opt.defaults["compensation"] == "auto"
    ref = _reference(torch_cls, **kwargs)
    assert torch.equal(exact_value(p, opt.state[p]["low_bits"]), ref)  # float32's updates, bitwise
    assert torch.equal(p, ref.to(torch.bfloat16)) and p[0].item() < 1.5


@pytest.mark.parametrize("cls", [SGD, AdamW])
def test_default_is_kahan_for_float16_and_for_a_group_holding_one(cls):
    p, opt = _run(cls, torch.float16, steps=200)
    assert opt.param_groups[0]["compensation"] == "kahan" and "kahan_comp" in opt.state[p]
    assert p[0].item() < 1.5  # 200 * 2**-18 is below half a float16 gap of 1.5 (2**-11)
    mixed = cls([torch.zeros(2, dtype=torch.bfloat16, requires_grad=True),
                 torch.zeros(2, dtype=torch.float16, requires_grad=True)])
    assert mixed.param_groups[0]["compensation"] == "kahan"  # "exact" cannot take float16


@pytest.mark.parametrize("cls,torch_cls", [(SGD, torch.optim.SGD), (AdamW, torch.optim.AdamW)])
def test_default_leaves_float32_parameters_bitwise_torch(cls, torch_cls):
    p, opt = _run(cls, torch.float32, steps=20, weight_decay=0.01)
    assert opt.param_groups[0]["compensation"] is None and set(opt.state[p]) <= {"step", "exp_avg", "exp_avg_sq", "momentum_buffer"}
    assert torch.equal(p.detach(), _reference(torch_cls, steps=20, weight_decay=0.01))


def test_none_and_the_string_none_are_naive_rounding():
    for choice in (None, "none"):
        p, opt = _run(AdamW, torch.bfloat16, steps=10, compensation=choice)
        assert opt.param_groups[0]["compensation"] is None
        assert set(opt.state[p]) == {"step", "exp_avg", "exp_avg_sq"}


def test_the_state_dict_records_the_resolved_choice_per_group():
    bf16 = torch.zeros(2, dtype=torch.bfloat16, requires_grad=True)
    fp32 = torch.zeros(2, requires_grad=True)
    opt = AdamW([{"params": [bf16]}, {"params": [fp32]}, {"params": [torch.zeros(2, dtype=torch.float16, requires_grad=True)]}])
    assert [g["compensation"] for g in opt.state_dict()["param_groups"]] == ["exact", None, "kahan"]
    opt.add_param_group({"params": [torch.zeros(2, dtype=torch.bfloat16, requires_grad=True)], "compensation": "none"})
    assert opt.param_groups[-1]["compensation"] is None
