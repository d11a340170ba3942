"""Recipes (validation, presets against torchao's configs), layer selection (eligible, first and
last), convert (state dict keys, shared parameters, bitwise equal to torchao's conversion),
layer_state, the stats table, the public surface."""

from __future__ import annotations

import copy
import dataclasses
import re
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

import mixprec
from mixprec import fp8
from mixprec.fp8 import Cast, Float8Recipe

torchao_float8 = pytest.importorskip("torchao.float8")


# --- recipes -----------------------------------------------------------------------------------

def _torchao_casts(name: str) -> dict[str, Cast]:
    c = torchao_float8.Float8LinearConfig.from_recipe_name(name)
    to_ours = {torch.float8_e4m3fn: "e4m3fn", torch.float8_e5m2: "e5m2"}

    def cast(cc):
        if cc.scaling_type is torchao_float8.ScalingType.DISABLED:
            return Cast("none")
        gran = "tensor" if cc.scaling_granularity is torchao_float8.ScalingGranularity.TENSORWISE else "row"
        return Cast(to_ours[cc.target_dtype], gran)

    return {
        "input": cast(c.cast_config_input), "weight": cast(c.cast_config_weight),
        "grad_output": cast(c.cast_config_grad_output),
        "weight_for_grad_input": cast(c.cast_config_weight_for_grad_input),
        "input_for_grad_weight": cast(c.cast_config_input_for_grad_weight),
        "grad_output_for_grad_weight": cast(c.cast_config_grad_output_for_grad_weight),
        "pow2_scales": c.round_scales_to_power_of_2,
    }


@pytest.mark.parametrize("name", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_presets_match_torchao_recipes(name):
    ours = Float8Recipe.from_name(name)
    assert ours == getattr(Float8Recipe, name)()
    assert ours.name == name
    assert {k: getattr(ours, k) for k in _torchao_casts(name)} == _torchao_casts(name)
    assert ours.save_fp8 == (name == "tensorwise")


def test_recipe_validation():
    with pytest.raises(ValueError, match="unknown fp8 recipe 'delayed'"):
        Float8Recipe.from_name("delayed")
    with pytest.raises(ValueError, match="Cast.format must be one of"):
        Cast("e4m3")
    with pytest.raises(ValueError, match="torchao's 'axiswise' is 'row' here"):
        Cast("e4m3fn", "axiswise")
    with pytest.raises(ValueError, match="the grad_weight GEMM mixes an fp8 operand with a high-precision one"):
        Float8Recipe(input_for_grad_weight=Cast("none"), save_fp8=False)
    with pytest.raises(ValueError, match="save_fp8=True needs the backward GEMMs to reuse the forward casts"):
        dataclasses.replace(Float8Recipe.rowwise(), save_fp8=True)
    with pytest.raises(ValueError, match="must be a Cast"):
        Float8Recipe(input="e4m3fn")
    with pytest.raises(dataclasses.FrozenInstanceError):
        Float8Recipe.tensorwise().pow2_scales = True  # type: ignore[misc]


def test_custom_recipe_runs_and_all_high_precision_equals_plain_linear():
    hp = Cast("none")
    recipe = Float8Recipe(hp, hp, hp, hp, hp, hp, save_fp8=False, name="hp")
    lin = nn.Linear(32, 16)
    x = torch.randn(4, 32, requires_grad=True)
    y = fp8.linear(x, lin.weight, lin.bias, recipe)
    assert torch.equal(y, x @ lin.weight.t() + lin.bias)
    e5 = Float8Recipe(Cast("e5m2", "row"), Cast("e5m2", "row"), save_fp8=False, pow2_scales=True)
    fp8.linear(x, lin.weight, lin.bias, e5).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


# --- selection ---------------------------------------------------------------------------------

def test_eligible_reasons():
    assert fp8.eligible(nn.Linear(32, 48), "a") == (True, "")
    assert fp8.eligible(nn.Linear(10, 32), "head") == (False, "'head': in_features=10 is not a multiple of 16")
    assert fp8.eligible(nn.Linear(10, 17), "x")[1] == "'x': in_features=10 and out_features=17 are not multiples of 16"
    assert fp8.eligible(nn.Conv1d(16, 16, 1), "c") == (
        False, "'c': Conv1d is not an nn.Linear or Linear-equivalent (transformers Conv1D)")


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 10), nn.Linear(10, 32),
                         nn.Linear(32, 32), nn.Linear(32, 16))


def test_select_layers_first_last_and_dims_rule():
    with pytest.warns(UserWarning) as caught:
        chosen = fp8.select_layers(_net())
    assert chosen == ["1", "4"]  # 0 and 5 are the first and last eligible; 2 and 3 are not multiples of 16
    messages = [str(w.message) for w in caught]
    assert messages == ["fp8: layer '2': out_features=10 is not a multiple of 16; it stays in the compute dtype",
                        "fp8: layer '3': in_features=10 is not a multiple of 16; it stays in the compute dtype"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert fp8.select_layers(_net(), first_last="fp8") == ["0", "1", "4", "5"]
        assert fp8.select_layers(_net(), names=r"^[15]$") == ["1"]
        assert fp8.select_layers(_net(), types=nn.Conv1d) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # names not matching the ineligible layers: no warning
        assert fp8.select_layers(_net(), names=r"^[014]$", first_last="fp8") == ["0", "1", "4"]
    with pytest.raises(ValueError, match="first_last must be 'keep'"):
        fp8.select_layers(_net(), first_last="bf16")
    with pytest.raises(ValueError, match="names must be a regular expression"):
        fp8.select_layers(_net(), names="(")


# --- convert ---------------------------------------------------------------------------------

def test_convert_keeps_state_dict_keys_and_shares_parameters():
    model = _net()
    before = model.state_dict()
    weights = [m.weight for m in model]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = fp8.convert(model, "rowwise")
    assert out is model
    assert [type(m).__name__ for m in model] == ["Linear", "Float8Linear", "Linear", "Linear", "Float8Linear", "Linear"]
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    assert all(m.weight is w for m, w in zip(model, weights))
    assert model[1].recipe == Float8Recipe.rowwise()
    model.load_state_dict(before)  # loads into the converted model as is
    assert "recipe=rowwise" in repr(model[1])


def test_converted_model_is_bitwise_equal_to_torchao_conversion():
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.GELU(), nn.Linear(32, 16))
    x = torch.randn(2, 6, 32)
    config = dataclasses.replace(torchao_float8.Float8LinearConfig.from_recipe_name("tensorwise"), emulate=True)
    theirs = torchao_float8.convert_to_float8_training(copy.deepcopy(base), config=config)
    ours = fp8.convert(copy.deepcopy(base), filter_fn=lambda m, fqn: True)
    outs = []
    for model in (ours, theirs):
        y = model(x)
        y.square().mean().backward()
        outs.append((y, *[p.grad for p in model.parameters()]))
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def test_float8_linear_follows_autocast_and_converts_root():
    lin = fp8.convert(nn.Linear(32, 32), filter_fn=lambda m, fqn: True)
    assert isinstance(lin, fp8.Float8Linear)
    x = torch.randn(4, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(x)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, fp8.linear(x.bfloat16(), lin.weight, lin.bias))
    with pytest.raises(ValueError, match="backend must be one of"):
        fp8.Float8Linear(16, 16, backend="tensor_cores")


def test_layer_state_is_not_in_state_dict_and_follows_deepcopy():
    lin = nn.Linear(16, 16)
    keys = list(lin.state_dict())
    st = fp8.layer_state(lin)
    assert fp8.layer_state(lin) is st and fp8.layer_state(nn.Linear(16, 16), create=False) is None
    assert list(lin.state_dict()) == keys
    fp8.linear(torch.randn(2, 16), lin.weight, state=st)
    twin = copy.deepcopy(lin)
    assert fp8.layer_state(twin) is not st and torch.equal(fp8.layer_state(twin).stats, st.stats)
    assert fp8.layer_states(nn.Sequential(lin, nn.ReLU())) == {"0": st}


def test_stats_table():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = fp8.convert(_net())
    model(torch.randn(3, 16)).sum().backward()
    table = fp8.stats(model)
    rows = table.to_list()
    assert [(r["layer"], r["operand"]) for r in rows] == [
        (layer, op) for layer in ("1", "4") for op in ("input", "weight", "grad_output")]
    assert all(r["amax"] > 0 and r["fallback"] is False for r in rows)
    text = str(table)
    assert text.splitlines()[0].split() == ["layer", "operand", "amax", "saturated", "underflow", "nonfinite",
                                            "sqnr_db", "fallback", "backend", "window"]
    assert re.search(r"^4\s+grad_output\s+\S+\s+0\.00%\s+0\.00%\s+0\s+-\s+no\s+emulated\s+open$", text, re.M)


@pytest.mark.parametrize("judge", ["guard", "controller"])
def test_stats_right_after_a_check_show_the_window_it_closed(judge):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _net()
        checker = fp8.Guard(every=2) if judge == "guard" else mixprec.Controller(every=2)
        model = fp8.convert(model, **{judge: checker})
    for step in range(2):
        model(torch.randn(3, 16, generator=torch.Generator().manual_seed(step))).sum().backward()
        if step == 0:
            checker.step()
    open_rows = fp8.stats(model).to_list()  # the window of steps 1 and 2, not checked yet
    assert {r["window"] for r in open_rows} == {"open"} and all(r["amax"] > 0 for r in open_rows)
    checker.step()  # the check: reads and resets the windows
    assert all(not st.stats.any() for st in fp8.layer_states(model).values())
    last_rows = fp8.stats(model).to_list()
    assert last_rows == [{**r, "window": "last"} for r in open_rows]
    assert str(fp8.stats(model)).splitlines()[1].endswith("last")
    model(torch.randn(3, 16)).sum().backward()  # a forward after the check: the new window again
    assert {r["window"] for r in fp8.stats(model).to_list()} == {"open"}


@pytest.mark.slow
def test_public_surface_and_light_import():
    for name in fp8.__all__:
        assert not name.startswith("_") and getattr(fp8, name) is not None
    code = "import sys, mixprec, mixprec.fp8; print('torchao' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# --- nothing selected: a warning that says why; a root Linear with children ----------------------

@pytest.mark.parametrize("model,kwargs,why", [
    (lambda: nn.Sequential(nn.Conv2d(3, 3, 1), nn.ReLU()), {},
     "the model has no nn.Linear or Linear-equivalent (transformers Conv1D) layer"),
    (lambda: nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16)), {},
     "the only eligible layers ('0', '1') are the model's first and last, kept in the compute dtype by "
     "first_last='keep'; pass first_last='fp8' to include them"),
    (lambda: nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 16)), {"names": "^x$"},
     "names='^x$' matches none of the 3 nn.Linear or Linear-equivalent (transformers Conv1D) layers (e.g. '0', '1', '2')"),
    (lambda: nn.Sequential(nn.Linear(10, 20), nn.Linear(20, 10)), {"first_last": "fp8"},
     "none of the 2 nn.Linear or Linear-equivalent (transformers Conv1D) layers is eligible (in and out features "
     "multiples of 16; each one's reason is in its own warning)"),
    (lambda: nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 16)), {"names": "^0$"},
     "the only eligible layers matching names ('0') are the model's first and last, kept in the compute dtype by "
     "first_last='keep'; pass first_last='fp8' to include them"),
])
def test_selecting_no_layer_warns_once_per_model_saying_why(model, kwargs, why):
    m = model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert fp8.select_layers(m, **kwargs) == []
        assert fp8.select_layers(m, **kwargs) == []  # the policy selects at every outermost call
    messages = [str(w.message) for w in caught if "no layer selected" in str(w.message)]
    assert messages == [f"fp8: no layer selected, nothing runs in fp8: {why}"]


def test_a_policy_and_convert_that_select_nothing_warn_once():
    import mixprec

    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            with mixprec.autocast("cpu", policy=mixprec.Policy.fp8()):
                model(torch.randn(2, 16))
        assert fp8.convert(model, filter_fn=lambda m, fqn: fqn == "x") is model
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2 and "first and last" in messages[0]
    assert messages[1] == ("fp8.convert: no layer converted, nothing runs in fp8: filter_fn chose none of "
                           "the 2 nn.Linear and Conv1D layers")


def test_convert_refuses_a_root_linear_with_children_before_changing_anything():
    root = nn.Linear(16, 16)
    root.extra = nn.Linear(16, 16)
    with pytest.raises(ValueError, match=r"the root module is a Linear with children \(extra\), which converting "
                                         r"it would drop; convert its parent module"):
        fp8.convert(root, filter_fn=lambda m, fqn: True)
    assert type(root.extra) is nn.Linear and fp8.layer_states(root) == {}
    assert type(fp8.convert(root, filter_fn=lambda m, fqn: fqn != "").extra) is fp8.Float8Linear


def test_convert_says_which_selected_subclasses_it_does_not_swap():
    class Scaled(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    model = nn.Sequential(nn.Linear(16, 16), Scaled(16, 16), nn.Linear(16, 16), nn.Linear(16, 16))
    with pytest.warns(UserWarning, match=r"fp8.convert: layer '1' \(Scaled\) is selected, but convert swaps only "
                                         r"nn.Linear and transformers Conv1D modules"):
        fp8.convert(model)
    assert [type(m).__name__ for m in model] == ["Linear", "Scaled", "Float8Linear", "Linear"]


WRAPPERS = {
    "torch.compile": torch.compile,
    "DataParallel": nn.DataParallel,
}


@pytest.mark.parametrize("wrap", WRAPPERS.values(), ids=WRAPPERS.keys())
def test_a_wrapped_model_is_converted_under_the_bare_model_names(wrap):
    """``fp8.convert(torch.compile(model))``: ``filter_fn`` and the layers' states see the bare
    model's names, as a policy and the Guard, Controller and export name them (before,
    ``_orig_mod.2``: a filter on ``"2"`` converted nothing, and said so only as "no layer")."""
    model = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Sequential(nn.Linear(32, 16)))
    seen = []
    fp8.convert(wrap(model), "tensorwise", filter_fn=lambda m, fqn: seen.append(fqn) or fqn == "2.0")
    assert seen == ["0", "2.0"]
    assert type(model[0]) is nn.Linear and type(model[2][0]).__name__ == "Float8Linear"
    assert fp8.layer_state(model[2][0]).name == "2.0"
