"""Expert routing drawn for ``fp8.grouped_linear`` (single process): the number of experts, each
expert's token count (0, a few, many, counts that fill no token block, every token to one expert,
none to any), padding rows after the last expert, a recipe, bf16 or float32, an outlier token of
one expert; two steps on the same states (the second cast sees the first's amax history).

Against the per-expert loop of ``fp8.linear`` (each expert its own ``LayerState``), as
``tests/fp8/test_grouped_experts.py`` holds it: every expert's statistics window bitwise the loop's;
the output and both gradients within the error bound of two summation orders of the same products
(from the run's own operands); an expert without tokens has a zero weight gradient and an
untouched window; padding rows give zero output and input gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import given
from hypothesis import strategies as st

from _adv_profile import profile
from mixprec import fp8
from mixprec.fp8 import Float8Recipe

EXPERT_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8", "blockwise", "mxfp4", "nvfp4")


@dataclass(frozen=True)
class Routing:
    recipe: str
    dtype: str  # "bfloat16" or "float32"
    counts: tuple[int, ...]  # tokens per expert, sorted by expert
    padding: int = 0  # rows after the last expert
    outlier: tuple[int, float] | None = None  # (row, value) at column 0 of the input
    seed: int = 0


@st.composite
def routings(draw: st.DrawFn) -> Routing:
    experts = draw(st.integers(1, 5))
    pattern = draw(st.sampled_from(["random", "one", "none", "sparse"]))
    if pattern == "one":  # all to one
        hot = draw(st.integers(0, experts - 1))
        counts = tuple(draw(st.sampled_from([1, 17, 40])) if e == hot else 0 for e in range(experts))
    elif pattern == "none":
        counts = (0,) * experts
    else:
        sizes = [0, 0, 1, 3, 17, 33] if pattern == "sparse" else [0, 1, 2, 5, 16, 31, 40]
        counts = tuple(draw(st.lists(st.sampled_from(sizes), min_size=experts, max_size=experts)))
    rows = sum(counts)
    outlier = None
    if rows and draw(st.booleans()):
        outlier = (draw(st.integers(0, rows - 1)), draw(st.sampled_from([300.0, 3e4])))
    return Routing(recipe=draw(st.sampled_from(EXPERT_RECIPES)), dtype=draw(st.sampled_from(["bfloat16", "float32"])),
                   counts=counts, padding=draw(st.sampled_from([0, 0, 3])), outlier=outlier,
                   seed=draw(st.integers(0, 5)))


def _bound(a: torch.Tensor, b: torch.Tensor, ref: torch.Tensor, k: int) -> torch.Tensor:
    """Two summation orders of the same products (tests/fp8/test_grouped_experts.py)."""
    mag = a.abs().double() @ b.abs().double()
    return 4 * k * torch.finfo(torch.float32).eps * mag + torch.finfo(ref.dtype).eps * ref.abs().double()


def _within(what: str, got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> None:
    assert got.dtype == ref.dtype and got.shape == ref.shape, what
    assert torch.isfinite(got).all(), f"{what}: not finite"
    excess = (got.double() - ref.double()).abs() - bound
    assert excess.numel() == 0 or excess.max() <= 0, f"{what}: off by {excess.max():.3g} beyond the bound"


def _loop(x: torch.Tensor, w: torch.Tensor, counts: tuple[int, ...], recipe: Float8Recipe,
          states: list[fp8.LayerState]) -> torch.Tensor:
    bounds = [0, *torch.tensor(counts).cumsum(0).tolist()]
    return torch.cat([fp8.linear(x[bounds[e]:bounds[e + 1]], w[e], None, recipe, state=states[e])
                      for e in range(w.shape[0])])


def check(r: Routing) -> None:
    dtype = getattr(torch, r.dtype)
    k, n = (128, 128) if r.recipe == "blockwise" else (64, 32)
    recipe = Float8Recipe.from_name(r.recipe)
    g = torch.Generator().manual_seed(r.seed)
    m = sum(r.counts)
    w = torch.randn(len(r.counts), n, k, generator=g) * 0.1
    offsets = torch.tensor(r.counts).cumsum(0)
    states = {grouped: [fp8.LayerState() for _ in r.counts] for grouped in (True, False)}
    for step in range(2):  # the same states: the second step's casts see the first's history
        x = torch.randn(m + r.padding, k, generator=g).to(dtype)
        if r.outlier is not None and step == 0:
            x[r.outlier[0], 0] = r.outlier[1]
        go = torch.randn(m + r.padding, n, generator=g).to(dtype)
        runs = {}
        for grouped in (True, False):
            xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
            if grouped:
                out = fp8.grouped_linear(xg, wg, offsets, recipe, states=states[True])
            else:
                out = torch.cat([_loop(xg[:m], wg, r.counts, recipe, states[False]),
                                 torch.zeros(r.padding, n, dtype=dtype)])
            out.backward(go)
            runs[grouped] = (out.detach(), xg.grad, wg.grad)
        (out, gx, gw), (ref, rgx, rgw) = runs[True], runs[False]
        for e, (a, b) in enumerate(zip(states[True], states[False])):
            assert torch.equal(a.window, b.window), f"step {step}: expert {e}'s window is not the loop's"
        rows = torch.cat([torch.full((c,), e) for e, c in enumerate(r.counts)]).long()
        wr = w[rows]
        _within(f"step {step} output", out[:m], ref[:m],
                _bound(x[:m].unsqueeze(1), wr.transpose(1, 2), ref[:m].unsqueeze(1), k).squeeze(1))
        _within(f"step {step} input gradient", gx[:m], rgx[:m],
                _bound(go[:m].unsqueeze(1), wr, rgx[:m].unsqueeze(1), n).squeeze(1))
        assert torch.equal(out[m:], torch.zeros_like(out[m:])) and torch.equal(gx[m:], torch.zeros_like(gx[m:])), \
            "padding rows: not zero"
        bounds = [0, *offsets.tolist()]
        for e, c in enumerate(r.counts):
            s = slice(bounds[e], bounds[e + 1])
            if c == 0:
                assert torch.equal(gw[e], torch.zeros_like(gw[e])), f"expert {e} without tokens: a weight gradient"
                assert torch.equal(states[True][e].window, fp8.LayerState().window), f"expert {e}: a window"
            else:
                _within(f"step {step} expert {e} weight gradient", gw[e], rgw[e],
                        _bound(go[s].t(), x[s], rgw[e], c))


KNOWN = [Routing("tensorwise", "bfloat16", (0, 0, 40, 0), padding=3, outlier=(5, 3e4)),
         Routing("mxfp8", "float32", (1, 0, 17, 33), padding=3), Routing("nvfp4", "bfloat16", (0, 0, 0)),
         Routing("rowwise", "bfloat16", (31, 1, 0, 2, 5), outlier=(0, 300.0))]


def test_known_routings() -> None:
    for r in KNOWN:
        check(r)


@profile(fast_examples=8)
@given(routing=routings())
def test_grouped_experts_are_the_per_expert_loop(routing: Routing) -> None:
    check(routing)
