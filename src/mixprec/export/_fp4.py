"""fp4 layers of an export: NVFP4 and MXFP4 weights in compressed-tensors' packed layout.

A layer whose forward GEMM casts its weight to e2m1 (``Float8Recipe.nvfp4()``, ``.mxfp4()``, a
Controller's fp4 rung) exports as compressed-tensors 0.20 reads it:

* ``nvfp4-pack-quantized``: ``weight_packed`` (uint8, two codes per byte, the even element in the
  low nibble), ``weight_scale`` (e4m3, one per 16 elements of a row: a 16x16 weight block's scale
  is repeated over its 16 rows), ``weight_global_scale`` = ``1 / tensor_scale`` (compressed-tensors
  divides the block scale by it, where mixprec multiplies by the tensor scale ``amax / (448 * 6)``)
  and ``input_global_scale`` = ``448 * 6 / amax`` with
  ``amax`` from the training statistics through the :class:`ScaleRule` (compressed-tensors'
  ``generate_gparam`` convention); the input's block scales stay dynamic (its ``"local"``).
* ``mxfp4-pack-quantized``: ``weight_packed`` and ``weight_scale`` (uint8 E8M0 exponents, one per
  32 elements); the input's scales are dynamic (nothing stored).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mixprec.export._rules import ScaleRule, check_finite_amax, has_statistics
from mixprec.fp8 import Float8Recipe, layer_state
from mixprec.fp8.internals import fp4_quantize

__all__ = ["CT_FORMATS", "Fp4Layer", "contradicts", "forward_recipe", "recipe_format", "quantize_fp4"]

#: mixprec's fp4 format -> compressed-tensors' CompressionFormat value
CT_FORMATS = {"nvfp4": "nvfp4-pack-quantized", "mxfp4": "mxfp4-pack-quantized"}
_GROUP = {"nvfp4": 16, "mxfp4": 32}
_NVFP4_RANGE = 448.0 * 6.0  # e4m3 max x e2m1 max


def forward_recipe(module: nn.Module) -> Float8Recipe | None:
    """The recipe the layer's forward runs: its Controller's rung, else a converted layer's own, else
    the recipe of the ``Policy.fp8`` that selected it (``LayerState.policy_recipe``); None for a
    layer that never ran in fp8."""
    st = layer_state(module, create=False)
    if st is not None and st.recipe is not None:
        return st.recipe
    own = getattr(module, "recipe", None)
    if own is not None:
        return own
    return None if st is None else st.policy_recipe


def contradicts(ran: Float8Recipe, asked: Float8Recipe) -> bool:
    """Whether exporting a layer that ran ``ran`` as ``asked`` would change its format (fp8, NVFP4,
    MXFP4) or, for fp4, its weight cast (the export writes fp8 weights by ``weight_strategy``)."""
    return recipe_format(ran) != recipe_format(asked) or (recipe_format(ran) != "fp8" and ran.weight != asked.weight)


def recipe_format(r: Float8Recipe | None) -> str:
    """``"nvfp4"`` or ``"mxfp4"`` when the forward casts the weight to e2m1 (E4M3 or E8M0 block
    scales), else ``"fp8"``."""
    if r is None or not r.weight.is_fp4:
        return "fp8"
    return "mxfp4" if r.weight.scale_format == "e8m0" else "nvfp4"


@dataclass
class Fp4Layer:
    """One fp4 layer of an export, in compressed-tensors' layout (see the module's docstring). The
    forward's input is cast to the same fp4 format (a recipe's GEMM casts both operands alike)."""

    format: str
    weight_packed: torch.Tensor
    weight_scale: torch.Tensor
    weight_global_scale: torch.Tensor | None
    input_global_scale: torch.Tensor | None
    input_amax: float | None
    source: str


def quantize_fp4(fqns: tuple[str, ...], r: Float8Recipe, weights: list[torch.Tensor], history: torch.Tensor | None,
                 source: str, rule: ScaleRule) -> dict[str, Fp4Layer]:
    """mixprec's fp4 cast by the forward recipe ``r`` of the ``(out, in)`` ``weights`` of the layers
    ``fqns``, in compressed-tensors' layout; ``history``: their input's window amaxes (NVFP4's input
    global scale). Several layers are the shards of one layer a serving engine fuses (q/k/v,
    gate/up): they are cast as that fused layer, the weights stacked along ``out`` (one NVFP4 tensor
    scale from their joint amax, every shard's block scales relative to it), so each shard stores the
    same ``weight_global_scale`` and what vLLM computes from them (it keeps one global scale per
    fused layer, the max over the shards) is bitwise this cast.
    Raises ValueError naming the layer when ``in`` is not a multiple of the group (16 or 32) or when
    an NVFP4 layer's input has no statistics, or an inf or NaN amax. One host sync."""
    fmt = recipe_format(r)
    group = _GROUP[fmt]
    in_f = weights[0].shape[1]
    if in_f % group:
        raise ValueError(f"export: layer {fqns[0]!r} is {fmt} but its {in_f} input features are not a multiple of "
                         f"{group} (compressed-tensors' {CT_FORMATS[fmt]} groups); pass layers=[...] without it "
                         f"(it stays in high precision)")
    weight = torch.cat([w.detach() for w in weights]) if len(weights) > 1 else weights[0].detach()
    out_f = weight.shape[0]
    t = fp4_quantize(weight, r.weight, subnormal_scales=r.subnormal_scales)
    packed = t.codes[:out_f].contiguous()
    rows = r.weight.block[0]
    scale = t.scales.repeat_interleave(rows, dim=0)[:out_f].contiguous() if rows > 1 else t.scales.contiguous()
    gscale = None if t.tensor_scale is None else (1.0 / t.tensor_scale.double()).float().reshape(1).cpu()
    in_gscale, amax = None, None
    if fmt == "nvfp4":
        if not has_statistics(history):
            raise ValueError(f"export: no statistics for the input of layer {fqns[0]!r} (NVFP4's input_global_scale "
                             f"needs its amax): record them with mixprec.export.Recorder")
        amax_t = rule.amax(history).double() * rule.margin
        check_finite_amax(amax_t, f"the input of layer {fqns[0]!r}", source)
        amax = float(amax_t)
        in_gscale = (_NVFP4_RANGE / amax_t.clamp(min=torch.finfo(torch.float32).tiny)).float().reshape(1)
    out, start = {}, 0
    for fqn, w in zip(fqns, weights):
        stop = start + w.shape[0]
        out[fqn] = Fp4Layer(fmt, packed[start:stop].cpu().contiguous(), scale[start:stop].cpu().contiguous(),
                            None if gscale is None else gscale.clone(),
                            None if in_gscale is None else in_gscale.clone(),
                            amax, source if in_gscale is not None else "none (dynamic input scales)")
        start = stop
    return out
