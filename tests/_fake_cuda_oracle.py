"""PyTorch's own CUDA autocast over fake CUDA tensors, then mixprec's Python kernels: the oracle
of test_cuda_fake_autocast.py.

    python tests/_fake_cuda_oracle.py OUT.json

First, in a process where mixprec was never imported (no mixprec kernel exists at
``AutocastCUDA``), every case of torch's CUDA autocast test lists under ``torch.autocast("cuda")``
in fp16 and bf16 (and promote ops' optional arguments: ``_fake_cuda.optional_argument_cases``). Then, with ``MIXPREC_NATIVE_KERNELS=0``, the same cases under
``mixprec.autocast`` with the edited policy ``_fake_cuda.EDITS``: its Python kernels.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from _fake_cuda import EDITS, cuda_patches, patched, run_autocast_cases, run_optional_argument_cases

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}

if __name__ == "__main__":
    assert "mixprec" not in sys.modules
    out: dict = {"torch": {}, "python_kernels": {}, "optional": {}}
    with patched(cuda_patches()):
        for name, dtype in DTYPES.items():
            out["torch"][name] = run_autocast_cases(lambda d: torch.autocast("cuda", dtype=d), dtype)
            out["optional"][name] = run_optional_argument_cases(lambda d: torch.autocast("cuda", dtype=d), dtype)
        os.environ["MIXPREC_NATIVE_KERNELS"] = "0"
        import mixprec

        policy = mixprec.Policy.default("cuda").with_ops(**EDITS)
        for name, dtype in DTYPES.items():
            out["python_kernels"][name] = run_autocast_cases(
                lambda d: mixprec.autocast("cuda", dtype=d, policy=policy), dtype)
        out["registered"] = sorted({f"{op}@{key}={impl}" for (op, key), impl in mixprec.engine.kernels._registered.items()})
    with open(sys.argv[1], "w") as f:
        json.dump(out, f)
