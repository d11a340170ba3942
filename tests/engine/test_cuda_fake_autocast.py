"""mixprec.autocast("cuda") over fake CUDA tensors: every case of PyTorch's CUDA autocast test lists
in fp16 and bf16 against torch.autocast("cuda"), edited policies on the AutocastCUDA key with the
C++ and the Python kernels, module rules and ``output=``.

The oracle is ``_fake_cuda_oracle.py``, run in a subprocess that computes PyTorch's own CUDA
autocast before mixprec is imported (this process may hold mixprec kernels at AutocastCUDA). The
fake mode runs torch's real AutocastCUDA kernels and meta functions: dtypes, shapes and strides
are checked, values cannot be (see _fake_cuda.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import mixprec
from mixprec import _native
from mixprec.engine import kernels

from _fake_cuda import (EDITS, cuda_module, edited_expectation, fake_cuda, fake_mode, run_autocast_cases,  # noqa: F401
                        run_optional_argument_cases)

HERE = Path(__file__).resolve().parents[1]  # tests/
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    path = tmp_path_factory.mktemp("fake_cuda") / "oracle.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(HERE / "_fake_cuda_oracle.py"), str(path)], env=env,
                          timeout=300, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(path.read_text())


def _mismatches(got: dict[str, str], want: dict[str, str]) -> list[str]:
    assert got.keys() == want.keys()
    return [f"{k}: {got[k]} != {want[k]}" for k in want if got[k] != want[k]]


@pytest.mark.slow  # its oracle is a subprocess
@pytest.mark.parametrize("dt", DTYPES)
def test_default_policy_matches_torch_on_every_cuda_list_case(fake_cuda, oracle, dt):
    got = run_autocast_cases(lambda d: mixprec.autocast("cuda", dtype=d), DTYPES[dt])
    want = oracle["torch"][dt]
    assert len(want) == 181  # every case of AutocastTestLists (test_cuda.py's skips: einsum)
    assert _mismatches(got, want) == []
    # the cases really ran CUDA autocast: the lower list casts to dt, the fp32 list to float32
    assert got["torch_fp16[18] mm (function)"].startswith(f"{DTYPES[dt]} (8, 8)")
    assert got["nn_fp16[0] linear (function)"].startswith(f"{DTYPES[dt]} ")
    assert got["torch_fp32[16] softmax (method)"].startswith("torch.float32 ")
    assert got["banned[0] binary_cross_entropy (function)"].startswith("RuntimeError: torch.nn.functional.binary")
    ran = [k for k, v in want.items() if v.startswith("torch.")]
    assert len(ran) >= 160, "fewer list cases than measured reach a result over fake CUDA tensors"


@pytest.mark.slow  # its oracle is a subprocess
@pytest.mark.parametrize("dt", DTYPES)
def test_edited_policy_on_the_cuda_key_cpp_and_python_kernels(fake_cuda, oracle, dt):
    policy = mixprec.Policy.default("cuda").with_ops(**EDITS)
    got = run_autocast_cases(lambda d: mixprec.autocast("cuda", dtype=d, policy=policy), DTYPES[dt])
    want = edited_expectation(oracle["torch"][dt], DTYPES[dt])
    assert want != oracle["torch"][dt]  # the edits change outcomes
    assert _mismatches(got, want) == [], "kernels of this process"
    assert _mismatches(oracle["python_kernels"][dt], want) == [], "Python kernels (MIXPREC_NATIVE_KERNELS=0)"
    cuda_impls = {impl for (op, key), impl in kernels._registered.items() if key == "AutocastCUDA" and impl}
    if _native.load() is not None:  # a C++ compiler: this process ran the C++ kernels
        assert "native" in cuda_impls and kernels._registered[("mm", "AutocastCUDA")] == "native"
    assert "mm@AutocastCUDA=python" in oracle["registered"]
    assert not any(r.endswith("=native") for r in oracle["registered"])


@pytest.mark.slow  # its oracle is a subprocess
@pytest.mark.parametrize("dt", DTYPES)
def test_promote_weighs_no_optional_argument_once_our_kernel_serves_the_op(fake_cuda, oracle, dt):
    """PyTorch's promote weighs Tensor and Tensor[] arguments only: bilinear's float32 bias leaves
    half inputs in the half dtype (the bias is cast). Once a policy has edited ``bilinear`` on
    CUDA, our kernel (C++ here, Python in the oracle's process) serves it in every region, plain
    ``torch.autocast`` too; until 2026-12-07 it weighed the bias and ran float32."""
    want = oracle["optional"][dt]
    half = str(DTYPES[dt]).removeprefix("torch.")
    assert want[f"bilinear {half} inputs, float32 bias"].startswith(f"torch.{half} ")  # the oracle's rule
    with mixprec.autocast("cuda", dtype=DTYPES[dt], policy=mixprec.Policy().with_ops(fp32=["bilinear"])):
        pass  # registers our kernel for bilinear at AutocastCUDA
    for region in (lambda d: torch.autocast("cuda", dtype=d),
                   lambda d: mixprec.autocast("cuda", dtype=d, policy=mixprec.Policy().with_ops(fp32=["mm"]))):
        assert _mismatches(run_optional_argument_cases(region, DTYPES[dt]), want) == []


def test_module_rules_and_output_on_cuda(fake_cuda):
    policy = (mixprec.Policy.parse("compute=fp16,output=bf16")
              .keep(names=r"^head$")
              .keep(types=(nn.GELU,), dtype=torch.bfloat16))
    seen: dict[str, torch.dtype] = {}
    with fake_mode(), torch.no_grad():
        model = cuda_module(lambda: nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)))
        model.add_module("head", cuda_module(lambda: nn.Linear(16, 8)))
        def record(module, args, output):
            seen[names[module]] = output.dtype

        names = {mod: name for name, mod in model.named_children()}
        for mod in names:
            mod.register_forward_hook(record)
        x = torch.randn(4, 16, device="cuda")
        with mixprec.autocast("cuda", policy=policy):
            out = model(x)
    assert out.device.type == "cuda" and out.dtype == torch.bfloat16  # output=
    assert seen == {"0": torch.float16, "1": torch.bfloat16, "2": torch.float16, "head": torch.float32}


def test_cuda_region_without_cuda_still_warns_and_disables():
    """The fixture changed nothing outside its tests: on this machine CUDA autocast is off."""
    if torch.cuda.is_available():
        pytest.skip("checks the no-CUDA fallback")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with mixprec.autocast("cuda"):
            assert not torch.is_autocast_enabled("cuda")
    assert any("CUDA is not available" in str(w.message) for w in caught)
