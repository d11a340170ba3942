"""Edited-op results under three policies, hashed: run with MIXPREC_NATIVE_KERNELS=1 and =0, the
C++ and the Python kernels must print the same hash (see test_autocast_engine.py)."""

import torch, mixprec, hashlib
from _op_samples import SAMPLES, flatten
h = hashlib.sha1()
policies = [mixprec.Policy.default("cuda"), mixprec.Policy.preset("fp32-numerics"),
            mixprec.Policy().with_ops(fp32=["mm", "softmax"], lower=["exp", "cat"], promote=["conv2d"], passthrough=["addmm"])]
for p in policies:
    for name, fns in sorted(SAMPLES.items()):
        for fn in fns:
            torch.manual_seed(0)
            try:
                with mixprec.autocast("cpu", dtype=torch.float16, policy=p):
                    outs = flatten(fn(torch.float16))
            except RuntimeError as e:
                h.update(str(e).splitlines()[0].encode()); continue
            for t in outs:
                h.update(str(t.dtype).encode()); h.update(t.detach().float().nan_to_num().numpy().tobytes())
print(sorted(set(v for v in mixprec.engine.kernels._registered.values())), h.hexdigest())
