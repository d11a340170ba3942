"""FSDP2 fp8 all-gather: an fp8 layer's weight crosses the wire in fp8 (tensorwise scaling), as
torchao's ``Float8LinearConfig(enable_fsdp_float8_all_gather=True)``.

``fp8.convert(model, fsdp_fp8_all_gather=True)`` wraps each converted layer's weight in a
:class:`Float8AllGatherWeight` (the high-precision weight: what the optimizer updates, what the
state dict holds). Under ``fully_shard``, FSDP2 calls its ``fsdp_pre_all_gather`` on each rank's
shard: the shard's amax, all-reduced (MAX) over the shard group, is the amax of the whole weight,
so the scale and every fp8 byte are those of casting the unsharded weight. The bytes travel as
uint8 (gloo cannot all-gather float8 dtypes; NCCL moves the same bytes). ``fsdp_post_all_gather``
wraps the gathered bytes and the scale in a :class:`GatheredFloat8Weight`, which
:func:`mixprec.fp8.linear` takes as the cast weight of both GEMMs that read it.
"""

from __future__ import annotations

import math
import warnings
import weakref
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from mixprec.formats._quant import cast_to_fp8
from mixprec.formats._recipe import Cast, Float8Recipe
from mixprec.formats._state import WEIGHT, LayerState, layer_state

__all__ = ["Float8AllGatherWeight", "GatheredFloat8Weight", "check_recipe", "reads_gathered", "retie", "wrap_weight",
           "plain_weight", "warn_fallback", "precompute_fsdp_scales"]

aten = torch.ops.aten
# What FSDP2 does to a parameter while sharding it (chunk, pad, copy, move): the result stays a
# Float8AllGatherWeight. Every other op sees the plain high-precision tensor.
_PRESERVE = {
    aten.empty_like.default, aten.new_zeros.default, aten.slice.Tensor, aten.copy_.default, aten.view.default,
    aten.as_strided.default, aten._to_copy.default, aten._pin_memory.default, aten.split.Tensor,
    aten.clone.default, aten.detach.default, aten.alias.default,
}
# Those of _PRESERVE whose result is a view of the first weight: it shares that weight's count of
# in-place writes (a write through a view, e.g. torch.distributed.checkpoint's narrowed copy_,
# counts as one to the shard it views).
_ALIASING = {aten.slice.Tensor, aten.view.default, aten.as_strided.default, aten.split.Tensor,
             aten.detach.default, aten.alias.default, aten.copy_.default}
# op -> the positions and names of the arguments it writes (in-place, out=): read from its schema
_WRITTEN: dict[Any, tuple[tuple[int, str], ...]] = {}
# Views of the gathered fp8 weight that stay fp8 (FSDP2's as_strided, nn.Parameter's detach,
# Conv1D's weight.t()); every other op sees the dequantized weight.
_VIEWS = {aten.detach.default, aten.alias.default, aten.as_strided.default, aten.t.default,
          aten.transpose.int}
_WARNED: weakref.WeakSet[LayerState] = weakref.WeakSet()


def tensor_parallel_groups(weight: Any, fsdp_mesh: Any) -> list[Any]:
    """The process groups of the mesh dimensions of ``weight`` (a DTensor parameter under FSDP2
    x TP) other than FSDP2's ``fsdp_mesh``: what a scale of the whole weight is reduced over
    besides FSDP2's shards (none for a plain parameter, or FSDP2 alone)."""
    mesh = getattr(weight, "device_mesh", None)
    if mesh is None or mesh.ndim < 2:
        return []
    fsdp = set(fsdp_mesh.mesh_dim_names or ())
    return [mesh.get_group(i) for i, name in enumerate(mesh.mesh_dim_names or ()) if name not in fsdp]


def check_recipe(recipe: Float8Recipe) -> None:
    """Raise ValueError unless ``recipe`` casts the weight the same way, one fp8 scale per
    tensor, in both GEMMs that read it (``output`` and ``grad_input``): what an fp8 all-gather
    of the weight can feed (torchao allows only tensorwise too)."""
    w, wgi = recipe.weight, recipe.weight_for_grad_input
    if not (w.is_fp8 and w.granularity == "tensor" and wgi == w):
        raise ValueError(f"fsdp_fp8_all_gather needs a recipe whose weight is cast to fp8 with one scale per "
                         f"tensor, the same cast in the output and grad_input GEMMs (e.g. 'tensorwise'); "
                         f"recipe {recipe.name!r} casts the weight as {w} and {wgi}")


def reads_gathered(weight: GatheredFloat8Weight, recipe: Float8Recipe) -> bool:
    """Whether ``recipe`` (e.g. a controller's rung) reads the weight exactly as it was gathered
    (else :func:`mixprec.fp8.linear` casts the dequantized gathered weight)."""
    return recipe.weight == weight._cast and recipe.weight_for_grad_input == weight._cast


def warn_fallback(state: LayerState) -> None:
    """Warn once per layer that its fallback runs on the dequantized fp8 weight."""
    if state not in _WARNED:
        _WARNED.add(state)
        warnings.warn("fp8: a layer that fell back to the compute dtype still gets its weight from FSDP2's fp8 "
                      "all-gather: its GEMMs run in the compute dtype on the dequantized fp8 weight (the "
                      "all-gather's format is fixed at the first all-gather); convert without "
                      "fsdp_fp8_all_gather for a high-precision weight", UserWarning, stacklevel=4)


def wrap_weight(module: nn.Module, recipe: Float8Recipe,
                wrapped: dict[int, tuple[nn.Parameter, nn.Parameter]]) -> None:
    """Make ``module.weight`` a :class:`Float8AllGatherWeight` parameter (storage shared).

    ``wrapped`` maps ``id(old)`` to ``(old, new)`` for the weights wrapped so far: a weight
    already in it (tied to another converted layer) gets the same wrapper, and a new one is added
    (:func:`retie` then points every other holder of ``old`` to ``new``).

    Raises ValueError when the weight is already sharded (a DTensor): convert before fully_shard.
    """
    weight = module.weight
    if id(weight) in wrapped:
        module.weight = wrapped[id(weight)][1]
        return
    if _is_dtensor(weight):
        raise ValueError("fp8.convert(..., fsdp_fp8_all_gather=True): the model is already sharded (its weights are "
                         "DTensors); convert it before fully_shard")
    inner = Float8AllGatherWeight(weight.detach(), recipe.weight, recipe.pow2_scales)
    module.weight = nn.Parameter(inner, requires_grad=weight.requires_grad)
    wrapped[id(weight)] = (weight, module.weight)


def retie(model: nn.Module, replaced: dict[int, tuple[nn.Parameter, nn.Parameter]]) -> list[str]:
    """Point every parameter slot of ``model`` that still holds a replaced weight (``replaced``
    maps ``id(old)`` to ``(old, new)``: :func:`wrap_weight`'s, or unconvert's plain weights) to
    its replacement, so a tie (an embedding sharing the LM head's weight) stays one parameter:
    one optimizer state, one update. Returns the slots it changed (``fqn.name``)."""
    tied = []
    for fqn, mod in model.named_modules(remove_duplicate=False):
        for name, p in list(mod._parameters.items()):
            if p is not None and id(p) in replaced and replaced[id(p)][0] is p:
                mod._parameters[name] = replaced[id(p)][1]
                tied.append(f"{fqn}.{name}" if fqn else name)
    return tied


def plain_weight(weight: nn.Parameter) -> nn.Parameter:
    """``weight`` without the :class:`Float8AllGatherWeight` wrapper (storage shared).

    Raises ValueError for a sharded one (a DTensor holding it): unconvert before fully_shard.
    """
    if _is_dtensor(weight) and isinstance(weight._local_tensor, Float8AllGatherWeight):
        raise ValueError("fp8.unconvert: the layer's weight is sharded by FSDP2 with fp8 all-gather; unconvert "
                         "before fully_shard (or load its state dict into an unconverted model)")
    if isinstance(weight, Float8AllGatherWeight):
        return nn.Parameter(weight._tensor, requires_grad=weight.requires_grad)
    return weight


@torch.no_grad()
def precompute_fsdp_scales(model: nn.Module) -> int:
    """The amaxes of every fp8-all-gathered weight of the FSDP2-sharded ``model`` in one
    all-reduce, instead of one per weight at each all-gather (torchao's
    ``precompute_float8_dynamic_scale_for_fsdp``); call it after ``optimizer.step()``. The casts
    are bitwise the same. A stored amax holds until the weight is next written in place, by any
    op on the parameter or a view of it (an optimizer step, foreach or fused included,
    ``load_state_dict``, ``torch.distributed.checkpoint.load``, ``.data.copy_``): the weight then
    reduces its own amax again at its next all-gather. Returns how many weights.

    Raises ValueError when the weights are sharded over more than one device mesh.

    Example:
        >>> precompute_fsdp_scales(torch.nn.Linear(16, 16))  # not sharded: nothing to do
        0
    """
    params = [p for p in model.parameters() if _is_dtensor(p) and isinstance(p._local_tensor, Float8AllGatherWeight)]
    if not params:
        return 0
    meshes = {p.device_mesh for p in params}
    if len(meshes) > 1:
        raise ValueError(f"precompute_fsdp_scales: the fp8-all-gathered weights are sharded over {len(meshes)} "
                         f"device meshes; call it on each FSDP2 module of one mesh")
    amax = torch.stack([_amax(p._local_tensor._tensor).double() for p in params])  # upcasts are exact
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=meshes.pop().get_group())
    for p, a in zip(params, amax):
        local = p._local_tensor
        local._precomputed = (a.to(p.dtype), local._writes[0])
    return len(params)


def _amax(shard: torch.Tensor) -> torch.Tensor:
    return torch.max(torch.abs(shard)) if shard.numel() else shard.new_zeros(())


def _written(func: Any) -> tuple[tuple[int, str], ...]:
    """The arguments ``func`` writes: (position, name) of each one its schema marks ``(a!)``."""
    if func not in _WRITTEN:
        schema = getattr(func, "_schema", None)
        _WRITTEN[func] = tuple((i, a.name) for i, a in enumerate(schema.arguments)
                               if a.alias_info is not None and a.alias_info.is_write) if schema is not None else ()
    return _WRITTEN[func]


def _count_writes(func: Any, args: tuple, kwargs: dict) -> None:
    """Count one write to each :class:`Float8AllGatherWeight` that ``func`` writes (in place or as
    its ``out``), and so to every view sharing its count: its precomputed amax is stale."""
    for i, name in _written(func):
        arg = args[i] if i < len(args) else kwargs.get(name)
        for t in arg if isinstance(arg, (list, tuple)) else (arg,):
            if isinstance(t, Float8AllGatherWeight):
                t._writes[0] += 1


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


class Float8AllGatherWeight(torch.Tensor):
    """A high-precision weight whose FSDP2 all-gather sends its fp8 cast (``cast``: one scale per
    tensor). Every op but FSDP2's sharding ones sees the plain tensor (``_tensor``).

    ``_writes`` counts the in-place writes to the weight, through it or any view of it (shared
    with its views): what tells :func:`precompute_fsdp_scales`' amax stale. The parameter's
    ``_version`` cannot: a foreach or fused optimizer step, or ``torch.distributed.checkpoint.load``,
    leaves a DTensor parameter's counter where it was.

    Example:
        >>> w = Float8AllGatherWeight(torch.ones(2, 2), Cast("e4m3fn"), False)
        >>> type(w * 2).__name__, type(w.detach()).__name__
        ('Tensor', 'Float8AllGatherWeight')
        >>> _ = w[:1].mul_(2); w._writes  # a write through a view counts to the weight
        [1]
    """

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, cast: Cast, pow2: bool,
                writes: list[int] | None = None) -> Float8AllGatherWeight:
        return torch.Tensor._make_wrapper_subclass(
            cls, tensor.size(), strides=tensor.stride(), storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype, layout=tensor.layout, device=tensor.device, requires_grad=tensor.requires_grad)

    def __init__(self, tensor: torch.Tensor, cast: Cast, pow2: bool, writes: list[int] | None = None) -> None:
        self._tensor, self._cast, self._pow2 = tensor, cast, pow2
        self._writes = [0] if writes is None else writes  # in-place writes, shared with the views
        self._precomputed: tuple[torch.Tensor, int] | None = None  # precompute_fsdp_scales: (amax, _writes[0])

    def _fresh_amax(self) -> torch.Tensor | None:
        """The precomputed amax while the weight is unchanged since (no in-place write to it or
        a view of it: through its parameter, an optimizer step, foreach or fused, a checkpoint
        load), else None."""
        if self._precomputed is None:
            return None
        amax, writes = self._precomputed
        return amax if self._writes[0] == writes else None

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        _count_writes(func, args, kwargs)
        meta: list[Float8AllGatherWeight] = []

        def unwrap(t: Float8AllGatherWeight) -> torch.Tensor:
            meta.append(t)
            return t._tensor

        args, kwargs = pytree.tree_map_only(cls, unwrap, (args, kwargs))
        out = func(*args, **kwargs)
        if func not in _PRESERVE:
            return out
        w = meta[0]
        writes = w._writes if func in _ALIASING else None  # a view counts the writes of what it views
        return pytree.tree_map_only(torch.Tensor, lambda t: cls(t, w._cast, w._pow2, writes), out)

    def __tensor_flatten__(self) -> tuple[list[str], tuple[Cast, bool]]:
        return ["_tensor"], (self._cast, self._pow2)

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], meta: tuple[Cast, bool], outer_size: Any,
                             outer_stride: Any) -> Float8AllGatherWeight:
        return Float8AllGatherWeight(inner["_tensor"], *meta)

    def __repr__(self) -> str:
        return f"Float8AllGatherWeight({self._tensor!r}, cast={self._cast})"

    def fsdp_pre_all_gather(self, mesh: Any, outer_size: torch.Size, outer_stride: tuple[int, ...],
                            module: nn.Module, mp_policy: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
        """FSDP2's hook: this rank's shard cast to fp8 with the amax of the whole weight (one
        all-reduce, or the one :func:`precompute_fsdp_scales` did), as uint8 padded to FSDP2's
        padded shard size. Records the shard's weight statistics into the module's
        :class:`LayerState` (not when it has fallen back)."""
        shard = self._tensor
        amax = self._fresh_amax()
        if amax is None:
            amax = _amax(shard)
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=mesh.get_group())
        for group in tensor_parallel_groups(module.weight, mesh):  # FSDP2 x TP: the TP shards too
            amax = amax.clone()
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        q, scale, amax = cast_to_fp8(shard, self._cast, 0, self._pow2, amax=amax)
        state = layer_state(module, create=False)
        # recorded where the layer reads these bytes: not in fallback, nor on another recipe's rung
        if state is not None and not state.fallback and (state.recipe is None or (
                state.recipe.weight == self._cast and state.recipe.weight_for_grad_input == self._cast)):
            if state.device != shard.device:
                state.to(shard.device)
            state.record(WEIGHT, shard, q, amax)
        data = q.view(torch.uint8)
        rows = math.ceil(outer_size[0] / mesh.size())
        if data.shape[0] != rows:  # uneven sharding: FSDP2 pads each shard at its end
            data = torch.cat([data, data.new_zeros(rows - data.shape[0], *data.shape[1:])])
        return (data,), (scale, amax, self._cast)

    def fsdp_post_all_gather(self, all_gather_outputs: tuple[torch.Tensor, ...], metadata: Any,
                             param_dtype: torch.dtype, *, out: torch.Tensor | None = None) -> Any:
        """FSDP2's hook: the gathered bytes as a :class:`GatheredFloat8Weight` of ``param_dtype``
        (the first time), or the new scale into the existing one (``out``, whose bytes FSDP2 has
        gathered into the same storage)."""
        (data,) = all_gather_outputs
        scale, amax, cast = metadata
        if out is not None:
            out = getattr(out, "_local_tensor", out)  # FSDP2 x TP: the DTensor over the TP shard
            if not isinstance(out, GatheredFloat8Weight):
                raise RuntimeError(f"fp8 all-gather: FSDP2 gave an unsharded weight of type {type(out).__name__}, "
                                   f"expected the GatheredFloat8Weight of the first all-gather")
            out._scale, out._amax = scale, amax
            return None
        return GatheredFloat8Weight(data.view(cast.dtype), scale, amax, param_dtype, cast), (data,)


class GatheredFloat8Weight(torch.Tensor):
    """The unsharded weight FSDP2's fp8 all-gather gives: the fp8 bytes (``_data``), the scale
    and amax of the whole weight; shown as a tensor of the parameter dtype. Views (``t``,
    ``as_strided``, ``detach``) stay fp8; any other op sees the dequantized weight
    (``_data.float() / _scale`` in that dtype), so gradients flow to it as to the weight.

    Example:
        >>> q = torch.tensor([[448.0, -224.0]]).to(torch.float8_e4m3fn)
        >>> w = GatheredFloat8Weight(q, torch.tensor(224.0), torch.tensor(2.0), torch.float32, Cast())
        >>> (w * 1).tolist(), type(w.t()).__name__
        ([[2.0, -1.0]], 'GatheredFloat8Weight')
    """

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype,
                cast: Cast) -> GatheredFloat8Weight:
        return torch.Tensor._make_wrapper_subclass(
            cls, data.size(), strides=data.stride(), storage_offset=data.storage_offset(), dtype=dtype,
            layout=data.layout, device=data.device, requires_grad=False)

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype,
                 cast: Cast) -> None:
        self._data, self._scale, self._amax, self._cast = data, scale, amax, cast

    def dequantize(self) -> torch.Tensor:
        """The weight in its dtype, from the fp8 bytes (a sequence gathered with a scale per row or
        the factors per block of its rows: :mod:`._tensor_parallel`, laid out as the rows)."""
        scale = self._scale
        if scale.dim() and scale.shape[:-1] != self._data.shape[:-1]:  # (a view of the bytes: the rows reshaped)
            scale = scale.reshape(*self._data.shape[:-1], -1)
        if self._cast.block is not None:  # per-block dequantization factors
            return (self._data.float() * scale.repeat_interleave(self._cast.block[1], -1)).to(self.dtype)
        return (self._data.float() / scale).to(self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _VIEWS:
            w = args[0]
            return cls(func(w._data, *args[1:], **kwargs), w._scale, w._amax, w.dtype, w._cast)
        args, kwargs = pytree.tree_map_only(cls, lambda t: t.dequantize(), (args, kwargs))
        return func(*args, **kwargs)

    def __repr__(self) -> str:
        return f"GatheredFloat8Weight(shape={tuple(self.shape)}, dtype={self.dtype}, cast={self._cast})"


# A checkpoint of a converted model holds these: loadable with torch.load(weights_only=True).
torch.serialization.add_safe_globals([Float8AllGatherWeight, Cast])
