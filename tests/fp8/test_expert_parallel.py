"""Expert parallelism over 2 gloo ranks: each rank holds half of the experts of a converted
``fp8.GroupedExperts``; the tokens travel to their expert's rank and back with
``all_to_all_single`` (differentiable). Every expert then casts exactly the tokens it casts in one
process (both ranks' tokens for it, in the same order), so the output, the input gradient, the
experts' weight gradients and each expert's statistics window equal, bitwise, what one process
computes with all the experts (the router runs per rank's tokens in both, the same GEMMs)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import pytest

from mixprec import fp8
from mixprec.fp8 import Float8Recipe

from _distributed import gloo_group, spawn
from test_grouped_experts import MoE

pytestmark = [pytest.mark.slow, pytest.mark.distributed,
              pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")]

TOKENS, DIM, HIDDEN, EXPERTS, WORLD = 24, 32, 64, 4, 2


def _model(recipe: str) -> MoE:
    torch.manual_seed(0)
    moe = MoE(DIM, HIDDEN, EXPERTS).to(torch.bfloat16)
    moe.experts.set_recipe(Float8Recipe.from_name(recipe))
    return moe


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(WORLD * TOKENS, DIM, generator=g, dtype=torch.bfloat16)
    x[3, 5] = 40.0  # an outlier in one expert's tokens
    return x, torch.randn(WORLD * TOKENS, DIM, generator=g, dtype=torch.bfloat16)


def _single(recipe: str) -> tuple[MoE, torch.Tensor, torch.Tensor]:
    """One process, all experts: the router on each rank's tokens, the experts on all of them."""
    moe = _model(recipe)
    x, g = _data()
    x.requires_grad_()
    scores = torch.cat([moe.scores(x[r * TOKENS:(r + 1) * TOKENS]) for r in range(WORLD)])
    xs, counts, token, score = moe.route(x, scores)
    out = moe.combine(moe.experts(xs, counts), token, score, x.shape[0])
    (out.float() * g.float()).sum().backward()
    return moe, out.detach(), x.grad


def _parallel(rank: int, recipe: str) -> tuple[MoE, torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s tokens through the experts of both ranks; it holds experts
    ``rank * E/2 .. (rank + 1) * E/2 - 1``."""
    full = _model(recipe)
    local = EXPERTS // WORLD
    mine = slice(rank * local, (rank + 1) * local)
    experts = fp8.GroupedExperts(DIM, HIDDEN, local, recipe=recipe, dtype=torch.bfloat16)
    with torch.no_grad():
        for n in ("w1", "w2", "w3"):
            getattr(experts, n).copy_(getattr(full.experts, n)[mine])
    x_all, g_all = _data()
    x = x_all[rank * TOKENS:(rank + 1) * TOKENS].clone().requires_grad_()
    xs, counts, token, score = full.route(x)
    # how many tokens each rank sends each of its peer's experts: [src, local expert]
    recv_counts = torch.empty(WORLD * local, dtype=counts.dtype)
    dist.all_to_all_single(recv_counts, counts)
    send = counts.reshape(WORLD, local).sum(1).tolist()
    got = recv_counts.reshape(WORLD, local)
    recv = got.sum(1).tolist()
    received = dist_fn.all_to_all_single(xs.new_empty(sum(recv), DIM), xs, recv, send)
    # [src][expert] blocks -> [expert][src] blocks, the order of one process's stable sort
    starts = torch.cat([torch.zeros(1, dtype=got.dtype), got.reshape(-1).cumsum(0)[:-1]]).reshape(WORLD, local)
    order = torch.cat([torch.arange(int(starts[s, e]), int(starts[s, e] + got[s, e]))
                       for e in range(local) for s in range(WORLD)]).long()
    y = _unpermute(experts(received[order], got.sum(0)), order)
    back = dist_fn.all_to_all_single(y.new_empty(xs.shape[0], DIM), y, send, recv)
    out = full.combine(back, token, score, x.shape[0])
    g = g_all[rank * TOKENS:(rank + 1) * TOKENS]
    (out.float() * g.float()).sum().backward()
    return experts, out.detach(), x.grad


def _unpermute(y: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Rows ``y[i]`` back to position ``order[i]`` (differentiable)."""
    return torch.zeros_like(y).index_copy(0, order, y)


def _worker(rank: int, port: int) -> None:
    with gloo_group(rank, port):
        for recipe in ("tensorwise", "nvfp4"):
            experts, out, gx = _parallel(rank, recipe)
            ref, rout, rgx = _single(recipe)
            rows = slice(rank * TOKENS, (rank + 1) * TOKENS)
            mine = slice(rank * EXPERTS // WORLD, (rank + 1) * EXPERTS // WORLD)
            assert torch.equal(out, rout[rows]), recipe
            assert torch.equal(gx, rgx[rows]), recipe
            for n in ("w1", "w2", "w3"):
                assert torch.equal(getattr(experts, n).grad, getattr(ref.experts, n).grad[mine]), (recipe, n)
            local, full = fp8.layer_states(experts), fp8.layer_states(ref)
            for e in range(EXPERTS // WORLD):
                for n in ("w1", "w2", "w3"):
                    assert torch.equal(local[f"{n}[{e}]"].window, full[f"experts.{n}[{mine.start + e}]"].window)


def test_expert_parallel_is_one_process() -> None:
    spawn(_worker, timeout=240.0)
