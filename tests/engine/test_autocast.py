"""Region semantics of mixprec.autocast, with torch.autocast as the oracle."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.engine import kernels, runtime

from _count_casts import CountCasts

DTYPES = [torch.bfloat16, torch.float16]


def both(fn, dtype=torch.bfloat16, seed=0, **kw):
    """Run fn() under torch.autocast and mixprec.autocast from the same RNG state."""
    outs = []
    for ctx in (torch.autocast, mixprec.autocast):
        torch.manual_seed(seed)
        with ctx("cpu", dtype=dtype, **kw):
            outs.append(fn())
    return outs


def assert_same(a, b):
    if isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
        return
    if a is None:
        assert b is None
        return
    assert a.dtype == b.dtype
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


# ------------------------------------------------------------------ basics
def test_defaults_follow_torch():
    ac = mixprec.autocast("cpu")
    assert ac.fast_dtype is torch.bfloat16
    with mixprec.autocast("cpu"):
        assert mixprec.is_autocast_enabled("cpu") and torch.is_autocast_enabled("cpu")
        assert mixprec.get_autocast_dtype("cpu") is torch.bfloat16
    assert not mixprec.is_autocast_enabled("cpu")


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="device_type"):
        mixprec.autocast(torch.device("cpu"))
    with pytest.raises(ValueError, match="supports device_type 'cpu' and 'cuda'"):
        mixprec.autocast("tpu")
    with pytest.raises(TypeError, match="policy"):
        mixprec.autocast("cpu", policy=3)
    with pytest.warns(UserWarning, match="not supported"):
        ac = mixprec.autocast("cpu", dtype=torch.float32)
    with ac:
        assert not torch.is_autocast_enabled("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA fallback")
def test_cuda_region_without_cuda_warns_and_disables():
    with pytest.warns(UserWarning, match="CUDA is not available"):
        with mixprec.autocast("cuda"):
            assert not torch.is_autocast_enabled("cuda")


@pytest.mark.parametrize("dt", DTYPES)
def test_only_floating_cpu_non_double_tensors_are_cast(dt):
    def fn():
        a = torch.randn(3, 3)
        return (torch.mm(a, a), torch.mm(a.double(), a.double()),
                torch.cat([a, a.double()]), torch.mm(a.to(dt), a))
    assert_same(*both(fn, dt))
    out = both(fn, dt)[1]
    assert out[0].dtype == dt and out[1].dtype == torch.float64


def test_in_place_and_out_calls_are_not_cast():
    def fn():
        a, b = torch.randn(3, 3), torch.randn(3, 3)
        out = torch.empty(3, 3)
        torch.mm(a, b, out=out)
        c = torch.randn(3, 3)
        c.addmm_(a, b)
        return out, c
    ref, got = both(fn)
    assert_same(ref, got)
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.float32


def test_ops_on_no_list_run_in_the_dtypes_they_get():
    def fn():
        a = torch.randn(4)
        return a.relu(), (a.bfloat16() + a), torch.softmax(a.bfloat16(), 0)
    ref, got = both(fn)
    assert_same(ref, got)
    assert got[1].dtype == torch.float32 and got[2].dtype == torch.bfloat16


def test_promote_mixing_fp16_and_bf16_errors_like_torch():
    a = torch.randn(3)
    with pytest.raises(RuntimeError, match="Unexpected floating ScalarType"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.cat([a.bfloat16(), a.half()])
    with pytest.raises(RuntimeError, match="Unexpected floating ScalarType"):
        with mixprec.autocast("cpu", dtype=torch.bfloat16):
            torch.cat([a.bfloat16(), a.half()])


# ------------------------------------------------------------------ nesting, threads, decorator
def test_nesting_and_inner_disabled_region():
    a = torch.randn(3, 3)
    with mixprec.autocast("cpu"):
        assert torch.mm(a, a).dtype == torch.bfloat16
        with mixprec.autocast("cpu", enabled=False):
            assert torch.mm(a, a).dtype == torch.float32
            with mixprec.autocast("cpu", dtype=torch.float16):
                assert torch.mm(a, a).dtype == torch.float16
            assert torch.mm(a, a).dtype == torch.float32
        assert torch.mm(a, a).dtype == torch.bfloat16
        with torch.autocast("cpu", enabled=False):
            assert torch.mm(a, a).dtype == torch.float32
    assert torch.mm(a, a).dtype == torch.float32
    assert not torch.is_autocast_enabled("cpu")
    assert torch.get_autocast_dtype("cpu") is torch.bfloat16


def test_state_is_restored_after_an_exception():
    with pytest.raises(ZeroDivisionError):
        with mixprec.autocast("cpu", dtype=torch.float16):
            1 / 0
    assert not torch.is_autocast_enabled("cpu")
    assert torch.get_autocast_dtype("cpu") is torch.bfloat16
    assert runtime.top("cpu") is None and runtime.RUNTIME.depth == 0


def test_state_is_thread_local():
    a = torch.randn(3, 3)
    seen = {}

    def other():
        seen["enabled"] = torch.is_autocast_enabled("cpu")
        seen["dtype"] = torch.mm(a, a).dtype

    with mixprec.autocast("cpu"):
        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert torch.mm(a, a).dtype == torch.bfloat16
    assert seen == {"enabled": False, "dtype": torch.float32}


def test_torch_autocast_in_another_thread_is_native_while_a_mixprec_region_runs():
    a = torch.randn(3, 3)
    seen = {}
    policy = mixprec.Policy().with_ops(fp32=["mm"])

    def other():
        with torch.autocast("cpu"):
            seen["dtype"] = torch.mm(a, a).dtype

    with mixprec.autocast("cpu", policy=policy):
        assert torch.mm(a, a).dtype == torch.float32
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert seen["dtype"] == torch.bfloat16


def test_decorator():
    @mixprec.autocast("cpu", dtype=torch.float16)
    def f(a):
        return torch.mm(a, a)

    assert f(torch.randn(2, 2)).dtype == torch.float16
    assert f.__name__ == "f"
    assert not torch.is_autocast_enabled("cpu")


# ------------------------------------------------------------------ cache
def test_weight_casts_are_cached_per_outermost_region():
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with CountCasts() as c, mixprec.autocast("cpu"):
        lin(x)
        first = c.casts
        lin(x)
        assert c.casts - first == 1  # only the activation is cast again
        with mixprec.autocast("cpu"):
            lin(x)
        assert c.casts - first == 2
    assert first == 3
    assert not runtime.RUNTIME.cache  # cleared on the outermost exit


def test_cache_disabled_casts_every_time():
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with CountCasts() as c, mixprec.autocast("cpu", cache_enabled=False):
        lin(x)
        lin(x)
    assert c.casts == 6


#: the oracle's count: ``torch.autocast`` in a process that never imports mixprec (in this one an
#: earlier test's policy may have given ``linear`` a Python kernel, which then serves a plain
#: ``torch.autocast`` region too when the C++ kernels are off: ``MIXPREC_NATIVE_KERNELS=0``)
_TORCH_CAST_COUNT = """
import sys, torch
from torch import nn
from _count_casts import CountCasts
lin, x = nn.Linear(4, 4), torch.randn(2, 4)
with CountCasts() as c, torch.autocast("cpu"):
    lin(x), lin(x), lin(x.detach())
assert "mixprec" not in sys.modules
print(c.casts)
"""


@pytest.mark.slow
def test_cast_counts_match_torch():
    tests = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}
    oracle = subprocess.run([sys.executable, "-c", _TORCH_CAST_COUNT], capture_output=True, text=True, check=True,
                            env=env, timeout=300)
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with CountCasts() as c, mixprec.autocast("cpu"):
        lin(x), lin(x), lin(x.detach())
    assert c.casts == int(oracle.stdout) == 5  # (x three times, the weight and the bias once: the cache)


def test_casts_made_under_no_grad_keep_a_grad_fn_later():
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with mixprec.autocast("cpu"):
        with torch.no_grad():
            lin(x)
        y = lin(x)
    y.float().sum().backward()
    assert lin.weight.grad is not None and lin.weight.grad.dtype == torch.float32


def test_inference_mode_casts_are_not_reused():
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with mixprec.autocast("cpu"):
        with torch.inference_mode():
            lin(x)
        y = lin(x)
    assert not y.is_inference()
    y.float().sum().backward()
    assert lin.weight.grad is not None


# ------------------------------------------------------------------ autograd
@pytest.mark.parametrize("dt", DTYPES)
def test_backward_runs_in_forward_dtypes_and_param_grads_are_fp32(dt):
    grads = []
    for ctx in (torch.autocast, mixprec.autocast):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.LayerNorm(8), nn.Linear(8, 3))
        x = torch.randn(5, 6)
        with ctx("cpu", dtype=dt):
            loss = F.cross_entropy(model(x), torch.tensor([0, 1, 2, 0, 1]))
        assert loss.dtype == torch.float32
        loss.backward()
        grads.append([p.grad for p in model.parameters()])
    for g_ref, g in zip(*grads):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, g_ref, rtol=0, atol=0)


# ------------------------------------------------------------------ composites
def _grads_equal(models):
    for pa, pb in zip(models[0].parameters(), models[1].parameters()):
        assert (pa.grad is None) == (pb.grad is None)
        if pa.grad is not None:
            assert pa.grad.dtype == pb.grad.dtype
            torch.testing.assert_close(pa.grad, pb.grad, rtol=0, atol=0)


def _compare_module(make, inputs, dt, train=True, backward=True):
    models, outs = [], []
    for ctx in (torch.autocast, mixprec.autocast):
        torch.manual_seed(0)
        m = make().train(train)
        args = inputs()
        with ctx("cpu", dtype=dt):
            out = m(*args)
        out0 = out[0] if isinstance(out, tuple) else out
        if backward:
            out0.float().square().mean().backward()
        models.append(m)
        outs.append(out)
    assert_same(outs[0], outs[1])
    if backward:
        _grads_equal(models)
    return outs[1]


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("train", [True, False])
def test_multihead_attention(dt, train):
    out = _compare_module(lambda: nn.MultiheadAttention(8, 2, batch_first=True),
                          lambda: (torch.randn(2, 5, 8),) * 3, dt, train, backward=train)
    assert out[0].dtype == dt


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("train", [True, False])
def test_transformer_encoder_and_decoder_layers(dt, train):
    enc = _compare_module(
        lambda: nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True),
        lambda: (torch.randn(2, 5, 8),), dt, train, backward=train)
    dec = _compare_module(
        lambda: nn.TransformerDecoderLayer(8, 2, 16, dropout=0.0, batch_first=True),
        lambda: (torch.randn(2, 5, 8), torch.randn(2, 4, 8)), dt, train, backward=train)
    assert enc.dtype == torch.float32 or enc.dtype == dt  # layer_norm output on CPU
    assert dec.shape == (2, 5, 8)


def test_transformer_encoder_eval_fast_path_under_no_grad():
    def make():
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()

    outs = []
    for ctx in (torch.autocast, mixprec.autocast):
        torch.manual_seed(0)
        m = make()
        x = torch.randn(2, 5, 8)
        with torch.no_grad(), ctx("cpu"):
            outs.append(m(x))
    assert_same(*outs)


@pytest.mark.parametrize("dt", DTYPES)
def test_einsum_sdpa_interpolate(dt):
    def fn():
        a, b = torch.randn(2, 3, 4), torch.randn(2, 4, 5)
        q = torch.randn(1, 2, 4, 8)
        img = torch.randn(1, 2, 4, 4)
        return (torch.einsum("bij,bjk->bik", a, b),
                F.scaled_dot_product_attention(q, q, q, is_causal=True),
                F.interpolate(img, scale_factor=2, mode="bilinear"),
                F.interpolate(img.to(dt), scale_factor=2, mode="nearest"))
    ref, got = both(fn, dt)
    assert_same(ref, got)
    assert got[0].dtype == dt and got[1].dtype == dt


@pytest.mark.parametrize("dt", DTYPES)
def test_conv_net_with_batchnorm_and_losses(dt):
    def make():
        return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))

    models, losses = [], []
    for ctx in (torch.autocast, mixprec.autocast):
        torch.manual_seed(0)
        m = make()
        x, y = torch.randn(2, 3, 6, 6), torch.tensor([0, 2])
        with ctx("cpu", dtype=dt):
            logits = m(x)
            loss = (F.cross_entropy(logits, y) + F.mse_loss(logits, torch.zeros_like(logits))
                    + F.binary_cross_entropy_with_logits(logits, torch.ones_like(logits)))
        loss.backward()
        models.append(m)
        losses.append((logits, loss))
    assert_same(*losses)
    assert losses[1][1].dtype == torch.float32
    _grads_equal(models)


# ------------------------------------------------------------------ custom_fwd / custom_bwd
class _MyMM(torch.autograd.Function):
    @staticmethod
    @mixprec.custom_fwd(device_type="cpu")
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        ctx.fwd_dtype = torch.mm(a, b).dtype
        return torch.mm(a, b)

    @staticmethod
    @mixprec.custom_bwd(device_type="cpu")
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        ctx.bwd_enabled = torch.is_autocast_enabled("cpu")
        return torch.mm(g, b.t()), torch.mm(a.t(), g)


class _MyFp32MM(torch.autograd.Function):
    @staticmethod
    @mixprec.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        ctx.inside = torch.is_autocast_enabled("cpu")
        return a.mm(b)

    @staticmethod
    @mixprec.custom_bwd(device_type="cpu")
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return g.mm(b.t()), a.t().mm(g)


def test_custom_fwd_bwd_replay_the_forward_state():
    a = torch.randn(3, 3, requires_grad=True)
    b = torch.randn(3, 3, requires_grad=True)
    with mixprec.autocast("cpu"):
        out = _MyMM.apply(a, b)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert a.grad.dtype == torch.float32


def test_custom_fwd_cast_inputs_runs_fp32_with_autocast_off():
    a = torch.randn(3, 3, requires_grad=True)
    with mixprec.autocast("cpu"):
        out = _MyFp32MM.apply(a.bfloat16(), a)
    assert out.dtype == torch.float32
    out.sum().backward()
    assert a.grad is not None
    out2 = _MyFp32MM.apply(a.bfloat16(), a.bfloat16())  # outside a region: untouched
    assert out2.dtype == torch.bfloat16


def test_custom_fwd_requires_a_device_type_string():
    with pytest.raises(ValueError, match="device_type"):
        mixprec.custom_fwd(device_type=torch.device("cpu"))


# ------------------------------------------------------------------ isolation from torch.autocast
def test_plain_torch_autocast_is_unchanged_after_mixprec_with_edited_policy():
    policy = mixprec.Policy().with_ops(fp32=["mm", "linear"], lower=["softmax"],
                                       passthrough=["cat"])
    a = torch.randn(3, 3)
    with mixprec.autocast("cpu", policy=policy):
        assert torch.mm(a, a).dtype == torch.float32
        assert torch.softmax(a, 0).dtype == torch.bfloat16
        assert torch.cat([a, a.bfloat16()]).dtype == torch.float32  # type promotion only
    with torch.autocast("cpu"):
        assert torch.mm(a, a).dtype == torch.bfloat16
        assert torch.softmax(a, 0).dtype == torch.float32
        assert torch.cat([a.bfloat16(), a.bfloat16()]).dtype == torch.bfloat16
    # and PyTorch's cache is still used by torch.autocast (the Python kernels, without the C++
    # build, cast afresh outside mixprec regions: mixprec.engine.kernels)
    lin = nn.Linear(4, 4)
    with CountCasts() as c, torch.autocast("cpu"):
        lin(torch.randn(2, 4)), lin(torch.randn(2, 4))
    python = kernels._registered.get(("linear", "AutocastCPU")) == "python"
    assert c.casts == (6 if python else 4)


@pytest.mark.slow
def test_importing_mixprec_registers_nothing():
    import subprocess
    import sys

    code = ("import torch, mixprec, mixprec.policy, mixprec.engine.region, mixprec.engine.kernels as d;"
            "print(len(d._registered), len(d._libs))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["0", "0"]


def test_ops_unknown_to_torch_stay_fallthrough_for_torch_autocast_after_mixprec_used_them():
    """einsum is on the CUDA list only: once mixprec has a CPU kernel for it, plain torch.autocast
    must still lower the bmm that einsum calls inside, as PyTorch's fallthrough does."""
    a, b = torch.randn(2, 3, 4), torch.randn(2, 4, 5)
    with mixprec.autocast("cpu", dtype=torch.float16, policy=mixprec.Policy.default("cuda")):
        assert torch.einsum("bij,bjk->bik", a, b).dtype == torch.float16
    with torch.autocast("cpu"):
        assert torch.einsum("bij,bjk->bik", a, b).dtype == torch.bfloat16


def test_passthrough_composite_still_autocasts_its_internals():
    """An op moved to passthrough behaves like an op on no list: the op itself is not cast,
    but the ops it calls inside are (here linear's matmul is lowered by the mm/addmm rules)."""
    x, w = torch.randn(3, 4), torch.randn(5, 4)
    policy = mixprec.Policy().with_ops(passthrough=["linear"])
    with mixprec.autocast("cpu", policy=policy):
        out = F.linear(x, w)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, torch.mm(x.bfloat16(), w.t().bfloat16()))


def test_torch_autocast_nested_in_a_mixprec_region_sets_the_dtype_and_cache():
    a = torch.randn(3, 3)
    lin = nn.Linear(3, 3)
    with mixprec.autocast("cpu", dtype=torch.bfloat16):
        with torch.autocast("cpu", dtype=torch.float16):
            assert torch.mm(a, a).dtype == torch.float16
        assert torch.mm(a, a).dtype == torch.bfloat16
        with CountCasts() as c, torch.autocast("cpu", cache_enabled=False):
            lin(a), lin(a)
        assert c.casts == 6


def test_checkpoint_recomputes_under_the_forward_policy():
    from torch.utils.checkpoint import checkpoint

    policy = mixprec.Policy().with_ops(fp32=["linear"], lower=["gelu"])
    grads = []
    for use_checkpoint in (False, True):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))
        x = torch.randn(3, 4, requires_grad=True)
        with mixprec.autocast("cpu", policy=policy):
            if use_checkpoint:
                y = checkpoint(m, x, use_reentrant=False, context_fn=mixprec.checkpoint_context_fn)
            else:
                y = m(x)
        y.float().sum().backward()
        grads.append([x.grad, *(p.grad for p in m.parameters())])
    for a, b in zip(*grads):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert not torch.is_autocast_enabled("cpu")
