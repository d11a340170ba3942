"""The torchao route: ``quantize_`` with float8 static-activation configs, scales from training."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from torch import nn

from mixprec.export._layers import linear_layers
from mixprec.export._quant import Quantized
from mixprec.fp8 import ROUNDING_KEY, unconvert

__all__ = ["torchao_model", "write_torchao"]


def _needs_fp8_device(model: nn.Module) -> None:
    p = next(model.parameters(), None)
    ok = p is not None and p.is_cuda and torch.cuda.get_device_capability(p.device) >= (8, 9)
    if not ok:
        raise ValueError("export format='torchao': torchao's float8 inference configs run only on a CUDA device "
                         "of compute capability 8.9+ (its Float8Tensor asserts it); move the model there first, or "
                         "use format='compressed-tensors', which writes on any device")


def torchao_model(model: nn.Module, q: Quantized) -> nn.Module:
    """A copy of ``model`` with torchao's ``Float8StaticActivationFloat8WeightConfig`` applied to each
    fp8 layer (``act_quant_scale``: the exported input scale; weights cast by torchao, per tensor, or
    per row for ``strategy='channel'``). Raises ValueError for an fp4 layer (named), off an fp8 GPU,
    or for Conv1D layers."""
    from torchao.prototype.quantization.quant_api import Float8StaticActivationFloat8WeightConfig
    from torchao.quantization import PerRow, PerTensor, quantize_

    if q.fp4:
        fqn = next(iter(q.fp4))
        raise ValueError(f"export format='torchao': layer {fqn!r} is {q.fp4[fqn].format} ({len(q.fp4)} fp4 layers in "
                         f"all), and this route writes torchao's float8 configs only; use format='compressed-tensors' "
                         f"(its {q.fp4[fqn].format}-pack-quantized format), or keep the layer out with layers=[...]")
    _needs_fp8_device(model)
    linears = linear_layers(model)
    bad = [n for n in q.layers if not isinstance(linears[n], nn.Linear)]
    if bad:
        raise ValueError(f"export format='torchao': torchao quantizes nn.Linear layers only, {bad[0]!r} is a "
                         f"{type(linears[bad[0]]).__name__}; pass layers=[...] without it")
    out = unconvert(copy.deepcopy(model))
    device = next(out.parameters()).device
    for fqn, layer in q.layers.items():
        config = Float8StaticActivationFloat8WeightConfig(
            act_quant_scale=layer.input_scale.to(device),
            granularity=PerTensor() if q.strategy == "tensor" else [PerTensor(), PerRow()])
        quantize_(out, config, filter_fn=lambda mod, name, target=fqn: name == target)
    return out


def write_torchao(model: nn.Module, folder: Path, q: Quantized) -> tuple[list[Path], nn.Module]:
    """``torch.save`` the quantized model's state dict (torchao tensor subclasses) to ``model.pt``
    and the per-layer configs to ``torchao_config.json``."""
    quantized = torchao_model(model, q)
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({k: v for k, v in quantized.state_dict().items() if not k.endswith(ROUNDING_KEY)},  # (training state)
               folder / "model.pt")
    configs = {fqn: {"config": "Float8StaticActivationFloat8WeightConfig", "act_quant_scale": float(layer.input_scale),
                     "granularity": q.strategy} for fqn, layer in q.layers.items()}
    (folder / "torchao_config.json").write_text(json.dumps(configs, indent=2) + "\n")
    return [folder / "model.pt", folder / "torchao_config.json"], quantized
