"""mixprec.optim's default ``compensation="auto"``: exact for bfloat16, Kahan for float16,
nothing for float32 (bitwise torch), resolved for the dtypes the parameters have at each step;
``None``/``"none"`` is naive rounding, by choice."""

import copy

import pytest
import torch

import mixprec
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
    assert opt.param_groups[0]["compensation"] == "auto" and opt.defaults["compensation"] == "auto"
    assert opt.resolved_compensation(opt.param_groups[0]) == "exact"
    ref = _reference(torch_cls, **kwargs)
    assert torch.equal(exact_value(p, opt.state[p]["low_bits"]), ref)  # float32's updates, bitwise
    assert torch.equal(p, ref.to(torch.bfloat16)) and p[0].item() < 1.5


@pytest.mark.parametrize("cls", [SGD, AdamW])
def test_default_is_kahan_for_float16_and_for_a_group_holding_one(cls):
    p, opt = _run(cls, torch.float16, steps=200)
    assert opt.resolved_compensation(opt.param_groups[0]) == "kahan" and "kahan_comp" in opt.state[p]
    assert p[0].item() < 1.5  # 200 * 2**-18 is below half a float16 gap of 1.5 (2**-11)
    mixed = cls([torch.zeros(2, dtype=torch.bfloat16, requires_grad=True),
                 torch.zeros(2, dtype=torch.float16, requires_grad=True)])
    assert mixed.resolved_compensation(mixed.param_groups[0]) == "kahan"  # "exact" cannot take float16


@pytest.mark.parametrize("cls,torch_cls", [(SGD, torch.optim.SGD), (AdamW, torch.optim.AdamW)])
def test_default_leaves_float32_parameters_bitwise_torch(cls, torch_cls):
    p, opt = _run(cls, torch.float32, steps=20, weight_decay=0.01)
    assert opt.resolved_compensation(opt.param_groups[0]) is None
    assert set(opt.state[p]) <= {"step", "exp_avg", "exp_avg_sq", "momentum_buffer"}
    assert torch.equal(p.detach(), _reference(torch_cls, steps=20, weight_decay=0.01))


def test_none_and_the_string_none_are_naive_rounding():
    for choice in (None, "none"):
        p, opt = _run(AdamW, torch.bfloat16, steps=10, compensation=choice)
        assert opt.param_groups[0]["compensation"] is None
        assert set(opt.state[p]) == {"step", "exp_avg", "exp_avg_sq"}


def test_the_state_dict_records_the_choice_per_group():
    """"auto" is kept (resolved for the parameters held when loaded), an explicit choice too."""
    bf16 = torch.zeros(2, dtype=torch.bfloat16, requires_grad=True)
    fp32 = torch.zeros(2, requires_grad=True)
    opt = AdamW([{"params": [bf16]}, {"params": [fp32], "compensation": "kahan"},
                 {"params": [torch.zeros(2, dtype=torch.float16, requires_grad=True)]}])
    assert [g["compensation"] for g in opt.state_dict()["param_groups"]] == ["auto", "kahan", "auto"]
    assert [opt.resolved_compensation(g) for g in opt.param_groups] == ["exact", "kahan", "kahan"]
    opt.add_param_group({"params": [torch.zeros(2, dtype=torch.bfloat16, requires_grad=True)], "compensation": "none"})
    assert opt.param_groups[-1]["compensation"] is None


def _cast_after(build, model):
    opt = build(model.parameters())
    mixprec.to_low_precision(model)
    return opt


def _cast_before(build, model):
    mixprec.to_low_precision(model)
    return build(model.parameters())


def _load_fp32_checkpoint(build, model):
    """docs/lowp.md "Resuming an fp32 run in bf16", from a mixprec fp32 optimizer's state_dict()."""
    fp32 = copy.deepcopy(model)
    fp32_opt = build(fp32.parameters())
    for p in fp32.parameters():
        p.grad = torch.zeros_like(p)
    fp32_opt.step()
    saved = copy.deepcopy(fp32_opt.state_dict())
    opt = _cast_before(build, model)
    opt.load_state_dict(saved)
    opt.load_fp32_weights(fp32.state_dict(), model=model)
    return opt


CAST_ORDERS = [
    # (how the optimizer meets bf16 weights, steps already taken in fp32 by the reference)
    ("built after to_low_precision", _cast_before, 0),
    ("built before to_low_precision", _cast_after, 0),
    ("fp32 mixprec checkpoint loaded", _load_fp32_checkpoint, 1),
]


@pytest.mark.parametrize("how,setup,done", CAST_ORDERS, ids=[c[0] for c in CAST_ORDERS])
@pytest.mark.parametrize("cls,torch_cls,kwargs", [(SGD, torch.optim.SGD, {}),
                                                  (AdamW, torch.optim.AdamW, dict(weight_decay=0.0))])
def test_auto_follows_the_dtypes_the_parameters_have_when_stepped(how, setup, done, cls, torch_cls, kwargs):
    """An optimizer built before the cast (its parameters keep their identity), or loaded from an
    fp32 run's mixprec checkpoint, trains bf16 weights with exact updates: bitwise fp32 torch.
    Before: "auto" was resolved on the fp32 parameters (None) and the weights never moved."""
    model = torch.nn.Linear(4, 1)
    with torch.no_grad():
        model.weight.fill_(1.5)
        model.bias.fill_(1.5)
    ref = torch.full((4,), 1.5, requires_grad=True)
    ref_opt = torch_cls([ref], lr=LR, **kwargs)
    for _ in range(done):  # the fp32 run's steps (zero gradients)
        ref.grad = torch.zeros_like(ref)
        ref_opt.step()
    opt = setup(lambda ps: cls(ps, lr=LR, **kwargs), model)
    for _ in range(STEPS):
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        ref.grad = torch.ones_like(ref)
        opt.step()
        ref_opt.step()
    assert model.weight.dtype == torch.bfloat16 and opt.resolved_compensation(opt.param_groups[0]) == "exact"
    assert torch.equal(exact_value(model.weight, opt.state[model.weight]["low_bits"])[0], ref.detach())
    assert model.weight[0, 0].item() < 1.5


def test_an_explicit_choice_is_kept_through_the_cast_and_a_checkpoint():
    model = torch.nn.Linear(4, 1)
    opt = AdamW(model.parameters(), compensation=None)
    saved = copy.deepcopy(opt.state_dict())
    mixprec.to_low_precision(model)
    assert opt.resolved_compensation(opt.param_groups[0]) is None
    other = AdamW(model.parameters())
    other.load_state_dict(saved)
    assert other.param_groups[0]["compensation"] is None
