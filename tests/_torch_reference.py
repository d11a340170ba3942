"""Compute the bitwise oracle in a process where mixprec never ran: PyTorch's own kernels.

    python tests/_torch_reference.py OUT.pt

Writes ``{(name, sample index, dtype name): outputs | error message}`` for every sample of
``_op_samples.SAMPLES`` under ``torch.autocast("cpu", dtype)``. mixprec is not imported, so no
mixprec kernel exists in this process.
"""

from __future__ import annotations

import os
import sys

import torch

from _op_samples import SAMPLES, flatten

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def reference() -> dict:
    if "MIXPREC_REFERENCE_THREADS" in os.environ:  # the test process's count (stft rounds by thread split)
        torch.set_num_threads(int(os.environ["MIXPREC_REFERENCE_THREADS"]))
    out = {}
    for name, fns in SAMPLES.items():
        for i, fn in enumerate(fns):
            for dt_name, dt in DTYPES.items():
                torch.manual_seed(0)
                try:
                    with torch.autocast("cpu", dtype=dt):
                        out[(name, i, dt_name)] = [t.detach() for t in flatten(fn(dt))]
                except RuntimeError as e:
                    out[(name, i, dt_name)] = str(e)
    return out


if __name__ == "__main__":
    assert "mixprec" not in sys.modules
    torch.save(reference(), sys.argv[1])
    assert "mixprec" not in sys.modules
