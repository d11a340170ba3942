"""Which layers of a model export in fp8, which stay in high precision, and where the K and V come from."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mixprec.fp8 import Float8Conv1D, Float8Linear, layer_state
from mixprec.fp8.internals import is_linear_like

__all__ = ["KVSource", "LayerPlan", "linear_layers", "kv_sources", "plan_layers", "weight_out_in"]


def _is_linear(module: nn.Module) -> bool:
    return is_linear_like(module) or isinstance(module, Float8Conv1D)


def _is_conv1d_layout(module: nn.Module) -> bool:
    """transformers' ``Conv1D`` (and mixprec's ``Float8Conv1D``): weight stored ``(in, out)``."""
    return not isinstance(module, nn.Linear)


def linear_layers(model: nn.Module) -> dict[str, nn.Module]:
    """``{fqn: module}`` of every ``nn.Linear``, transformers ``Conv1D`` and mixprec fp8 layer."""
    return {fqn: m for fqn, m in model.named_modules() if _is_linear(m)}


def weight_out_in(module: nn.Module) -> torch.Tensor:
    """The weight as ``(out, in)`` (the ``F.linear`` layout), detached."""
    w = module.weight.detach()
    return w.t() if _is_conv1d_layout(module) else w


@dataclass(frozen=True)
class KVSource:
    """Where an attention layer's keys or values are computed: the output of ``layer``, columns
    ``[start, stop)`` of its last dimension (the whole output when ``start`` is None)."""

    attention: str
    which: str  # "k" or "v"
    layer: str
    start: int | None = None
    stop: int | None = None


def kv_sources(model: nn.Module) -> list[KVSource]:
    """The key and value projections of every attention module: Llama-style ``k_proj``/``v_proj``
    children, or a fused projection of equal thirds q, k, v (GPT-2's ``c_attn``, a ``qkv`` child as
    in mixprec's demo model): its output's middle and last thirds."""
    out = []
    for fqn, mod in model.named_modules():
        prefix = f"{fqn}." if fqn else ""
        k, v = getattr(mod, "k_proj", None), getattr(mod, "v_proj", None)
        fused = "c_attn" if hasattr(mod, "c_attn") else "qkv"
        c_attn = getattr(mod, fused, None)
        if k is not None and v is not None and _is_linear(k) and _is_linear(v):
            out += [KVSource(fqn, "k", prefix + "k_proj"), KVSource(fqn, "v", prefix + "v_proj")]
        elif c_attn is not None and _is_linear(c_attn) and not getattr(mod, "is_cross_attention", False):
            width = weight_out_in(c_attn).shape[0]
            name = prefix + fused
            if width % 3 == 0:
                e = width // 3
                out += [KVSource(fqn, "k", name, e, 2 * e), KVSource(fqn, "v", name, 2 * e, 3 * e)]
    return out


@dataclass(frozen=True)
class LayerPlan:
    """The export's decision for the model: ``fp8`` layers (fqn -> weight strategy source recipe
    name) and ``kept`` ones (high precision, with the reason)."""

    fp8: tuple[str, ...]
    kept: dict[str, str]


def plan_layers(model: nn.Module, layers: list[str] | None = None) -> LayerPlan:
    """Which layers export in fp8.

    ``layers`` given: those (each must be a linear layer of the model). Else the model's fp8
    layers: the ones :func:`mixprec.fp8.convert` made, and the ones a ``Policy.fp8`` routed to fp8
    (their ``LayerState.routed``); a layer whose state is in fallback (a Guard or a Controller kept
    it above fp8) stays in high precision. Every other linear layer is kept.

    Raises ValueError when ``layers`` names a module that is not a linear layer of the model, or
    when the model has no fp8 layer and ``layers`` is not given.
    """
    linears = linear_layers(model)
    kept: dict[str, str] = {}
    if layers is not None:
        unknown = [n for n in layers if n not in linears]
        if unknown:
            raise ValueError(f"export: layers {unknown} are not nn.Linear/Conv1D layers of the model "
                             f"(its linear layers: {list(linears)[:6]}{' ...' if len(linears) > 6 else ''})")
        chosen = [n for n in linears if n in set(layers)]
    else:
        chosen = []
        for fqn, mod in linears.items():
            st = layer_state(mod, create=False)
            converted = isinstance(mod, (Float8Linear, Float8Conv1D))
            if not converted and (st is None or not st.routed):
                continue
            chosen.append(fqn)
        if not chosen:
            raise ValueError("export: the model has no fp8 layer (none converted by mixprec.fp8.convert, none routed "
                             "to fp8 by a Policy.fp8 region); pass layers=[...] to choose the layers to quantize "
                             "(e.g. after mixprec.export.calibrate)")
    fp8 = []
    for fqn in chosen:
        st = layer_state(linears[fqn], create=False)
        if st is not None and st.fallback:
            kept[fqn] = "in fallback (a Guard or Controller kept it above fp8)"
        else:
            fp8.append(fqn)
    for fqn in linears:
        if fqn not in fp8 and fqn not in kept:
            kept[fqn] = "not an fp8 layer"
    return LayerPlan(tuple(fp8), kept)
