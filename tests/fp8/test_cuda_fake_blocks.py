"""The block-scaled recipes (blockwise, mxfp8, mxfp4, nvfp4) on fake CUDA devices of compute
capability 8.9, 9.0 and 10.0: each GEMM's emulation runs, output shapes and dtypes on CUDA.

Their casts use aten ops only (``unsqueeze``/``narrow``, no indexing), so this tier takes the
``fake_cuda`` fixture's indexing routes away: the block casts must run without them (indexing's
C++ binding takes a device guard a CPU-only build refuses; issue 38 measured exactly that).

Autograd cannot run on fake CUDA tensors (see _fake_cuda.py); the backward's two GEMMs run by
calling the autograd function's ``forward`` and ``backward`` with a stand-in context.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mixprec import fp8
from mixprec.formats._fp4_linear import Fp4Matmul
from mixprec.formats._linear import _Float8Matmul

from _fake_cuda import fake_cuda, fake_mode  # noqa: F401

CAPABILITIES = [(8, 9), (9, 0), (10, 0)]
RECIPES = ["blockwise", "mxfp8", "mxfp4", "nvfp4"]

#: (M, K, N) -> what each recipe gives: "ok", or the error a weight off the recipe's blocks raises.
#: M (tokens) need not fit any block: 200 is no multiple of 128 nor 32 (a partial block in the
#: weight-gradient GEMM, which contracts over M), 1 a single row. K = 48: a multiple of 16, not 32.
SHAPES = {
    (200, 256, 128): dict.fromkeys(RECIPES, "ok"),
    (1, 256, 128): dict.fromkeys(RECIPES, "ok"),
    (33, 128, 256): dict.fromkeys(RECIPES, "ok"),
    (200, 48, 64): {"blockwise": "ValueError", "mxfp8": "ValueError", "mxfp4": "ValueError", "nvfp4": "ok"},
}
CASES = [(recipe, m, k, n, expected) for (m, k, n), by in SHAPES.items() for recipe, expected in by.items()]

#: indexing's own C++ bindings, which the fixture routes around
_GETITEM, _SETITEM = torch._C.TensorBase.__getitem__, torch._C.TensorBase.__setitem__


@pytest.fixture
def bare_cuda(fake_cuda, monkeypatch):
    """Sets the capability of ``fake_cuda`` without its indexing routes: a fake CUDA tensor's
    ``t[...]`` is refused again, as on a CPU-only build outside the fixture."""
    def set_capability(capability: tuple[int, int]) -> None:
        fake_cuda.set_capability(capability)
        monkeypatch.setattr(torch.Tensor, "__getitem__", _GETITEM)
        monkeypatch.setattr(torch.Tensor, "__setitem__", _SETITEM)
    set_capability((9, 0))
    return set_capability


class _Ctx(SimpleNamespace):
    """A stand-in autograd context: what ``forward`` saves, ``backward`` reads."""

    needs_input_grad = (True, True, True)

    def save_for_backward(self, *tensors: torch.Tensor) -> None:
        self.saved_tensors = tensors


def _meta(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.dtype, t.device.type


def _three_gemms(recipe: str, m: int, k: int, n: int, dtype: torch.dtype) -> list[tuple]:
    """Forward, input-gradient and weight-gradient GEMMs of ``recipe`` on fake CUDA tensors."""
    r = fp8.as_recipe(recipe)
    with fake_mode(), torch.no_grad():
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        w = torch.randn(n, k, device="cuda", dtype=dtype)
        out = fp8.linear(x, w, recipe=r)
        go = torch.randn(m, n, device="cuda", dtype=dtype)
        ctx = _Ctx()
        if r.fp4:
            step = torch.zeros((), dtype=torch.int64, device="cuda")
            Fp4Matmul.forward(ctx, x, w, None, r, None, None, step)
            grads = Fp4Matmul.backward(ctx, go)[:2]
        else:
            _Float8Matmul.forward(ctx, x, w, r, "emulate", None, None)
            grads = _Float8Matmul.backward(ctx, go)[:2]
        return [_meta(out), *(_meta(g) for g in grads)]


@pytest.mark.parametrize("capability", CAPABILITIES, ids=lambda c: f"sm{c[0]}{c[1]}")
@pytest.mark.parametrize("recipe,m,k,n,expected", CASES, ids=[f"{c[0]}-{c[1]}x{c[2]}x{c[3]}" for c in CASES])
def test_block_recipes_run_on_fake_cuda(bare_cuda, capability, recipe, m, k, n, expected):
    bare_cuda(capability)
    if expected != "ok":
        with pytest.raises(ValueError, match=f"not multiples of {fp8.as_recipe(recipe).block_multiple}"):
            _three_gemms(recipe, m, k, n, torch.bfloat16)
        return
    for dtype in (torch.bfloat16, torch.float32):
        assert _three_gemms(recipe, m, k, n, dtype) == [((m, n), dtype, "cuda"), ((m, k), dtype, "cuda"),
                                                        ((n, k), dtype, "cuda")]


def test_the_bare_fixture_refuses_indexing(bare_cuda):
    """What the tier stands on: without the routes, indexing a fake CUDA tensor is refused as
    issue 38 measured (so the tests above would catch an indexing op in a block cast)."""
    with fake_mode():
        s = torch.randn(4, 2, device="cuda")
        with pytest.raises(RuntimeError, match="not linked with support for cuda"):
            s[:, None, :, None]
        assert s.unsqueeze(1).unsqueeze(3).shape == (4, 1, 2, 1)
