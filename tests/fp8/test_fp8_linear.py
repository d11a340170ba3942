"""mixprec.fp8.linear against torchao's emulated Float8Linear (the bitwise oracle), SQNR floors
against fp32, saved-activation bytes, backends, autocast inside, torch.compile."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from mixprec import fp8
from mixprec.fp8 import Float8Recipe

torchao_float8 = pytest.importorskip("torchao.float8")

RECIPES = ["tensorwise", "rowwise", "rowwise_with_gw_hp"]


def _torchao(name: str, lin: nn.Linear) -> nn.Module:
    config = dataclasses.replace(torchao_float8.Float8LinearConfig.from_recipe_name(name), emulate=True)
    return torchao_float8.convert_to_float8_training(nn.Sequential(lin), config=config)[0]  # shares lin's parameters


def _run(fn, lin: nn.Linear, x: torch.Tensor, grad: torch.Tensor):
    lin = copy.deepcopy(lin)
    x = x.detach().clone().requires_grad_()
    y = fn(lin, x)
    y.backward(grad)
    return y, x.grad, lin.weight.grad, None if lin.bias is None else lin.bias.grad


def _case(shape, n, dtype, weight_dtype, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(shape[-1], n, bias=bias).to(weight_dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) * 0.2)
        if bias:
            lin.bias.copy_(torch.randn(n, generator=g))
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    grad = torch.randn(*shape[:-1], n, generator=g).to(dtype)
    return lin, x, grad


GRID = [
    # (input shape, out features, input dtype, weight dtype, bias)
    ((8, 32), 16, torch.float32, torch.float32, True),
    ((2, 5, 48), 24, torch.float32, torch.float32, False),
    ((7, 33), 17, torch.float32, torch.float32, True),       # odd K and N
    ((3, 3, 31), 9, torch.float32, torch.float32, True),
    ((8, 32), 16, torch.bfloat16, torch.bfloat16, True),
    ((2, 5, 33), 17, torch.bfloat16, torch.bfloat16, True),
    ((6, 32), 16, torch.bfloat16, torch.float32, True),       # bf16 activations, fp32 weights
    ((2, 3, 48), 16, torch.float16, torch.float16, False),
    ((160, 128), 144, torch.bfloat16, torch.float32, True),  # operands past formats._blocks.fp8_values' size
]


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("shape,n,dtype,wdtype,bias", GRID)
def test_bitwise_equal_to_torchao(name, shape, n, dtype, wdtype, bias):
    lin, x, grad = _case(shape, n, dtype, wdtype, bias)
    ref = _run(lambda m, t: _torchao(name, m)(t), lin, x, grad)
    ours = _run(lambda m, t: fp8.linear(t, m.weight, m.bias, Float8Recipe.from_name(name)), lin, x, grad)
    for what, a, b in zip(("output", "grad_input", "grad_weight", "grad_bias"), ours, ref):
        if b is None:
            assert a is None
            continue
        assert a.dtype == b.dtype, what
        assert torch.equal(a, b), f"{what} differs from torchao ({name}, {shape}, {dtype})"
    assert ours[0].dtype == dtype


@pytest.mark.parametrize("save_fp8", [True, False])
def test_tensorwise_saved_fp8_gives_torchao_bits(save_fp8):
    """torchao re-casts x and W in backward; the fp8 tensors saved by the forward are the same bits."""
    lin, x, grad = _case((4, 3, 32), 16, torch.bfloat16, torch.float32, True, seed=3)
    recipe = dataclasses.replace(Float8Recipe.tensorwise(), save_fp8=save_fp8)
    ref = _run(lambda m, t: _torchao("tensorwise", m)(t), lin, x, grad)
    ours = _run(lambda m, t: fp8.linear(t, m.weight, m.bias, recipe), lin, x, grad)
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))


def _saved_bytes(fn) -> tuple[int, list[torch.dtype]]:
    total, dtypes = 0, []

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        dtypes.append(t.dtype)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total, dtypes


def test_saved_activations_are_fp8_for_tensorwise():
    m, k, n = 64, 64, 32
    lin = nn.Linear(k, n)
    x = torch.randn(m, k, requires_grad=True)
    ours, dtypes = _saved_bytes(lambda: fp8.linear(x, lin.weight, lin.bias))
    theirs, _ = _saved_bytes(lambda: _torchao("tensorwise", lin)(x))
    plain, _ = _saved_bytes(lambda: lin(x))
    assert ours == m * k + k * n + 2 * 4  # fp8 input and weight, two fp32 scales
    assert dtypes.count(torch.float8_e4m3fn) == 2
    assert theirs == plain == 4 * (m * k + k * n)  # torchao saves high precision, as nn.Linear
    rowwise, _ = _saved_bytes(lambda: fp8.linear(x, lin.weight, lin.bias, Float8Recipe.rowwise()))
    assert rowwise == plain  # rowwise backward needs other casts: high precision is saved


def _sqnr(ref: torch.Tensor, y: torch.Tensor) -> float:
    ref, y = ref.detach().double(), y.detach().double()
    return float(20 * torch.log10(ref.norm() / (ref - y).norm()))


@pytest.mark.parametrize("name,floors", [("tensorwise", (27, 23, 23)), ("rowwise", (27.5, 27.5, 27))])
def test_sqnr_floors_against_fp32(name, floors):
    lin, x, grad = _case((256, 256), 256, torch.float32, torch.float32, False, seed=1)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(256, 256, generator=torch.Generator().manual_seed(2)))
    x, grad = x / 3, grad
    ref = _run(lambda m, t: m(t), lin, x, grad)
    ours = _run(lambda m, t: fp8.linear(t, m.weight, None, Float8Recipe.from_name(name)), lin, x, grad)
    got = [_sqnr(a, b) for a, b in zip(ref[:3], ours[:3])]
    assert all(g >= f for g, f in zip(got, floors)), f"{name}: SQNR {got} dB below floors {floors}"


def test_autocast_is_switched_off_inside():
    lin, x, grad = _case((8, 32), 16, torch.float32, torch.float32, True)
    ref = _run(lambda m, t: fp8.linear(t, m.weight, m.bias), lin, x, grad)
    import mixprec

    for region in (lambda: torch.autocast("cpu", dtype=torch.bfloat16),
                   lambda: mixprec.autocast("cpu", dtype=torch.bfloat16)):
        with region():
            ours = _run(lambda m, t: fp8.linear(t, m.weight, m.bias), lin, x, grad)
        assert ours[0].dtype == torch.float32
        assert all(torch.equal(a, b) for a, b in zip(ours, ref))


def test_bad_arguments_raise():
    x, w = torch.randn(4, 32), torch.randn(16, 32)
    with pytest.raises(ValueError, match="does not fit"):
        fp8.linear(torch.randn(4, 31), w)
    with pytest.raises(ValueError, match="high-precision floating"):
        fp8.linear(x.to(torch.float8_e4m3fn), w)
    with pytest.raises(ValueError, match="backend must be one of"):
        fp8.linear(x, w, backend="cublas")
    with pytest.raises(ValueError, match="Float8Recipe"):
        fp8.linear(x, w, recipe="tensorwise")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="compute capability 8.9"):
            fp8.linear(x, w, backend="scaled_mm")


@pytest.mark.parametrize("name, odd, fits", [("mxfp4", (16, 48), (32, 64)), ("nvfp4", (24, 16), (16, 32)),
                                              ("mxfp8", (32, 48), (32, 64)), ("blockwise", (128, 64), (128, 128))])
def test_features_not_multiples_of_the_blocks_raise(name, odd, fits):
    recipe = Float8Recipe.from_name(name)
    x = torch.randn(4, odd[1])
    with pytest.raises(ValueError, match=rf"{tuple(odd)}.*not multiples of {recipe.block_multiple}, the '{name}'"):
        fp8.linear(x, torch.randn(*odd), recipe=recipe)
    state = fp8.LayerState()
    state.recipe = recipe  # a controller's rung: the same refusal
    with pytest.raises(ValueError, match="not multiples of"):
        fp8.linear(x, torch.randn(*odd), state=state)
    assert fp8.linear(torch.randn(4, fits[1]), torch.randn(*fits), recipe=recipe).shape == (4, fits[0])


def test_auto_backend_emulates_on_cpu():
    lin, x, grad = _case((8, 32), 16, torch.float32, torch.float32, True)
    auto = _run(lambda m, t: fp8.linear(t, m.weight, m.bias, backend="auto"), lin, x, grad)
    emu = _run(lambda m, t: fp8.linear(t, m.weight, m.bias, backend="emulate"), lin, x, grad)
    assert all(torch.equal(a, b) for a, b in zip(auto, emu))


def test_fallback_runs_plain_linear_in_input_dtype():
    lin, x, grad = _case((8, 32), 16, torch.bfloat16, torch.float32, True)
    state = fp8.LayerState()
    state.fallback = True
    ours = _run(lambda m, t: fp8.linear(t, m.weight, m.bias, state=state), lin, x, grad)
    ref = _run(lambda m, t: torch.nn.functional.linear(t, m.weight.bfloat16(), m.bias.bfloat16()), lin, x, grad)
    assert ours[0].dtype == torch.bfloat16
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))
    assert torch.equal(state.stats, torch.zeros(3, 4))


@pytest.mark.cuda
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)),
                    reason="needs a CUDA device of compute capability 8.9+")
@pytest.mark.parametrize("name", RECIPES)
def test_scaled_mm_backend_equals_torchao_on_gpu(name):
    lin, x, grad = _case((32, 64), 48, torch.bfloat16, torch.float32, True)
    lin, x, grad = lin.cuda(), x.cuda(), grad.cuda()
    config = torchao_float8.Float8LinearConfig.from_recipe_name(name)
    ref_mod = torchao_float8.convert_to_float8_training(nn.Sequential(copy.deepcopy(lin)), config=config)[0]
    ref = _run(lambda m, t: ref_mod(t), lin, x, grad)
    ours = _run(lambda m, t: fp8.linear(t, m.weight, m.bias, Float8Recipe.from_name(name), backend="scaled_mm"),
                lin, x, grad)
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])


class _Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 16)

    def forward(self, x):
        h = torch.relu(fp8.linear(x, self.a.weight, self.a.bias, state=fp8.layer_state(self.a)))
        return fp8.linear(h, self.b.weight, self.b.bias, Float8Recipe.rowwise(), state=fp8.layer_state(self.b))


@pytest.mark.slow
def test_compile_fullgraph_bitwise_equal_to_eager_without_recompiles():
    torch.manual_seed(0)
    eager = _Two()
    compiled_mod = copy.deepcopy(eager)
    for mod in (eager, compiled_mod):
        fp8.layer_state(mod.a), fp8.layer_state(mod.b)
    compiled = torch.compile(compiled_mod, fullgraph=True)
    torch._dynamo.reset()
    for step in range(3):
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(step))
        y = eager(x)
        y.square().sum().backward()
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            yc = compiled(x)
        yc.square().sum().backward()
        assert torch.equal(y, yc)
    for name in ("a", "b"):
        assert torch.equal(getattr(eager, name).weight.grad, getattr(compiled_mod, name).weight.grad)
        assert torch.equal(fp8.layer_state(getattr(eager, name)).stats,
                           fp8.layer_state(getattr(compiled_mod, name)).stats)
    assert fp8.layer_state(compiled_mod.b).stats[2, 0] > 0  # backward statistics are recorded


@pytest.mark.parametrize("name", ["tensorwise", "rowwise"])
def test_activation_checkpointing_recomputes_bitwise(name):
    from torch.utils.checkpoint import checkpoint

    lin1, x, _ = _case((2, 4, 32), 32, torch.float32, torch.float32, True, seed=5)
    lin2, _, grad = _case((2, 4, 32), 16, torch.float32, torch.float32, True, seed=6)
    recipe = Float8Recipe.from_name(name)

    def block(t, a, b):
        return fp8.linear(torch.tanh(fp8.linear(t, a.weight, a.bias, recipe)), b.weight, b.bias, recipe)

    outs = []
    for use_ckpt in (False, True):
        a, b = copy.deepcopy(lin1), copy.deepcopy(lin2)
        t = x.clone().requires_grad_()
        y = checkpoint(block, t, a, b, use_reentrant=False) if use_ckpt else block(t, a, b)
        y.backward(grad)
        outs.append((y, t.grad, a.weight.grad, b.weight.grad, a.bias.grad))
    assert all(torch.equal(p, q) for p, q in zip(*outs))
