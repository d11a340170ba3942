"""fp8 on fake CUDA devices of compute capability 8.0, 8.9, 9.0 and 10.0: which GEMMs reach
``torch._scaled_mm`` (whose meta function checks every argument: layouts, scale shapes, dtypes),
with what, and which run emulated; the FSDP2 fp8 all-gather's hooks on CUDA. Forward only
(backward cannot be faked, see _fake_cuda.py)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import mixprec
from mixprec import fp8
from mixprec.formats import _fsdp

from _fake_cuda import HostReads, cuda_module, fake_cuda, fake_mode  # noqa: F401

FP8_GPUS = [(8, 9), (9, 0), (10, 0)]


@pytest.fixture
def scaled_mm(monkeypatch):
    """Records each ``torch._scaled_mm`` call (then runs it: the meta function checks it)."""
    calls = []
    original = torch._scaled_mm

    def spy(a, b, *, scale_a, scale_b, out_dtype=None, use_fast_accum=False, **kwargs):
        out = original(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype,
                       use_fast_accum=use_fast_accum, **kwargs)
        calls.append(SimpleNamespace(a=(tuple(a.shape), a.stride(), a.dtype), b=(tuple(b.shape), b.stride(), b.dtype),
                                     scale_a=tuple(scale_a.shape), scale_b=tuple(scale_b.shape),
                                     out_dtype=out_dtype, fast_accum=use_fast_accum, out=out.dtype))
        return out

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    return calls


def _linear(m, k, n, dtype, recipe, backend="auto"):
    with fake_mode(), torch.no_grad():
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        w = torch.randn(n, k, device="cuda", dtype=dtype)
        out = fp8.linear(x, w, recipe=fp8.as_recipe(recipe), backend=backend)
        return out.shape, out.dtype, out.device.type


@pytest.mark.parametrize("capability", FP8_GPUS, ids=lambda c: f"sm{c[0]}{c[1]}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_tensorwise_and_rowwise_reach_scaled_mm(fake_cuda, scaled_mm, capability, dtype):
    fake_cuda.set_capability(capability)
    e4m3 = torch.float8_e4m3fn
    assert _linear(32, 64, 48, dtype, "tensorwise") == (torch.Size([32, 48]), dtype, "cuda")
    (call,) = scaled_mm
    # a row-major, b column-major (the meta function's "mat2 must be col_major"), inverse scales
    assert call.a == ((32, 64), (64, 1), e4m3) and call.b == ((64, 48), (1, 64), e4m3)
    # torchao's tensorwise recipe: the output GEMM with fast accumulation, in the input's dtype
    assert call.scale_a == call.scale_b == () and call.out_dtype == dtype and call.fast_accum
    scaled_mm.clear()
    assert _linear(32, 64, 48, dtype, "rowwise") == (torch.Size([32, 48]), dtype, "cuda")
    (call,) = scaled_mm
    assert call.a == ((32, 64), (64, 1), e4m3) and call.b == ((64, 48), (1, 64), e4m3)
    assert call.scale_a == (32, 1) and call.scale_b == (1, 48)
    # torchao's rule: the rowwise kernel without fast accumulation has no fp32 output, and its
    # scales are applied after the GEMM; output in bf16, then cast
    assert call.out_dtype == torch.bfloat16 and call.out == torch.bfloat16


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_below_sm89_runs_emulated(fake_cuda, scaled_mm, recipe):
    fake_cuda.set_capability((8, 0))
    assert _linear(32, 64, 48, torch.bfloat16, recipe) == (torch.Size([32, 48]), torch.bfloat16, "cuda")
    assert scaled_mm == []
    with pytest.raises(ValueError, match="compute capability 8.9"):
        _linear(32, 64, 48, torch.bfloat16, recipe, backend="scaled_mm")


@pytest.mark.parametrize("m,k,n", [(17, 72, 40), (32, 72, 48), (32, 64, 40), (17, 64, 48)])
def test_dims_not_multiples_of_16_fall_back_unpadded(fake_cuda, scaled_mm, m, k, n):
    """No padding: a linear with a dimension that is not a multiple of 16 runs emulated. M (the
    tokens) too: torch._scaled_mm takes M=17 in the forward, but the grad_weight GEMM contracts
    over the tokens, where it needs a multiple of 16."""
    assert _linear(m, k, n, torch.bfloat16, "tensorwise") == (torch.Size([m, n]), torch.bfloat16, "cuda")
    assert scaled_mm == []
    with pytest.raises(ValueError, match="multiple of 16"):
        _linear(m, k, n, torch.bfloat16, "tensorwise", backend="scaled_mm")


@pytest.mark.parametrize("recipe", ["mxfp8", "blockwise"])
def test_block_recipes_below_their_hardware_run_emulated(fake_cuda, scaled_mm, recipe):
    """At 8.9 no block-scaled GEMM exists (MXFP8 needs sm100, blockwise sm90): emulated, and
    ``backend="scaled_mm"`` names the capability it needs (tests/fp8/test_native_gemm.py: where
    they run natively)."""
    fake_cuda.set_capability((8, 9))
    assert _linear(32, 128, 128, torch.bfloat16, recipe) == (torch.Size([32, 128]), torch.bfloat16, "cuda")
    assert scaled_mm == []
    with pytest.raises(ValueError, match="compute capability .* this device has 8.9"):
        _linear(32, 128, 128, torch.bfloat16, recipe, backend="scaled_mm")


def _mlp():
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64),
                         nn.ReLU(), nn.Linear(64, 16))


@pytest.mark.parametrize("capability,expected", [((8, 0), 0), ((9, 0), 2)], ids=["sm80", "sm90"])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_policy_fp8_layers_on_cuda(fake_cuda, scaled_mm, capability, expected, recipe):
    """Policy.fp8: the middle layers (first and last kept) reach _scaled_mm on sm90, with their
    statistics recorded on the device and no host read."""
    fake_cuda.set_capability(capability)
    policy = mixprec.Policy.parse("compute=bf16").fp8(recipe)
    with fake_mode(), torch.no_grad(), HostReads() as reads:
        model = cuda_module(_mlp)
        with mixprec.autocast("cuda", policy=policy):
            out = model(torch.randn(16, 32, device="cuda"))
        states = fp8.layer_states(model)
    assert reads.count == 0, reads.sites
    assert out.dtype == torch.bfloat16 and out.device.type == "cuda"
    assert len(scaled_mm) == expected
    assert sorted(states) == ["2", "4"] and all(s.device.type == "cuda" for s in states.values())


@pytest.mark.parametrize("capability", FP8_GPUS, ids=lambda c: f"sm{c[0]}{c[1]}")
def test_converted_layers_on_cuda(fake_cuda, scaled_mm, capability):
    fake_cuda.set_capability(capability)
    with fake_mode(), torch.no_grad(), HostReads() as reads:
        model = fp8.convert(cuda_module(_mlp), "rowwise")
        out = model(torch.randn(16, 32, device="cuda", dtype=torch.bfloat16).float())
    assert reads.count == 0, reads.sites
    layers = [m for m in model.modules() if isinstance(m, fp8.Float8Linear)]
    assert len(layers) == len(scaled_mm) >= 2
    assert out.dtype == torch.float32 and all(c.scale_a == (16, 1) for c in scaled_mm)


def test_fsdp_fp8_all_gather_hooks_on_cuda(fake_cuda, scaled_mm, monkeypatch):
    """FSDP2's pre/post all-gather hooks on a CUDA shard, the all-reduce of the amax stubbed (NCCL
    cannot run here): uint8 bytes padded to the shard size, a GatheredFloat8Weight on CUDA that
    the sm90 GEMM takes as the cast weight (no second cast)."""
    reduced = []
    monkeypatch.setattr(_fsdp.dist, "all_reduce", lambda t, op=None, group=None: reduced.append(t.device.type))
    mesh = SimpleNamespace(size=lambda: 2, get_group=lambda: None)
    recipe = fp8.Float8Recipe.tensorwise()
    with fake_mode(), torch.no_grad(), HostReads() as reads:
        layer = cuda_module(lambda: nn.Linear(64, 48, bias=False))
        fp8.layer_state(layer)
        shard = torch.randn(23, 64, device="cuda")  # rank 1 of 48 rows over 2 ranks, uneven: 23 of 24
        weight = _fsdp.Float8AllGatherWeight(shard, recipe.weight, recipe.pow2_scales)
        (data,), meta = weight.fsdp_pre_all_gather(mesh, torch.Size([47, 64]), (64, 1), layer, None)
        gathered, _ = weight.fsdp_post_all_gather((torch.empty(48, 64, dtype=torch.uint8, device="cuda"),), meta,
                                                  torch.bfloat16)
        out = fp8.linear(torch.randn(32, 64, device="cuda", dtype=torch.bfloat16), gathered, recipe=recipe)
    assert reads.count == 0, reads.sites
    assert reduced == ["cuda"]
    assert (data.dtype, tuple(data.shape), data.device.type) == (torch.uint8, (24, 64), "cuda")
    assert isinstance(gathered, _fsdp.GatheredFloat8Weight) and gathered.dtype == torch.bfloat16
    assert gathered.device.type == "cuda" and gathered._data.dtype == torch.float8_e4m3fn
    (call,) = scaled_mm
    assert call.b == ((64, 48), (1, 64), torch.float8_e4m3fn) and out.dtype == torch.bfloat16


def test_scaled_mm_meta_rules_behind_the_fallback(fake_cuda):
    """What the fallback rule stands on: torch._scaled_mm's checks take M=17 but refuse K=72 and
    N=40 and a row-major mat2; the backward's grad_weight GEMM has the tokens as its K."""
    def mm(m, k, n, col_major=True):
        with fake_mode():
            a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
            b = (torch.randn(n, k, device="cuda").t() if col_major else torch.randn(k, n, device="cuda"))
            b = b.to(torch.float8_e4m3fn)
            s = torch.ones((), device="cuda")
            return torch._scaled_mm(a, b, scale_a=s, scale_b=s, out_dtype=torch.bfloat16).shape

    assert mm(17, 64, 48) == (17, 48)
    for args, match in [((32, 72, 48), "divisible by 16"), ((32, 64, 40), "divisible by 16"),
                        ((48, 32, 17), "divisible by 16"),  # grad_weight of M=17 tokens: K=17
                        ((32, 64, 48, False), "col_major")]:
        with pytest.raises(RuntimeError, match=match):
            mm(*args)


@pytest.mark.parametrize("cost_rows", [None, 4])
def test_controller_loss_cost_on_cuda_reads_no_host(fake_cuda, cost_rows):
    """``Controller(max_loss_cost=...)`` on CUDA: the forward's float32 reference GEMM, the recipe
    below's emulated one (NVFP4 under tensorwise), the sums the backward hook adds and the
    per-step fold of the estimates stay on the device, without a host read between checks but
    the one read of each early step (``_early``: from the 3rd step of the first window; the hook
    is called by hand: autograd cannot run on fake CUDA tensors); ``cost_rows`` of the 16: the
    rows drawn from the step's device copy, on the device."""
    from mixprec.control._cost import sampled_rows
    from mixprec.control._ladder import _accumulate_cost, output_errors

    fake_cuda.set_capability((9, 0))
    ctl = mixprec.Controller(every=10, ladder=("nvfp4", "tensorwise", "compute"), per_gemm=True, floor="nvfp4",
                             max_loss_cost=1e-3, cost_row_share=1.0 if cost_rows is None else cost_rows / 16)
    with fake_mode(), HostReads() as reads:
        model = fp8.convert(cuda_module(_mlp), "tensorwise", filter_fn=lambda m, n: True, controller=ctl,
                            backend="emulate_fp32")
        x = torch.randn(16, 32, device="cuda")
        model(x)  # tracks the layers
        rec, layer = ctl._layers["0"], model[0]
        for step in range(3):
            out = model[0](x)
            rows = sampled_rows(16, cost_rows, rec.cost_step_t, "cuda")
            errors = output_errors(rec, x, layer.weight, layer.bias, out, rows=rows)
            _accumulate_cost(rec.cost, errors, torch.randn(16, 64, device="cuda"), rows=rows, total=16)
            ctl.step(loss_scale=torch.ones((), device="cuda"))
            if step == 1:
                assert reads.count == 0, reads.sites
    assert dict(reads.sites) == {"mixprec/control/_early.py:promote_early": 1}
    size = 16 if cost_rows is None else cost_rows
    assert [(row, e.shape, e.dtype, e.device.type) for row, e in errors] == [
        (0, (size, 64), torch.float32, "cuda"), (1, (size, 64), torch.float32, "cuda")]
    assert cost_rows is None or (rows.device.type, rows.shape) == ("cuda", (4,))
    assert rec.forward_below.fp4 and all(r.cost.device.type == "cuda" for r in ctl._layers.values())


_AFTER_FAKE_CUDA = """
import torch
from _fake_cuda import cuda_patches, fake_mode, patched
from mixprec.formats._fp4 import decode_e2m1

with patched(cuda_patches((9, 0))), fake_mode():
    torch.randn(4, device="cuda")  # (Dynamo's map of torch's functions is built by now)


class Decode(torch.autograd.Function):
    @staticmethod
    def forward(ctx, codes, x):
        return x + decode_e2m1(codes)

    @staticmethod
    def backward(ctx, grad):
        return None, grad


compiled = torch.compile(lambda c, x: Decode.apply(c, x), backend="eager", fullgraph=True)
print(compiled(torch.tensor([1, 9], dtype=torch.uint8), torch.zeros(2, requires_grad=True)).tolist())
"""


@pytest.mark.slow
def test_a_fake_cuda_block_leaves_compiled_fp4_code_traceable():
    """The fake-CUDA patches replace ``torch.tensor``; Dynamo's map of torch's functions, cached
    for the process, must hold the real one (built before the patches), or every later compile of
    an fp4 decode in an ``autograd.Function`` finds ``torch.tensor`` "skipped" (a fresh process:
    the map is built once)."""
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", _AFTER_FAKE_CUDA], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0 and run.stdout.strip().endswith("[0.5, -0.5]"), run.stderr[-3000:]
