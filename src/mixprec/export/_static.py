"""mixprec's own fp8 inference forward of an export: fp8 weights, static input scales."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from mixprec._modules import named_modules
from mixprec.export._ct import WEIGHTS_NAME
from mixprec.export._rules import E4M3_MAX

__all__ = ["StaticFloat8Linear", "fake_quantize", "load_static"]


def fake_quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Static fp8 e4m3 quantize-dequantize, as compressed-tensors and vLLM define it:
    ``float8(clamp(x / scale)) * scale`` (``scale`` is the dequantization factor), in ``x``'s dtype."""
    q = (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return (q.to(scale.dtype) * scale).to(x.dtype)


class StaticFloat8Linear(nn.Module):
    """An inference linear layer from an export: ``F.linear(fake_quantize(x, input_scale),
    q * weight_scale, bias)``, the weights kept in fp8 (``q``, ``(out, in)``).

    Example:
        >>> lin = StaticFloat8Linear(torch.ones(2, 2).to(torch.float8_e4m3fn), torch.ones(1), torch.ones(1), None)
        >>> lin(torch.tensor([[1.0, 2.0]]))
        tensor([[3., 3.]])
    """

    def __init__(self, q: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor,
                 bias: torch.Tensor | None) -> None:
        super().__init__()
        self.register_buffer("weight", q)
        self.register_buffer("weight_scale", weight_scale)
        self.register_buffer("input_scale", input_scale)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = (self.weight.to(self.weight_scale.dtype) * self.weight_scale).to(x.dtype)
        return F.linear(fake_quantize(x, self.input_scale), w, None if self.bias is None else self.bias.to(x.dtype))


#: What to do about a folder that does not fit the model (the end of load_static's errors about it).
_WHAT_TO_DO = "export the model again (mixprec.export), or load the folder into the model it was exported from"
_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _scale_problem(key: str, t: torch.Tensor, shapes: list[tuple[int, ...]]) -> str | None:
    """What is wrong with scale ``key`` (its dtype, its shape: one of ``shapes``, its values: finite and
    > 0), or None."""
    if t.dtype not in _SCALE_DTYPES:
        return f"{key!r} is {t.dtype}, not a float32 scale"
    if tuple(t.shape) not in shapes:
        return f"{key!r} has shape {tuple(t.shape)}, not one of {shapes}"
    bad = ~(torch.isfinite(t) & (t > 0))
    if bad.any():
        return f"{key!r} holds {float(t[bad][0]):g} (a scale must be finite and > 0)"
    return None


def _layer_problem(fqn: str, tensors: dict[str, torch.Tensor], modules: dict[str, nn.Module]) -> str | None:
    """What is wrong with fp8 layer ``fqn``'s tensors for the model's layer of that name, or None: each
    of the three present, the weight e4m3 of the layer's weight's shape without NaN, the scales float of
    the shapes the format has (``weight_scale`` ``(1,)`` or ``(out, 1)``, ``input_scale`` ``(1,)``; or
    ``()`` per tensor, as earlier compressed-tensors checkpoints have them), finite and > 0."""
    keys = [f"{fqn}.{n}" for n in ("weight", "weight_scale", "input_scale")]
    absent = [k for k in keys if k not in tensors]
    if absent:
        return f"{absent[0]!r} is missing (an fp8 layer has {', '.join(map(repr, keys))})"
    if fqn not in modules:
        return f"{keys[0]!r} is for layer {fqn!r}, which the model does not have"
    weight = getattr(modules[fqn], "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return f"{keys[0]!r} is for {fqn!r}, a {type(modules[fqn]).__name__} in the model, not a linear layer"
    q, ws, xs = (tensors[k] for k in keys)
    if q.dtype != torch.float8_e4m3fn:
        return f"{keys[0]!r} is {q.dtype}, not torch.float8_e4m3fn (an fp8 layer's weight)"
    if q.shape != weight.shape:
        return (f"{keys[0]!r} has shape {tuple(q.shape)}, but layer {fqn!r} of the model has a "
                f"{tuple(weight.shape)} weight")
    if (q.view(torch.uint8) & 0x7F).eq(0x7F).any():
        return f"{keys[0]!r} holds NaN (e4m3 0x7f)"
    return _scale_problem(keys[1], ws, [(1,), (), (q.shape[0], 1)]) or _scale_problem(keys[2], xs, [(1,), ()])


def _scale_dtype_problem(fqn: str, tensors: dict[str, torch.Tensor], scale_dtype: torch.dtype) -> str | None:
    """Which of ``fqn``'s (valid) scales becomes inf or 0 in ``scale_dtype`` (float16: below 6e-8 or
    above 65504), or None. A ``weight_scale`` of 0 is harmless on a row of zeros (an all-zero weight's
    scale is 2.2e-15)."""
    q = tensors[f"{fqn}.weight"]
    used = (q.view(torch.uint8) & 0x7F).ne(0).any(1, keepdim=True)
    for name, need in (("weight_scale", used), ("input_scale", torch.ones(1, dtype=torch.bool))):
        t = tensors[f"{fqn}.{name}"]
        t, c, need = torch.broadcast_tensors(t, t.to(scale_dtype), need)
        bad = ~torch.isfinite(c) | (need & (c == 0))
        if bad.any():
            return f"'{fqn}.{name}' holds {float(t[bad][0]):g}, which is {float(c[bad][0]):g} in {scale_dtype}"
    return None


def load_static(model: nn.Module, folder: str | Path, scale_dtype: torch.dtype | None = None) -> nn.Module:
    """Swap, in place, each layer that the compressed-tensors export in ``folder`` stores in fp8 for a
    :class:`StaticFloat8Linear` with the exported bytes and scales (the other layers keep their
    weights), by the bare model's names (``model`` may be wrapped: torch.compile, DDP). Returns
    ``model``. ``scale_dtype``: read the (float32) scales in that dtype, as
    transformers' compressed-tensors integration does for a bf16/fp16 model (it creates the scale
    parameters in the model's dtype); None keeps float32, as vLLM reads them.

    Everything it uses is checked before the model is changed: raises ValueError, naming the file and
    the tensor, when ``folder`` is not such an export (no weights or config, a truncated safetensors
    file, a config that is not JSON), holds fp4 layers (NVFP4/MXFP4: this forward does not run them),
    or an fp8 layer's tensors do not fit: ``weight``, ``weight_scale`` or ``input_scale`` missing, a
    layer the model does not have or that is not linear, a weight that is not e4m3 or not of the
    layer's shape or holds NaN, a scale that is not float, not of the format's shape (``(1,)``, or
    ``(out, 1)`` for a per-channel ``weight_scale``), not finite or not > 0, or becomes inf or 0 in
    ``scale_dtype``. ``model`` is then unchanged.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    config_path, weights_path = folder / "config.json", folder / WEIGHTS_NAME
    if not weights_path.is_file() or not config_path.is_file():
        raise ValueError(f"{folder}: not a compressed-tensors export (needs {WEIGHTS_NAME} and config.json)")
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{config_path}: not JSON ({e}): {_WHAT_TO_DO}") from e
    if not isinstance(config, dict) or "quantization_config" not in config:
        raise ValueError(f"{config_path}: no quantization_config (not written by mixprec.export)")
    try:
        tensors = load_file(str(weights_path))
    except SafetensorError as e:
        raise ValueError(f"{weights_path}: not a whole safetensors file ({e}): {_WHAT_TO_DO}") from e
    fp4 = sorted(k[:-len(".weight_packed")] for k in tensors if k.endswith(".weight_packed"))
    if fp4:
        raise ValueError(f"{folder}: load_static runs fp8 layers only, and {len(fp4)} layers of this export are fp4 "
                         f"(NVFP4/MXFP4: {fp4[0]!r}{' ...' if len(fp4) > 1 else ''}); read it with transformers "
                         f"(from_pretrained(folder, dtype=torch.bfloat16)) or compressed-tensors' decompress_model")
    # an fp8 layer: any of its scales, or an e4m3 weight (so that one missing its scales is not left out)
    fp8 = list(dict.fromkeys(k.rpartition(".")[0] for k, t in tensors.items()
                             if k.endswith((".weight_scale", ".input_scale"))
                             or (k.endswith(".weight") and t.dtype == torch.float8_e4m3fn)))
    modules = dict(named_modules(model))
    problems = [p for p in (_layer_problem(fqn, tensors, modules) for fqn in fp8) if p is not None]
    if problems:
        more = f" (and {len(problems) - 1} more layers)" if len(problems) > 1 else ""
        raise ValueError(f"{weights_path}: {problems[0]}{more}: {_WHAT_TO_DO}")
    if scale_dtype is not None:
        problems = [p for p in (_scale_dtype_problem(fqn, tensors, scale_dtype) for fqn in fp8) if p is not None]
        if problems:
            more = f" (and {len(problems) - 1} more layers)" if len(problems) > 1 else ""
            raise ValueError(f"{weights_path}: {problems[0]}{more}, the scale_dtype asked for: load with "
                             f"scale_dtype=torch.bfloat16, or None (float32)")
    swaps = []
    for fqn in fp8:  # all built before any is swapped in
        ws, xs = tensors[f"{fqn}.weight_scale"], tensors[f"{fqn}.input_scale"]
        if scale_dtype is not None:
            ws, xs = ws.to(scale_dtype), xs.to(scale_dtype)
        new = StaticFloat8Linear(tensors[f"{fqn}.weight"], ws, xs, getattr(modules[fqn], "bias", None))
        parent, _, child = fqn.rpartition(".")
        swaps.append((modules[parent], child, new))
    for parent, child, new in swaps:
        setattr(parent, child, new)
    return model
