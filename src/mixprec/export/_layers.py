"""Which layers of a model export in fp8, which stay in high precision, and where the K and V come from."""

from __future__ import annotations

import inspect
import re
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from mixprec._modules import named_modules, unwrap
from mixprec.fp8 import Float8Conv1D, Float8Linear, layer_state
from mixprec.fp8.internals import is_linear_like

__all__ = ["FUSED", "KVSource", "LayerPlan", "cache_argument", "fused_groups", "linear_layers", "kv_sources",
           "plan_layers", "weight_out_in"]

#: the names an attention module's forward takes its KV cache under (transformers 5: ``cache``; earlier:
#: ``past_key_values``/``past_key_value``, the names compressed-tensors 0.20's KV hooks look for)
CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value")
#: sibling layers a serving engine fuses into one GEMM with one quantization scheme (vLLM's
#: ``packed_modules_mapping``: ``qkv_proj``, ``gate_up_proj``, Mixtral experts' ``w13``, DeepSeek's
#: ``fused_qkv_a_proj``); vLLM refuses a checkpoint whose shards of one fused layer differ in scheme
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"), ("q_a_proj", "kv_a_proj_with_mqa"))
#: fused q/k/v projections: GPT-2's ``c_attn``, mixprec's demo ``qkv``, Phi-3's ``qkv_proj``
FUSED_QKV = ("c_attn", "qkv", "qkv_proj")


def _is_linear(module: nn.Module) -> bool:
    return is_linear_like(module) or isinstance(module, Float8Conv1D)


def _is_conv1d_layout(module: nn.Module) -> bool:
    """transformers' ``Conv1D`` (and mixprec's ``Float8Conv1D``): weight stored ``(in, out)``."""
    return not isinstance(module, nn.Linear)


def linear_layers(model: nn.Module) -> dict[str, nn.Module]:
    """``{fqn: module}`` of every ``nn.Linear``, transformers ``Conv1D`` and mixprec fp8 layer, by the
    bare model's names (a wrapper's ``_orig_mod.`` or ``module.`` is no part of them: :func:`named_modules`)."""
    return {fqn: m for fqn, m in named_modules(model) if _is_linear(m)}


def weight_out_in(module: nn.Module) -> torch.Tensor:
    """The weight as ``(out, in)`` (the ``F.linear`` layout), detached."""
    w = module.weight.detach()
    return w.t() if _is_conv1d_layout(module) else w


@dataclass(frozen=True)
class KVSource:
    """Where an attention layer's keys or values are measured. ``cache``: the forward argument that
    takes the KV cache (see :func:`cache_argument`): the keys and values are read where the attention
    hands them to the cache's ``update``, after RoPE and any ``k_norm`` (what the cache stores, where
    compressed-tensors' KV hooks observe them). None (a module without a KV cache, e.g. mixprec's
    demo model): the output of ``layer``, columns ``[start, stop)`` of its last dimension (the whole
    output when ``start`` is None), which is what such a module attends with only when nothing
    (RoPE, a norm) transforms them in between."""

    attention: str
    which: str  # "k" or "v"
    layer: str
    start: int | None = None
    stop: int | None = None
    cache: str | None = None

    @property
    def site(self) -> str:
        """Where the statistic is taken, in words (for the export manifest)."""
        if self.cache is not None:
            return f"{'keys' if self.which == 'k' else 'values'} stored in the KV cache (after RoPE and any norm)"
        return f"output of {self.layer}" + ("" if self.start is None else f" [{self.start}:{self.stop}]")


def cache_argument(module: nn.Module) -> str | None:
    """The name under which ``module.forward`` takes a KV cache (one of :data:`CACHE_ARGUMENTS`) when it
    uses that cache only through ``update`` (Llama, Qwen3, Mistral, Phi-3: a stand-in can then take
    its place, with or without a real cache); None when it takes none, or uses it otherwise too
    (GPT-2's and T5's ``is_updated``, ``cross_attention_cache``...), or its source cannot be read."""
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return None
    name = next((n for n in CACHE_ARGUMENTS if n in params), None)
    if name is None:
        return None
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return None
    return name if set(re.findall(rf"\b{name}\.(\w+)", source)) <= {"update"} else None


def _transforms_keys(module: nn.Module) -> bool:
    """Whether the attention module may transform its keys between projection and cache (RoPE, a norm)."""
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return True
    return bool(re.search(r"rotary|rope|k_norm|position_embeddings", source))


def kv_sources(model: nn.Module) -> list[KVSource]:
    """The keys and values of every attention module: those it hands to its KV cache when its forward
    takes one (transformers' attention modules: Llama, Qwen3 with ``k_norm``, GPT-2, Phi-3 with a
    fused ``qkv_proj``), else the outputs of its ``k_proj``/``v_proj`` children or the middle and
    last thirds of a fused ``c_attn``/``qkv`` (mixprec's demo model). Cross-attention is skipped.
    Named as in the bare model (:func:`named_modules`); a wrapper (torch.compile's, which forwards
    attribute reads to the module it wraps) is not an attention module."""
    out = []
    for fqn, mod in named_modules(model):
        if unwrap(mod) is not mod or getattr(mod, "is_cross_attention", False):
            continue
        prefix = f"{fqn}." if fqn else ""
        k, v = getattr(mod, "k_proj", None), getattr(mod, "v_proj", None)
        fused = next((n for n in FUSED_QKV if getattr(mod, n, None) is not None and _is_linear(getattr(mod, n))), None)
        if not ((k is not None and v is not None and _is_linear(k) and _is_linear(v)) or fused is not None):
            continue
        cache = cache_argument(mod)
        if cache is None and _transforms_keys(mod):
            warnings.warn(f"export: the keys of {fqn or type(mod).__name__} are measured at its projection's output: "
                          f"its forward uses its KV cache beyond update() (or takes none), so mixprec cannot read "
                          f"them as the cache stores them, and it may apply RoPE or a norm in between (its "
                          f"k_scale may then be too small); check it, or pass kv_cache=False to export",
                          stacklevel=3)
        if cache is not None:
            layer = prefix + ("k_proj" if fused is None else fused)
            out += [KVSource(fqn, "k", layer, cache=cache), KVSource(fqn, "v", layer, cache=cache)]
        elif fused is None:
            out += [KVSource(fqn, "k", prefix + "k_proj"), KVSource(fqn, "v", prefix + "v_proj")]
        elif fused != "qkv_proj":
            width = weight_out_in(getattr(mod, fused)).shape[0]
            if width % 3 == 0:
                e = width // 3
                name = prefix + fused
                out += [KVSource(fqn, "k", name, e, 2 * e), KVSource(fqn, "v", name, 2 * e, 3 * e)]
    return out


def fused_groups(names: list[str]) -> list[tuple[str, ...]]:
    """The groups of :data:`FUSED` siblings (same parent) among the layer names ``names``, each in the
    pattern's order; a group has at least two members present."""
    present = set(names)
    groups = []
    parents = sorted({n.rpartition(".")[0] for n in names})
    for parent in parents:
        prefix = f"{parent}." if parent else ""
        for pattern in FUSED:
            members = tuple(prefix + p for p in pattern if prefix + p in present)
            if len(members) > 1:
                groups.append(members)
    return groups


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
