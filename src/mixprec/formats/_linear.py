"""``linear``: the functional fp8 linear layer (three GEMMs in fp8, bias in high precision)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

from mixprec.formats._blocks import block_gemm, quantize
from mixprec.formats._fp4_linear import Fp4Matmul, fp4_grads
from mixprec.formats._fsdp import GatheredFloat8Weight, reads_gathered, warn_fallback
from mixprec.formats._native_gemm import block_mm, missing, note_emulated
from mixprec.formats._quant import cast_to_fp8, gemm
from mixprec.formats._recipe import Cast, Float8Recipe
from mixprec.formats._state import GRAD_OUTPUT, INPUT, WEIGHT, LayerState, record_cast, record_sqnr
from mixprec.formats._tensor_parallel import Sharding, global_amax, is_distributed_tensor, sharded_linear

__all__ = ["linear", "linear_grads", "local_linear", "resolve_backend", "BACKENDS"]

#: ``"emulate"``: the GEMMs emulated as torchao's emulation computes them (tensor/row-scaled fp8 in
#: float32; fp4 and MX blocks dequantized and multiplied in the input's dtype); ``"emulate_fp32"``:
#: every emulated GEMM dequantized and multiplied in float32 and rounded once to the output dtype,
#: as an fp8/fp4 tensor core accumulates (on a CPU without native bf16 GEMMs, several times faster
#: for fp4 and MX recipes; the same bits as ``"emulate"`` for tensor/row-scaled fp8);
#: ``"emulate_tc"``: as ``"emulate_fp32"``, but each GEMM's products accumulated as an fp8 tensor core
#: does (about 14 bits kept, promoted to float32 every 128 elements of K: ``_accumulate``), so CPU
#: loss-parity figures are not optimistic;
#: ``"scaled_mm"``: torch's scaled GEMMs (``torch._scaled_mm``, ``F.scaled_mm``: tensor/row fp8 on
#: CUDA sm89+, blockwise on sm90, MXFP8/MXFP4/NVFP4 on sm100; see ``_native_gemm``); ``"auto"``:
#: ``"scaled_mm"`` where it runs, else ``"emulate"`` (said once on the ``mixprec`` logger).
BACKENDS = ("auto", "emulate", "emulate_fp32", "emulate_tc", "scaled_mm")
EMULATED = ("emulate", "emulate_fp32", "emulate_tc")
_TENSORWISE = Float8Recipe.tensorwise()


def _rows(scale: torch.Tensor) -> torch.Tensor:
    """A row scale of an N-d operand as the ``(M, 1)`` scale of its 2-D view."""
    return scale.reshape(-1, 1) if scale.dim() > 0 else scale


def _t(scale: torch.Tensor) -> torch.Tensor:
    return scale.t() if scale.dim() == 2 else scale


def _record(stats: torch.Tensor | None, operand: int, x: torch.Tensor, cast: tuple) -> None:
    """Record the cast ``(q, scale, amax)`` of ``x`` into the layer's window ``stats`` (if any)."""
    record_cast(stats, operand, x, cast[0], cast[2])


def _cast_weight(wt: torch.Tensor, cast: Cast, row_dim: int, pow2: bool, tp: Sharding | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``cast_to_fp8`` of the weight (``W.t()``; under tensor parallelism ``tp``, with the
    global amax where the scale spans the shards), or the bytes FSDP2's fp8 all-gather brought
    (``linear`` made sure ``cast`` is theirs: ``reads_gathered``)."""
    if isinstance(wt, GatheredFloat8Weight):
        return wt._data, wt._scale, wt._amax
    return cast_to_fp8(wt, cast, row_dim, pow2, global_amax(tp, wt, cast, row_dim, "kn", "kn"[row_dim]))


def _primary(a: Cast, b: Cast) -> Cast | None:
    """The cast whose statistics stand for an operand: its first fp8 cast."""
    return a if a.is_fp8 else (b if b.is_fp8 else None)


class _Float8Matmul(torch.autograd.Function):
    """``x @ w.t()`` with the recipe's casts; mirrors torchao's ``matmul_with_hp_or_float8_args``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, recipe: Float8Recipe, backend: str,
                stats: torch.Tensor | None, sqnr: torch.Tensor | None, tp: Sharding | None = None) -> torch.Tensor:
        r = recipe
        wt = w.t()
        k, n = wt.shape
        with torch.autocast(x.device.type, enabled=False):
            if r.blocked and r.input.is_fp8:
                if isinstance(x, GatheredFloat8Weight):  # a sequence gathered in fp8 (recorded per shard)
                    xc = (x._data.reshape(-1, k), x._scale.reshape(-1, x._scale.shape[-1]))
                else:
                    x2 = x.reshape(-1, k)
                    xc = quantize(x2, r.input, r.pow2_scales)
                    _record(stats, INPUT, x2, xc)
                wc = quantize(w, r.weight, r.pow2_scales)
                _record(stats, WEIGHT, w, wc)
                out = _block_mm(xc[:2], r.input, wc[:2], r.weight, x.dtype, backend)
            elif r.input.is_fp8:
                if isinstance(x, GatheredFloat8Weight):  # a sequence gathered in fp8 (recorded per shard)
                    xc = (x._data, x._scale, x._amax)
                else:
                    xc = cast_to_fp8(x, r.input, -1, r.pow2_scales, global_amax(tp, x, r.input, -1, "mk", "k"))
                    _record(stats, INPUT, x, xc)
                wc = _cast_weight(wt, r.weight, 0, r.pow2_scales, tp)
                if not isinstance(w, GatheredFloat8Weight):  # (gathered: recorded per shard before the all-gather)
                    _record(stats, WEIGHT, w, (wc[0].t(), *wc[1:]))  # w and q.t() are contiguous
                out = gemm(xc[0].reshape(-1, k), _rows(xc[1]), wc[0], wc[1], x.dtype, backend, True)
            else:
                out = torch.mm(x.reshape(-1, k), wt.to(x.dtype))
            if sqnr is not None:
                _record_sqnr(sqnr, out, x.reshape(-1, k), wt)
        ctx.recipe, ctx.backend, ctx.stats, ctx.tp = r, backend, stats, tp
        ctx.x_shape, ctx.w_dtype = x.shape, w.dtype
        if r.save_fp8:
            ctx.save_for_backward(xc[0], xc[1], wc[0], wc[1])
        else:
            ctx.save_for_backward(x, wt)
        return out.reshape(*x.shape[:-1], n)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        r, backend, stats, tp = ctx.recipe, ctx.backend, ctx.stats, ctx.tp
        if r.save_fp8:
            xq, sx, wq, sw = ctx.saved_tensors
            k = xq.shape[-1]
        else:
            x, wt = ctx.saved_tensors
            k = wt.shape[0]
        go = grad_output.reshape(-1, grad_output.shape[-1])
        dtype = go.dtype
        if r.blocked:
            return _block_backward(ctx, x, wt, go, grad_output.shape)
        grad_input = grad_weight = None
        with torch.autocast(go.device.type, enabled=False):
            go_gi = None
            if r.grad_output.is_fp8 and (ctx.needs_input_grad[0] or stats is not None):
                go_gi = cast_to_fp8(go, r.grad_output, -1, r.pow2_scales,
                                    global_amax(tp, go, r.grad_output, -1, "mn", "n"))
                _record(stats, GRAD_OUTPUT, go, go_gi)
            if ctx.needs_input_grad[0]:
                if r.grad_output.is_fp8:
                    if not r.save_fp8:
                        wq, sw, _ = _cast_weight(wt, r.weight_for_grad_input, -1, r.pow2_scales, tp)
                    grad_input = gemm(go_gi[0], go_gi[1], wq.t(), _t(sw), dtype, backend, False)
                else:
                    grad_input = torch.mm(go, wt.t().to(dtype))
                grad_input = grad_input.reshape(*grad_output.shape[:-1], k)
            cw = r.grad_output_for_grad_weight
            if cw.is_fp8 and not r.grad_output.is_fp8:
                _record(stats, GRAD_OUTPUT, go, cast_to_fp8(go, cw, 0, r.pow2_scales,
                                                            global_amax(tp, go, cw, 0, "mn", "m")))
            if ctx.needs_input_grad[1]:
                if cw.is_fp8:
                    if go_gi is not None and cw == r.grad_output and cw.granularity == "tensor":
                        goq, sgo = go_gi[0], go_gi[1]  # the same cast: bitwise the same bits
                    else:
                        goq, sgo, _ = cast_to_fp8(go, cw, 0, r.pow2_scales, global_amax(tp, go, cw, 0, "mn", "m"))
                    if r.save_fp8:
                        xq2, sx2 = xq.reshape(-1, k), sx
                    else:
                        x2 = x.reshape(-1, k)
                        xq2, sx2, _ = cast_to_fp8(x2, r.input_for_grad_weight, 0, r.pow2_scales,
                                                  global_amax(tp, x2, r.input_for_grad_weight, 0, "mk", "m"))
                    grad_weight = gemm(goq.t(), _t(sgo), xq2, sx2, dtype, backend, False)
                else:
                    grad_weight = torch.mm(go.t(), x.reshape(-1, k))
                grad_weight = grad_weight.to(ctx.w_dtype)
        return grad_input, grad_weight, None, None, None, None, None


def _block_backward(ctx: Any, x: torch.Tensor, wt: torch.Tensor, go: torch.Tensor, go_shape: torch.Size
                    ) -> tuple[torch.Tensor | None, ...]:
    """The backward GEMMs of a block recipe, each operand cast by blocks along that GEMM's
    contracted dimension (a contiguous copy with it last, as torchao's emulated MXFP8 does)."""
    r, stats, dtype = ctx.recipe, ctx.stats, go.dtype
    backend = ctx.backend
    k = wt.shape[0]
    x2 = x.reshape(-1, k)
    grad_input = grad_weight = None
    with torch.autocast(go.device.type, enabled=False):
        if r.grad_output.is_fp8 and (ctx.needs_input_grad[0] or stats is not None):
            goc = quantize(go, r.grad_output, r.pow2_scales)
            _record(stats, GRAD_OUTPUT, go, goc)
        cw = r.grad_output_for_grad_weight
        if cw.is_fp8 and not r.grad_output.is_fp8:
            got = quantize(go.t().contiguous(), cw, r.pow2_scales)
            _record(stats, GRAD_OUTPUT, go.t(), got)
        if ctx.needs_input_grad[0]:
            if r.grad_output.is_fp8:
                wtc = quantize(wt.contiguous(), r.weight_for_grad_input, r.pow2_scales)
                grad_input = _block_mm(goc[:2], r.grad_output, wtc[:2], r.weight_for_grad_input, dtype, backend)
            else:
                grad_input = torch.mm(go, wt.t().to(dtype))
            grad_input = grad_input.reshape(*go_shape[:-1], k)
        if ctx.needs_input_grad[1]:
            if cw.is_fp8:
                if r.grad_output.is_fp8:
                    got = quantize(go.t().contiguous(), cw, r.pow2_scales)
                xt = quantize(x2.t().contiguous(), r.input_for_grad_weight, r.pow2_scales)
                grad_weight = _block_mm(got[:2], cw, xt[:2], r.input_for_grad_weight, dtype, backend)
            else:
                grad_weight = torch.mm(go.t(), x2)
            grad_weight = grad_weight.to(ctx.w_dtype)
    return grad_input, grad_weight, None, None, None, None, None


def _record_sqnr(sqnr: torch.Tensor, out: torch.Tensor, x2: torch.Tensor, wt: torch.Tensor) -> None:
    ref = torch.mm(x2, wt.to(x2.dtype)).double()
    record_sqnr(sqnr, ref, ref - out.double())


def resolve_backend(backend: str, input: torch.Tensor, weight: torch.Tensor,
                    recipe: Float8Recipe = _TENSORWISE) -> str:
    """The backend of this call: ``"scaled_mm"`` or an emulated one. ``"auto"`` picks torch's scaled
    GEMM where the device has it for every fp8 GEMM of ``recipe`` (:func:`~._native_gemm.missing`:
    tensor/row fp8 on CUDA sm89+ with every GEMM dimension a multiple of 16; blockwise on sm90;
    MXFP8, MXFP4 and NVFP4 on sm100), else ``"emulate"``, and says so once on the ``mixprec``
    logger.

    Raises ValueError for an unknown backend, or ``"scaled_mm"`` where it cannot run (naming
    what is missing: the device's capability, the torch build or a shape).
    """
    if backend not in BACKENDS:
        raise ValueError(f"fp8 backend must be one of {BACKENDS}, got {backend!r}")
    if backend in EMULATED:
        return backend
    gap = missing(recipe, input, weight)
    if gap is None:
        return "scaled_mm"
    if backend == "scaled_mm":
        raise ValueError(f"fp8 backend 'scaled_mm' for the {recipe.name!r} recipe needs {gap}; "
                         f"use backend='emulate' or 'auto'")
    if not torch.compiler.is_compiling():  # (eager calls say it; a log call would break the graph)
        note_emulated(recipe, gap, input.is_cuda)
    return "emulate"


def _block_mm(a: tuple[torch.Tensor, torch.Tensor], ca: Cast, b: tuple[torch.Tensor, torch.Tensor], cb: Cast,
              out_dtype: torch.dtype, backend: str) -> torch.Tensor:
    """One GEMM of fp8 block casts: torch's scaled GEMM, or emulated."""
    if backend == "scaled_mm":
        return block_mm(a, ca, b, cb, out_dtype)
    return block_gemm(a, ca, b, cb, out_dtype, backend == "emulate_fp32", backend == "emulate_tc")


def linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           recipe: Float8Recipe = _TENSORWISE, *, state: LayerState | None = None,
           backend: str = "auto") -> torch.Tensor:
    """``F.linear`` with its three GEMMs in fp8: output in ``input``'s dtype, differentiable.

    Bitwise equal to torchao's emulated ``Float8Linear`` (``emulate=True``) for the same recipe
    (``mxfp8``: torchao's ``MXFP8Linear`` with ``KernelPreference.EMULATED``; ``blockwise``:
    torchao's path needs Triton): output and the gradients of input, weight and bias. Under
    ``"scaled_mm"`` the same casts meet torch's scaled GEMMs (:mod:`._native_gemm`; the emulation
    of that call is this emulation, bitwise). The bias is added in high precision.
    With ``state``, the casts' statistics are accumulated into it on the device (no host sync),
    and a layer whose ``state.fallback`` is set runs ``F.linear`` in ``input``'s dtype instead;
    a ``state.recipe`` (a :class:`Controller`'s rung) replaces ``recipe``, and a ``state.probe``
    (the controller's measurements) sees input, weight and output (``probe.fp32``: the fallback
    GEMM runs in float32, output float32).
    Mixed precision regions are switched off inside: the GEMMs run exactly as the recipe says.

    An empty input (no rows) gives an empty output through ``F.linear`` (differentiable) and
    records nothing.

    Raises ValueError on shapes that do not fit (also a weight whose features are not multiples
    of the recipe's blocks, ``recipe.block_multiple``: ``mxfp4``, ``nvfp4``, ``mxfp8``,
    ``blockwise``; it would run on zero-padded blocks), non-floating inputs or an unknown backend.

    Example:
        >>> x, w = torch.randn(4, 32), torch.randn(16, 32, requires_grad=True)
        >>> y = linear(x, w, recipe=Float8Recipe.rowwise())
        >>> y.shape, y.dtype
        (torch.Size([4, 16]), torch.float32)
    """
    if not isinstance(recipe, Float8Recipe):
        raise ValueError(f"recipe must be a Float8Recipe (e.g. Float8Recipe.from_name('tensorwise')), got {recipe!r}")
    if weight.dim() != 2 or input.dim() < 1 or input.shape[-1] != weight.shape[1]:
        raise ValueError(f"fp8 linear: input of shape {tuple(input.shape)} does not fit weight of shape "
                         f"{tuple(weight.shape)} (expected input[..., {weight.shape[-1] if weight.dim() else '?'}] "
                         f"and a 2-D weight)")
    if not (input.is_floating_point() and weight.is_floating_point()) or input.element_size() < 2:
        raise ValueError(f"fp8 linear takes high-precision floating inputs (fp32, bf16, fp16), "
                         f"got {input.dtype} and {weight.dtype}")
    if is_distributed_tensor(input, weight, bias):  # tensor parallelism: the local shards, global scales
        rung = recipe if state is None else None if state.fallback else state.recipe or recipe
        return sharded_linear(input, weight, bias, lambda x, w, b, tp: _linear(x, w, b, recipe, state, backend, tp),
                              rung, None if state is None else state.name, None if state is None else state.window)
    return _linear(input, weight, bias, recipe, state, backend, None)


def local_linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: Float8Recipe,
                 backend: str, tp: Sharding | None) -> torch.Tensor:
    """:func:`linear` without a state on a tensor-parallel layer's local shards (``tp``: its
    sharding, None: plain tensors): the casts take the whole layer's scales, the result is the
    local output (colwise: its columns; rowwise: its partial sums, before the reduce). A
    Controller's estimate of another rung's error on a sharded layer. Preconditions: those of
    :func:`linear`, unchecked."""
    return _linear(input, weight, bias, recipe, None, backend, tp)


def linear_grads(input: torch.Tensor, weight: torch.Tensor, grad_output: torch.Tensor, recipe: Float8Recipe,
                 wanted: tuple[bool, bool] = (True, True), backend: str = "emulate_fp32"
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The input and weight gradients (each only where ``wanted``; the other GEMM does not run)
    that the backward of :func:`linear` ``(input, weight, None, recipe, backend=backend)`` gives
    for ``grad_output``, without running its forward GEMM: bitwise ``torch.autograd.grad`` through
    it. What a Controller's shadow step emulates of another rung's backward GEMMs.

    Preconditions (unchecked): those of :func:`linear` on plain, non-empty tensors without a
    state; ``grad_output`` in ``input``'s dtype and the output's shape. Autocast is off inside.

    Example:
        >>> x, w, g = torch.randn(4, 32), torch.randn(16, 32), torch.randn(4, 16)
        >>> gi, gw = linear_grads(x, w, g, Float8Recipe.rowwise())
        >>> gi.shape, gw.shape
        (torch.Size([4, 32]), torch.Size([16, 32]))
    """
    backend = resolve_backend(backend, input, weight, recipe)
    with torch.autocast(input.device.type, enabled=False):
        if recipe.fp4:
            return fp4_grads(input, weight, grad_output, recipe, wanted, backend)
        r, wt = recipe, weight.t()
        saved: tuple[torch.Tensor, ...] = (input, wt)
        if r.save_fp8:  # the forward's casts, without its GEMM
            xc = cast_to_fp8(input, r.input, -1, r.pow2_scales, None)
            wc = _cast_weight(wt, r.weight, 0, r.pow2_scales)
            saved = (xc[0], xc[1], wc[0], wc[1])
        ctx = SimpleNamespace(recipe=r, backend=backend, stats=None, tp=None, x_shape=input.shape,
                              w_dtype=weight.dtype, saved_tensors=saved, needs_input_grad=wanted)
        return _Float8Matmul.backward(ctx, grad_output)[:2]


def _linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: Float8Recipe,
            state: LayerState | None, backend: str, tp: Sharding | None) -> torch.Tensor:
    """:func:`linear` on plain tensors (under tensor parallelism ``tp``: the local shards)."""
    gathered = isinstance(weight, GatheredFloat8Weight)
    probe = state.probe if state is not None else None
    if input.numel() == 0:  # an empty batch: nothing to cast, nothing to record (no amax of nothing)
        fp32 = state is not None and state.fallback and probe is not None and probe.fp32
        dtype = torch.float32 if fp32 else input.dtype
        with torch.autocast(input.device.type, enabled=False):
            return F.linear(input.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))
    if state is not None and state.recipe is not None:  # a Controller's rung
        recipe = state.recipe
    if gathered and ((state is not None and state.fallback) or not reads_gathered(weight, recipe)):
        # FSDP2's fp8 all-gather brought the weight cast for the layer's first recipe: the compute
        # dtype and another recipe's casts run on it dequantized (differentiable, as the weight)
        if state is not None and state.fallback:
            warn_fallback(state)
        weight, gathered = weight.clone(), False
    if state is not None and state.fallback:
        if probe is not None and probe.fp32:  # a Controller's fp32 rung
            with torch.autocast(input.device.type, enabled=False):
                out = F.linear(input.float(), weight.float(), None if bias is None else bias.float())
        else:
            out = F.linear(input, weight.to(input.dtype), None if bias is None else bias.to(input.dtype))
        return out if probe is None else probe(input, weight, out, bias, tp)
    blocks = recipe.block_multiple
    if any(f % blocks for f in weight.shape):
        raise ValueError(f"fp8 linear: a weight of shape {tuple(weight.shape)} (out, in features) whose features "
                         f"are not multiples of {blocks}, the {recipe.name!r} recipe's blocks (fp8.convert "
                         f"refuses such layers); pad the layer to a multiple of {blocks}, or pick a recipe "
                         f"without blocks ('tensorwise', 'rowwise')")
    backend = resolve_backend(backend, input, weight, recipe)
    stats = sqnr = None
    if state is not None:
        if state.device != input.device:
            state.to(input.device)
        stats = state.window
        sqnr = state.output_sqnr_db if state.sample_sqnr else None
    if state is not None and not torch.compiler.is_compiling():  # (a Python attribute Dynamo would guard on:
        e2m1 = _e2m1_operands(recipe)                               # set by the eager calls, read by a Guard)
        if state.e2m1 != e2m1:
            state.e2m1 = e2m1
        ran = "scaled_mm" if backend == "scaled_mm" else "emulated"
        if state.__dict__.get("backend") != ran:  # (a state pickled before it existed has none)
            state.backend = ran
    tap = getattr(probe, "tap", None) if not gathered else None
    if tap is not None:  # (a Controller measuring the backward GEMMs' cost reads their results)
        input, weight = tap(input, weight)
    if recipe.fp4:  # its own GEMM path (fp8/_fp4_linear.py); the layer's call count seeds stochastic rounding
        step = (state.next_rounding_step(recipe.stochastic_rounding) if state is not None
                else input.new_zeros((), dtype=torch.int64))
        out = Fp4Matmul.apply(input, weight, bias, recipe, stats, sqnr, step, backend, tp)
    else:
        out = _Float8Matmul.apply(input, weight, recipe, backend, stats, sqnr, tp)
        if bias is not None:
            out = out + bias.to(out.dtype)
    return out if probe is None else probe(input, None if gathered else weight, out, bias, tp)


def _e2m1_operands(r: Float8Recipe) -> tuple[bool, bool, bool]:
    """Whether ``r`` casts input, weight, grad_output (in any GEMM) to e2m1."""
    return (r.input.is_fp4 or r.input_for_grad_weight.is_fp4, r.weight.is_fp4 or r.weight_for_grad_input.is_fp4,
            r.grad_output.is_fp4 or r.grad_output_for_grad_weight.is_fp4)
