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


def load_static(model: nn.Module, folder: str | Path, scale_dtype: torch.dtype | None = None) -> nn.Module:
    """Swap, in place, each layer that the compressed-tensors export in ``folder`` stores in fp8 for a
    :class:`StaticFloat8Linear` with the exported bytes and scales (the other layers keep their
    weights), by the bare model's names (``model`` may be wrapped: torch.compile, DDP). Returns
    ``model``. ``scale_dtype``: read the (float32) scales in that dtype, as
    transformers' compressed-tensors integration does for a bf16/fp16 model (it creates the scale
    parameters in the model's dtype); None keeps float32, as vLLM reads them. Raises ValueError when
    ``folder`` is not such an export, names a layer the model does not have, or holds fp4 layers
    (NVFP4/MXFP4: this forward does not run them; the folder is left unused and ``model`` unchanged).
    """
    from safetensors.torch import load_file

    folder = Path(folder)
    config_path = folder / "config.json"
    if not (folder / WEIGHTS_NAME).is_file() or not config_path.is_file():
        raise ValueError(f"{folder}: not a compressed-tensors export (needs {WEIGHTS_NAME} and config.json)")
    if "quantization_config" not in json.loads(config_path.read_text()):
        raise ValueError(f"{config_path}: no quantization_config (not written by mixprec.export)")
    tensors = load_file(str(folder / WEIGHTS_NAME))
    fp4 = sorted(k[:-len(".weight_packed")] for k in tensors if k.endswith(".weight_packed"))
    if fp4:
        raise ValueError(f"{folder}: load_static runs fp8 layers only, and {len(fp4)} layers of this export are fp4 "
                         f"(NVFP4/MXFP4: {fp4[0]!r}{' ...' if len(fp4) > 1 else ''}); read it with transformers "
                         f"(from_pretrained(folder, dtype=torch.bfloat16)) or compressed-tensors' decompress_model")
    fp8 = [k[:-len(".input_scale")] for k in tensors if k.endswith(".input_scale")]
    modules = dict(named_modules(model))
    missing = [n for n in fp8 if n not in modules]
    if missing:
        raise ValueError(f"{folder}: layers {missing} are not in the model")
    for fqn in fp8:
        bias = getattr(modules[fqn], "bias", None)
        ws, xs = tensors[f"{fqn}.weight_scale"], tensors[f"{fqn}.input_scale"]
        if scale_dtype is not None:
            ws, xs = ws.to(scale_dtype), xs.to(scale_dtype)
        new = StaticFloat8Linear(tensors[f"{fqn}.weight"], ws, xs, bias)
        parent, _, child = fqn.rpartition(".")
        setattr(modules[parent], child, new)
    return model
