"""The experts of a mixture of experts in fp8 and fp4 (``fp8.grouped_linear``, ``fp8.GroupedExperts``).

The oracle is a loop over the experts of ``fp8.linear`` on each expert's rows (one ``LayerState``
each): the grouped GEMMs must cast every expert as that loop does (its statistics windows are
compared bitwise, so are the scales) and compute the same numbers. The GEMMs run through
``grouped_mm`` on other operand layouts than the loop's ``mm``; the outputs and gradients are held
to the error bound of two summation orders of the same products (taken from the run's own
operands: ``K * eps32 * |A| @ |B|`` plus one rounding of the output), and most are bitwise (counted
in the report of the session that wrote this). ``MoE`` is a tiny token-choice layer (router top-k,
tokens sorted by expert, offsets, un-permute) used here and by test_expert_parallel.py.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec import Policy, fp8
from mixprec.fp8 import Float8Recipe

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8", "blockwise", "mxfp4", "nvfp4")
COUNTS = (5, 0, 40, 3)  # an expert without tokens, a skewed one


# ----------------------------------------------------------------- the reference MoE
class MoE(nn.Module):
    """Token-choice top-k MoE over a :class:`fp8.GroupedExperts`: route, sort the tokens by expert
    (stable), run the experts on the sorted tokens, un-permute and weight by the router scores."""

    def __init__(self, dim: int, hidden: int, experts: int, top_k: int = 2) -> None:
        super().__init__()
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = fp8.GroupedExperts(dim, hidden, experts)
        self.top_k = top_k

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        return F.softmax(self.router(x).float(), dim=-1)

    def route(self, x: torch.Tensor, scores: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(sorted tokens, num_tokens_per_expert, token index of each sorted row, its score)``."""
        scores = self.scores(x) if scores is None else scores
        top, idx = torch.topk(scores, self.top_k, dim=-1)
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.experts.num_experts)
        token = order // self.top_k
        return x[token], counts, token, top.reshape(-1)[order]

    def combine(self, y: torch.Tensor, token: torch.Tensor, score: torch.Tensor, n: int) -> torch.Tensor:
        out = torch.zeros(n, y.shape[-1], dtype=y.dtype, device=y.device)
        return out.index_add(0, token, y * score.to(y.dtype).unsqueeze(-1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xs, counts, token, score = self.route(x)
        return self.combine(self.experts(xs, counts), token, score, x.shape[0])


# ----------------------------------------------------------------- helpers
def _loop(x: torch.Tensor, w: torch.Tensor, counts, recipe, states) -> torch.Tensor:
    """The oracle: fp8.linear on each expert's rows."""
    bounds = [0, *torch.tensor(counts).cumsum(0).tolist()]
    return torch.cat([fp8.linear(x[bounds[e]:bounds[e + 1]], w[e], None, recipe, state=states[e])
                      for e in range(w.shape[0])])


def _bound(a: torch.Tensor, b: torch.Tensor, ref: torch.Tensor, k: int) -> torch.Tensor:
    """What two summation orders of the same products may differ by, from the run's operands:
    ``4 K eps32 |a| @ |b|`` (dequantized operands within twice the originals) plus one rounding of
    the output dtype."""
    mag = a.abs().double() @ b.abs().double()
    return 4 * k * torch.finfo(torch.float32).eps * mag + torch.finfo(ref.dtype).eps * ref.abs().double()


def _within(got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> None:
    assert got.dtype == ref.dtype and got.shape == ref.shape
    assert torch.isfinite(got).all()
    excess = (got.double() - ref.double()).abs() - bound
    assert excess.max() <= 0, f"off by {excess.max():.3g} beyond the bound"


def _shapes(name: str) -> tuple[int, int]:
    return (128, 128) if name == "blockwise" else (64, 32)  # (in, out): blockwise takes 128-blocks


def _run_both(name: str, dtype: torch.dtype, counts=COUNTS, seed: int = 0, x: torch.Tensor | None = None):
    torch.manual_seed(seed)
    k, n = _shapes(name)
    recipe = Float8Recipe.from_name(name)
    m = sum(counts)
    x = torch.randn(m, k, dtype=dtype) if x is None else x
    w = torch.randn(len(counts), n, k) * 0.1
    go = torch.randn(m, n, dtype=dtype)
    runs = []
    for grouped in (True, False):
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        states = [fp8.LayerState() for _ in counts]
        if grouped:
            out = fp8.grouped_linear(xg, wg, torch.tensor(counts).cumsum(0), recipe, states=states)
        else:
            out = _loop(xg, wg, counts, recipe, states)
        out.backward(go)
        runs.append((out, xg.grad, wg.grad, states))
    return x, w, go, runs


# ----------------------------------------------------------------- the grouped GEMMs
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", RECIPES)
def test_grouped_linear_is_the_per_expert_loop(name: str, dtype: torch.dtype) -> None:
    x, w, go, ((out, gx, gw, st), (ref, rgx, rgw, rst)) = _run_both(name, dtype)
    for a, b in zip(st, rst):  # the same casts: every expert's window, bitwise (its scales' amaxes too)
        assert torch.equal(a.window, b.window)
    k, n = _shapes(name)
    bounds = [0, *torch.tensor(COUNTS).cumsum(0).tolist()]
    rows = torch.cat([torch.full((c,), e) for e, c in enumerate(COUNTS)])
    wr = w[rows]  # each row's expert weight
    _within(out, ref, (_bound(x.unsqueeze(1), wr.transpose(1, 2), ref.unsqueeze(1), k)).squeeze(1))
    _within(gx, rgx, (_bound(go.unsqueeze(1), wr, rgx.unsqueeze(1), n)).squeeze(1))
    for e in range(len(COUNTS)):
        s = slice(bounds[e], bounds[e + 1])
        _within(gw[e], rgw[e], _bound(go[s].t(), x[s], rgw[e], max(COUNTS[e], 1)))
    assert torch.equal(gw[1], torch.zeros_like(gw[1]))  # no tokens: no gradient, exactly


def test_an_outlier_of_one_expert_leaves_the_others_scales() -> None:
    """Tensorwise: an expert's scale comes from its own rows; an outlier in expert 0's tokens
    changes only expert 0 (outputs, gradients and windows of the others bitwise unchanged)."""
    torch.manual_seed(1)
    x = torch.randn(sum(COUNTS), 64, dtype=torch.bfloat16)
    spiked = x.clone()
    spiked[0, 0] = 3e4  # expert 0's first token
    _, _, _, ((out, gx, gw, st), _) = _run_both("tensorwise", torch.bfloat16, x=x)
    _, _, _, ((out2, gx2, gw2, st2), _) = _run_both("tensorwise", torch.bfloat16, x=spiked)
    b = COUNTS[0]
    assert torch.equal(out[b:], out2[b:]) and torch.equal(gx[b:], gx2[b:]) and torch.equal(gw[1:], gw2[1:])
    assert all(torch.equal(a.window, c.window) for a, c in zip(st[1:], st2[1:]))
    assert float(st2[0].stats[0, 0]) == float(spiked[0, 0]) and not torch.equal(out[:b], out2[:b])


@pytest.mark.parametrize("name", ["tensorwise", "mxfp8", "nvfp4"])
def test_all_tokens_to_one_expert_and_none_at_all(name: str) -> None:
    """Skewed routing (one expert takes every token) and a batch that reaches no expert: finite
    outputs and gradients, zero gradients and untouched windows for the experts without tokens."""
    x, w, go, ((out, gx, gw, st), (ref, rgx, rgw, _)) = _run_both(name, torch.bfloat16, counts=(0, 0, 24, 0))
    assert torch.isfinite(out).all() and torch.isfinite(gx).all() and torch.isfinite(gw).all()
    for e in (0, 1, 3):
        assert torch.equal(gw[e], torch.zeros_like(gw[e])) and torch.equal(st[e].window, fp8.LayerState().window)
    assert float(st[2].stats[0, 0]) == float(x.abs().max())
    _, _, _, ((out, gx, gw, st), _) = _run_both(name, torch.bfloat16, counts=(0, 0, 0, 0))
    assert out.shape == (0, _shapes(name)[1]) and gx.shape[0] == 0
    assert torch.equal(gw, torch.zeros_like(gw)) and all(torch.equal(s.window, fp8.LayerState().window) for s in st)


def test_padding_rows_after_the_last_expert_give_zeros() -> None:
    x = torch.randn(10, 32, requires_grad=True)
    w = torch.randn(2, 16, 32)
    out = fp8.grouped_linear(x, w, torch.tensor([3, 7]))
    ref = _loop(x.detach(), w, (3, 4), Float8Recipe.tensorwise(), [None, None])
    assert torch.equal(out[7:], torch.zeros(3, 16)) and torch.allclose(out[:7], ref, rtol=0, atol=1e-5)
    out.sum().backward()
    assert torch.equal(x.grad[7:], torch.zeros(3, 32))


def test_fallback_and_rung_of_one_expert() -> None:
    """A fallback expert runs in the input's dtype (F.linear on its rows, recording nothing); an
    expert whose state carries a recipe (a Controller's rung) runs that recipe; the others the call's."""
    torch.manual_seed(2)
    x, w = torch.randn(sum(COUNTS), 64, dtype=torch.bfloat16), torch.randn(4, 32, 64) * 0.1
    st = [fp8.LayerState() for _ in COUNTS]
    st[0].route(fallback=True)
    st[2].route(recipe=Float8Recipe.mxfp8())
    out = fp8.grouped_linear(x, w, torch.tensor(COUNTS).cumsum(0), Float8Recipe.rowwise(), states=st)
    hp = F.linear(x[:5], w[0].to(torch.bfloat16))
    mx = fp8.linear(x[5:45], w[2], None, Float8Recipe.mxfp8())
    rw = fp8.linear(x[45:], w[3], None, Float8Recipe.rowwise())
    _within(out[:5], hp, _bound(x[:5], w[0].t(), hp, 64))
    _within(out[5:45], mx, _bound(x[5:45], w[2].t(), mx, 64))
    _within(out[45:], rw, _bound(x[45:], w[3].t(), rw, 64))
    assert torch.equal(st[0].window, fp8.LayerState().window) and float(st[2].stats[0, 0]) > 0


def test_bad_arguments_raise() -> None:
    x, w = torch.randn(6, 32), torch.randn(3, 16, 32)
    with pytest.raises(ValueError, match="must not decrease"):
        fp8.grouped_linear(x, w, torch.tensor([4, 2, 6]))
    with pytest.raises(ValueError, match="input rows"):
        fp8.grouped_linear(x, w, torch.tensor([2, 4, 7]))
    with pytest.raises(ValueError, match="offsets must be 3 integers"):
        fp8.grouped_linear(x, w, torch.tensor([2, 6]))
    with pytest.raises(ValueError, match="2 states for 3 experts"):
        fp8.grouped_linear(x, w, torch.tensor([2, 4, 6]), states=[fp8.LayerState()] * 2)
    with pytest.raises(ValueError, match="no backend='emulate_tc'"):  # an error, not a silent emulation
        fp8.grouped_linear(x, w, torch.tensor([2, 4, 6]), backend="emulate_tc")
    with pytest.raises(ValueError, match="needs for the experts' grouped GEMMs a CUDA device"):  # on the CPU
        fp8.grouped_linear(x, w, torch.tensor([2, 4, 6]), backend="scaled_mm")
    with pytest.raises(ValueError, match="multiples of 32"):
        fp8.grouped_linear(torch.randn(6, 48), torch.randn(3, 16, 48), torch.tensor([2, 4, 6]), Float8Recipe.mxfp8())


# ----------------------------------------------------------------- the module, convert, stats, Guard
def _moe(seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    return MoE(32, 64, 4)


def test_converted_moe_is_each_expert_as_fp8_linear() -> None:
    """fp8.convert gives the experts the recipe; the MoE equals its SwiGLU experts written with
    fp8.linear per expert (the same windows, bitwise), and fp8.stats names each expert."""
    moe = _moe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the router is too narrow for fp8: warned)
        fp8.convert(moe, "rowwise")
    assert moe.experts.recipe == Float8Recipe.rowwise()
    x = torch.randn(24, 32)
    xs, counts, token, score = moe.route(x)
    y = moe.experts(xs, counts)
    bounds = [0, *counts.cumsum(0).tolist()]
    e_ = moe.experts
    states = {n: [fp8.LayerState() for _ in range(4)] for n in ("w1", "w2", "w3")}
    parts = []
    for e in range(4):
        xe = xs[bounds[e]:bounds[e + 1]]
        lin = lambda n, v: fp8.linear(v, getattr(e_, n)[e], None, Float8Recipe.rowwise(), state=states[n][e])  # noqa: E731
        parts.append(lin("w2", F.silu(lin("w1", xe)) * lin("w3", xe)))
    ref = torch.cat(parts)
    assert torch.allclose(y, ref, rtol=1e-3, atol=1e-6)
    layers = fp8.layer_states(moe)
    assert [f"experts.w1[{e}]" in layers for e in range(4)] == [True] * 4
    for n in ("w1", "w3"):  # the first GEMMs see the same inputs: the same casts
        for e in range(4):
            assert torch.equal(layers[f"experts.{n}[{e}]"].window, states[n][e].window)
    names = {r["layer"] for r in fp8.stats(moe).rows}
    assert {f"experts.{n}[{e}]" for n in ("w1", "w2", "w3") for e in range(4)} <= names
    fp8.unconvert(moe)
    assert moe.experts.recipe is None and not any(k.startswith("experts.") for k in fp8.layer_states(moe))


def test_guard_falls_back_the_expert_that_fails_only() -> None:
    """A nonfinite token of expert 2: the Guard moves expert 2's three GEMMs (the inf reaches w2's
    input through the SwiGLU) to the compute dtype, no other expert's."""
    moe = _moe()
    guard = fp8.Guard(every=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fp8.convert(moe, "tensorwise", guard=guard)
    x = torch.randn(24, 32)
    xs, counts, _, _ = moe.route(x)
    e2 = int(counts[:2].sum())
    assert counts[2] > 0
    xs = xs.clone()
    xs[e2, 0] = float("inf")
    moe.experts(xs, counts)
    with pytest.warns(fp8.Float8FallbackWarning):
        falls = guard.step(moe)
    assert sorted(f.layer for f in falls) == ["experts.w1[2]", "experts.w2[2]", "experts.w3[2]"]
    states = mixprec.fp8.layer_states(moe)
    assert states["experts.w1[2]"].fallback and not states["experts.w1[0]"].fallback


def test_policy_runs_the_experts_as_convert_does_and_only_inside_its_region() -> None:
    """Policy.fp8 selects a GroupedExperts and runs its experts in the rule's recipe (eager): the
    same output, gradients and per-expert windows as the converted module under the same region;
    outside the region, and in a region without the fp8 rule, it runs in high precision again."""
    import copy

    moe = _moe()
    conv = copy.deepcopy(moe)
    fp8.convert(conv, "rowwise", filter_fn=lambda m, fqn: fqn == "experts")
    x = torch.randn(24, 32)
    runs = []
    for model, policy in ((moe, Policy.fp8("rowwise")), (conv, Policy())):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the router is too narrow for fp8: warned)
            with mixprec.autocast("cpu", torch.bfloat16, policy=policy):
                out = model(x)
        out.float().square().sum().backward()
        runs.append((out, model.experts.w1.grad, fp8.layer_states(model)))
    (out, g, st), (out2, g2, st2) = runs
    assert out.dtype == torch.bfloat16 and torch.equal(out, out2) and torch.equal(g, g2)
    names = [f"experts.{n}[{e}]" for n in ("w1", "w2", "w3") for e in range(4)]
    assert all(torch.equal(st[k].window, st2[k].window) for k in names)
    assert float(st["experts.w1[0]"].stats[0, 0]) > 0 and moe.experts.recipe is None
    xs, counts, _, _ = moe.route(x)
    plain = torch.cat([F.linear(F.silu(F.linear(xs[a:b], e_w1)) * F.linear(xs[a:b], e_w3), e_w2)
                       for (a, b), e_w1, e_w2, e_w3 in zip(zip([0, *counts.cumsum(0).tolist()], counts.cumsum(0).tolist()),
                                                          moe.experts.w1, moe.experts.w2, moe.experts.w3)])
    before = st["experts.w1[0]"].window.clone()
    assert torch.allclose(moe.experts(xs, counts), plain, rtol=1e-4, atol=1e-6)  # outside: high precision
    assert torch.equal(st["experts.w1[0]"].window, before)  # (and records nothing)


def test_unconverted_experts_are_grouped_mm_in_the_input_dtype() -> None:
    moe = _moe()
    x = torch.randn(24, 32)
    xs, counts, _, _ = moe.route(x)
    y = moe.experts(xs, counts)
    bounds = [0, *counts.cumsum(0).tolist()]
    e_ = moe.experts
    ref = torch.cat([F.linear(F.silu(F.linear(xs[a:b], e_.w1[e])) * F.linear(xs[a:b], e_.w3[e]), e_.w2[e])
                     for e, (a, b) in enumerate(zip(bounds, bounds[1:]))])
    assert torch.allclose(y, ref, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", ["tensorwise", "mxfp4"])
def test_where_grouped_mm_refuses_the_dtype_the_groups_run_one_mm_each(name: str, monkeypatch) -> None:
    """CUDA's grouped_mm takes bf16 only: float32 GEMMs (tensor-scaled fp8) run one ``mm`` per
    expert there, the same bits as the CPU's grouped_mm (which is an ``mm`` per group)."""
    from mixprec.formats import _grouped

    _, _, _, ((out, gx, gw, st), _) = _run_both(name, torch.float32)
    monkeypatch.setattr(_grouped, "_takes", lambda a: False)
    _, _, _, ((out2, gx2, gw2, st2), _) = _run_both(name, torch.float32)
    assert torch.equal(out, out2) and torch.equal(gx, gx2) and torch.equal(gw, gw2)
    assert all(torch.equal(a.window, b.window) for a, b in zip(st, st2))


def _outlier_run(route: str) -> tuple[mixprec.Controller, list, MoE]:
    """6 steps of :class:`MoE` under a Controller (every 2 steps), ``route`` ``"policy"`` (``Policy.fp8``)
    or ``"convert"`` (``fp8.convert(..., controller=ctl)``), from step 2 an outlier in expert 2's tokens."""
    torch.manual_seed(0)
    moe = MoE(32, 64, 4)
    ctl = mixprec.Controller(every=2)
    if route == "policy":
        ctl.attach(moe)
        policy = Policy.fp8("tensorwise", controller=ctl.settings)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the router is too narrow for fp8: warned)
            fp8.convert(moe, "tensorwise", controller=ctl)
        policy = None
    spike = []

    def outlier(module: nn.Module, args: tuple) -> tuple | None:
        xs, counts = args
        if not spike:
            return None
        xs = xs.clone()
        xs[int(counts[:2].sum()), 0] = 1e5  # expert 2's first token
        return xs, counts

    moe.experts.register_forward_pre_hook(outlier)
    decided = []
    for step in range(6):
        if step == 2:
            spike.append(True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the router is too narrow for fp8: warned)
            with mixprec.autocast("cpu", torch.bfloat16, policy=policy):
                out = moe(torch.randn(24, 32))
        out.float().sum().backward()
        decided += ctl.step()
    return ctl, decided, moe


@pytest.mark.parametrize("route", ["policy", "convert"])
def test_controller_decides_per_expert(route: str) -> None:
    """Each expert of each weight is a layer of the Controller, on the policy route and after
    ``fp8.convert(..., controller=ctl)``: an outlier in expert 2's tokens (its tensorwise scale then
    flushes the rest) promotes expert 2's three GEMMs, and no other expert's; the next forward runs
    expert 2 in the new rung (its state's recipe)."""
    ctl, decided, moe = _outlier_run(route)
    names = [f"experts.{n}[{e}]" for n in ("w1", "w2", "w3") for e in range(4)]
    assert sorted(ctl.precisions()) == names
    moved = sorted(d.layer for d in decided)
    assert moved == ["experts.w1[2]", "experts.w2[2]", "experts.w3[2]"], moved
    assert {ctl.precision(n) for n in names if "[2]" not in n} == {"fp8-tensorwise"}
    rung = ctl.precision("experts.w1[2]")
    assert rung != "fp8-tensorwise" and fp8.layer_states(moe)["experts.w1[2]"].recipe is not None


def test_the_convert_route_decides_as_the_policy_route_and_warns_nothing() -> None:
    """Same model, same data: ``fp8.convert(..., controller=ctl)`` takes the policy route's
    decisions (step, layer, rung) and ends on its rungs, and says nothing about the experts."""
    policy_ctl, policy_log, policy_moe = _outlier_run("policy")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ctl, log, moe = _outlier_run("convert")
    assert not [w for w in caught if "GroupedExperts" in str(w.message) or "Controller" in str(w.message)], \
        [str(w.message) for w in caught]
    assert [(d.step, d.layer, d.action, d.to) for d in log] == [(d.step, d.layer, d.action, d.to) for d in policy_log]
    assert ctl.precisions() == policy_ctl.precisions()
    assert ctl.state_dict() == policy_ctl.state_dict()
    for name, st in fp8.layer_states(policy_moe).items():
        assert fp8.layer_states(moe)[name].recipe == st.recipe, name


def test_an_expert_on_the_fp32_rung_multiplies_in_float32_and_the_probe_sees_its_rows() -> None:
    """A Controller's fp32 rung (fallback with ``probe.fp32``): that expert's GEMMs run in float32
    (its output rounded once to the input's dtype); each probe is called on its own expert's rows."""
    seen = {}

    class Probe:
        fp32 = True

        def __init__(self, e: int) -> None:
            self.e = e

        def __call__(self, x, weight, out, bias=None):
            seen[self.e] = (x.shape[0], weight.shape, out.dtype)
            return out

    torch.manual_seed(3)
    x, w = torch.randn(sum(COUNTS), 64, dtype=torch.bfloat16), torch.randn(4, 32, 64) * 0.1
    st = [fp8.LayerState() for _ in COUNTS]
    st[2].route(fallback=True)
    st[2].probe, st[3].probe = Probe(2), Probe(3)
    st[3].probe.fp32 = False
    out = fp8.grouped_linear(x, w, torch.tensor(COUNTS).cumsum(0), states=st)
    ref = F.linear(x[5:45].float(), w[2]).to(torch.bfloat16)
    _within(out[5:45], ref, _bound(x[5:45], w[2].t(), ref, 64))
    assert seen == {2: (40, (32, 64), torch.bfloat16), 3: (3, (32, 64), torch.bfloat16)}


def test_converting_a_model_of_experts_only_warns_nothing() -> None:
    """No 'no layer selected, nothing runs in fp8' when the model's only fp8 layers are experts."""
    model = nn.ModuleDict({"experts": fp8.GroupedExperts(32, 64, 4)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fp8.convert(model, "tensorwise")
    assert model["experts"].recipe == Float8Recipe.tensorwise()
