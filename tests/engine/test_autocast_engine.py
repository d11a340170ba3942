"""Engine v2: PyTorch's kernels wherever the policy agrees, Python kernels only for edits, no
collateral cost or change for plain torch.autocast, complete policy values."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

import mixprec
from mixprec import Policy
from mixprec.engine import kernels

from _native_required import kernels_missing

HERE = Path(__file__).resolve().parents[1]  # tests/


def _python(code: str) -> str:
    """Run ``code`` in a fresh interpreter (a process whose dispatcher we know); its stdout."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr
    return out.stdout


# ----------------------------------------------------------------------- native where it agrees
@pytest.mark.slow
def test_default_policy_runs_pytorchs_kernels_only():
    out = _python("""
        import torch, mixprec
        from mixprec.engine import kernels
        m = torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
        for dt in (torch.bfloat16, torch.float16):
            with mixprec.autocast("cpu", dtype=dt):
                m(torch.randn(2, 3, 8)).sum().backward()
            with mixprec.autocast("cpu", policy=mixprec.Policy.default("cpu").keep(types=torch.nn.LayerNorm)):
                m(torch.randn(2, 3, 8))
        print(len(kernels.registered("cpu")), len(kernels._libs))
    """)
    assert out.split() == ["0", "0"]


@pytest.mark.slow
def test_a_policy_registers_kernels_for_its_edits_only():
    out = _python("""
        import torch, mixprec
        from mixprec.engine import kernels
        p = mixprec.Policy().with_ops(fp32=["softmax"], lower=["bmm"])
        with mixprec.autocast("cpu", policy=p):
            torch.softmax(torch.randn(2, 2), -1)
        print(sorted(kernels.registered("cpu")), sorted(p.edits("cpu")))
    """)
    registered, edits = out.strip().split("] [")
    assert registered + "]" == "[" + edits  # same list
    assert "'softmax.int'" in registered and "'mm'" not in registered


@pytest.mark.slow
def test_plain_torch_autocast_is_bitwise_unchanged_before_and_after_mixprec_regions():
    """Every CPU-table sample, plus softmax (edited below): torch.autocast before any mixprec
    kernel exists, then after regions with edited policies, then after release_kernels()."""
    out = _python("""
        import torch
        from _op_samples import SAMPLES, flatten
        samples = {**SAMPLES, "softmax": [lambda dt: torch.softmax(torch.randn(4, 4).to(dt), -1)]}

        def run():
            res = {}
            for name, fns in samples.items():
                for i, fn in enumerate(fns):
                    torch.manual_seed(0)
                    try:
                        with torch.autocast("cpu", dtype=torch.bfloat16):
                            res[(name, i)] = [t.detach() for t in flatten(fn(torch.bfloat16))]
                    except RuntimeError as e:
                        res[(name, i)] = str(e)
            return res

        before = run()
        import mixprec
        policies = [mixprec.Policy.preset("fp32-numerics"), mixprec.Policy().with_ops(
            fp32=["softmax", "mm"], passthrough=["cat", "addmm"], promote=["conv2d"])]
        for p in policies:
            with mixprec.autocast("cpu", policy=p):
                for fns in samples.values():
                    for fn in fns:
                        try:
                            fn(torch.bfloat16)
                        except RuntimeError:
                            pass
        assert mixprec.engine.kernels.registered("cpu")
        after = run()
        mixprec.release_kernels()
        released = run()
        for got in (after, released):
            for k, ref in before.items():
                o = got[k]
                assert type(o) is type(ref), k
                if isinstance(ref, str):
                    assert o == ref, k
                    continue
                assert len(o) == len(ref), k
                for a, b in zip(o, ref):
                    assert a.dtype == b.dtype and a.shape == b.shape, k
                    assert torch.equal(a, b) or (a.isnan() == b.isnan()).all() and torch.equal(
                        a.nan_to_num(), b.nan_to_num()), k
        print(len(before), len(mixprec.engine.kernels.registered("cpu")))
    """)
    n, left = out.split()
    assert int(n) > 127 and left == "0"


@pytest.mark.slow
def test_native_and_python_kernels_agree_bitwise():
    """Every CPU-table sample under the CUDA table, the fp32-numerics preset and a policy with
    every kind of edit: the C++ kernel and the Python kernels give the same dtypes and bits."""
    outs = {}
    for flag in ("1", "0"):
        env = {**os.environ, "MIXPREC_NATIVE_KERNELS": flag,
               "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
        out = subprocess.run([sys.executable, str(HERE / "_native_vs_python.py")], capture_output=True,
                             text=True, env=env, timeout=900)
        assert out.returncode == 0, out.stderr
        outs[flag] = out.stdout.strip().splitlines()[-1]
    if "'native'" not in outs["1"]:
        kernels_missing(f"the C++ kernel could not be built here: {outs['1']}")
    assert outs["0"].startswith("['python']")
    assert outs["1"].split()[-1] == outs["0"].split()[-1]


def test_edited_ops_run_the_cpp_kernel_fp8_routing_included(native_ops):
    x = torch.randn(4, 4).bfloat16()
    policy = Policy().with_ops(fp32=["softmax"]).fp8()  # fp8: linear's C++ kernel calls a route op
    with mixprec.autocast("cpu", policy=policy):
        assert torch.softmax(x, -1).dtype == torch.float32
    assert kernels._registered[("softmax.int", "AutocastCPU")] == "native"
    assert kernels._registered[("linear", "AutocastCPU")] == "native"  # Python only in fp8 regions
    assert "linear" in kernels._routes
    with torch.autocast("cpu"):  # outside the region: PyTorch's kind (softmax on no CPU list)
        assert torch.softmax(x, -1).dtype == torch.bfloat16


def test_release_kernels_and_regions_register_again():
    p = Policy().with_ops(fp32=["exp"])
    x = torch.randn(3).bfloat16()
    with mixprec.autocast("cpu", policy=p):
        assert torch.exp(x).dtype == torch.float32
        with pytest.raises(RuntimeError, match="1 in this thread.*after the regions exit"):
            mixprec.release_kernels()
    if threading.active_count() > 1:  # a thread left by another test (tqdm's monitor): refused
        pytest.skip("other threads are alive: release_kernels() refuses (tests/engine/test_dispatch_threads.py)")
    assert mixprec.release_kernels() >= 1
    assert not kernels.registered("cpu")
    with torch.autocast("cpu"):
        assert torch.exp(x).dtype == torch.bfloat16
    with mixprec.autocast("cpu", policy=p):
        assert torch.exp(x).dtype == torch.float32
    assert "exp" in kernels.registered("cpu")


def test_edited_op_follows_the_innermost_region():
    x = torch.randn(4, 4).bfloat16()
    edited = Policy().with_ops(fp32=["softmax"])
    with mixprec.autocast("cpu", policy=edited):
        assert torch.softmax(x, -1).dtype == torch.float32
        with mixprec.autocast("cpu"):  # the default policy inside: PyTorch's CPU list
            assert torch.softmax(x, -1).dtype == torch.bfloat16
        with torch.autocast("cpu", dtype=torch.float16):  # not a policy: the edit still holds
            assert torch.softmax(x, -1).dtype == torch.float32
        with mixprec.autocast("cpu", enabled=False):
            assert torch.softmax(x, -1).dtype == torch.bfloat16
    with torch.autocast("cpu"):
        assert torch.softmax(x, -1).dtype == torch.bfloat16


@pytest.mark.parametrize("kind,expected", [("fp32", torch.float32), ("lower", torch.bfloat16),
                                           ("passthrough", torch.float32)])
def test_each_kind_of_edit_on_a_non_composite_op(kind, expected):
    a = torch.randn(3, 3)  # bmm/mm have real kernels: redispatched below autocast
    policy = Policy().with_ops(**{kind: ["mm"]})
    with mixprec.autocast("cpu", policy=policy):
        out = torch.mm(a.bfloat16() if kind == "fp32" else a, a)
    assert out.dtype == expected
    ref = {"fp32": torch.mm(a.bfloat16().float(), a), "lower": torch.mm(a.bfloat16(), a.bfloat16()),
           "passthrough": torch.mm(a, a)}[kind]
    assert torch.equal(out, ref)


def test_edit_to_fp32_of_a_composite_op_keeps_its_internals_in_fp32():
    """linear is CompositeImplicit: PyTorch's kernels run it with autocast excluded, so the
    addmm it calls is not lowered again; ours must do the same."""
    x, w, b = torch.randn(3, 4), torch.randn(5, 4), torch.randn(5)
    with mixprec.autocast("cpu", policy=Policy().with_ops(fp32=["linear"])):
        out = nn.functional.linear(x, w, b)
    assert out.dtype == torch.float32 and torch.equal(out, nn.functional.linear(x, w, b))


# ----------------------------------------------------------------------- module rules
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        return self.b(self.a(x))


def _dtypes_seen(model, fn):
    seen = {}
    hooks = [m.register_forward_hook(lambda m, i, o, n=n: seen.__setitem__(n, o.dtype))
             for n, m in model.named_modules() if n]
    try:
        fn()
    finally:
        for h in hooks:
            h.remove()
    return seen


def test_name_rules_see_submodules_swapped_or_added_between_calls():
    m = Block()
    x = torch.randn(2, 4)
    policy = Policy().keep(names=r"^a$")
    region = lambda: mixprec.autocast("cpu", policy=policy)  # noqa: E731

    def call():
        with region():
            m(x)

    assert _dtypes_seen(m, call) == {"a": torch.float32, "b": torch.bfloat16}
    m.a, m.b = m.b, m.a  # the module now under the name "a" is the old b
    assert _dtypes_seen(m, call) == {"a": torch.float32, "b": torch.bfloat16}
    m.a = nn.Sequential(nn.Linear(4, 4))  # added: "a" and "a.0" are new modules
    assert _dtypes_seen(m, call) == {"a": torch.float32, "a.0": torch.float32, "b": torch.bfloat16}


def test_outer_module_rules_and_output_are_suspended_in_a_nested_region():
    m = Block()
    x = torch.randn(2, 4)
    outer = Policy(output=torch.float16).keep(types=nn.Linear)

    def call():
        with mixprec.autocast("cpu", policy=outer):
            with mixprec.autocast("cpu"):  # the innermost region's policy governs: no rules
                return m(x)

    assert _dtypes_seen(m, call) == {"a": torch.bfloat16, "b": torch.bfloat16}
    assert call().dtype == torch.bfloat16
    with mixprec.autocast("cpu", policy=outer):  # and apply again once it exits
        assert m(x).dtype == torch.float16
        with torch.autocast("cpu"):  # torch.autocast is not a policy: outer rules still hold
            assert _dtypes_seen(m, lambda: m(x)) == {"a": torch.float32, "b": torch.float32}


# ----------------------------------------------------------------------- policies are values
def test_table_is_read_only_and_edits_are_against_pytorchs_table():
    table = Policy().table("cpu")
    with pytest.raises(TypeError):
        table["mm"] = "fp32"  # type: ignore[index]
    with mixprec.autocast("cpu"):
        assert torch.mm(torch.randn(2, 2), torch.randn(2, 2)).dtype == torch.bfloat16
    assert dict(Policy().edits("cpu")) == {}
    assert dict(Policy().with_ops(passthrough=["mm"]).edits("cpu")) == {"mm": "passthrough"}
    assert len(Policy.preset("fp32-numerics").edits("cpu")) > 40


def _full_policy() -> Policy:
    return (Policy.parse("params=bf16,compute=fp16,output=f32,preset=fp32-numerics")
            .with_ops(fp32=["softmax", torch.exp], lower=["bmm"], passthrough=["cat"])
            .keep(types=(nn.LayerNorm, nn.Embedding))
            .keep(names=r"^head$", dtype="bf16"))


def test_policy_round_trips_through_json_and_files(tmp_path):
    p = _full_policy()
    assert Policy.from_json(p.to_json()) == p
    assert Policy.parse(p.to_json()) == p
    assert Policy.from_dict(json.loads(json.dumps(p.to_dict()))) == p
    p.save(tmp_path / "policy.json")
    assert Policy.load(tmp_path / "policy.json") == p
    (tmp_path / "report.json").write_text(json.dumps({"risks": [], "policy": p.to_dict()}))
    assert Policy.load(tmp_path / "report.json") == p
    # and the loaded value behaves: the kept module runs in float32 in a region
    m = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    with mixprec.autocast("cpu", policy=Policy.load(tmp_path / "policy.json")):
        assert _dtypes_seen(m, lambda: m(torch.randn(2, 4))) == {"0": torch.float16, "1": torch.float32}


def test_policy_json_errors_say_what_to_do():
    class Local(nn.Module):
        pass

    with pytest.raises(ValueError, match="names="):
        Policy().keep(types=Local).to_json()
    with pytest.raises(ValueError, match="not an importable nn.Module"):
        Policy.from_dict({"module_rules": [{"types": ["torch.nn.NoSuchLayer"]}]})
    with pytest.raises(ValueError, match="unknown policy field"):
        Policy.from_dict({"computee": "bf16"})
    with pytest.raises(ValueError, match="not a policy in JSON"):
        Policy.from_json("{not json")


def test_preset_typo_lists_the_presets_and_suggests():
    with pytest.raises(ValueError, match="Did you mean 'fp32-numerics'.*Presets: torch, fp32-numerics"):
        mixprec.autocast("cpu", policy="fp32-numercs")
    with pytest.raises(ValueError, match="Did you mean 'bf16'"):
        Policy.parse("bf61")


def test_to_low_precision_honours_policy_params():
    m = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    mixprec.to_low_precision(m, policy=Policy(params=torch.float16).keep(names=r"^2$"))
    assert [p.dtype for p in m.parameters()] == [torch.float16] * 4 + [torch.float32] * 2
    m = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    mixprec.to_low_precision(m, policy="params=bf16")  # no rules: norms stay fp32 as by default
    assert [p.dtype for p in m.parameters()] == [torch.bfloat16] * 2 + [torch.float32] * 2
    with pytest.raises(ValueError, match="params=float32"):
        mixprec.to_low_precision(m, policy=Policy())
    with pytest.raises(ValueError, match="dtype=torch.float16 and policy.params=torch.bfloat16"):
        mixprec.to_low_precision(m, torch.float16, policy="params=bf16")
