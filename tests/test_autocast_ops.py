"""Every overload of PyTorch's CPU autocast table, in bf16 and fp16: same dtypes, same bits."""

from __future__ import annotations

import re

import pytest
import torch

import mixprec
from mixprec.ops import default_table

from _op_samples import SAMPLES

CPU_TABLE = default_table("cpu")


def _flatten(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _flatten(o)]
    return []


def _run(ctx, fn, dt):
    torch.manual_seed(0)
    with ctx:
        return _flatten(fn(dt))


def test_samples_cover_the_whole_cpu_table():
    assert set(SAMPLES) == set(CPU_TABLE)
    assert len(CPU_TABLE) == 127


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_op_matches_torch_autocast_bitwise(name, dt):
    kind = CPU_TABLE[name]
    for i, fn in enumerate(SAMPLES[name]):
        try:
            ref = _run(torch.autocast("cpu", dtype=dt), fn, dt)
        except RuntimeError as e:  # e.g. oneDNN has no fp16 LSTM: we must fail the same way
            with pytest.raises(type(e), match=re.escape(str(e).splitlines()[0][:40])):
                _run(mixprec.autocast("cpu", dtype=dt), fn, dt)
            continue
        out = _run(mixprec.autocast("cpu", dtype=dt), fn, dt)
        assert len(out) == len(ref) > 0
        for r, o in zip(ref, out):
            assert o.dtype == r.dtype, f"{name} sample {i}: {o.dtype} != {r.dtype}"
            torch.testing.assert_close(o, r, rtol=0, atol=0, equal_nan=True,
                                       msg=lambda m: f"{name} sample {i}: {m}")
        first = out[0]
        # the sample really exercises the cast: the dtype tells which list the op is on
        if kind == "lower" and first.is_floating_point():
            assert first.dtype == dt, name
        if kind == "fp32" and first.is_floating_point():
            assert first.dtype in (torch.float32, torch.complex64), name


CUDA_TABLE = default_table("cuda")
SHARED = sorted(set(SAMPLES) & set(CUDA_TABLE))


def test_cuda_and_cpu_tables_share_enough_ops_to_check_the_cuda_policy():
    assert len(SHARED) >= 30


@pytest.mark.parametrize("name", SHARED)
def test_cuda_policy_decision_on_cpu_tensors(name):
    """The CUDA table, applied to CPU tensors: the output dtype shows the decision."""
    kind = CUDA_TABLE[name]
    policy = mixprec.Policy.default("cuda")
    dt = torch.float16
    for fn in SAMPLES[name]:
        torch.manual_seed(0)
        if kind == "banned":
            with pytest.raises(RuntimeError, match="unsafe to autocast"):
                with mixprec.autocast("cpu", dtype=dt, policy=policy):
                    fn(dt)
            continue
        with mixprec.autocast("cpu", dtype=dt, policy=policy):
            out = _flatten(fn(dt))[0]
        if not out.is_floating_point() and not out.is_complex():
            continue
        if kind == "lower":
            assert out.dtype == dt, name
        elif kind.startswith("fp32"):
            assert out.dtype in (torch.float32, torch.complex64), name
