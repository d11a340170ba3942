"""fp4 recipes in training: stochastic rounding, the Hadamard transform, saved bytes, the
backward GEMMs, per-GEMM composition, statistics, and the recipes wherever fp8's go."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from torch import nn

import mixprec
from mixprec import Policy, fp8
from mixprec.formats._fp4 import E2M1_VALUES, decode_e2m1, encode_e2m1, quantize, rounding_generator
from mixprec.formats._hadamard import hadamard, hadamard_matrix, hadamard_of
from mixprec.formats._recipe import RECIPE_NAMES

MXFP4, NVFP4 = fp8.Float8Recipe.mxfp4(), fp8.Float8Recipe.nvfp4()
NV_PLAIN = fp8.Float8Recipe.nvfp4(hadamard=False, stochastic_rounding=False, weight_block=(1, 16))
HP = fp8.Cast("none")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _run(recipe, x, w, g, state=None):
    x, w = x.clone().requires_grad_(), nn.Parameter(w.clone())
    y = fp8.linear(x, w, None, recipe, state=state)
    y.backward(g)
    return y.detach(), x.grad, w.grad


def _sqnr(ref: torch.Tensor, y: torch.Tensor) -> float:
    ref, y = ref.double(), y.double()
    return float(20 * torch.log10(ref.norm() / (ref - y).norm()))


# ---- stochastic rounding -------------------------------------------------------------------

def test_stochastic_rounding_is_unbiased_over_a_million_draws():
    x = torch.rand(1_000_000, generator=_gen(11)) * 12 - 6  # the whole e2m1 range, both signs
    got = decode_e2m1(encode_e2m1(x, rounding_generator(0, 0, 0, "cpu")))
    grid = torch.tensor(E2M1_VALUES[:8])
    lo = grid[torch.bucketize(x.abs(), grid[1:], right=True)]
    step = grid[torch.bucketize(x.abs(), grid[1:], right=True).clamp(max=6) + 1] - lo
    assert torch.all((got - x).abs() <= step)  # always one of the two neighbours
    assert abs(float(((got - x) / step).mean())) < 1e-3
    nearest = decode_e2m1(encode_e2m1(x))
    assert abs(float(((nearest - x) / step).mean())) < 1e-3  # (symmetric data: RNE's mean is 0 too)
    one = torch.full((1_000_000,), 2.5)  # exactly between 2 and 3: RNE always 2, SR half the time 3
    sr = decode_e2m1(encode_e2m1(one, rounding_generator(1, 0, 0, "cpu")))
    assert abs(float(sr.mean()) - 2.5) < 1e-3 and float(decode_e2m1(encode_e2m1(one)).mean()) == 2.0


def test_stochastic_rounding_seeded_reproducible_global_rng_untouched():
    x = torch.randn(4096, generator=_gen(1)) * 2
    before = torch.get_rng_state()
    a = encode_e2m1(x, rounding_generator(7, 3, 1, "cpu"))
    assert torch.equal(a, encode_e2m1(x, rounding_generator(7, 3, 1, "cpu")))
    assert torch.equal(torch.get_rng_state(), before)
    for other in (rounding_generator(7, 4, 1, "cpu"), rounding_generator(7, 3, 0, "cpu"), rounding_generator(8, 3, 1, "cpu")):
        assert not torch.equal(a, encode_e2m1(x, other))


def test_stochastic_rounding_same_on_every_rank_and_advances_per_step():
    """Two "ranks" (independent states, different global RNG streams) draw the same roundings at
    the same step; a layer's next step draws new ones; only grad_output's casts are stochastic."""
    gen = _gen(2)
    x, w, g = torch.randn(32, 64, generator=gen), torch.randn(32, 64, generator=gen), torch.randn(32, 32, generator=gen)
    runs = []
    for rank_seed in (0, 1):
        torch.manual_seed(rank_seed)
        st = fp8.LayerState()
        runs.append([_run(NVFP4, x, w, g, st) for _ in range(2)])
    for (y0, gx0, gw0), (y1, gx1, gw1) in zip(*runs):
        assert torch.equal(y0, y1) and torch.equal(gx0, gx1) and torch.equal(gw0, gw1)
    (y0, gx0, gw0), (y1, gx1, gw1) = runs[0]
    assert torch.equal(y0, y1)  # the forward has no stochastic cast
    assert not torch.equal(gx0, gx1) and not torch.equal(gw0, gw1)
    off = dataclasses.replace(NVFP4, stochastic_rounding=False)
    st = fp8.LayerState()
    assert torch.equal(_run(off, x, w, g, st)[1], _run(off, x, w, g, st)[1])


# ---- Hadamard transform --------------------------------------------------------------------

def test_hadamard_is_orthogonal_exactly_inverted_and_keeps_products():
    h = hadamard_matrix(0)
    assert torch.equal(h.abs(), torch.full((16, 16), 0.25))
    assert torch.allclose(h @ h.t(), torch.eye(16), atol=1e-7, rtol=0)
    assert not torch.equal(h, hadamard_matrix(1)) and torch.equal(h, hadamard_matrix(0))
    gen = _gen(3)
    a, b = torch.randn(8, 40, generator=gen), torch.randn(6, 40, generator=gen)
    ha = hadamard(a, h)
    assert ha.shape == (8, 48)  # zero-padded to whole blocks of 16
    back = hadamard(ha, h.t())
    assert torch.allclose(back[:, :40], a, atol=1e-6, rtol=0) and back[:, 40:].abs().max() < 1e-6
    assert torch.allclose(ha @ hadamard(b, h).t(), a @ b.t(), atol=1e-5, rtol=0)
    assert torch.allclose(ha.norm(dim=1), a.norm(dim=1), rtol=1e-6, atol=0)


def test_hadamard_of_builds_each_seed_and_device_once_and_a_fresh_one_under_a_mode():
    """The GEMMs' transform: one tensor per seed and device for plain eager operands (the seed's
    own bits, another seed's or device's its own), a normal tensor even when first built under
    inference mode (autograd may save it later); a fresh one under FakeTensorMode and for a
    subclass operand, whose device it takes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.zeros(4, 16)
    with torch.inference_mode():
        first = hadamard_of(7, torch.zeros(4, 16))
    assert not first.is_inference() and hadamard_of(7, x) is first and torch.equal(first, hadamard_matrix(7))
    assert torch.equal(hadamard_of(8, x), hadamard_matrix(8)) and not torch.equal(hadamard_of(8, x), first)
    meta = hadamard_of(7, torch.empty(4, 16, device="meta"))
    assert meta.device.type == "meta" and hadamard_of(7, x) is first
    w = nn.Parameter(torch.randn(16, 16))
    assert hadamard_of(7, w) is first
    with FakeTensorMode() as mode:
        fake = hadamard_of(7, mode.from_tensor(x))
        also = hadamard_of(7, torch.empty(2, 16, device="cuda"))
    assert fake is not first and also.device.type == "cuda" and hadamard_of(7, x) is first


def test_hadamard_of_a_transposed_operand_is_its_contiguous_copys_bitwise():
    """The weight gradient's operands come transposed: each block's 16-term products are the
    same bits as the contiguous operand's (float32 and bfloat16, whole blocks and padded)."""
    h = hadamard_matrix(5)
    for dtype in (torch.float32, torch.bfloat16):
        for rows, cols in ((48, 64), (40, 33)):
            x = (torch.randn(rows, cols, generator=_gen(6)) * 100).to(dtype)
            for strided in (x.t(), x[:, ::2]):
                assert not strided.is_contiguous()
                assert torch.equal(hadamard(strided, h), hadamard(strided.contiguous(), h))


def test_hadamard_spreads_an_outlier_over_its_block():
    """One outlier per block of 16: after the transform every element of the block carries a
    quarter of it (the block's max over its RMS falls from about 4 to about 1), so the block
    scale no longer flushes the other fifteen values."""
    x = torch.randn(64, 256, generator=_gen(4))
    x[:, ::16] = 50.0
    h = hadamard_matrix(0)

    def crest(t):
        b = t.reshape(64, -1, 16)
        return float((b.abs().amax(-1) / b.square().mean(-1).sqrt()).mean())

    assert crest(x) > 3.5 and crest(hadamard(x, h)) < 1.5
    nv = fp8.Cast("e2m1", "1x16")
    flushed = lambda t: float((quantize(t, nv).magnitudes() == 0).float().mean())  # noqa: E731
    assert flushed(x) > 0.5 and flushed(hadamard(x, h)) < 0.1


def test_nvfp4_hadamard_only_touches_the_weight_gradient():
    gen = _gen(5)
    x, w, g = torch.randn(48, 64, generator=gen), torch.randn(32, 64, generator=gen), torch.randn(48, 32, generator=gen)
    with_h = _run(dataclasses.replace(NVFP4, stochastic_rounding=False), x, w, g)
    without = _run(fp8.Float8Recipe.nvfp4(hadamard=False, stochastic_rounding=False), x, w, g)
    assert torch.equal(with_h[0], without[0]) and torch.equal(with_h[1], without[1])
    assert not torch.equal(with_h[2], without[2])
    assert _sqnr(g.t() @ x, with_h[2]) > 10 and _sqnr(g.t() @ x, without[2]) > 10


# ---- backward GEMMs, memory ----------------------------------------------------------------

@pytest.mark.parametrize("recipe", [MXFP4, NV_PLAIN], ids=["mxfp4", "nvfp4"])
def test_backward_gemms_run_in_fp4_by_hand(recipe):
    """Each backward GEMM equals its operands cast by hand (contracted dimension last) and
    multiplied; replaced by Cast('none') it is the high-precision GEMM."""
    gen = _gen(6)
    x, w, g = (torch.randn(40, 64, generator=gen) for _ in range(3))
    w, g = w[:32], torch.randn(40, 32, generator=gen)
    y, gx, gw = _run(recipe, x, w, g)

    def mm(a, ca, b, cb):
        return quantize(a, ca).dequantize(torch.float32) @ quantize(b.contiguous(), cb).dequantize(torch.float32).t()

    assert torch.equal(gx, mm(g, recipe.grad_output, w.t(), recipe.weight_for_grad_input))
    assert torch.equal(gw, mm(g.t(), recipe.grad_output_for_grad_weight, x.t(), recipe.input_for_grad_weight))
    hp = dataclasses.replace(recipe, grad_output=HP, weight_for_grad_input=HP, input_for_grad_weight=HP,
                             grad_output_for_grad_weight=HP)
    y2, gx2, gw2 = _run(hp, x, w, g)
    assert torch.equal(y2, y) and torch.equal(gx2, g @ w) and torch.equal(gw2, g.t() @ x)


def _saved_activation_bytes(fn, weight: torch.Tensor) -> int:
    total = 0

    def pack(t):
        nonlocal total
        if t.data_ptr() != weight.data_ptr():  # the parameter itself: saved by reference, no bytes
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total


@pytest.mark.parametrize("recipe", [MXFP4, NVFP4, NV_PLAIN], ids=["mxfp4", "nvfp4", "nvfp4-plain"])
def test_saved_activations_are_packed_fp4(recipe):
    lin = nn.Linear(256, 128).to(torch.bfloat16)
    x = torch.randn(8, 64, 256, dtype=torch.bfloat16, requires_grad=True)
    bf16 = _saved_activation_bytes(lambda: lin(x), lin.weight)
    assert bf16 == x.numel() * 2
    ours = _saved_activation_bytes(lambda: fp8.linear(x, lin.weight, lin.bias, recipe), lin.weight)
    assert ours <= 0.3 * bf16, ours / bf16
    assert ours >= x.numel() // 2  # the codes themselves: two per byte


# ---- composition, validation, statistics ---------------------------------------------------

def test_per_gemm_composition_fp4_forward_fp8_input_gradient_hp_weight_gradient():
    row = fp8.Cast("e4m3fn", "row")
    mixed = dataclasses.replace(NV_PLAIN, grad_output=fp8.Cast("e5m2", "row"), weight_for_grad_input=row,
                                input_for_grad_weight=HP, grad_output_for_grad_weight=HP, pow2_scales=True)
    assert mixed.fp4
    gen = _gen(7)
    x, w, g = torch.randn(32, 64, generator=gen), torch.randn(32, 64, generator=gen), torch.randn(32, 32, generator=gen)
    y, gx, gw = _run(mixed, x, w, g)
    assert torch.equal(y, _run(NV_PLAIN, x, w, g)[0])
    assert torch.equal(gw, g.t() @ x)
    from mixprec.formats._quant import cast_to_fp8

    gq, gs, _ = cast_to_fp8(g, fp8.Cast("e5m2", "row"), -1, True)
    wq, ws, _ = cast_to_fp8(w.t().contiguous(), row, -1, True)
    assert torch.equal(gx, (gq.float() / gs) @ (wq.float() / ws).t())


def test_fp4_recipe_validation():
    with pytest.raises(ValueError, match="fp4 .'e2m1'. takes the blocks"):
        fp8.Cast("e2m1", "tensor")
    with pytest.raises(ValueError, match="NVFP4's: it needs format='e2m1'"):
        fp8.Cast("e4m3fn", "1x16")
    mx, nv = fp8.Cast("e2m1", "1x32"), fp8.Cast("e2m1", "1x16")
    with pytest.raises(ValueError, match="contracted dimension or in scale format"):
        fp8.Float8Recipe(nv, mx, nv, nv, nv, nv, save_fp8=False)
    with pytest.raises(ValueError, match="cast differently"):
        fp8.Float8Recipe(nv, fp8.Cast("e4m3fn", "1x32"), nv, nv, nv, nv, pow2_scales=True, save_fp8=False)
    with pytest.raises(ValueError, match="save_fp8=False"):
        fp8.Float8Recipe(nv, nv, nv, nv, nv, nv)
    with pytest.raises(ValueError, match="weight_block"):
        fp8.Float8Recipe.nvfp4(weight_block=(32, 32))
    with pytest.raises(ValueError, match="seed"):
        dataclasses.replace(NVFP4, seed=-1)
    with pytest.raises(ValueError, match="hadamard must be a bool"):
        dataclasses.replace(NVFP4, hadamard=1)
    with pytest.raises(ValueError, match="needs a CUDA device of compute capability 10.0 or newer"):
        fp8.linear(torch.randn(32, 32), torch.randn(32, 32), recipe=MXFP4, backend="scaled_mm")


def test_recipes_by_name_and_the_format_neutral_alias():
    assert fp8.Recipe is fp8.Float8Recipe and "Recipe" in fp8.__all__
    assert {"mxfp4", "nvfp4"} <= set(RECIPE_NAMES)
    assert fp8.Float8Recipe.from_name("mxfp4") == MXFP4 == fp8.as_recipe("mxfp4")
    assert fp8.Float8Recipe.from_name("nvfp4") == NVFP4
    assert NVFP4.hadamard and NVFP4.stochastic_rounding and not NVFP4.subnormal_scales
    assert NVFP4.weight.granularity == NVFP4.weight_for_grad_input.granularity == "16x16"
    assert all(c.scale_format == "e8m0" for pair in MXFP4.gemms().values() for c in pair)
    assert MXFP4.multiple == 32 and NVFP4.multiple == 16 and MXFP4.fp4 and not fp8.Float8Recipe().fp4
    assert fp8.Cast("e2m1", "1x16").dtype == torch.float4_e2m1fn_x2


@pytest.mark.parametrize("name", ["mxfp4", "nvfp4"])
def test_policy_files_name_fp4_recipes(name):
    policy = Policy.parse(f"compute=bf16,fp8={name}")
    assert f"fp8 {name}=Linear" in str(policy)
    assert Policy.from_json(policy.to_json()) == policy
    assert Policy.fp8(name).fp8_rule.recipe_name == name


def test_fp4_layer_statistics_count_flushed_codes():
    st = fp8.LayerState()
    x = torch.full((4, 32), 1e-3)
    x[:, 0] = 100.0  # each block: one large value, 31 that round to zero in MXFP4
    w = torch.randn(32, 32, generator=_gen(8))
    fp8.linear(x, w, None, MXFP4, state=st)
    row = st.read()["input"]
    assert row["amax"] == 100.0 and row["underflow"] == pytest.approx(31 / 32)
    assert st.read()["weight"]["underflow"] < 0.2 and st.rounding_step == 1


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64),
                         nn.GELU(), nn.Linear(64, 32))


@pytest.mark.parametrize("name", ["mxfp4", "nvfp4"])
def test_convert_and_policy_train_alike(name):
    x = torch.randn(32, 64, generator=_gen(9))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        converted = fp8.convert(_model(), name)
    assert [n for n, m in converted.named_modules() if isinstance(m, fp8.Float8Linear)] == ["2", "4"]
    routed = _model()
    policy = Policy.parse("compute=bf16").fp8(name)
    results = []
    for model, region in ((converted, lambda: torch.autocast("cpu", torch.bfloat16)),
                          (routed, lambda: mixprec.autocast("cpu", policy=policy))):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with region():
                loss = model(x).float().square().mean()
        loss.backward()
        results.append((loss.detach(), model[2].weight.grad.clone(), model[4].weight.grad.clone()))
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert torch.isfinite(results[0][0]) and results[0][1].abs().sum() > 0
    rows = fp8.stats(routed).to_list()
    assert {r["layer"] for r in rows} == {"2", "4"} and all(r["amax"] > 0 for r in rows)


@pytest.mark.parametrize("recipe,floor", [(MXFP4, 12), (NVFP4, 14), (NV_PLAIN, 14)], ids=["mxfp4", "nvfp4", "nvfp4-plain"])
def test_fp4_sqnr_floors_against_fp32(recipe, floor):
    gen = _gen(10)
    x, w, g = torch.randn(256, 256, generator=gen), torch.randn(128, 256, generator=gen), torch.randn(256, 128, generator=gen)
    y, gx, gw = _run(recipe, x, w, g)
    got = (_sqnr(x @ w.t(), y), _sqnr(g @ w, gx), _sqnr(g.t() @ x, gw))
    assert min(got) > floor, got


@pytest.mark.parametrize("recipe", [MXFP4, NVFP4], ids=["mxfp4", "nvfp4"])
def test_fp16_computes_in_fp32(recipe):
    """fp16 (which torchao's MX refuses): the same casts, the GEMMs in fp32, the results in fp16."""
    gen = _gen(12)
    x, w = torch.randn(64, 64, generator=gen).half(), (torch.randn(32, 64, generator=gen) * 0.1).half()
    g = torch.randn(64, 32, generator=gen).half()
    half, full = _run(recipe, x, w, g), _run(recipe, x.float(), w.float(), g.float())
    assert half[0].dtype == torch.float16 and half[2].dtype == torch.float16
    for a, e in zip(half, full):
        assert torch.equal(a, e.half())


@pytest.mark.parametrize("recipe", [MXFP4, dataclasses.replace(NVFP4, stochastic_rounding=False)],
                         ids=["mxfp4", "nvfp4-no-sr"])
def test_compile_fullgraph_bitwise_eager(recipe):
    """(Stochastic rounding makes a generator per call, which Dynamo does not trace: not fullgraph.)"""
    st = fp8.LayerState()
    w = nn.Parameter(torch.randn(64, 64, generator=_gen(13)))
    x, g = torch.randn(32, 64, generator=_gen(14)), torch.randn(32, 64, generator=_gen(15))

    def run(f):
        w.grad = None
        y = f(x)
        y.backward(g)
        return y.detach(), w.grad.clone(), st.stats.clone()

    f = lambda t: fp8.linear(t, w, None, recipe, state=st, backend="emulate")  # noqa: E731
    eager = run(f)
    st.reset()
    compiled = run(torch.compile(f, fullgraph=True, backend="aot_eager"))
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))
