"""Every overload of PyTorch's CPU autocast table, in bf16 and fp16: same dtypes, same bits.

The reference is computed by ``torch.autocast`` in a subprocess that never imports mixprec
(``_torch_reference.py``), so it is PyTorch's own kernels, whatever this process registered.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mixprec
from mixprec.ops import default_table

from _op_samples import SAMPLES, flatten

CPU_TABLE = default_table("cpu")
HERE = Path(__file__).resolve().parents[1]  # tests/


@pytest.fixture(scope="session")
def torch_reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("oracle") / "reference.pt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
           # the oracle runs with this process's thread count: stft's FFT rounds by thread split
           "MIXPREC_REFERENCE_THREADS": str(torch.get_num_threads())}
    subprocess.run([sys.executable, str(HERE / "_torch_reference.py"), str(path)], check=True,
                   env=env, timeout=600)
    return torch.load(path, weights_only=False)


def _run(ctx, fn, dt):
    torch.manual_seed(0)
    with ctx:
        return flatten(fn(dt))


def test_samples_cover_the_whole_cpu_table():
    assert set(SAMPLES) == set(CPU_TABLE)
    assert len(CPU_TABLE) == 127


@pytest.mark.slow
@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_op_table_is_pytorchs_registered_autocast_kernels(device_type):
    """The data in ops/<device>.py against the kernels PyTorch registers at its autocast key
    (read in a subprocess: this process may hold mixprec kernels there)."""
    key = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}[device_type]
    code = ("import torch; print('\\n'.join(torch._C._dispatch_get_registrations_for_dispatch_key"
            f"('{key}')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    registered = {n.removeprefix("aten::") for n in out.stdout.split()}
    assert set(default_table(device_type)) == registered


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_op_matches_torch_autocast_bitwise(name, dt, torch_reference):
    kind = CPU_TABLE[name]
    dt_name = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dt]
    for i, fn in enumerate(SAMPLES[name]):
        ref = torch_reference[(name, i, dt_name)]
        if isinstance(ref, str):  # e.g. oneDNN has no fp16 LSTM: we must fail the same way
            with pytest.raises(RuntimeError, match=re.escape(ref.splitlines()[0][:40])):
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
            out = flatten(fn(dt))[0]
        if not out.is_floating_point() and not out.is_complex():
            continue
        if kind == "lower":
            assert out.dtype == dt, name
        elif kind.startswith("fp32"):
            assert out.dtype in (torch.float32, torch.complex64), name
