"""mixprec.optim checkpoints: load_state_dict validates as the constructor does, restores the
generator, refuses incomplete state; 8-bit state to and from torch.optim.AdamW."""

import copy
import pickle

import pytest
import torch

from mixprec.optim import SGD, AdamW
from mixprec.optim.quant8 import Quantized8


def _params(dtype=torch.bfloat16, big=False):
    g = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (5,)] + ([(64, 70)] if big else [])  # 4480 elements: enough for 8-bit state
    return [torch.randn(s, generator=g).to(dtype).requires_grad_() for s in shapes]


def _steps(opt, params, first, last):
    for step in range(first, last):
        g = torch.Generator().manual_seed(100 + step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        opt.step()


def _trained(cls=AdamW, dtype=torch.bfloat16, big=False, steps=2, **kwargs):
    params = _params(dtype, big)
    opt = cls(params, lr=1e-2, generator=torch.Generator().manual_seed(0), **kwargs)
    _steps(opt, params, 0, steps)
    return params, opt


def _snapshot(opt):
    return copy.deepcopy(opt.param_groups), {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}


def _assert_unchanged(opt, before):
    groups, state = before
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == [
        {k: v for k, v in g.items() if k != "params"} for g in groups
    ]
    assert {id(p): s.keys() for p, s in opt.state.items()} == {k: s.keys() for k, s in state.items()}
    for p, s in opt.state.items():
        for key, value in s.items():
            assert torch.equal(value, state[id(p)][key]), key


@pytest.mark.parametrize(
    "edit,match",
    [
        (dict(compensation="kahn"), "compensation"),
        (dict(compensation=3), "compensation"),
        (dict(state_dtype="9bit"), "state_dtype"),
        (dict(state_dtype=torch.float16), "exp_avg_sq"),
        (dict(betas=(1.0, 0.999)), "beta"),
        (dict(lr=-1.0), "learning rate"),
        (dict(fused=True, foreach=True), "fused"),
    ],
)
def test_load_refuses_what_the_constructor_refuses(edit, match):
    with pytest.raises(ValueError, match=match):  # the constructor's own refusal
        AdamW(_params(), **edit)
    _, saved = _trained()
    state = saved.state_dict()
    state["param_groups"][0].update(edit)
    params, opt = _trained(steps=1)
    before = _snapshot(opt)
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(state)
    _assert_unchanged(opt, before)
    opt.step()  # still usable


def test_load_refuses_exact_on_float16_and_bad_sgd_options():
    _, saved = _trained(dtype=torch.float16, compensation="kahan")
    state = saved.state_dict()
    state["param_groups"][0]["compensation"] = "exact"
    state["state"][0]["low_bits"] = state["state"][0].pop("kahan_comp")
    _, opt = _trained(dtype=torch.float16, compensation="kahan")
    with pytest.raises(ValueError, match="float16.*kahan"):
        opt.load_state_dict(state)
    _, sgd = _trained(SGD, momentum=0.9)
    state = sgd.state_dict()
    state["param_groups"][0].update(nesterov=True, dampening=0.5)
    with pytest.raises(ValueError, match="Nesterov"):
        sgd.load_state_dict(state)
    state["param_groups"][0].update(nesterov=False, dampening=0.0, state_dtype="8bit")
    with pytest.raises(ValueError, match="state_dtype"):
        sgd.load_state_dict(state)


@pytest.mark.parametrize(
    "cls,kwargs,drop",
    [
        (AdamW, {}, "exp_avg_sq"),
        (AdamW, dict(amsgrad=True), "max_exp_avg_sq"),
        (AdamW, dict(state_dtype="8bit"), "exp_avg_absmax"),
        (SGD, dict(momentum=0.9), "momentum_buffer"),
    ],
)
def test_load_refuses_a_state_missing_what_the_step_reads(cls, kwargs, drop):
    """A missing moment used to be re-created at zero silently (a different run)."""
    _, saved = _trained(cls, big=True, **kwargs)
    state = saved.state_dict()
    del state["state"][2][drop]
    _, opt = _trained(cls, big=True, steps=1, **kwargs)
    before = _snapshot(opt)
    with pytest.raises(ValueError, match=f"parameter 2 lacks '{drop}'"):
        opt.load_state_dict(state)
    _assert_unchanged(opt, before)


def test_load_refuses_another_compensations_buffer():
    _, saved = _trained(compensation="exact")
    state = saved.state_dict()
    state["param_groups"][0]["compensation"] = "kahan"
    _, opt = _trained(compensation="kahan")
    with pytest.raises(ValueError, match="'low_bits'.*compensation='kahan'"):
        opt.load_state_dict(state)


@pytest.mark.parametrize("cls", [AdamW, SGD])
def test_a_stochastic_checkpoint_restores_its_generator_into_an_optimizer_built_otherwise(cls):
    """The saved generator state used to be dropped (no generator to load it into), and the
    steps drew from the global RNG."""
    a, opt_a = _trained(cls, compensation="stochastic")
    saved = copy.deepcopy(opt_a.state_dict())
    b = [p.detach().clone().requires_grad_() for p in a]
    opt_b = cls(b, lr=1e-2, compensation=None)
    assert opt_b.generator is None
    global_rng = torch.random.get_rng_state()
    opt_b.load_state_dict(saved)
    assert opt_b.param_groups[0]["compensation"] == "stochastic"
    assert torch.equal(opt_b.generator.get_state(), saved["generator_state"])
    _steps(opt_a, a, 2, 4)
    _steps(opt_b, b, 2, 4)
    for p, q in zip(a, b):
        assert torch.equal(p, q)
    assert torch.equal(torch.random.get_rng_state(), global_rng)


def test_a_torch_checkpoint_into_a_stochastic_group_gets_a_seeded_generator():
    ref = _params(torch.float32)
    torch_opt = torch.optim.AdamW(ref, lr=1e-2)
    _steps(torch_opt, ref, 0, 1)
    low = _params()
    opt = AdamW(low, lr=1e-2)
    opt.load_state_dict(torch_opt.state_dict())
    assert opt.generator is None and opt.resolved_compensation(opt.param_groups[0]) == "exact"  # "auto"
    opt = AdamW(low, lr=1e-2, compensation="stochastic")
    opt.generator = None
    opt.load_state_dict(torch_opt.state_dict())
    assert opt.generator is not None


def test_eight_bit_state_exports_to_torch_adamw():
    """``state_dict()`` holds uint8 codes, which torch would cast to numbers (max 255);
    ``torch_state_dict()`` holds the float32 moments torch resumes from."""
    ours, opt = _trained(dtype=torch.float32, big=True, state_dtype="8bit")
    codes = opt.state[ours[2]]["exp_avg"]
    assert codes.dtype == torch.uint8
    exported = copy.deepcopy(opt.torch_state_dict())  # as torch.save/load: no shared tensors
    assert "generator_state" not in exported
    assert all("compensation" not in g and "state_dtype" not in g for g in exported["param_groups"])
    theirs = [p.detach().clone().requires_grad_() for p in ours]
    torch_opt = torch.optim.AdamW(theirs, lr=1e-2)
    torch_opt.load_state_dict(exported)
    for p, q, signed in ((ours[2], theirs[2], True),):
        expected = Quantized8(codes, opt.state[p]["exp_avg_absmax"], signed, p.shape).dequantize()
        assert torch.equal(torch_opt.state[q]["exp_avg"], expected)
        assert torch_opt.state[q]["exp_avg"].abs().max() < 1.0
        assert set(torch_opt.state[q]) == {"step", "exp_avg", "exp_avg_sq"}
    for p, q in zip(ours[:2], theirs[:2]):  # small parameters keep float32 moments
        assert torch.equal(torch_opt.state[q]["exp_avg"], opt.state[p]["exp_avg"])
    _steps(torch_opt, theirs, 2, 3)
    _steps(opt, ours, 2, 3)
    for p, q in zip(ours, theirs):  # the same moments, up to the 8-bit requantization
        torch.testing.assert_close(p, q, rtol=0, atol=1e-4)


def test_torch_adamw_state_loads_into_eight_bit_and_bf16_moments():
    ref = _params(torch.float32, big=True)
    torch_opt = torch.optim.AdamW(ref, lr=1e-2)
    _steps(torch_opt, ref, 0, 2)
    saved = torch_opt.state_dict()
    opt = AdamW(_params(torch.float32, big=True), lr=1e-2, state_dtype="8bit")
    opt.load_state_dict(saved)
    big = opt.param_groups[0]["params"][2]
    state = opt.state[big]
    assert state["exp_avg"].dtype == torch.uint8 and state["exp_avg_sq"].dtype == torch.uint8
    for key, signed in (("exp_avg", True), ("exp_avg_sq", False)):
        value = Quantized8(state[key], state[key + "_absmax"], signed, big.shape).dequantize()
        expected = torch_opt.state[ref[2]][key]
        assert (value - expected).abs().max() < 0.01 * expected.abs().max()
    assert opt.state[opt.param_groups[0]["params"][0]]["exp_avg"].dtype == torch.float32  # small
    opt.step()  # runs on the quantized state
    bf16_state = AdamW(_params(torch.float32, big=True), lr=1e-2, state_dtype=torch.bfloat16)
    bf16_state.load_state_dict(saved)
    assert all(s["exp_avg_sq"].dtype == torch.bfloat16 for s in bf16_state.state.values())
    # bfloat16 parameters: torch keeps bf16 moments, ours are float32 (the default)
    low_ref = _params()
    low_torch = torch.optim.AdamW(low_ref, lr=1e-2)
    _steps(low_torch, low_ref, 0, 1)
    low = AdamW(_params(), lr=1e-2)
    low.load_state_dict(low_torch.state_dict())
    assert all(s["exp_avg"].dtype == torch.float32 for s in low.state.values())
    assert low.generator is None


def test_sgd_torch_state_dict_drops_the_buffers_and_torch_resumes_bitwise():
    ours, opt = _trained(SGD, dtype=torch.float32, momentum=0.9, compensation="kahan")
    exported = copy.deepcopy(opt.torch_state_dict())
    assert all(set(s) == {"momentum_buffer"} for s in exported["state"].values())
    theirs = [p.detach().clone().requires_grad_() for p in ours]
    torch_opt = torch.optim.SGD(theirs, lr=1e-2, momentum=0.9)
    torch_opt.load_state_dict(exported)
    _steps(torch_opt, theirs, 2, 4)
    _steps(opt, ours, 2, 4)
    for p, q in zip(ours, theirs):
        assert torch.equal(p, q)
    _, low = _trained(SGD, momentum=0.9, compensation="kahan")  # bf16: Kahan buffers in the state
    assert all("kahan_comp" in s for s in low.state_dict()["state"].values())
    exported = low.torch_state_dict()["state"]
    assert all(set(s) == {"momentum_buffer"} and s["momentum_buffer"].dtype == torch.float32 for s in exported.values())


def _bitwise_state(opt):
    """``opt.state_dict()`` with every tensor cloned: what a refused load must leave as it was."""
    return _cloned(opt.state_dict())


def _cloned(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _cloned(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cloned(v) for v in value)
    return copy.deepcopy(value)


def _assert_bitwise_equal(opt, before, where="state_dict"):
    now = _bitwise_state(opt) if where == "state_dict" else opt
    if isinstance(before, torch.Tensor):
        assert now.dtype == before.dtype and torch.equal(now, before), where
    elif isinstance(before, dict):
        assert now.keys() == before.keys(), where
        for k in before:
            _assert_bitwise_equal(now[k], before[k], f"{where}[{k!r}]")
    elif isinstance(before, (list, tuple)):
        assert len(now) == len(before), where
        for i, (a, b) in enumerate(zip(now, before)):
            _assert_bitwise_equal(a, b, f"{where}[{i}]")
    else:
        assert now == before, where


def _torch_checkpoint(shapes, lr=0.5, weight_decay=0.3):
    ref = [torch.randn(s).requires_grad_() for s in shapes]
    torch_opt = torch.optim.AdamW(ref, lr=lr, weight_decay=weight_decay)
    _steps(torch_opt, ref, 0, 1)
    return torch_opt.state_dict()


@pytest.mark.parametrize("kwargs", [dict(state_dtype=torch.bfloat16, compensation="kahan"),
                                    dict(state_dtype="8bit", compensation="kahan")],
                         ids=["bf16-state", "8bit-state"])
def test_a_torch_checkpoint_of_other_shapes_is_refused_before_anything_changes(kwargs):
    """A torch checkpoint whose last moment has 7 elements for a 4480-element parameter (before:
    lr 1e-3 became 0.5, weight_decay and the moments were replaced and the Kahan buffers dropped
    before the error; 8-bit state zero-padded the 7 elements and trained on them)."""
    params = _params(big=True)
    opt = AdamW(params, lr=1e-3, generator=torch.Generator().manual_seed(0), **kwargs)
    _steps(opt, params, 0, 2)
    before = _bitwise_state(opt)
    saved = _torch_checkpoint([(7, 5), (5,), (7,)])
    with pytest.raises(ValueError, match=r"parameter 2 holds 'exp_avg' of shape \(7,\) for a parameter of shape \(64, 70\)"):
        opt.load_state_dict(saved)
    _assert_bitwise_equal(opt, before)
    assert opt.param_groups[0]["lr"] == 1e-3


def test_eight_bit_codes_of_another_block_count_are_refused():
    _, saved = _trained(big=True, state_dtype="8bit")
    state = saved.state_dict()
    state["state"][2]["exp_avg"] = state["state"][2]["exp_avg"][:256]  # one block of 18
    _, opt = _trained(big=True, steps=1, state_dtype="8bit")
    before = _bitwise_state(opt)
    with pytest.raises(ValueError, match=r"'exp_avg' of shape \(256,\).*expected 4608 elements"):
        opt.load_state_dict(state)
    _assert_bitwise_equal(opt, before)


def test_sgd_momentum_of_another_shape_is_refused_before_anything_changes():
    _, saved = _trained(SGD, momentum=0.9, compensation="kahan")
    state = saved.state_dict()
    state["param_groups"][0]["lr"] = 0.5
    state["state"][0]["momentum_buffer"] = state["state"][0]["momentum_buffer"].T.contiguous()  # (5, 7)
    _, opt = _trained(SGD, steps=1, momentum=0.9, compensation="kahan")
    before = _bitwise_state(opt)
    with pytest.raises(ValueError, match=r"'momentum_buffer' of shape \(5, 7\)"):
        opt.load_state_dict(state)
    _assert_bitwise_equal(opt, before)


def test_master_weights_refuse_a_moment_of_another_shape_before_anything_changes():
    from mixprec import MasterWeights

    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3)).bfloat16()
    opt = MasterWeights(torch.optim.AdamW(model.parameters(), lr=1e-3))
    model(torch.randn(2, 5).bfloat16()).float().sum().backward()
    opt.step()
    before = _bitwise_state(opt)
    masters = [m.clone() for m in opt.masters]
    saved = _torch_checkpoint([(7, 5), (7,), (3, 7), (4,)])
    with pytest.raises(ValueError, match=r"parameter 3 holds 'exp_avg' of shape \(4,\) for a parameter of shape \(3,\)"):
        opt.load_state_dict(saved)
    _assert_bitwise_equal(opt, before)
    assert all(torch.equal(m, n) for m, n in zip(opt.masters, masters))


def test_torch_state_dict_holds_float32_moments_for_bfloat16_state():
    """bfloat16 moments (``state_dtype``) go out as float32, as ``torch_state_dict()`` promises:
    a reader other than ``torch.optim`` (a file, another framework) sees torch's dtype."""
    params, opt = _trained(dtype=torch.float32, state_dtype=torch.bfloat16)
    exported = opt.torch_state_dict()["state"]
    for index, p in enumerate(params):
        for key in ("exp_avg", "exp_avg_sq"):
            assert opt.state[p][key].dtype == torch.bfloat16
            assert exported[index][key].dtype == torch.float32
            assert torch.equal(exported[index][key], opt.state[p][key].float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_load_fp32_weights_seeds_the_kahan_buffer(dtype):
    """``compensation="kahan"``: each parameter becomes the float32 weight rounded to nearest and
    its buffer what the rounding lost, so training resumes from the float32 weights."""
    fp32 = torch.nn.Linear(6, 5)
    model = torch.nn.Linear(6, 5).to(dtype)
    opt = AdamW(model.parameters(), compensation="kahan")
    opt.load_fp32_weights(fp32.state_dict(), model=model)
    for name, p in model.named_parameters():
        w = fp32.state_dict()[name]
        comp = opt.state[p]["kahan_comp"]
        assert torch.equal(p, w.to(dtype)) and comp.dtype == dtype
        assert torch.equal(comp, (w - p.float()).to(dtype))
        assert comp.ne(0).any()  # (random float32 weights: most are not representable)
        assert (p.float() + comp.float() - w).abs().max() < (p.float() - w).abs().max() * 2**-6


SEEDED = {  # (class, options): a buffer load_fp32_weights seeds before the first step
    "AdamW, exact": (AdamW, {"compensation": "exact"}),
    "AdamW, kahan": (AdamW, {"compensation": "kahan"}),
    "AdamW, kahan, amsgrad": (AdamW, {"compensation": "kahan", "amsgrad": True}),
    "SGD, exact, momentum": (SGD, {"compensation": "exact", "momentum": 0.9}),
    "SGD, kahan, momentum": (SGD, {"compensation": "kahan", "momentum": 0.9}),
}


@pytest.mark.parametrize("case", SEEDED)
def test_state_dict_saved_after_load_fp32_weights_resumes_bitwise(case):
    """A checkpoint taken after ``load_fp32_weights`` and before the first step (the state holds
    only the seeded buffer) loads into a fresh optimizer, which then steps bitwise as the original
    (it was refused: "lacks 'step', 'exp_avg', ...")."""
    cls, options = SEEDED[case]
    fp32 = [torch.randn(7, 5, generator=torch.Generator().manual_seed(1)), torch.randn(5)]
    runs = []
    for resume in (False, True):
        params = [w.to(torch.bfloat16).requires_grad_() for w in fp32]
        opt = cls(params, lr=1e-2, **options)
        opt.load_fp32_weights(fp32)
        assert all(opt.state[p] for p in params)  # the seeded buffers
        if resume:
            saved = copy.deepcopy(opt.state_dict())
            params = [p.detach().clone().requires_grad_() for p in params]
            opt = cls(params, lr=1e-2, **options)
            opt.load_state_dict(saved)
        _steps(opt, params, 0, 3)
        runs.append([p.detach().clone() for p in params])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


COPIES = {
    "deepcopy": copy.deepcopy,
    "pickle": lambda o: pickle.loads(pickle.dumps(o)),
}
COPIED = {  # (class, options): every compensation and state kind that keeps something beside torch's
    "AdamW, stochastic": (AdamW, {"compensation": "stochastic"}),
    "AdamW, kahan, bf16 state": (AdamW, {"compensation": "kahan", "state_dtype": torch.bfloat16}),
    "AdamW, 8-bit state": (AdamW, {"state_dtype": "8bit"}),
    "SGD, stochastic, momentum": (SGD, {"compensation": "stochastic", "momentum": 0.9}),
    "SGD, kahan": (SGD, {"compensation": "kahan"}),
}


@pytest.mark.parametrize("how", COPIES.values(), ids=COPIES.keys())
@pytest.mark.parametrize("case", COPIED.values(), ids=COPIED.keys())
def test_a_copied_optimizer_steps_and_draws_as_the_original(case, how):
    """``copy.deepcopy`` or a pickle (``torch.save`` of the object) of a trained optimizer, with
    its parameters, steps; on the same gradients it writes what the original writes, bitwise,
    its generator drawing what the original's draws (before, the copy had no ``generator`` and
    its step raised AttributeError)."""
    cls, kwargs = case
    params, opt = _trained(cls, big=True, **kwargs)
    copied_params, copied = how((params, opt))
    _steps(opt, params, 2, 5)
    _steps(copied, copied_params, 2, 5)
    for p, q in zip(params, copied_params):
        assert torch.equal(p, q)
    assert torch.equal(copied.generator.get_state(), opt.generator.get_state())
    assert copied.state_dict().keys() == opt.state_dict().keys()


def test_a_copied_optimizer_without_a_generator_makes_its_own_when_a_group_draws():
    params = _params()
    opt = AdamW(params, lr=1e-2, compensation="kahan")
    assert opt.generator is None
    copied = copy.deepcopy(opt)
    assert copied.generator is None
    copied.add_param_group({"params": [torch.zeros(3, dtype=torch.bfloat16, requires_grad=True)],
                            "compensation": "stochastic"})
    assert isinstance(copied.generator, torch.Generator)


DTYPE_SWITCHES = {  # the dtypes the bf16 parameters take after 3 steps ("auto": exact -> ...), 3 steps each
    "bf16 -> fp32": (torch.float32,),
    "bf16 -> fp16 -> bf16": (torch.float16, torch.bfloat16),
    "bf16 -> fp32 -> bf16": (torch.float32, torch.bfloat16),
}
SWITCHED = {"AdamW": (AdamW, {}), "SGD": (SGD, dict(momentum=0.9))}


def _switched(cls, kwargs, dtypes, forget):
    """3 bf16 steps, then 3 steps in each of ``dtypes`` (``p.data = ...``, as ``model.float()``);
    ``forget``: the reference, whose compensation buffers are removed by hand at each switch."""
    params = _params()
    opt = cls(params, lr=1e-2, **kwargs)
    _steps(opt, params, 0, 3)
    for i, dtype in enumerate(dtypes):
        for p in params:
            p.data = p.data.to(dtype)
        if forget:
            for state in opt.state.values():
                state.pop("low_bits", None)
                state.pop("kahan_comp", None)
        _steps(opt, params, 3 * i + 3, 3 * i + 6)
    return params, opt


@pytest.mark.parametrize("switch", DTYPE_SWITCHES)
@pytest.mark.parametrize("case", SWITCHED)
def test_a_dtype_switch_drops_the_earlier_rules_buffer_and_the_state_dict_resumes_bitwise(case, switch):
    """Until 2026-12-07 the earlier rule's buffer was kept: saved in state_dict(), whose load then
    refused it ("mixes two optimizers"), and back in bf16 its stale low bits were added to the
    new weights. Now it is dropped (the new rule's buffer starts at zero), and the optimizer's
    own state_dict() resumes bitwise the uninterrupted run."""
    cls, kwargs = SWITCHED[case]
    params, opt = _switched(cls, kwargs, DTYPE_SWITCHES[switch], forget=False)
    ref_params, ref = _switched(cls, kwargs, DTYPE_SWITCHES[switch], forget=True)
    assert all(torch.equal(p, q) for p, q in zip(params, ref_params))
    _assert_bitwise_equal(opt, _bitwise_state(ref))
    copies = [p.detach().clone().requires_grad_() for p in params]
    resumed = cls(copies, lr=1e-2, **kwargs)
    resumed.load_state_dict(_cloned(opt.state_dict()))  # (as saved: torch's load would share the tensors)
    done = 3 * len(DTYPE_SWITCHES[switch]) + 3
    _steps(opt, params, done, done + 3)
    _steps(resumed, copies, done, done + 3)
    assert all(torch.equal(p, q) for p, q in zip(params, copies))
    _assert_bitwise_equal(resumed, _bitwise_state(opt))
