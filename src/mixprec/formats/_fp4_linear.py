"""The GEMMs of an fp4 recipe: each GEMM cast and multiplied on its own, emulated.

A recipe with an e2m1 cast (``Float8Recipe.mxfp4()``, ``.nvfp4()``, or one composed per GEMM
from fp4 and fp8 recipes) runs here instead of the fp8 path. Every GEMM is ``A @ B.t()`` with
the contracted dimension last in both operands (forward: ``x``, ``W``; input gradient:
``grad_output``, ``W.t()``; weight gradient: ``grad_output.t()``, ``x.t()``, contiguous copies as
torchao's emulated MX training). Each operand is cast by its :class:`Cast`: e2m1 blocks
(:mod:`mixprec.formats._fp4`), fp8 blocks (:mod:`mixprec.formats._blocks`), fp8 tensor/row casts
(:func:`~mixprec.formats._quant.cast_to_fp8`) or none; then dequantized and multiplied in the
GEMM's dtype (fp4 and MX: the input's, float32 for float16, as torchao's emulation; float32-scaled
fp8: float32; every GEMM in float32 under the backend ``"emulate_fp32"``, as a tensor core
accumulates: operands exact, the product rounded once).

Saved for backward: the weight (the parameter, no copy) and the input already cast for the
weight-gradient GEMM (with the Hadamard transform when the recipe asks): packed codes and
scales, not the high-precision input.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from mixprec.formats._accumulate import tensor_core_mm
from mixprec.formats._blocks import dequantize as block_dequantize
from mixprec.formats._blocks import gemm_dtype
from mixprec.formats._blocks import quantize as block_quantize
from mixprec.formats._fp4 import Fp4Tensor, RoundingKey, quantize
from mixprec.formats._hadamard import hadamard, hadamard_of
from mixprec.formats._native_gemm import block_mm, fp4_mm
from mixprec.formats._quant import cast_to_fp8
from mixprec.formats._quant import dequantize as fp8_dequantize
from mixprec.formats._recipe import Cast, Float8Recipe
from mixprec.formats._state import GRAD_OUTPUT, INPUT, WEIGHT, record_cast, record_sqnr
from mixprec.formats._tensor_parallel import Sharding, global_amax, shard_window, tensor_amax_reduce

__all__ = ["Fp4Matmul", "cast_operand", "fp4_grads", "gemm", "gemm_values"]

#: rounding streams of one step: grad_output as the input-gradient and the weight-gradient GEMMs read it.
_GO_GRAD_INPUT, _GO_GRAD_WEIGHT = 0, 1


def cast_operand(t2: torch.Tensor, cast: Cast, recipe: Float8Recipe, generator: RoundingKey | None = None,
                 tp: Sharding | None = None, has: str = "") -> tuple[Any, torch.Tensor | None, torch.Tensor | None]:
    """Cast the 2-D ``t2`` (contracted dimension last) for a GEMM: ``(operand, q, amax)``, where
    ``q`` (in ``t2``'s layout; fp4: the magnitude index of each code) and ``amax`` feed the cast
    statistics (None for ``"none"``). ``operand`` is what :func:`gemm` takes. Under tensor
    parallelism ``tp``, ``has`` names ``t2``'s layer dimensions (``"mk"``: the input, ...; the
    contracted one last): a scale that spans the sharded one is global."""
    if cast.is_fp4:
        t = quantize(t2, cast, subnormal_scales=recipe.subnormal_scales, generator=generator,
                     reduce=tensor_amax_reduce(tp, cast, has))
        return t, None, t.amax
    if cast.block is not None:
        q, deq, amax = block_quantize(t2, cast, recipe.pow2_scales)
        return (q, deq), q, amax
    if cast.is_fp8:
        q, scale, amax = cast_to_fp8(t2, cast, -1, recipe.pow2_scales, global_amax(tp, t2, cast, -1, has, has[-1:]))
        return (q, scale), q, amax
    return t2, None, None


def _values(op: Any, cast: Cast, dtype: torch.dtype) -> torch.Tensor:
    if cast.is_fp4:
        return op.dequantize(dtype)
    if cast.block is not None:
        return block_dequantize(op[0], op[1], cast, dtype)
    if cast.is_fp8:
        q, scale = op
        return fp8_dequantize(q, scale.reshape(-1, 1) if scale.dim() else scale)
    return op


def gemm(a: Any, ca: Cast, b: Any, cb: Cast, out_dtype: torch.dtype, bias: torch.Tensor | None = None,
         backend: str = "emulate") -> torch.Tensor:
    """``A @ B.t()`` (``+ bias``) of two operands of :func:`cast_operand`. ``backend="scaled_mm"``:
    block casts (e2m1, fp8 blocks) on torch's scaled GEMM (:mod:`._native_gemm`; the caller made
    sure the device has it), the bias added after in ``out_dtype``. Else emulated: dequantized
    and multiplied (one ``addmm`` with the bias) in the GEMM's dtype (:func:`gemm_values`;
    ``"emulate_tc"``: accumulated as an fp8 tensor core), then cast to ``out_dtype``."""
    if backend == "scaled_mm" and ca.block is not None:
        out = fp4_mm(a, ca, b, cb, out_dtype) if ca.is_fp4 else block_mm(a, ca, b, cb, out_dtype)
        return out if bias is None else out + bias.to(out_dtype)
    a, b = gemm_values(a, ca, b, cb, out_dtype, backend in ("emulate_fp32", "emulate_tc"))
    if backend == "emulate_tc" and ca.is_fp8:  # accumulated as an fp8 tensor core (_accumulate)
        out = tensor_core_mm(a, b) if bias is None else tensor_core_mm(a, b) + bias.to(a.dtype)
    else:
        out = torch.mm(a, b) if bias is None else torch.addmm(bias.to(a.dtype), a, b)
    return out.to(out_dtype)


def gemm_values(a: Any, ca: Cast, b: Any, cb: Cast, out_dtype: torch.dtype, fp32: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The operands of :func:`gemm` dequantized in the GEMM's dtype: ``(A, B.t())`` (a view): e2m1
    and E8M0 blocks: ``out_dtype``, float32 for float16; other fp8 casts: float32; none: ``A``'s;
    with ``fp32``: float32 for every cast."""
    if fp32 and ca.is_fp8:
        dtype = torch.float32
    elif not ca.is_fp8:
        dtype = a.dtype
    elif ca.is_fp4:  # as torchao's MX and NVFP4 emulation: in the input's dtype (MX takes no float16)
        dtype = out_dtype if out_dtype != torch.float16 else torch.float32
    else:
        dtype = gemm_dtype(ca, out_dtype) if ca.block else torch.float32
    return _values(a, ca, dtype), _values(b, cb, dtype).t().to(dtype)


def _record(stats: torch.Tensor | None, operand: int, x: torch.Tensor, op: Any, q: torch.Tensor | None,
            amax: torch.Tensor | None) -> None:
    """Record a cast of ``x`` into the layer's window (fp4: on its codes' magnitudes)."""
    if stats is not None and amax is not None:
        record_cast(stats, operand, x, op.magnitudes() if isinstance(op, Fp4Tensor) else q, amax)


def _saved(op: Any) -> list[torch.Tensor]:
    if isinstance(op, Fp4Tensor):
        ts = op.tensor_scale if op.tensor_scale is not None else op.codes.new_empty(0, dtype=torch.float32)
        return [op.codes, op.scales, ts]
    return list(op) if isinstance(op, tuple) else [op]


def _restored(tensors: tuple[torch.Tensor, ...], cast: Cast, shape: torch.Size) -> Any:
    if cast.is_fp4:
        codes, scales, ts = tensors
        return Fp4Tensor(codes, scales, ts if ts.numel() else None, scales.new_empty(0), shape, cast)
    return tuple(tensors) if cast.is_fp8 else tensors[0]


class Fp4Matmul(torch.autograd.Function):
    """``x @ w.t()`` with an fp4 recipe's casts, GEMM by GEMM (see the module's docstring).
    ``step``: the layer's fp4 call count (a 0-d int64 tensor, :meth:`LayerState.next_rounding_step`),
    which seeds stochastic rounding (:class:`~mixprec.formats._fp4.RoundingKey`: traceable);
    ``backend``: the resolved backend of :func:`~mixprec.formats._linear.linear` (``"emulate"``,
    ``"emulate_fp32"``: every GEMM in float32, ``"scaled_mm"``: block GEMMs on torch's scaled GEMM)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, recipe: Float8Recipe,
                stats: torch.Tensor | None, sqnr: torch.Tensor | None, step: torch.Tensor,
                backend: str = "emulate", tp: Sharding | None = None) -> torch.Tensor:
        r = recipe
        k, n = w.shape[1], w.shape[0]
        x2 = x.reshape(-1, k)
        with torch.autocast(x.device.type, enabled=False):
            xa, xq, xamax = cast_operand(x2, r.input, r, tp=tp, has="mk")
            wb, wq, wamax = cast_operand(w, r.weight, r, tp=tp, has="nk")
            _record(stats, INPUT, x2, xa, xq, xamax)
            _record(stats, WEIGHT, w, wb, wq, wamax)
            out = gemm(xa, r.input, wb, r.weight, x.dtype, bias, backend)  # one addmm, as torchao's MX QAT linear
            if sqnr is not None:  # the GEMM's SQNR (the bias, exact in both, left out of the signal)
                ref = torch.mm(x2, w.t().to(x2.dtype)).double()
                err = out.double() - ref if bias is None else out.double() - bias.double() - ref
                record_sqnr(sqnr, ref, err)
            saved, xt_shape = _grad_weight_operand(x2, r, tp, ctx.needs_input_grad[1])
        ctx.recipe, ctx.stats, ctx.backend, ctx.tp = r, stats, backend, tp
        ctx.xt_shape, ctx.w_dtype = xt_shape, w.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.save_for_backward(w, step, *_saved(saved))
        return out.reshape(*x.shape[:-1], n)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        r, stats, tp = ctx.recipe, ctx.stats, ctx.tp
        w, step, *saved = ctx.saved_tensors
        k = w.shape[1]
        go = grad_output.reshape(-1, grad_output.shape[-1])
        dtype = go.dtype
        grad_input = grad_weight = None
        sr = r.stochastic_rounding

        def rng(stream: int, t: torch.Tensor, cast: Cast, has: str) -> RoundingKey | None:
            return RoundingKey(r.seed, step, stream, shard_window(tp, t.shape, cast, has)) if sr else None

        with torch.autocast(go.device.type, enabled=False):
            cg = r.grad_output
            if cg.is_fp8 and (ctx.needs_input_grad[0] or stats is not None):
                ga, gq, gamax = cast_operand(go, cg, r, rng(_GO_GRAD_INPUT, go, cg, "mn") if cg.is_fp4 else None, tp, "mn")
                _record(stats, GRAD_OUTPUT, go, ga, gq, gamax)
            if ctx.needs_input_grad[0]:
                if cg.is_fp8:
                    wb = cast_operand(w.t().contiguous(), r.weight_for_grad_input, r, tp=tp, has="kn")[0]
                    grad_input = gemm(ga, cg, wb, r.weight_for_grad_input, dtype, backend=ctx.backend)
                else:
                    grad_input = torch.mm(go, w.to(dtype))
                grad_input = grad_input.reshape(*grad_output.shape[:-1], k)
            cw = r.grad_output_for_grad_weight
            if ctx.needs_input_grad[1] or (stats is not None and cw.is_fp8 and not cg.is_fp8):
                got = go.t()
                if _hadamard(r):
                    got = hadamard(got, hadamard_of(r.seed, go))
                if cw.is_fp8:
                    gb, gq, gamax = cast_operand(got.contiguous(), cw, r,
                                                 rng(_GO_GRAD_WEIGHT, got, cw, "nm") if cw.is_fp4 else None, tp, "nm")
                    if not cg.is_fp8:
                        _record(stats, GRAD_OUTPUT, got, gb, gq, gamax)
                if ctx.needs_input_grad[1]:
                    xop = _restored(tuple(saved), r.input_for_grad_weight, ctx.xt_shape)
                    if cw.is_fp8:
                        grad_weight = gemm(gb, cw, xop, r.input_for_grad_weight, dtype, backend=ctx.backend)
                    else:
                        grad_weight = torch.mm(go.t(), xop.to(dtype))
                    grad_weight = grad_weight.to(ctx.w_dtype)
            grad_bias = None
            if ctx.needs_input_grad[2]:
                grad_bias = go.sum(0).to(ctx.bias_dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None


def fp4_grads(x: torch.Tensor, w: torch.Tensor, grad_output: torch.Tensor, recipe: Float8Recipe,
              wanted: tuple[bool, bool], backend: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The input and weight gradients (each where ``wanted``) :class:`Fp4Matmul`'s backward gives
    for ``grad_output``, without its forward GEMM (no statistics, no tensor parallelism, the
    rounding step 0 as a stateless call's): bitwise that backward. Autocast off, unchecked."""
    saved, xt_shape = _grad_weight_operand(x.reshape(-1, w.shape[1]), recipe, None, wanted[1])
    ctx = SimpleNamespace(recipe=recipe, stats=None, tp=None, backend=backend, xt_shape=xt_shape, w_dtype=w.dtype,
                          bias_dtype=None, needs_input_grad=(*wanted, False),
                          saved_tensors=(w, x.new_zeros((), dtype=torch.int64), *_saved(saved)))
    return Fp4Matmul.backward(ctx, grad_output)[:2]


def _grad_weight_operand(x2: torch.Tensor, r: Float8Recipe, tp: Sharding | None, needed: bool
                         ) -> tuple[Any, torch.Size]:
    """What the weight-gradient GEMM keeps of the input ``x2`` (``(m, k)``): its cast of ``x2.t()``
    (through the Hadamard transform where ``r`` asks), ``x2`` where that GEMM is not cast, nothing
    where the weight gradient is not ``needed`` (a Controller's shadow GEMM); and ``(k, m)``."""
    xt = x2.t()
    if not needed:
        return (), xt.shape
    if _hadamard(r):
        xt = hadamard(xt, hadamard_of(r.seed, x2))
    cx = r.input_for_grad_weight
    return (cast_operand(xt.contiguous(), cx, r, tp=tp, has="km")[0] if cx.is_fp8 else x2), xt.shape


def _hadamard(r: Float8Recipe) -> bool:
    """Whether the weight-gradient GEMM's operands pass through the Hadamard transform."""
    return r.hadamard and r.input_for_grad_weight.is_fp4
