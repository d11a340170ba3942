"""Policies: parsing, presets, op edits and module rules, each with a test that fails if ignored."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec import Policy
from mixprec.ops import default_table


# ------------------------------------------------------------------ values
def test_parse_jmp_style():
    p = Policy.parse("params=float32,compute=bfloat16,output=float32")
    assert (p.params, p.compute, p.output) == (torch.float32, torch.bfloat16, torch.float32)
    q = Policy.parse("p=f32,c=half,o=bf16")
    assert (q.params, q.compute, q.output) == (torch.float32, torch.float16, torch.bfloat16)
    assert Policy.parse("bf16").compute is torch.bfloat16
    assert Policy.parse("fp32-numerics").base == "fp32-numerics"
    assert Policy.parse(str(p)) == p


@pytest.mark.parametrize("spec, match", [
    ("params=float33", "unknown dtype"),
    ("compute=bf16,compute=f16", "given twice"),
    ("weights=f32", "unknown policy key"),
    ("compute=int8", "unknown dtype"),
])
def test_parse_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        Policy.parse(spec)


def test_policies_are_immutable_hashable_values():
    p = Policy.default("cpu")
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.compute = torch.float16
    q = p.with_ops(fp32=["mm"])
    assert p != q and p.op_rules == () and hash(q)
    assert dataclasses.replace(q, compute=torch.float16).op_rules == q.op_rules
    with pytest.raises(ValueError, match="must be torch.float32, torch.bfloat16 or torch.float16"):
        Policy(compute=torch.int8)
    with pytest.raises(ValueError, match="preset"):
        Policy(base="fast")
    with pytest.raises(ValueError, match="op tables"):
        Policy.default("tpu")


def test_default_tables_are_pytorch_2_13s():
    cpu, cuda = default_table("cpu"), default_table("cuda")
    assert len(cpu) == 127
    assert len(cuda) == 119 + 0
    assert cpu["mm"] == "lower" and cpu["cross_entropy_loss"] == "fp32" and cpu["cat"] == "promote"
    assert "softmax.int" not in cpu
    assert cuda["softmax.int"] == "fp32_set_opt_dtype" and cuda["norm.Scalar"] == "fp32_append_dtype"
    assert cuda["binary_cross_entropy"] == "banned"


def test_fp32_numerics_preset_keeps_sensitive_ops_fp32_on_cpu():
    p = Policy.preset("fp32-numerics")
    x = torch.randn(4, 8)
    w = torch.randn(8, 8)
    with mixprec.autocast("cpu", policy=p):
        h = x @ w
        assert h.dtype == torch.bfloat16
        assert torch.softmax(h, -1).dtype == torch.float32
        assert F.log_softmax(h, -1).dtype == torch.float32
        assert F.layer_norm(h, (8,)).dtype == torch.float32
        assert h.exp().dtype == torch.float32 and h.pow(2).dtype == torch.float32
        assert h.sum().dtype == torch.float32
    with mixprec.autocast("cpu"):
        assert torch.softmax(x @ w, -1).dtype == torch.bfloat16  # the torch CPU list


# ------------------------------------------------------------------ op edits
def test_with_ops_moves_ops_between_lists():
    x = torch.randn(4, 4)
    p = Policy().with_ops(fp32=[torch.mm, "linear"], lower=["softmax.int", torch.exp],
                          promote=["add.Tensor"], passthrough=[torch.ops.aten.bmm.default])
    with mixprec.autocast("cpu", policy=p):
        assert torch.mm(x, x).dtype == torch.float32
        assert F.linear(x, x).dtype == torch.float32
        assert torch.softmax(x, 0).dtype == torch.bfloat16
        assert torch.exp(x).dtype == torch.bfloat16
        assert (x.bfloat16() + x.bfloat16()).dtype == torch.bfloat16
        assert (x.bfloat16() + x).dtype == torch.float32
        assert torch.bmm(x[None], x[None]).dtype == torch.float32  # left alone
        assert torch.matmul(x, x).dtype == torch.bfloat16  # untouched entries stay


def test_with_ops_lower_matches_a_hand_cast_control_bitwise():
    x = torch.randn(5, 7)
    p = Policy().with_ops(lower=["softmax.int"])
    with mixprec.autocast("cpu", policy=p):
        got = torch.softmax(x, -1)
    assert torch.equal(got, torch.softmax(x.bfloat16(), -1))


def test_fp32_edit_uses_the_dtype_argument_form_where_torch_does():
    p = Policy().with_ops(fp32=["softmax.int"])
    assert p.table("cpu")["softmax.int"] == "fp32_set_opt_dtype"
    x = torch.randn(5, 7).bfloat16()
    with mixprec.autocast("cpu", policy=p):
        got = torch.softmax(x, -1)
    assert got.dtype == torch.float32 and torch.equal(got, torch.softmax(x, -1, dtype=torch.float32))


def test_a_later_edit_of_an_op_wins():
    policy = Policy().with_ops(fp32=["mm"]).with_ops(lower=["mm"]).with_ops(promote=["softmax"], fp32=["exp"])
    assert policy.kind("mm.default", "cpu") == "lower" and policy.kind("exp.default", "cpu") == "fp32"
    assert Policy().with_ops(lower=["exp"]).with_ops(fp32=["exp"]).kind("exp.default", "cpu") == "fp32"


#: (id, the callable listed in fp32=, a call of it on a bfloat16 tensor): each edit reaches the aten op
#: the call runs (torch.norm and Tensor.norm run linalg_vector_norm: their edit did nothing)
CALLABLE_EDITS = [
    ("torch.norm", torch.norm, lambda x: torch.norm(x)),
    ("torch.norm p=1 dim", torch.norm, lambda x: torch.norm(x, p=1, dim=0)),
    ("Tensor.norm", torch.Tensor.norm, lambda x: x.norm(p=3)),
    ("linalg.vector_norm", torch.linalg.vector_norm, lambda x: torch.linalg.vector_norm(x)),
    ("torch.exp", torch.exp, torch.exp),
    ("F.softmax", torch.nn.functional.softmax, lambda x: torch.nn.functional.softmax(x, -1)),
]


@pytest.mark.parametrize("op,call", [c[1:] for c in CALLABLE_EDITS], ids=[c[0] for c in CALLABLE_EDITS])
def test_an_edit_by_callable_reaches_what_the_callable_runs(op, call):
    x = torch.randn(4, 8).bfloat16()
    with mixprec.autocast("cpu", policy=Policy().with_ops(fp32=[op])):
        assert call(x).dtype == torch.float32


def test_unknown_op_names_suggest_close_matches():
    with pytest.raises(ValueError, match="Did you mean: softmax"):
        Policy().with_ops(fp32=["sofmax"])
    with pytest.raises(ValueError, match="no overload"):
        Policy().with_ops(fp32=["softmax.float"])
    with pytest.raises(ValueError, match="both"):
        Policy().with_ops(fp32=["mm"], lower=["mm"])
    with pytest.raises(TypeError):
        Policy().with_ops(fp32=[3])


# ------------------------------------------------------------------ CUDA table on CPU tensors
def _cuda_table_region(**kw):
    return mixprec.autocast("cpu", dtype=torch.float16, policy=Policy.default("cuda"), **kw)


def test_cuda_policy_decisions_on_cpu_tensors():
    x = torch.randn(4, 6)
    h = x.half()
    with _cuda_table_region():
        assert torch.mm(x, x.t()).dtype == torch.float16
        assert torch.mv(x, x[0]).dtype == torch.float16           # not on the CPU list
        assert torch.addmv(x[:, 0], x, x[0]).dtype == torch.float16
        assert torch.einsum("ij,kj->ik", x, x).dtype == torch.float16
        # fp32
        for got, control in [
            (h.exp(), x.half().float().exp()),
            (F.layer_norm(h, (6,)), F.layer_norm(h.float(), (6,))),
            (h.pow(2), h.float().pow(2)),
            (torch.logsumexp(h, 1), torch.logsumexp(h.float(), 1)),
            (F.mse_loss(h, h * 0), F.mse_loss(h.float(), h.float() * 0)),
        ]:
            assert got.dtype == torch.float32 and torch.equal(got, control)
        # fp32_set_opt_dtype: dtype argument set, an explicit one respected
        assert torch.equal(torch.softmax(h, 1), torch.softmax(h, 1, dtype=torch.float32))
        assert torch.softmax(h, 1, dtype=torch.float16).dtype == torch.float16
        assert torch.equal(h.sum(), h.sum(dtype=torch.float32))
        assert torch.equal(h.cumsum(0), h.cumsum(0, dtype=torch.float32))
        assert torch.softmax(h.double(), 1).dtype == torch.float64  # ineligible: untouched
        # fp32_append_dtype
        n = h.norm()
        assert n.dtype == torch.float32 and torch.equal(n, torch.norm(h, dtype=torch.float32))
        assert h.norm(2, 1).dtype == torch.float32
        # promote
        assert torch.addcmul(x, h, h).dtype == torch.float32
        assert torch.addcmul(h, h, h).dtype == torch.float16
        assert torch.dot(h[0], x[0]).dtype == torch.float32
        # banned
        with pytest.raises(RuntimeError, match="unsafe to autocast"):
            F.binary_cross_entropy(torch.rand(3), torch.rand(3))


# ------------------------------------------------------------------ module rules
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.norm = nn.LayerNorm(8)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(2)])
        self.head = nn.Linear(8, 3)
        self.seen: dict[str, torch.dtype] = {}
        for name, m in self.named_modules():
            if isinstance(m, nn.Linear) or isinstance(m, nn.LayerNorm):
                m.register_forward_hook(self._record(name))

    def _record(self, name):
        def hook(mod, args, out):
            self.seen[name] = out.dtype
        return hook

    def forward(self, x):
        x = self.norm(self.inp(x))
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def test_keep_by_type_runs_module_in_fp32():
    net = Net()
    x = torch.randn(2, 6)
    with mixprec.autocast("cpu", policy=Policy().keep(types=(nn.LayerNorm,))):
        net(x)
    assert net.seen["norm"] == torch.float32
    assert net.seen["inp"] == torch.bfloat16 and net.seen["head"] == torch.bfloat16
    with mixprec.autocast("cpu"):
        net(x)
    assert net.seen["norm"] == torch.bfloat16  # without the rule LayerNorm follows its input


def test_keep_by_name_regex_and_no_op_inside_is_lowered():
    net = Net()
    with mixprec.autocast("cpu", policy=Policy().keep(names=r"^blocks\.1$|^head$")):
        out = net(torch.randn(2, 6))
    assert net.seen["blocks.0.0"] == torch.bfloat16
    assert net.seen["blocks.1.0"] == torch.float32 and net.seen["head"] == torch.float32
    assert out.dtype == torch.float32


def test_keep_in_another_half_dtype():
    net = Net()
    policy = Policy(compute=torch.float16).keep(names=r"^head$", dtype="bf16")
    with mixprec.autocast("cpu", policy=policy):
        net(torch.randn(2, 6))
    assert net.seen["inp"] == torch.float16 and net.seen["head"] == torch.bfloat16


def test_keep_matches_a_hand_written_fp32_control_bitwise():
    torch.manual_seed(0)
    net = Net()
    x = torch.randn(2, 6)
    with mixprec.autocast("cpu", policy=Policy().keep(names=r"^head$")):
        got = net(x)
    with torch.autocast("cpu"):
        h = net.norm(net.inp(x))
        for b in net.blocks:
            h = b(h)
    control = net.head(h.float())
    assert torch.equal(got, control)


def test_output_dtype_casts_what_the_model_returns():
    net = Net()
    with mixprec.autocast("cpu", policy="compute=bf16,output=f32"):
        out = net(torch.randn(2, 6))
        assert net.seen["head"] == torch.bfloat16
    assert out.dtype == torch.float32
    with mixprec.autocast("cpu", policy="compute=bf16,output=f16"):
        assert net(torch.randn(2, 6)).dtype == torch.float16


def test_policy_compute_sets_region_dtype_and_a_conflicting_dtype_is_an_error():
    x = torch.randn(3, 3)
    with mixprec.autocast("cpu", policy=Policy(compute=torch.float16)):
        assert torch.mm(x, x).dtype == torch.float16
    with mixprec.autocast("cpu", dtype=torch.float16, policy=Policy(compute=torch.float16)):
        assert torch.mm(x, x).dtype == torch.float16
    with pytest.raises(ValueError, match="dtype=torch.float16 and a policy with compute=torch.bfloat16"):
        mixprec.autocast("cpu", dtype=torch.float16, policy="compute=bf16")


@pytest.mark.slow
def test_module_hooks_exist_only_while_a_rule_region_runs():
    """(Unless a region with rules was traced inside compiled code in this process: its graphs
    guard on the hooks, which then stay; the subprocess below has none.)"""
    import subprocess
    import sys

    code = """
import torch, mixprec
from torch import nn
from torch.nn.modules import module as m
before = (len(m._global_forward_pre_hooks), len(m._global_forward_hooks))
with mixprec.autocast("cpu", policy=mixprec.Policy().keep(types=(nn.LayerNorm,))):
    assert len(m._global_forward_pre_hooks) == before[0] + 1
assert (len(m._global_forward_pre_hooks), len(m._global_forward_hooks)) == before
with mixprec.autocast("cpu"):
    assert len(m._global_forward_pre_hooks) == before[0]
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "ok", out.stderr


def test_module_rule_state_is_restored_when_forward_raises():
    class Boom(nn.Module):
        def forward(self, x):
            raise RuntimeError("boom")

    net = nn.Sequential(nn.Linear(2, 2), Boom())
    with mixprec.autocast("cpu", policy=Policy().keep(types=(Boom,))):
        with pytest.raises(RuntimeError, match="boom"):
            net(torch.randn(1, 2))
        assert torch.is_autocast_enabled("cpu")
        assert torch.mm(torch.randn(2, 2), torch.randn(2, 2)).dtype == torch.bfloat16


def test_in_place_and_out_overloads_cannot_be_listed():
    with pytest.raises(ValueError, match="in-place or out="):
        Policy().with_ops(lower=["mm.out"])
    with pytest.raises(ValueError, match="in-place or out="):
        Policy().with_ops(fp32=[torch.ops.aten.add_.Tensor])
    assert "mm.out" not in dict(Policy().with_ops(lower=["mm"]).op_rules)


def test_decorated_function_output_follows_policy_output():
    @mixprec.autocast("cpu", policy="compute=bf16,output=f32")
    def f(a):
        return torch.mm(a, a), [torch.mm(a, a)], torch.arange(3)

    x, (y,), ints = f(torch.randn(2, 2))
    assert x.dtype == torch.float32 and y.dtype == torch.float32 and ints.dtype == torch.int64


# ------------------------------------------------------------------ one validation for every path
def _every_way(rules):
    """The same op rules through the constructor, from_dict, from_json, parse and load."""
    import json

    data = {"op_rules": [list(r) for r in rules]}
    yield lambda: Policy(op_rules=tuple(rules))
    yield lambda: Policy.from_dict(data)
    yield lambda: Policy.from_json(json.dumps(data))
    yield lambda: Policy.parse(json.dumps(data))
    yield lambda: Policy.from_json(json.dumps({"policy": data, "risks": []}))  # an audit's report.json


def test_a_bare_name_in_json_expands_as_with_ops_does():
    x = torch.randn(4, 6).bfloat16()
    for make in _every_way([("softmax", "fp32")]):
        p = make()
        assert p == Policy().with_ops(fp32=["softmax"])
        with mixprec.autocast("cpu", policy=p):
            assert torch.softmax(x, -1).dtype == torch.float32


def test_json_names_the_default_overload_as_the_tables_do():
    p = Policy.from_json('{"op_rules": [["mm", "fp32"]]}')
    assert p.op_rules == (("mm", "fp32"),)  # mm.default only, stable through a round trip
    q = Policy().with_ops(fp32=["mm"])
    assert Policy.from_json(q.to_json()) == q and ("mm.dtype", "fp32") in q.op_rules


@pytest.mark.parametrize("rules, match", [
    ([("add_.Tensor", "fp32")], "in-place or out="),
    ([("mm.out", "lower")], "in-place or out="),
    ([("sofmax", "fp32")], "Did you mean: softmax"),
    ([("mm", "fp16")], "unknown cast kind"),
    ([("mm", "fp32_set_opt_dtype")], "no fp32_set_opt_dtype form"),
    ([("mm",)], "pair"),
    ([("mm", 3)], "pair"),
])
def test_every_way_of_making_a_policy_refuses_what_with_ops_refuses(rules, match):
    for make in _every_way(rules):
        with pytest.raises(ValueError, match=match):
            make()


def test_a_refused_in_place_rule_would_have_lost_the_update():
    """What the validation prevents: add_ routed through a cast writes into a temporary."""
    t = torch.zeros(3, dtype=torch.bfloat16)
    with mixprec.autocast("cpu", policy=Policy().with_ops(fp32=["add.Tensor"])):
        t.add_(1)  # the in-place overload is not edited: the tensor is updated
    assert t.tolist() == [1.0, 1.0, 1.0]


@pytest.mark.slow
def test_module_rule_types_are_never_imported(tmp_path):
    import json
    import subprocess
    import sys

    data = json.dumps({"module_rules": [{"types": ["this.Zen"]}]})
    code = ("import sys, mixprec\n"
            "try:\n"
            f"    mixprec.Policy.from_json({data!r})\n"
            "except ValueError as e:\n"
            "    print('ERROR', e)\n"
            "print('imported' if 'this' in sys.modules else 'not imported')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "The Zen of Python" not in out.stdout
    assert "module 'this' is not imported" in out.stdout and "run `import this`" in out.stdout
    assert out.stdout.strip().endswith("not imported")


def test_module_rule_types_resolve_among_imported_modules():
    p = Policy().keep(types=(nn.LayerNorm,)).fp8(types=(nn.Linear,))
    assert Policy.from_json(p.to_json()) == p
    with pytest.raises(ValueError, match="not an importable nn.Module subclass"):
        Policy.from_dict({"module_rules": [{"types": ["torch.nn.functional.relu"]}]})
    with pytest.raises(ValueError, match="dotted path"):
        Policy.from_dict({"module_rules": [{"types": ["LayerNorm"]}]})


@pytest.mark.parametrize("text, match", [
    ("[" * 100_000, "nested too deeply"),
    ("[1, 2]", "a policy must be an object"),
    ('{"op_rules": {"mm": "fp32"}}', "'op_rules' must be a list"),
    ('{"op_rules": ["mm"]}', r"\[op, kind\] pair"),
    ('{"params": 16}', "dtype name"),
    ('{"module_rules": [["float32", "torch.nn.Linear"]]}', "module rule must be an object"),
    ('{"module_rules": [{"types": "torch.nn.Linear"}]}', "list of type paths"),
    ('{"module_rules": [{"names": "x", "dtypes": "bf16"}]}', "unknown module rule field"),
    ('{"fp8_rule": {"recipe": 8}}', "'recipe' must be a str"),
    ('{"fp8_rule": {"guard": {"every": 1, "often": 2}}}', r"unknown Guard setting\(s\) \['often'\]"),
    ('{"base": ["torch"]}', "'base' must be a str"),
    ('{"policy": [1]}', "a policy must be an object"),
    ("3", "a policy must be an object"),
])
def test_malformed_json_is_a_clear_value_error(text, match):
    with pytest.raises(ValueError, match=match):
        Policy.from_json(text)


def test_the_constructor_validates_rules_and_fields():
    with pytest.raises(ValueError, match="ModuleRules"):
        Policy(module_rules=("LayerNorm",))
    with pytest.raises(ValueError, match="Fp8Rule"):
        Policy(fp8_rule="tensorwise")
    with pytest.raises(ValueError, match="op rules|tuple of"):
        Policy(op_rules="mm")
    assert Policy(op_rules=(("softmax.int", "fp32"),)).op_rules == (("softmax.int", "fp32_set_opt_dtype"),)


# ------------------------------------------------------------------ str
def test_str_shows_what_the_policy_does():
    p = (Policy.parse("compute=bf16,output=f32")
         .with_ops(fp32=["softmax", torch.exp], lower=["bmm.default"], passthrough=["cat"])
         .keep(types=(nn.LayerNorm,)).keep(names=r"^head$", dtype="f16"))
    assert str(p) == ("params=float32,compute=bfloat16,output=float32; "
                      "ops lower=bmm.default fp32=softmax,exp passthrough=cat; "
                      "keep float32=LayerNorm; keep float16=/^head$/")
    assert str(Policy.fp8("tensorwise")) == "params=float32,compute=auto; fp8 tensorwise=Linear except first/last"
    assert str(Policy.parse("bf16").fp8("rowwise", names=r"blocks", first_last="fp8")) == (
        "params=float32,compute=bfloat16; fp8 rowwise=Linear|/blocks/")
    assert "ops fp32=mm.default" in str(Policy().with_ops(fp32=["mm.default"]))


@pytest.mark.parametrize("spec", ["params=float32,compute=auto", "compute=bf16,output=f32,preset=fp32-numerics",
                                  "params=bf16,compute=f16,table=cuda"])
def test_str_of_a_policy_without_edits_parses_back(spec):
    p = Policy.parse(spec)
    assert Policy.parse(str(p)) == p


def test_the_canonical_policy_keeps_its_own_guard_and_controller():
    """Equal policies share one object for Dynamo's guard, but never another policy's live fp8
    guard or controller (the older spelling's object, which equality leaves out): a compiled
    region must not step, or fall back by, a guard the caller did not give."""
    from mixprec import fp8

    guard = fp8.Guard()
    guarded = Policy.parse("compute=bf16").fp8(first_last="fp8", guard=guard)
    settings = Policy.parse("compute=bf16").fp8(first_last="fp8", guard=guard.settings)
    assert guarded == settings and guarded != Policy.parse("compute=bf16").fp8(first_last="fp8")
    assert guarded._canonical is not settings._canonical
    assert guarded._canonical.fp8_rule.live is guard and settings._canonical.fp8_rule.live is None
    assert Policy.parse("compute=bf16").fp8(first_last="fp8", guard={})._canonical is settings._canonical
    other = Policy.parse("compute=bf16").fp8(first_last="fp8", guard=fp8.Guard())
    assert other._canonical.fp8_rule.live is other.fp8_rule.live
