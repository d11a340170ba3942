"""Per-layer fp8 formats: audit(..., fp8="auto") picks the cheapest format each layer passes in,
Policy.fp8(recipes={layer: recipe}) runs each layer in its own (bitwise fp8.linear in that
recipe), as a value (validated, JSON, str); the guard and the controller work per layer."""

from __future__ import annotations

import json
import sys
import types
import warnings

import pytest
import torch
from torch import nn

import mixprec
from mixprec.control._decide import layer_up
from mixprec import Controller, Policy, fp8

R = fp8.Float8Recipe.from_name


class Net(nn.Module):
    """``inp -> a -> b -> c -> out``; ``b``'s input has an outlier feature (0: 1e6) in a block of
    zeros (1..31): a per-tensor or per-row scale flushes the rest of its input, a 1x32 block
    (mxfp8) does not. ``inp`` and ``out`` are the first and last Linear."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.a, self.b, self.c = nn.Linear(32, 128), nn.Linear(128, 128), nn.Linear(128, 128), nn.Linear(128, 128)
        self.out = nn.Linear(128, 16)
        mask, outlier = torch.ones(128), torch.zeros(128)
        mask[:32], outlier[0] = 0.0, 1e6
        self.register_buffer("mask", mask)
        self.register_buffer("outlier", outlier)

    def body(self, x: torch.Tensor, lin) -> torch.Tensor:
        h = torch.tanh(lin("a", torch.tanh(lin("inp", x))))
        h = h * self.mask + self.outlier
        return lin("out", torch.tanh(lin("c", torch.tanh(lin("b", h)))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x, lambda name, h: getattr(self, name)(h))


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 32, generator=g), torch.randn(16, 16, generator=g)


def _loss(m: nn.Module, b) -> torch.Tensor:
    return nn.functional.mse_loss(m(b[0]).float(), b[1])


def _policy(**recipes: str) -> Policy:
    return Policy.parse("compute=bf16").fp8(names=r"^(a|b|c)$", first_last="fp8", recipes=recipes)


def test_auto_picks_tensorwise_for_normal_layers_and_a_block_format_for_the_outlier_layer(tmp_path) -> None:
    model = Net()
    report = mixprec.audit(model, _batch(), _loss, dtypes=(torch.bfloat16,), fp8="auto")
    advice = report.fp8
    assert advice.recipe == "auto" and advice.verified and advice.layers == ("a", "b", "c")
    assert advice.recipes == {"a": "tensorwise", "b": "mxfp8", "c": "tensorwise"}
    assert set(advice.rejected) == {"b"} and list(advice.rejected["b"]) == ["tensorwise", "rowwise"]
    assert all(why.startswith("input underflow = ") for why in advice.rejected["b"].values())
    assert advice.stats["b"]["input"]["underflow"] == 0.0 and advice.stats["b"]["output_sqnr_db"] > 20
    assert advice.stay["inp"].startswith("first or last") and advice.stay["out"].startswith("first or last")
    rule = report.policy.fp8_rule
    assert (rule.recipe, rule.recipes) == ("tensorwise", (("b", "mxfp8"),))
    assert "fp8 (auto): tensorwise 'a', 'c'; mxfp8 'b'" in report.summary_text()  # each format once
    assert "fp8 (auto): 'a' tensorwise, 'b' mxfp8, 'c' tensorwise" in report.summary_text(full=True)
    report.save(tmp_path)
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["fp8"]["recipes"] == advice.recipes and data["fp8"]["rejected"] == advice.rejected
    assert Policy.load(tmp_path / "report.json") == report.policy
    assert fp8.layer_states(model) == {}  # the model as found

    # a single recipe: every fp8 layer in it, no per-layer recipes in the policy
    single = mixprec.audit(model, _batch(), _loss, dtypes=(torch.bfloat16,), fp8="tensorwise").fp8
    assert single.layers == ("a", "c") and single.recipes == {"a": "tensorwise", "c": "tensorwise"}
    assert single.stay["b"].startswith("input underflow = ") and single.rejected == {}


def test_auto_leaves_a_layer_out_when_no_format_passes() -> None:
    model = Net()
    report = mixprec.audit(model, _batch(), _loss, dtypes=(torch.bfloat16,), fp8="auto", underflow_threshold=0.0,
                           fp8_min_sqnr_db=60.0)  # above what fp8 reaches (about 29 dB)
    assert report.fp8.layers == () and report.policy.fp8_rule is None
    why = report.fp8.stay["b"]
    assert why.startswith("no format meets the thresholds: tensorwise: input underflow")
    assert all(f"{f}: " in why for f in ("rowwise", "mxfp8", "blockwise"))


def test_per_layer_policy_runs_each_layer_bitwise_as_fp8_linear_in_its_recipe() -> None:
    model, x = Net(), _batch()[0]
    recipes = {"a": R("tensorwise"), "b": R("mxfp8"), "c": R("blockwise")}

    def ref_lin(name: str, h: torch.Tensor) -> torch.Tensor:  # the region's casts, by hand
        m = getattr(model, name)
        if name in recipes:
            return fp8.linear(h.bfloat16(), m.weight, m.bias, recipes[name])
        return nn.functional.linear(h.bfloat16(), m.weight.bfloat16(), m.bias.bfloat16())

    ref = model.body(x, ref_lin)
    ref.float().square().mean().backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    with mixprec.autocast("cpu", policy=_policy(b="mxfp8", c="blockwise")):
        out = model(x)
    out.float().square().mean().backward()
    assert out.dtype == ref.dtype == torch.bfloat16 and torch.equal(out, ref)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), ref_grads))
    assert sorted(fp8.layer_states(model)) == ["a", "b", "c"]


def test_per_layer_recipes_are_a_value() -> None:
    policy = _policy(b="mxfp8", c="blockwise")
    assert policy.fp8_rule.recipes == (("b", "mxfp8"), ("c", "blockwise"))
    assert policy.fp8_rule.recipe_for("b") == R("mxfp8") and policy.fp8_rule.recipe_for("a") == R("tensorwise")
    assert str(policy) == ("params=float32,compute=bfloat16; fp8 tensorwise=Linear|/^(a|b|c)$/ "
                           "recipes b=mxfp8,c=blockwise")
    back = Policy.from_json(policy.to_json())
    assert back == policy and hash(back) == hash(policy) and str(back) == str(policy)
    assert json.loads(policy.to_json())["fp8_rule"]["recipes"] == {"b": "mxfp8", "c": "blockwise"}
    assert _policy(c="blockwise", b="mxfp8") == policy != _policy(b="mxfp8")
    assert "recipes" not in json.loads(Policy.fp8().to_json())["fp8_rule"]  # none: as before
    named = Policy.fp8(recipes={"b": R("mxfp8")})
    assert json.loads(named.to_json())["fp8_rule"]["recipes"] == {"b": "mxfp8"}

    with pytest.raises(ValueError, match=r"recipes\['b'\]: unknown fp8 recipe 'fp2'"):
        Policy.fp8(recipes={"b": "fp2"})
    with pytest.raises(ValueError, match="recipes must be a mapping"):
        Policy.fp8(recipes=["b"])
    with pytest.raises(ValueError, match="keys must be distinct layer names"):
        Policy.fp8(recipes={0: "mxfp8"})
    custom = Policy.fp8(recipes={"b": fp8.Float8Recipe(name="mine")})
    with pytest.raises(ValueError, match="cannot serialize the custom fp8 recipe"):
        custom.to_json()
    data = json.loads(policy.to_json())
    data["fp8_rule"]["recipes"] = ["b"]
    with pytest.raises(ValueError, match="fp8_rule 'recipes' must be an object"):
        Policy.from_json(json.dumps(data))
    data["fp8_rule"]["recipes"] = {"b": 3}
    with pytest.raises(ValueError, match=r"fp8_rule recipes\['b'\] must be a recipe name"):
        Policy.from_json(json.dumps(data))


@pytest.mark.parametrize("recipes, match", [
    ({"inp": "mxfp8"}, r"name layer\(s\) \['inp'\] that the rule does not select"),
    ({"nope": "mxfp8"}, r"name layer\(s\) \['nope'\] that the rule does not select"),
])
def test_recipes_for_layers_the_rule_does_not_select_are_refused(recipes, match) -> None:
    model = Net()
    with pytest.raises(ValueError, match=match), mixprec.autocast("cpu", policy=Policy.fp8(recipes=recipes)):
        model(_batch()[0])


def test_a_layer_not_eligible_for_its_recipe_is_refused() -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64))
    with pytest.raises(ValueError, match=r"fp8 recipes: layer '1': .*multiples? of 128.*give it another recipe"), \
            mixprec.autocast("cpu", policy=Policy.fp8(recipes={"1": "blockwise"})):
        model(torch.randn(4, 64))
    with mixprec.autocast("cpu", policy=Policy.fp8(recipes={"1": "mxfp8"})):  # 64 = 2 blocks of 32
        model(torch.randn(4, 64))
    assert list(fp8.layer_states(model)) == ["1"]


def _train(model: Net, policy: Policy, steps: int = 2) -> None:
    for _ in range(steps):
        with mixprec.autocast("cpu", policy=policy):
            loss = _loss(model, _batch())
        loss.backward()
        policy.fp8_rule.live.step()


def test_guard_with_per_layer_recipes_decides_per_layer() -> None:
    guard = fp8.Guard(every=1)
    with pytest.warns(fp8.Float8FallbackWarning, match="'b' falls back"):
        _train(Net(), _policy().fp8(names=r"^(a|b|c)$", first_last="fp8", guard=guard))
    assert list(guard.decisions) == ["b"]  # tensorwise flushes b's input
    guard = fp8.Guard(every=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", fp8.Float8FallbackWarning)
        _train(Net(), _policy().fp8(names=r"^(a|b|c)$", first_last="fp8", guard=guard, recipes={"b": "mxfp8"}))
    assert guard.decisions == {}  # in mxfp8, b passes


def test_controller_ladders_start_at_each_layers_recipe() -> None:
    ctl = Controller(every=1)
    model = Net()
    with mixprec.autocast("cpu", policy=_policy().fp8(names=r"^(a|b|c)$", first_last="fp8", controller=ctl,
                                                      recipes={"b": "rowwise"})):
        model(_batch()[0])
    assert ctl.precisions() == {"a": "fp8-tensorwise", "b": "fp8-rowwise", "c": "fp8-tensorwise"}
    ctl = Controller()  # mxfp8 is not a rung of the default ladder: refused, naming the layer and the ladder to pass
    with pytest.raises(ValueError, match="layer 'b''s fp8 recipe 'mxfp8' is not on the controller's ladder .*pass Controller\\(ladder="), \
            mixprec.autocast("cpu", policy=Policy.fp8(controller=ctl, recipes={"b": "mxfp8"})):
        model(_batch()[0])


def test_audit_fp8_auto_arguments() -> None:
    with pytest.raises(ValueError, match="unknown fp8 recipe 'fp2'.*or 'auto'"):
        mixprec.audit(Net(), _batch(), _loss, fp8="fp2")


def test_cli_fp8_auto(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mixprec.diagnostics.cli import audit_command

    module = types.ModuleType("fp8_auto_factories")
    module.net = lambda: (Net(), _batch(), _loss)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    assert audit_command("fp8_auto_factories:net", str(tmp_path / "out"), device_type="cpu", dtypes=["bfloat16"],
                         steps=1, fp8="auto") == 0
    data = json.loads((tmp_path / "out" / "report.json").read_text())
    assert data["fp8"]["recipe"] == "auto" and data["fp8"]["recipes"]["b"] == "mxfp8"


def test_the_controller_climbs_the_audits_ladder_to_the_block_format_the_outlier_layer_needs() -> None:
    """The audit's formats as rungs: on the outlier layer ``b`` (tensorwise and rowwise flush 75%
    of its input, mxfp8 nothing) a controller whose ladder holds mxfp8 promotes ``b`` from
    tensorwise to rowwise to mxfp8 and keeps it in fp8 there; ``a`` and ``c`` stay tensorwise.
    A layer whose features are not multiples of a block rung's blocks skips that rung."""
    ctl = Controller(every=1, ladder=("tensorwise", "rowwise", "mxfp8", "blockwise", "compute"),
                     min_dwell=0, demote_windows=1)
    model = Net()
    policy = _policy().fp8(names=r"^(a|b|c)$", first_last="fp8", controller=ctl)
    x, y = _batch()
    for _ in range(6):
        with mixprec.autocast("cpu", policy=policy):
            loss = nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        model.zero_grad()
        ctl.step()
    assert ctl.precisions() == {"a": "fp8-tensorwise", "b": "fp8-mxfp8", "c": "fp8-tensorwise"}
    assert [(d.layer, d.from_, d.to) for d in ctl.log] == [("b", "fp8-tensorwise", "fp8-rowwise"),
                                                          ("b", "fp8-rowwise", "fp8-mxfp8")]
    # features 48 (a multiple of 16, not of 32 or 128): the block rungs are skipped
    small = nn.Sequential(nn.Linear(48, 48), nn.Tanh(), nn.Linear(48, 48))
    ctl = Controller(every=1, ladder=("tensorwise", "mxfp8", "blockwise", "compute"))
    with mixprec.autocast("cpu", policy=Policy.parse("compute=bf16").fp8(first_last="fp8", controller=ctl)):
        small(torch.randn(4, 48))
    rec = ctl._layers["0"]
    assert rec.allowed == (True, False, False, True) and layer_up(rec) == 3


def test_a_checkpoint_with_a_rung_the_layer_cannot_run_is_refused() -> None:
    def controlled(ladder):
        ctl = Controller(every=1, ladder=ladder)
        model = nn.Sequential(nn.Linear(48, 48), nn.Tanh(), nn.Linear(48, 48))
        with mixprec.autocast("cpu", policy=Policy.parse("compute=bf16").fp8(first_last="fp8", controller=ctl)):
            model(torch.randn(4, 48))
        return ctl

    state = controlled(("tensorwise", "mxfp8", "compute")).state_dict()
    state["layers"]["0"]["rung"] = "mxfp8"  # 48 features: not a multiple of 32
    with pytest.raises(ValueError, match="rung 'mxfp8', whose blocks its features are not multiples of"):
        controlled(("tensorwise", "mxfp8", "compute")).load_state_dict(state)
    with pytest.raises(ValueError, match="rung 'mxfp8' is not on the ladder"):
        controlled(("tensorwise", "rowwise", "compute")).load_state_dict(state)
