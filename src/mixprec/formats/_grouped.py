"""The experts of a mixture of experts in fp8 and fp4: :func:`grouped_linear` and :class:`GroupedExperts`.

A token-choice MoE layer sorts its tokens by expert; expert ``e`` multiplies rows ``offsets[e-1]:offsets[e]`` of
the input by its weight ``weight[e]`` (``[E, out, in]``, as torchtitan's ``GroupedExperts``). Each expert is
cast as :func:`~mixprec.formats._linear.linear` casts one layer, on its own rows only: its own scales
(tensorwise: one per expert and operand, so one expert's outlier leaves the others' scales alone; rowwise and
blocks: within its rows), its own statistics window (:class:`~mixprec.formats._state.LayerState`), its own
fallback and Controller recipe. Every GEMM takes its operands with the contracted dimension last
(:func:`~mixprec.formats._fp4_linear.cast_operand`), dequantized in the GEMM's dtype
(:func:`~mixprec.formats._fp4_linear.gemm_values`: float32 for tensor/row-scaled fp8, the input's dtype for MX
and fp4 blocks, float32 for all with the backend ``"emulate_fp32"``), and the experts' GEMM runs as one
``torch.nn.functional.grouped_mm``: the forward and the input gradient on the jagged token rows, the weight
gradient with the tokens as the jagged contracted dimension (one ``[out, in]`` gradient per expert). Experts
whose GEMMs run in different dtypes (one in fallback) get one grouped GEMM per dtype, each over the rows of its
own experts. Under ``backend="scaled_mm"`` (``"auto"`` where the device has it) the GEMMs that torch's grouped
scaled GEMM takes (rowwise e4m3, MXFP8) run there on the same casts instead (:mod:`._grouped_native`).

An expert that receives no tokens casts nothing and records nothing (no amax of nothing): its rows
are empty and its weight gradient is zero, as :func:`linear` on an empty batch.
"""

from __future__ import annotations

import weakref
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mixprec.formats._fp4 import RoundingKey
from mixprec.formats._hadamard import hadamard, hadamard_of
from mixprec.formats._fp4_linear import _GO_GRAD_INPUT, _GO_GRAD_WEIGHT, _record, cast_operand, gemm_values
from mixprec.formats._grouped_native import grouped_jagged, grouped_rows, resolve_grouped, split_native
from mixprec.formats._linear import BACKENDS, _e2m1_operands, _record_sqnr
from mixprec.formats._recipe import Cast, Float8Recipe
from mixprec.formats._state import _ATTR, GRAD_OUTPUT, INPUT, WEIGHT, LayerState

__all__ = ["grouped_linear", "GroupedExperts", "ExpertLayer", "grouped_states", "WEIGHTS"]

_HP = Cast("none")
_TENSORWISE = Float8Recipe.tensorwise()
#: the weights of :class:`GroupedExperts` (torchtitan's names): gate, down and up projections.
WEIGHTS = ("w1", "w2", "w3")
_STATES, _POLICY, _LAYERS = "_mixprec_grouped_states", "_mixprec_grouped_policy", "_mixprec_grouped_layers"
#: the plan of an expert on a Controller's fp32 rung: its GEMMs in float32, no cast.
_FP32 = "fp32"


def _cast(plan: Float8Recipe | str | None, field: str) -> Cast:
    """An expert's cast of one operand: its recipe's, or none for an expert in the compute dtype (or float32)."""
    return getattr(plan, field) if isinstance(plan, Float8Recipe) else _HP


def _hp(t: torch.Tensor, plan: Float8Recipe | str | None) -> torch.Tensor:
    """An operand as the expert's GEMM takes it before any cast: in float32 on the fp32 rung."""
    return t.float() if plan == _FP32 else t


def _stack_t(mats: list[torch.Tensor]) -> torch.Tensor:
    """``[E, r, c]`` dequantized operands ``b`` as the ``[E, c, r]`` right operand ``b.t()`` (a view, the
    layout of the one-expert GEMM's ``b.t()``)."""
    return torch.stack(mats).transpose(-2, -1)


def _takes(a: torch.Tensor) -> bool:
    """Whether ``F.grouped_mm`` takes operands like ``a`` (the CPU kernel: every float dtype; CUDA's: bf16)."""
    return a.device.type == "cpu" or a.dtype == torch.bfloat16


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """``F.grouped_mm(a, b, offs=offs)`` where it takes the operands (on the CPU, every float dtype;
    elsewhere bf16 only: torch 2.13's CUDA kernel), else the same GEMMs one ``mm`` per group
    (``bounds``: the host copy of ``[0, *offs]``)."""
    if _takes(a):
        return F.grouped_mm(a, b, offs=offs)
    if b.dim() == 3:  # jagged rows
        return torch.cat([a[s:t] @ b[e] for e, (s, t) in enumerate(zip(bounds, bounds[1:]))])
    return torch.stack([a[:, s:t] @ b[s:t] for s, t in zip(bounds, bounds[1:])])  # jagged contracted dim


def _run_rows(groups: list[tuple[Any, Cast, Any, Cast] | None], b_shape: tuple[int, int], bounds: list[int],
              out_dtype: torch.dtype, backend: str, device: torch.device) -> torch.Tensor:
    """``A_e @ B_e.t()`` of each expert on its rows, one grouped GEMM per GEMM dtype (and one on
    torch's grouped scaled GEMM per kind under ``backend="scaled_mm"``): ``groups[e]`` is ``(a, ca, b, cb)``
    of :func:`cast_operand` (``a``: the expert's rows, ``b``: ``b_shape`` with the contracted
    dimension last), None for an expert without rows."""
    native, groups = split_native(groups, backend, device)
    values = [None if g is None else gemm_values(*g, out_dtype, backend == "emulate_fp32") for g in groups]
    dtypes = list(dict.fromkeys(v[0].dtype for v in values if v is not None))
    offs = torch.tensor(bounds[1:], dtype=torch.int32, device=device)
    out = None
    for kind, ops in native.items():
        part = grouped_rows(kind, ops, bounds, *b_shape, device).to(out_dtype)
        out = part if out is None else out + part
    if out is None and not dtypes:
        out = torch.zeros(bounds[-1], b_shape[0], dtype=out_dtype, device=device)
    for dtype in dtypes:  # (one in nearly every call: the experts' GEMMs in one dtype)
        rows, mats = [], []
        for e, v in enumerate(values):
            n = bounds[e + 1] - bounds[e]
            if v is not None and v[0].dtype == dtype:
                rows.append(v[0])
                mats.append(v[1].t())
            else:  # another dtype's expert (its rows come from its own GEMM), or no rows
                rows.append(torch.zeros(n, b_shape[1], dtype=dtype, device=device))
                mats.append(torch.zeros(b_shape, dtype=dtype, device=device))
        part = _grouped_mm(torch.cat(rows), _stack_t(mats), offs, bounds).to(out_dtype)
        out = part if out is None else out + part
    return out


def _run_jagged(groups: list[tuple[Any, Cast, Any, Cast] | None], shape: tuple[int, int],
                out_dtype: torch.dtype, backend: str, device: torch.device) -> torch.Tensor:
    """``[E, *shape]``: ``A_e @ B_e.t()`` of each expert over its tokens (the weight gradient),
    in grouped GEMMs as :func:`_run_rows` runs them; an expert whose group is None: zeros."""
    native, groups = split_native(groups, backend, device)
    values = [None if g is None else gemm_values(*g, out_dtype, backend == "emulate_fp32") for g in groups]
    dtypes = list(dict.fromkeys(v[0].dtype for v in values if v is not None))
    out = torch.zeros(len(groups), *shape, dtype=out_dtype, device=device) if not native else None
    for kind, ops in native.items():
        part = grouped_jagged(kind, ops, *shape, device).to(out_dtype)
        out = part if out is None else out + part
    for dtype in dtypes:
        a_rows, b_rows, ends, end = [], [], [], 0
        for v in values:
            if v is not None and v[0].dtype == dtype:
                a_rows.append(v[0].t())  # [tokens, out]: the tokens-major layout grouped_mm's strides take
                b_rows.append(v[1])
                end += v[1].shape[0]
            ends.append(end)
        offs = torch.tensor(ends, dtype=torch.int32, device=device)
        out = out + _grouped_mm(torch.cat(a_rows).t(), torch.cat(b_rows), offs, [0, *ends]).to(out_dtype)
    return out


class _GroupedMatmul(torch.autograd.Function):
    """``x[rows of e] @ w[e].t()`` for every expert ``e`` with its own casts (see the module's docstring).
    ``bounds``: the ``E + 1`` row boundaries (host ints); ``plans[e]``: the expert's recipe, None for the
    compute dtype; ``windows``, ``sqnrs``, ``steps``: per expert, its statistics window, sampled SQNR
    and fp4 rounding step (or None); ``backend``: resolved (``"scaled_mm"`` or an emulated one)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, bounds: list[int], plans: tuple,
                windows: tuple, sqnrs: tuple, steps: tuple, backend: str) -> torch.Tensor:
        dtype = x.dtype
        with torch.autocast(x.device.type, enabled=False):
            groups = []
            for e, plan in enumerate(plans):
                x_e = x[bounds[e]:bounds[e + 1]]
                if x_e.shape[0] == 0:
                    groups.append(None)
                    continue
                ci, cw = _cast(plan, "input"), _cast(plan, "weight")
                xa, xq, xamax = cast_operand(_hp(x_e, plan), ci, plan)
                wb, wq, wamax = cast_operand(_hp(w[e], plan), cw, plan)
                _record(windows[e], INPUT, x_e, xa, xq, xamax)
                _record(windows[e], WEIGHT, w[e], wb, wq, wamax)
                groups.append((xa, ci, wb, cw))
            out = _run_rows(groups, tuple(w.shape[1:]), bounds, dtype, backend, x.device)
            for e, sqnr in enumerate(sqnrs):
                if sqnr is not None and groups[e] is not None:
                    _record_sqnr(sqnr, out[bounds[e]:bounds[e + 1]], x[bounds[e]:bounds[e + 1]], w[e].t())
        ctx.bounds, ctx.plans, ctx.windows, ctx.steps, ctx.backend = bounds, plans, windows, steps, backend
        ctx.save_for_backward(x, w)
        return out

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w = ctx.saved_tensors
        bounds, plans, windows = ctx.bounds, ctx.plans, ctx.windows
        go_all, dtype = grad_output, grad_output.dtype
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_input = grad_weight = None
        with torch.autocast(go_all.device.type, enabled=False):
            rows, cols = [], []
            for e, plan in enumerate(plans):
                go = go_all[bounds[e]:bounds[e + 1]]
                if go.shape[0] == 0:
                    rows.append(None)
                    cols.append(None)
                    continue
                r, stats, go = plan, windows[e], _hp(go, plan)
                rng = (lambda s: RoundingKey(r.seed, ctx.steps[e], s)) if isinstance(r, Float8Recipe) \
                    and r.stochastic_rounding else (lambda s: None)
                cg, cw = _cast(r, "grad_output"), _cast(r, "grad_output_for_grad_weight")
                ga = None
                if cg.is_fp8 and (need_x or stats is not None):
                    ga, gq, gamax = cast_operand(go, cg, r, rng(_GO_GRAD_INPUT) if cg.is_fp4 else None)
                    _record(stats, GRAD_OUTPUT, go, ga, gq, gamax)
                if need_x:
                    cwi = _cast(r, "weight_for_grad_input")
                    wb = cast_operand(_hp(w[e], r).t().contiguous(), cwi, r)[0]
                    rows.append((go if ga is None else ga, cg, wb, cwi))
                if need_w or (stats is not None and cw.is_fp8 and not cg.is_fp8):
                    x_e, got = _hp(x[bounds[e]:bounds[e + 1]], r), go.t()
                    xt = x_e.t()
                    if isinstance(r, Float8Recipe) and r.hadamard and r.input_for_grad_weight.is_fp4:
                        h = hadamard_of(r.seed, go)
                        got, xt = hadamard(got, h), hadamard(xt, h)
                    gb = got
                    if cw.is_fp8:
                        gb, gq, gamax = cast_operand(got.contiguous(), cw, r, rng(_GO_GRAD_WEIGHT) if cw.is_fp4 else None)
                        if not cg.is_fp8:
                            _record(stats, GRAD_OUTPUT, got, gb, gq, gamax)
                    cx = _cast(r, "input_for_grad_weight")
                    cols.append((gb, cw, cast_operand(xt.contiguous(), cx, r)[0], cx))
            if need_x:
                grad_input = _run_rows(rows, (w.shape[2], w.shape[1]), bounds, dtype, ctx.backend, go_all.device)
                if grad_input.shape[0] < x.shape[0]:  # rows after the last expert's: no gradient
                    grad_input = F.pad(grad_input, (0, 0, 0, x.shape[0] - grad_input.shape[0]))
            if need_w:
                grad_weight = _run_jagged(cols, tuple(w.shape[1:]), dtype, ctx.backend, go_all.device).to(w.dtype)
        return grad_input, grad_weight, None, None, None, None, None, None


def _check(input: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, recipe: Float8Recipe,
           states: Sequence[LayerState] | None, backend: str) -> list[int]:
    """The row bounds ``[0, *offsets]`` (one host sync), after checking every argument."""
    if not isinstance(recipe, Float8Recipe):
        raise ValueError(f"recipe must be a Float8Recipe (e.g. Float8Recipe.from_name('tensorwise')), got {recipe!r}")
    if backend not in BACKENDS:
        raise ValueError(f"fp8 backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "emulate_tc":
        raise ValueError("grouped_linear has no backend='emulate_tc' (no tensor-core accumulation model for the "
                         "experts yet); use backend='emulate', 'emulate_fp32', 'scaled_mm' or 'auto'")
    if input.dim() != 2 or weight.dim() != 3 or input.shape[1] != weight.shape[2]:
        raise ValueError(f"grouped_linear: input of shape {tuple(input.shape)} does not fit weight of shape "
                         f"{tuple(weight.shape)} (expected input [tokens, in] and weight [experts, out, in])")
    if not (input.is_floating_point() and weight.is_floating_point()) or input.element_size() < 2:
        raise ValueError(f"grouped_linear takes high-precision floating inputs (fp32, bf16, fp16), "
                         f"got {input.dtype} and {weight.dtype}")
    blocks = recipe.block_multiple
    if any(f % blocks for f in weight.shape[1:]):
        raise ValueError(f"grouped_linear: expert weights of shape {tuple(weight.shape[1:])} (out, in) whose features "
                         f"are not multiples of {blocks}, the {recipe.name!r} recipe's blocks; pad them, or pick "
                         f"a recipe without blocks ('tensorwise', 'rowwise')")
    experts = weight.shape[0]
    if states is not None and len(states) != experts:
        raise ValueError(f"grouped_linear: {len(states)} states for {experts} experts (one LayerState per expert)")
    if offsets.dim() != 1 or offsets.numel() != experts or offsets.is_floating_point():
        raise ValueError(f"grouped_linear: offsets must be {experts} integers (the end row of each expert's "
                         f"tokens, cumulative), got shape {tuple(offsets.shape)} of {offsets.dtype}")
    bounds = [0, *offsets.tolist()]
    if any(b > a for a, b in zip(bounds[1:], bounds)) or bounds[-1] > input.shape[0]:
        raise ValueError(f"grouped_linear: offsets {bounds[1:]} must not decrease and end at most at the "
                         f"{input.shape[0]} input rows")
    return bounds


def grouped_linear(input: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
                   recipe: Float8Recipe = _TENSORWISE, *, states: Sequence[LayerState] | None = None,
                   backend: str = "auto") -> torch.Tensor:
    """The experts' linear layers of a mixture of experts, in fp8 or fp4: row ``i`` of the output is
    ``input[i] @ weight[e].t()`` for the expert ``e`` whose rows hold ``i`` (``offsets[e-1] <= i <
    offsets[e]``, ``offsets`` cumulative as ``torch.nn.functional.grouped_mm`` takes them); rows after
    ``offsets[-1]`` (padding) give zeros. Differentiable (input and weight); output in ``input``'s dtype.

    Each expert runs as :func:`mixprec.fp8.linear` would on its rows alone, with its own scales: the
    same casts, the same statistics and, where the GEMM kernel reads the operands alike, the same
    bits (see the module's docstring); the three GEMMs of all experts run as grouped GEMMs.
    ``states`` (one :class:`LayerState` per expert): each expert's casts are recorded into its own
    window on the device, its ``fallback`` runs it in ``input``'s dtype (in float32 with a
    ``probe.fp32``: a Controller's fp32 rung), its ``recipe`` (a Controller's rung) replaces
    ``recipe``, ``sample_sqnr`` measures its output SQNR, and its ``probe`` is called on its rows
    (``probe(rows, weight[e], out_rows)``). Mixed precision regions are switched off inside.

    .. warning:: reads ``offsets`` on the host: one host sync per call (the casts need each
       expert's rows).

    Raises ValueError on shapes that do not fit (also expert weights whose features are not
    multiples of the recipe's blocks), offsets that decrease or pass the input's rows, a number of
    states other than the experts', non-floating inputs, an unknown backend or ``"emulate_tc"``, and
    ``"scaled_mm"`` where torch's grouped scaled GEMM cannot run (naming what is missing: the
    device, the recipe's casts or the features; ``"auto"`` then emulates and says so once).

    Example:
        >>> x, w = torch.randn(6, 32), torch.randn(3, 16, 32)
        >>> grouped_linear(x, w, torch.tensor([2, 2, 6]), Float8Recipe.rowwise()).shape
        torch.Size([6, 16])
    """
    bounds = _check(input, weight, offsets, recipe, states, backend)
    experts = weight.shape[0]
    plans, windows, sqnrs, steps, probes = [], [], [], [], []
    for e in range(experts):
        st = states[e] if states is not None else None
        plan = recipe if st is None or st.recipe is None else st.recipe
        if st is not None and st.fallback:
            plan = _FP32 if st.probe is not None and st.probe.fp32 else None
        active = bounds[e + 1] > bounds[e]
        if st is not None and st.device != input.device:
            st.to(input.device)
        low = isinstance(plan, Float8Recipe)
        if st is not None and low and not torch.compiler.is_compiling():
            st.e2m1 = _e2m1_operands(plan)
        fp4 = low and plan.fp4 and active
        steps.append((st.next_rounding_step() if st is not None else input.new_zeros((), dtype=torch.int64))
                     if fp4 else None)
        plans.append(plan)
        windows.append(st.window if st is not None and low else None)
        sqnrs.append(st.output_sqnr_db if st is not None and low and st.sample_sqnr else None)
        probes.append(st.probe if st is not None and active else None)
    out = _GroupedMatmul.apply(input, weight, bounds, tuple(plans), tuple(windows), tuple(sqnrs),
                               tuple(steps), resolve_grouped(backend, input, weight, recipe))
    if any(p is not None for p in probes):  # a Controller measures its experts: each on its rows
        out = torch.cat([out[s:t] if p is None else p(input[s:t], weight[e], out[s:t])
                         for e, (p, s, t) in enumerate(zip(probes, bounds, bounds[1:]))])
    if out.shape[0] < input.shape[0]:  # padding rows after the last expert's
        out = F.pad(out, (0, 0, 0, input.shape[0] - out.shape[0]))
    return out


def grouped_states(module: nn.Module) -> dict[str, LayerState]:
    """``{"w1[0]": LayerState, ...}``: one statistics window per weight and expert of a
    :class:`GroupedExperts` that ran or runs in fp8 (converted, or selected by a policy; empty for
    any other module): what :func:`~mixprec.control._guard.layer_states` names ``f"{fqn}.{key}"``,
    each a layer of its own for ``fp8.stats`` and a Guard."""
    states = module.__dict__.get(_STATES)
    return {} if states is None else {f"{n}[{e}]": st for n, per in states.items() for e, st in enumerate(per)}


class ExpertLayer(nn.Module):
    """One expert of one weight of a :class:`GroupedExperts`, as a Controller sees a layer: its
    ``weight`` (``[out, in]``, a view of the stacked parameter), features ``nx`` (in) and ``nf``
    (out), its :class:`LayerState`. Not a submodule (no parameters, no state dict entries): the
    experts' module keeps one per weight and expert (:meth:`GroupedExperts.expert_layers`)."""

    def __init__(self, parent: GroupedExperts, name: str, expert: int, state: LayerState) -> None:
        super().__init__()
        self.__dict__["_parent"] = parent  # (not registered: the parent's, not a child)
        self.weight_name, self.expert = name, expert
        self.nf, self.nx = getattr(parent, name).shape[1:]
        self.__dict__[_ATTR] = state

    @property
    def weight(self) -> torch.Tensor:
        return getattr(self.__dict__["_parent"], self.weight_name)[self.expert]

    def extra_repr(self) -> str:
        return f"{self.weight_name}[{self.expert}], nx={self.nx}, nf={self.nf}"


class GroupedExperts(nn.Module):
    """The experts of a token-choice mixture of experts, torchtitan's ``GroupedExperts``: each a
    SwiGLU feed-forward ``w2 @ (silu(w1 @ x) * (w3 @ x))``, the weights of all experts stacked
    ``[E, out, in]`` (``w1``, ``w3``: ``[E, hidden_dim, dim]``; ``w2``: ``[E, dim, hidden_dim]``).

    ``forward(x, num_tokens_per_expert)`` takes the tokens sorted by expert (``[tokens, dim]``) and
    how many each expert receives. With ``recipe`` None it runs in ``x``'s dtype through
    ``grouped_mm`` (under a ``Policy.fp8`` region that selects it, eager: in the policy's recipe);
    with a recipe (:func:`mixprec.fp8.convert` sets it) its three GEMMs run through
    :func:`grouped_linear`, each expert of each weight with its own scales and its own
    :class:`LayerState` (:func:`grouped_states`; named ``"<fqn>.w1[3]"`` by ``fp8.stats`` and a Guard).
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, *, recipe: Float8Recipe | str | None = None,
                 backend: str = "auto", device: Any = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if num_experts < 1 or dim < 1 or hidden_dim < 1:
            raise ValueError(f"GroupedExperts needs dim, hidden_dim and num_experts >= 1, got "
                             f"{dim}, {hidden_dim}, {num_experts}")
        self.dim, self.hidden_dim, self.num_experts = dim, hidden_dim, num_experts
        kw = {"device": device, "dtype": dtype}
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim, **kw))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim, **kw))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim, **kw))
        for w in (self.w1, self.w2, self.w3):
            nn.init.trunc_normal_(w, std=0.02)
        self.recipe, self.backend = None, backend
        if recipe is not None:
            self.set_recipe(recipe, backend)

    def set_recipe(self, recipe: Float8Recipe | None, backend: str = "auto") -> None:
        """Run the experts in ``recipe`` (None: in the input's dtype, statistics dropped); each
        expert of each weight gets a fresh :class:`LayerState` on its weight's device."""
        if backend not in BACKENDS:
            raise ValueError(f"fp8 backend must be one of {BACKENDS}, got {backend!r}")
        if isinstance(recipe, str):
            recipe = Float8Recipe.from_name(recipe)
        if recipe is not None and not isinstance(recipe, Float8Recipe):
            raise ValueError(f"recipe must be a Float8Recipe, a recipe name or None, got {recipe!r}")
        self.recipe, self.backend = recipe, backend
        self.__dict__.pop(_STATES, None)
        if recipe is not None:
            self.ensure_states()

    def ensure_states(self) -> None:
        """Give each expert of each weight its :class:`LayerState` if it has none (a policy's run)."""
        if _STATES not in self.__dict__:
            self.__dict__[_STATES] = {n: [LayerState(getattr(self, n).device) for _ in range(self.num_experts)]
                                      for n in WEIGHTS}

    def expert_layers(self) -> dict[str, ExpertLayer]:
        """``{"w1[0]": ExpertLayer, ...}``, the same objects on every call (a Controller records
        each as a layer), for the states of :func:`grouped_states` (created if missing)."""
        self.ensure_states()
        layers = self.__dict__.get(_LAYERS)
        if layers is None or any(layer.__dict__[_ATTR] is not st for layer, st in
                                 zip(layers.values(), grouped_states(self).values())):
            layers = {f"{n}[{e}]": ExpertLayer(self, n, e, st) for n, per in self.__dict__[_STATES].items()
                      for e, st in enumerate(per)}
            self.__dict__[_LAYERS] = layers
        return layers

    def enter_policy(self, owner: object, recipe: Float8Recipe, backend: str) -> None:
        """A policy's call of the module (the fp8 seam's target ``owner``, while it lives, until
        :meth:`leave_policy`) runs its experts in ``recipe`` when it has none of its own."""
        self.ensure_states()
        self.__dict__.setdefault(_POLICY, []).append((weakref.ref(owner), recipe, backend))

    def leave_policy(self) -> None:
        stack = self.__dict__.get(_POLICY)
        if stack:
            stack.pop()
        if not stack:
            self.__dict__.pop(_POLICY, None)

    def _running(self) -> tuple[Float8Recipe | None, str]:
        """``(recipe, backend)`` of this call: its own, else the policy's whose call it is, else none."""
        if self.recipe is not None:
            return self.recipe, self.backend
        for owner, recipe, backend in reversed(self.__dict__.get(_POLICY, ())):
            if owner() is not None:  # (a call that raised left its entry: its target is gone with its region)
                return recipe, backend
        return None, self.backend

    def _linear(self, name: str, x: torch.Tensor, offsets: torch.Tensor, recipe: Float8Recipe | None,
                backend: str) -> torch.Tensor:
        w = getattr(self, name)
        if recipe is None:
            bounds = [0, *offsets.tolist()]
            out = _grouped_mm(x[:bounds[-1]], w.to(x.dtype).transpose(-2, -1), offsets, bounds)
            return F.pad(out, (0, 0, 0, x.shape[0] - bounds[-1]))  # (padding rows: zeros)
        return grouped_linear(x, w, offsets, recipe, states=self.__dict__[_STATES][name], backend=backend)

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        if torch.is_autocast_enabled(device):
            x = x.to(torch.get_autocast_dtype(device))
        offsets = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
        run = self._running()
        h = F.silu(self._linear("w1", x, offsets, *run)) * self._linear("w3", x, offsets, *run)
        return self._linear("w2", h, offsets, *run)

    def extra_repr(self) -> str:
        recipe = "none" if self.recipe is None else self.recipe.name
        return f"dim={self.dim}, hidden_dim={self.hidden_dim}, num_experts={self.num_experts}, recipe={recipe}"
