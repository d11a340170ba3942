"""The compressed-tensors checkpoint: safetensors + ``quantization_config`` in ``config.json``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mixprec._modules import clean_name
from mixprec.export._fp4 import CT_FORMATS
from mixprec.export._layers import linear_layers
from mixprec.export._quant import Quantized
from mixprec.fp8 import ROUNDING_KEY

__all__ = ["write_compressed_tensors", "quantization_config", "WEIGHTS_NAME"]

WEIGHTS_NAME = "model.safetensors"
#: the compressed-tensors release whose format this writes
FORMAT_VERSION = "0.20.0"


def _args(strategy: str) -> dict[str, Any]:
    return {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": False,
            "group_size": None, "block_structure": None, "actorder": None, "observer": None, "observer_kwargs": {}}


def _fp4_args(fmt: str, dynamic: bool | str) -> dict[str, Any]:
    """compressed-tensors' NVFP4 (``tensor_group``, 16, e4m3 scales) or MXFP4 (``group``, 32, E8M0
    uint8 scales) arguments, as its ``NVFP4``/``MXFP4`` presets serialize them."""
    nv = fmt == "nvfp4"
    return {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group" if nv else "group",
            "dynamic": dynamic, "group_size": 16 if nv else 32,
            "scale_dtype": "torch.float8_e4m3fn" if nv else "torch.uint8", "block_structure": None,
            "actorder": None, "observer": "static_minmax" if nv and dynamic == "local" else None,
            "observer_kwargs": {}}


def _fp4_groups(q: Quantized) -> dict[str, dict[str, Any]]:
    """One config group per fp4 format (weights and inputs), targeting its layers by name."""
    groups: dict[str, list[str]] = {}
    for fqn, layer in q.fp4.items():
        groups.setdefault(layer.format, []).append(fqn)
    return {fmt: {"targets": sorted(names),
                  "weights": _fp4_args(fmt, False),
                  "input_activations": _fp4_args(fmt, "local" if fmt == "nvfp4" else True),
                  "output_activations": None,
                  "format": CT_FORMATS[fmt]} for fmt, names in sorted(groups.items())}


def quantization_config(q: Quantized) -> dict[str, Any]:
    """The ``quantization_config`` entry of ``config.json`` (compressed-tensors' schema). fp8 layers
    form ``group_0`` (targets ``["Linear"]``, every other linear layer in ``ignore``; by name when
    the model also has fp4 layers); each fp4 format has its own group, its layers named."""
    ignore = sorted(q.kept)
    groups: dict[str, dict[str, Any]] = {}
    if q.layers or not q.fp4:
        groups["group_0"] = {
            "targets": sorted(q.layers) if q.fp4 else ["Linear"],
            "weights": _args(q.strategy),
            "input_activations": _args("tensor"),
            "output_activations": None,
            "format": "float-quantized",
        }
    groups.update(_fp4_groups(q))
    formats = {g["format"] for g in groups.values()}
    return {
        "quant_method": "compressed-tensors",
        "format": formats.pop() if len(formats) == 1 else "mixed-precision",
        "quantization_status": "compressed",
        "version": FORMAT_VERSION,
        "global_compression_ratio": None,
        "sparsity_config": {},
        "transform_config": {},
        "config_groups": groups,
        "ignore": ignore,
        "kv_cache_scheme": _args("tensor") if q.kv_scales else None,
    }


def _check_layout(model: nn.Module, q: Quantized) -> None:
    linears = linear_layers(model)
    bad = [n for n in [*q.layers, *q.fp4] if not isinstance(linears[n], nn.Linear)]
    if bad:
        raise ValueError(f"export: compressed-tensors quantizes nn.Linear layers only (its "
                         f"initialize_module_for_quantization rejects other types), and {bad[0]!r} is a "
                         f"{type(linears[bad[0]]).__name__} (GPT-2's Conv1D){f' (and {len(bad) - 1} more)' if len(bad) > 1 else ''}; "
                         f"pass layers=[...] without them to keep them in high precision")
    ptrs: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        ptrs.setdefault(p.untyped_storage().data_ptr(), []).append(clean_name(name))
    for fqn in [*q.layers, *q.fp4]:
        shared = [n for n in ptrs.get(linears[fqn].weight.untyped_storage().data_ptr(), []) if n != f"{fqn}.weight"]
        if shared:
            raise ValueError(f"export: layer {fqn!r} shares its weight with {shared[0]!r} (tied embeddings): storing it "
                             f"in fp8 or fp4 would change both; leave it out of layers (it stays in high precision)")


def _tensors(model: nn.Module, q: Quantized) -> dict[str, torch.Tensor]:
    """The state dict with the fp8 and fp4 layers' weights replaced; tied tensors stored once (the first name);
    without the layers' fp4 call counts (training state: :data:`~mixprec.formats._state.ROUNDING_KEY`). Named
    as in the bare model (an inner torch.compile wrapper's ``_orig_mod.`` left out: :func:`clean_name`)."""
    out: dict[str, torch.Tensor] = {}
    seen: dict[tuple, str] = {}
    replaced = {f"{n}.weight" for n in [*q.layers, *q.fp4]}
    for name, t in model.state_dict(keep_vars=False).items():
        name = clean_name(name)
        if name in replaced or name.endswith(ROUNDING_KEY):
            continue
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype) if t.numel() else None
        if key is not None and key in seen:
            continue  # tied (e.g. lm_head to the embedding): the reader ties it back
        if key is not None:
            seen[key] = name
        out[name] = t.detach().cpu().contiguous()
    for fqn, layer in q.layers.items():
        out[f"{fqn}.weight"] = layer.q.contiguous()
        out[f"{fqn}.weight_scale"] = layer.weight_scale.contiguous()
        out[f"{fqn}.input_scale"] = layer.input_scale.contiguous()
    for fqn, f in q.fp4.items():
        out[f"{fqn}.weight_packed"] = f.weight_packed
        out[f"{fqn}.weight_scale"] = f.weight_scale
        if f.weight_global_scale is not None:
            out[f"{fqn}.weight_global_scale"] = f.weight_global_scale
        if f.input_global_scale is not None:
            out[f"{fqn}.input_global_scale"] = f.input_global_scale
    for attn, scales in q.kv_scales.items():
        for name, s in scales.items():
            out[f"{attn}.{name}" if attn else name] = s.contiguous()
    return out


def write_compressed_tensors(model: nn.Module, folder: Path, q: Quantized) -> list[Path]:
    """Write ``model.safetensors`` and ``config.json`` (the model's own ``config`` when it has one,
    e.g. a transformers model, with ``architectures`` naming the model's class as ``save_pretrained``
    writes it, plus ``quantization_config``). Returns the files written."""
    from safetensors.torch import save_file

    _check_layout(model, q)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(_tensors(model, q), str(folder / WEIGHTS_NAME), metadata={"format": "pt"})
    config = getattr(model, "config", None)
    data = config.to_dict() if hasattr(config, "to_dict") else {}
    if "architectures" in data:
        # a transformers config: name the model's class, as save_pretrained does (a model built from a
        # config has None there, and vLLM then builds the base model, e.g. LlamaModel: no LM head)
        data["architectures"] = [type(model).__name__]
    data["quantization_config"] = quantization_config(q)
    (folder / "config.json").write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    written = [folder / WEIGHTS_NAME, folder / "config.json"]
    gen = getattr(model, "generation_config", None)
    if gen is not None and hasattr(gen, "save_pretrained"):
        gen.save_pretrained(folder)
        written.append(folder / "generation_config.json")
    return written
