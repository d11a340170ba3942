"""Tensor parallelism for the fp8/fp4 linear: scales that span a sharded dimension are global.

torch.distributed's ``ColwiseParallel`` and ``RowwiseParallel`` hand a layer's ``F.linear``
DTensors: the weight sharded along its out features (``Shard(0)``) or its in features
(``Shard(1)``, the contracted dimension). :func:`sharded_linear` runs the fp8/fp4 GEMMs on the
local shards and gives a DTensor back (colwise: the output sharded along its last dimension;
rowwise: the partial sums, which the layer's output hook reduces). A :class:`Sharding` names the
sharded dimension of the layer's three (``m`` tokens, ``k`` in features, ``n`` out features),
and the casts ask it, through :func:`global_amax` and :func:`tensor_amax_reduce`, for the amax of
a scale that spans that dimension: the local amax all-reduced (MAX) over the TP group, so every
shard casts with the scale one process would use:

* a tensor scale (``tensorwise``; NVFP4's per-tensor scale) of an operand that holds the
  sharded dimension: one scalar all-reduced;
* a row scale taken over the sharded dimension (the contracted one of that GEMM): one amax per
  row all-reduced (rowwise: the input's rows in a rowwise layer's forward, grad_output's and the
  weight's in a colwise layer's input-gradient GEMM);
* block scales stay local: their blocks lie inside a shard, which :func:`check_blocks` makes
  sure of (a block that would straddle two shards is refused).

A colwise layer whose input is sharded along the sequence (:func:`colwise_sequence_parallel`)
gathers it itself, in fp8 where the recipe allows (:func:`gathers_fp8`): half the bytes of bf16.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from mixprec.formats._fsdp import GatheredFloat8Weight
from mixprec.formats._quant import cast_to_fp8
from mixprec.formats._recipe import Cast, Float8Recipe
from mixprec.formats._state import INPUT, record_cast

__all__ = ["Sharding", "gathered_copy", "global_amax", "probe_operand", "gathers_fp8", "colwise_sequence_parallel", "shard_window", "tensor_amax_reduce", "is_distributed_tensor", "sharded_linear",
           "check_blocks"]


def is_distributed_tensor(*tensors: Any) -> bool:
    """Whether any of ``tensors`` is a DTensor (``torch.distributed.tensor``)."""
    if not dist.is_available() or all(type(t).__name__ != "DTensor" for t in tensors):
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(t, DTensor) for t in tensors)


@dataclass(frozen=True, eq=False)
class Sharding:
    """Which dimension of a linear layer's GEMMs a tensor-parallel ``group`` shards: ``"n"``
    (out features: ``ColwiseParallel``) or ``"k"`` (in features, the forward's contracted
    dimension: ``RowwiseParallel``)."""

    dim: str
    group: Any

    def reduce(self, amax: torch.Tensor, op: Any = dist.ReduceOp.MAX) -> torch.Tensor:
        """``amax`` all-reduced (``op``: MAX) over the group, in float32: a new tensor in
        ``amax``'s dtype (through the CPU on gloo)."""
        on_cpu = dist.get_backend(self.group) == "gloo" and amax.device.type != "cpu"
        buf = amax.detach().to("cpu" if on_cpu else amax.device, torch.float32, copy=True)
        dist.all_reduce(buf, op=op, group=self.group)
        return buf.to(device=amax.device, dtype=amax.dtype)


def global_amax(tp: Sharding | None, t: torch.Tensor, cast: Cast, row_dim: int, has: str, reduced: str
                ) -> torch.Tensor | None:
    """The amax an fp8 tensor or row cast of ``t`` takes under ``tp`` when its scale spans the
    sharded dimension, else None (the cast takes its own). ``has``: the layer dimensions ``t``
    holds (``"mk"`` for the input, ``"kn"`` for the weight as ``W.t()``, ...); ``reduced``: the
    one a row scale is taken over (along ``row_dim``). Block casts: None (local, see
    :func:`check_blocks`)."""
    if tp is None or not cast.is_fp8 or cast.block is not None or tp.dim not in has:
        return None
    with torch.no_grad():
        if cast.granularity == "tensor":
            return tp.reduce(torch.max(torch.abs(t)))
        if reduced == tp.dim:
            return tp.reduce(torch.amax(torch.abs(t), dim=row_dim, keepdim=True))
    return None


def tensor_amax_reduce(tp: Sharding | None, cast: Cast, has: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """For an NVFP4 cast (e4m3 block scales under a float32 tensor scale) of an operand holding
    the sharded dimension: what makes its local tensor amax global (:meth:`Sharding.reduce`);
    else None."""
    if tp is None or not cast.is_fp4 or cast.scale_format != "e4m3" or tp.dim not in has:
        return None
    return tp.reduce


def shard_window(tp: Sharding | None, shape: tuple[int, ...], cast: Cast, has: str
                 ) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """Where the 2-D shard of ``shape`` (layer dimensions ``has``, e.g. ``"mn"``) lies in the
    tensor one process casts, both padded to ``cast``'s blocks: ``((rows, cols), (row0, col0))``,
    what a stochastic rounding key takes to draw the one process's numbers
    (:class:`~mixprec.formats._fp4.RoundingKey`); None when ``tp`` shards none of its dimensions.
    (Shards are even: :func:`check_blocks` made each a multiple of the blocks.)"""
    if tp is None or tp.dim not in has:
        return None
    axis = has.index(tp.dim)
    rank, size = dist.get_rank(tp.group), dist.get_world_size(tp.group)
    full = [shape[0], shape[1]]
    full[axis] *= size
    padded = tuple(-(-f // b) * b for f, b in zip(full, cast.block))
    offset = [0, 0]
    offset[axis] = rank * shape[axis]
    return (padded[0], padded[1]), (offset[0], offset[1])


def probe_operand(tp: Sharding | None, t: torch.Tensor, has: str, cast: Cast, sample: int
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What a Controller's probe measures (:func:`~mixprec.control._measure.measure`, ``sample``
    elements of ``cast``) of the operand whose local part is ``t`` (its last dimension the
    columns, the others the rows; ``has``: the layer dimensions of rows and columns, ``"mk"``
    for the input, ``"nk"`` for the weight, ``"mn"`` for grad_output, ``"kn"`` for ``W.t()``, ...),
    as ``(rows, amax)``: under ``tp`` sharding one of them, the rows of the whole operand the
    one-process measurement samples (evenly strided), gathered over the group (an all-reduce SUM
    of about ``sample`` elements: each rank adds its part, zeros elsewhere, exact in float32),
    which ``measure`` then takes whole, and the whole operand's amax (MAX over the group): the
    one process's statistics on every rank. A 2-D block cast (measured on every row) and an fp4
    one (whose sample carries the whole tensor's scale: ``measure`` adds it) gather the whole
    operand, and ``measure`` samples it as one process does. Otherwise
    ``(t, None)``: the shard's own (or the whole operand, unsharded)."""
    if tp is None or tp.dim not in has or t.numel() == 0:
        return t, None
    t2 = t.detach().reshape(-1, t.shape[-1])
    axis, rank, size = has.index(tp.dim), dist.get_rank(tp.group), dist.get_world_size(tp.group)
    rows, cols = t2.shape[0] * (size if axis == 0 else 1), t2.shape[1] * (size if axis == 1 else 1)
    whole = cast.is_fp4 or (cast.block is not None and cast.block[0] > 1)
    stride = 1 if whole else max(1, rows // -(-sample // max(cols, 1)))  # (measure's, on the whole operand)
    picked = torch.arange(0, rows, stride, device=t2.device)
    buf = t2.new_zeros(picked.numel(), cols, dtype=torch.float32)
    if axis == 0:
        first = rank * t2.shape[0]
        mine = (picked >= first) & (picked < first + t2.shape[0])
        buf[mine] = t2[picked[mine] - first].float()
    else:
        buf[:, rank * t2.shape[1]:(rank + 1) * t2.shape[1]] = t2[::stride].float()
    amax = tp.reduce(torch.max(torch.abs(t2)))
    return tp.reduce(buf, dist.ReduceOp.SUM).to(t2.dtype), amax


def check_blocks(recipe: Float8Recipe, local_features: int, dim: str, where: str) -> None:
    """Raise ValueError when a block of ``recipe`` would straddle two shards: the sharded
    feature dimension ``dim`` (``"n"`` or ``"k"``) holds ``local_features`` per shard, which must
    be a multiple of every block side (:attr:`Float8Recipe.block_multiple`). ``where`` names
    the layer and the mesh."""
    multiple = recipe.block_multiple
    if local_features % multiple:
        name = "out" if dim == "n" else "in"
        raise ValueError(
            f"fp8 tensor parallelism: {where} holds {local_features} {name} features per shard, not a multiple of "
            f"{multiple}, the blocks of recipe {recipe.name!r}: a block would straddle two shards (one process "
            f"scales it as one block). Make the layer's {name} features a multiple of {multiple} x the mesh size, "
            f"use a smaller mesh, or pick a recipe without blocks ('tensorwise', 'rowwise')")


def gathers_fp8(recipe: Float8Recipe | None, weight_grad: bool = True) -> bool:
    """Whether a sequence-sharded input is all-gathered in fp8 for ``recipe``, the bytes and
    scales of its forward cast (the linear then reads them as its cast input):

    * ``tensorwise``: one fp8 scale for the input (global: the shards' amax all-reduced), reused
      bit for bit by the weight-gradient GEMM (``save_fp8``), so the gathered bytes are all the
      layer needs of it: always;
    * row and 1-D block scales along the in features (``rowwise``, ``rowwise_with_gw_hp``,
      ``mxfp8``, ``blockwise``: one scale per token, or per block of a token's features), each
      local to the shard that holds the token: only without a weight gradient (``weight_grad``
      False: no grad mode, or a frozen weight). The weight-gradient GEMM casts the input again,
      by columns (over the tokens: across the shards), from the high-precision input; gathering
      that too would move ``2 x (1 + scales)`` bytes per element, more than bf16's 2 once.

    fp4 recipes gather in the input's dtype."""
    if recipe is None or recipe.fp4 or not recipe.input.is_fp8:
        return False
    cast = recipe.input
    if cast.granularity == "tensor" and recipe.save_fp8 and not recipe.blocked:
        return True
    along_features = cast.granularity == "row" if cast.block is None else cast.block[0] == 1
    return not weight_grad and along_features


def colwise_sequence_parallel(*, sequence_dim: int = 1, output_layouts: Any = None,
                              use_local_output: bool = True) -> Any:
    """torch's ``ColwiseParallel(input_layouts=Shard(sequence_dim))`` whose sequence-sharded input
    reaches the layer's fp8 linear still sharded: the layer all-gathers it itself, in fp8 where
    :func:`gathers_fp8` (``tensorwise``: half the bytes of bf16), else in the input's dtype (what
    ``ColwiseParallel`` moves). As torchao's ``Float8ColwiseParallel``. A layer outside fp8 gets
    the input gathered by DTensor's own ``F.linear``."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel

    style = ColwiseParallel(input_layouts=Shard(sequence_dim), output_layouts=output_layouts,
                            use_local_output=use_local_output)
    style.desired_input_layouts = (Shard(sequence_dim),)  # (ColwiseParallel's would be Replicate)
    return style


def _all_gather(t: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """``t`` all-gathered along ``dim`` (ranks in order)."""
    moved = t.movedim(dim, 0).contiguous()
    out = moved.new_empty(dist.get_world_size(group) * moved.shape[0], *moved.shape[1:])
    dist.all_gather_into_tensor(out, moved, group=group)
    return out.movedim(0, dim)


class _GatherSequence(torch.autograd.Function):
    """The sequence shard ``x`` all-gathered along ``dim``: with ``cast`` (the layer's input
    cast, :func:`gathers_fp8`), cast to fp8 first (a tensor scale: with the global amax; row and
    block scales: the shard's own, each token's), its statistics recorded into ``window`` on the
    shard, and gathered as bytes with the scales, given as a :class:`GatheredFloat8Weight` the
    fp8 linear reads as its cast input; else gathered in ``x``'s dtype. Backward: the gradient
    reduce-scattered back to the shards."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, mesh: Any, cast: Cast | None, pow2: bool,
                window: torch.Tensor | None) -> torch.Tensor:
        ctx.dim, ctx.mesh = dim, mesh
        group = mesh.get_group()
        if cast is None:
            return _all_gather(x, dim, group)
        if cast.granularity == "tensor":
            q, scale, amax = cast_to_fp8(x, cast, -1, pow2, Sharding("m", group).reduce(torch.max(torch.abs(x))))
            record_cast(window, INPUT, x, q, amax)
        else:  # one scale per token (rowwise) or per block of its features: local, gathered with the bytes
            q, scale, amax = cast_to_fp8(x, cast, -1, pow2)
            record_cast(window, INPUT, x.reshape(-1, x.shape[-1]) if cast.block else x, q.reshape(-1, x.shape[-1])
                        if cast.block else q, amax)
            scale = _all_gather(scale.reshape(*x.shape[:-1], -1), dim, group)
        data = _all_gather(q.view(torch.uint8), dim, group).view(cast.dtype)
        return GatheredFloat8Weight(data, scale, amax, x.dtype, cast)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        from torch.distributed.tensor import DTensor, Partial, Shard

        local = DTensor.from_local(grad, ctx.mesh, [Partial()], run_check=False)
        return local.redistribute(ctx.mesh, [Shard(ctx.dim)]).to_local(), None, None, None, None, None


def sharded_linear(input: Any, weight: Any, bias: Any,
                   run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, Sharding | None],
                                 torch.Tensor],
                   recipe: Float8Recipe | None, name: str | None = None, window: torch.Tensor | None = None) -> Any:
    """``F.linear`` of DTensors (a ``ColwiseParallel`` or ``RowwiseParallel`` layer) run as
    ``run(x_local, w_local, b_local, sharding)`` (the fp8/fp4 linear on local tensors), the
    result a DTensor: colwise, the output sharded along its last dimension; rowwise, the partial
    sums (``Partial()``), plus the replicated bias. Differentiable; the gradients come back as
    the DTensors of the inputs' layouts. ``recipe``: the one the GEMMs run (None: the compute
    dtype), whose blocks are checked; ``name``: the layer's, for errors. A colwise layer's input
    sharded along a dimension other than the last (the sequence: :func:`colwise_sequence_parallel`)
    is all-gathered here, in fp8 where :func:`gathers_fp8` (its statistics into ``window``).

    Raises ValueError for a layout other than those two (or both replicated), a mesh of more than
    one dimension, or blocks that would straddle two shards (:func:`check_blocks`).
    """
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    dts = [t for t in (input, weight, bias) if isinstance(t, DTensor)]
    mesh = dts[0].device_mesh
    where = f"layer {name or '(unnamed)'} on the mesh {mesh}"
    if mesh.ndim != 1 or any(t.device_mesh != mesh for t in dts):
        raise ValueError(f"fp8 tensor parallelism: {where}: the fp8 linear takes DTensors of one 1-D mesh (the "
                         f"tensor-parallel one), got meshes {[str(t.device_mesh) for t in dts]}")

    def placement(t: Any) -> Any:
        return t.placements[0] if isinstance(t, DTensor) else None

    wp, xp, bp = placement(weight), placement(input), placement(bias)
    x_last = Shard(input.dim() - 1)
    if wp == Shard(0) and xp in (Replicate(), None) and bp in (Shard(0), None):
        tp = Sharding("n", mesh.get_group())
        if recipe is not None:
            check_blocks(recipe, weight.to_local().shape[0], "n", where)
        x = input.to_local(grad_placements=[Partial()]) if xp is not None else input
        b = None if bias is None else bias.to_local()
        out = run(x, _local_weight(weight), b, tp)
        shape = (*input.shape[:-1], weight.shape[0])
        return DTensor.from_local(out, mesh, [Shard(out.dim() - 1)], run_check=False, shape=shape,
                                  stride=_contiguous_strides(shape))
    if wp == Shard(0) and isinstance(xp, Shard) and xp.dim < input.dim() - 1 and bp in (Shard(0), None):
        tp = Sharding("n", mesh.get_group())
        if recipe is not None:
            check_blocks(recipe, weight.to_local().shape[0], "n", where)
        # (traced: in the input's dtype, the same casts after it; Dynamo cannot trace the fp8 bytes'
        # tensor subclass out of the gather's autograd.Function)
        fp8 = gathers_fp8(recipe, torch.is_grad_enabled() and weight.requires_grad) and not torch.compiler.is_compiling()
        x = _GatherSequence.apply(input.to_local(), xp.dim, mesh, recipe.input if fp8 else None,
                                  fp8 and recipe.pow2_scales, window if fp8 else None)
        out = run(x, _local_weight(weight), None if bias is None else bias.to_local(), tp)
        shape = (*input.shape[:-1], weight.shape[0])
        return DTensor.from_local(out, mesh, [Shard(out.dim() - 1)], run_check=False, shape=shape,
                                  stride=_contiguous_strides(shape))
    if wp == Shard(1) and xp == x_last and bp in (Replicate(), None):
        tp = Sharding("k", mesh.get_group())
        if recipe is not None:
            check_blocks(recipe, weight.to_local().shape[1], "k", where)
        out = run(input.to_local(), _local_weight(weight), None, tp)
        shape = (*input.shape[:-1], weight.shape[0])
        out = DTensor.from_local(out, mesh, [Partial()], run_check=False, shape=shape,
                                 stride=_contiguous_strides(shape))
        return out if bias is None else out + bias.to(out.dtype)
    if wp in (Replicate(), None) and xp in (Replicate(), None) and bp in (Replicate(), None):
        x = input.to_local() if xp is not None else input
        b = None if bias is None else bias.to_local() if bp is not None else bias
        w = weight.to_local() if wp is not None else weight
        return DTensor.from_local(run(x, w, b, None), mesh, [Replicate()], run_check=False)
    raise ValueError(f"fp8 tensor parallelism: {where}: the fp8 linear runs ColwiseParallel (weight Shard(0), "
                     f"input Replicate) and RowwiseParallel (weight Shard(1), input Shard(-1)) layouts; got "
                     f"input {xp}, weight {wp}, bias {bp}. Shard the layer with ColwiseParallel or "
                     f"RowwiseParallel, or keep it out of fp8")


class _Local(torch.autograd.Function):
    """``weight``'s local tensor itself (FSDP2's fp8 all-gather: the :class:`GatheredFloat8Weight`,
    which ``to_local()`` would dequantize through a view); the gradient comes back as a DTensor
    of the weight's placements."""

    @staticmethod
    def forward(ctx: Any, weight: Any) -> torch.Tensor:
        ctx.spec = weight.device_mesh, weight.placements, weight.shape, weight.stride()
        return weight._local_tensor.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        from torch.distributed.tensor import DTensor

        mesh, placements, shape, stride = ctx.spec
        return DTensor.from_local(grad, mesh, placements, run_check=False, shape=shape, stride=stride)


def _local_weight(weight: Any) -> torch.Tensor:
    """The weight's local shard, the fp8 bytes of FSDP2's all-gather kept as they came."""
    if type(weight._local_tensor).__name__ == "GatheredFloat8Weight":
        return _Local.apply(weight)
    return weight.to_local()


def gathered_copy(model: nn.Module) -> nn.Module:
    """``model`` itself when none of its parameters and buffers is a DTensor; else a copy whose
    DTensors are full tensors (``full_tensor()``: an all-gather every rank of their meshes runs, in
    the same order), without the modules' forward hooks (the parallel styles'), the layers'
    :class:`LayerState` copied. What :func:`mixprec.export` writes from a tensor-parallel model:
    the folder one process writes."""
    from torch.distributed.tensor import DTensor

    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    if not any(isinstance(t, DTensor) for _, t in tensors):
        return model
    memo: dict[int, Any] = {}
    for _, t in tensors:
        if isinstance(t, DTensor) and id(t) not in memo:
            full = t.detach().full_tensor()
            memo[id(t)] = nn.Parameter(full, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else full
    for module in model.modules():
        for hooks in ("_forward_pre_hooks", "_forward_hooks", "_forward_pre_hooks_with_kwargs",
                      "_forward_hooks_with_kwargs", "_forward_hooks_always_called"):
            if hasattr(module, hooks):
                memo[id(getattr(module, hooks))] = type(getattr(module, hooks))()
    return copy.deepcopy(model, memo)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= size
    return tuple(reversed(strides))
