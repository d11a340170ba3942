"""The results a Controller's loss costs take their errors against (``ControllerSettings.
reference``): the GEMM a layer's top rung would run, in float32 or from bfloat16 operands
accumulated in float32.

A cast's error is an order of magnitude or more over bfloat16's rounding (NVFP4's elements round
by up to 2**-3 of their block's scale, e4m3's by 2**-4, bfloat16's by 2**-9), and under bf16
autocast a layer's input and output gradient are bfloat16 already: a bfloat16 reference moves a
cost's squared term by up to a percent and its first-order sum by a few percent of that sum's own
noise (tests/fp8/test_controller_reference.py). It is 2.2x cheaper than a float32 GEMM on a CPU with bfloat16
units (AVX512-BF16, AMX; 2-5x dearer on one without) and 8-16x on a GPU's tensor cores, where a
float32 GEMM beside an NVFP4 step would cost more than the step. ``"auto"`` takes bfloat16 for a
layer that computes in bfloat16 (its operands are bfloat16: the reference is its compute rung's
GEMM) where the device multiplies it natively (CUDA from sm80; a CPU with ``avx512_bf16`` or AMX,
unless ``ONEDNN_MAX_CPU_ISA`` holds oneDNN below them), float32 elsewhere (a float32 or float16
model keeps an exact reference). The GEMMs a cost emulates (the rung below's) multiply where the
reference does (:func:`emulation_backend`). Pure functions, no host sync."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

__all__ = ["REFERENCES", "emulation_backend", "operand_dtype", "reference_dtype", "reference_linear", "reference_mm"]

#: the values of ``ControllerSettings.reference``
REFERENCES = ("auto", "bfloat16", "float32")


def reference_dtype(reference: str, device: torch.device) -> torch.dtype | None:
    """The operand dtype of the reference GEMMs on ``device`` for the setting ``reference`` (one of
    :data:`REFERENCES`): float32, bfloat16, or None (``"auto"`` where ``device`` multiplies
    bfloat16 natively): bfloat16 for bfloat16 operands, else float32 (:func:`operand_dtype`).

    Example:
        >>> reference_dtype("float32", torch.device("cpu")), reference_dtype("bfloat16", torch.device("cpu"))
        (torch.float32, torch.bfloat16)
    """
    if reference == "auto":
        return None if _native_bfloat16(device) else torch.float32
    return torch.bfloat16 if reference == "bfloat16" else torch.float32


def operand_dtype(reference: torch.dtype | None, operands: torch.dtype) -> torch.dtype:
    """The dtype a reference GEMM takes its operands in, for a resolved ``reference``
    (:func:`reference_dtype`) and the dtype the layer computes in (``operands``: its input's or
    output gradient's).

    Example:
        >>> operand_dtype(None, torch.bfloat16), operand_dtype(None, torch.float32), operand_dtype(torch.float32, torch.bfloat16)
        (torch.bfloat16, torch.float32, torch.float32)
    """
    if reference is None:
        return torch.bfloat16 if operands == torch.bfloat16 else torch.float32
    return reference


def emulation_backend(operands: torch.dtype) -> str:
    """The backend a cost emulates another recipe's GEMMs with (the rung below, the own casts of
    an untapped layer), for the reference's operand dtype (:func:`operand_dtype`): bfloat16 ones
    multiply NVFP4 and MX blocks in the layer's dtype (``"emulate"``: 1.3-1.8x cheaper on a CPU
    with bfloat16 units, its rounding 2-3% of an NVFP4 error's norm), float32 ones in float32
    (``"emulate_fp32"``). Tensor- and row-scaled fp8 are the same bits under either.

    Example:
        >>> emulation_backend(torch.bfloat16), emulation_backend(torch.float32)
        ('emulate', 'emulate_fp32')
    """
    return "emulate" if operands == torch.bfloat16 else "emulate_fp32"


def _native_bfloat16(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 0)
    if device.type != "cpu":
        return False
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
    held = isa != "ALL" and "BF16" not in isa and "AMX" not in isa
    return not held and (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def reference_mm(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``a @ b`` (2-D) in float32: from float32 operands, or (``dtype`` bfloat16) from bfloat16
    operands accumulated in float32 (a float32 result on CUDA; elsewhere the GEMM's bfloat16 result).

    Example:
        >>> a, b = torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0], [4.0]])
        >>> reference_mm(a, b), reference_mm(a, b, torch.bfloat16)
        (tensor([[11.]]), tensor([[11.]]))
    """
    if dtype == torch.float32:
        return a.float() @ b.float()
    a, b = a.to(dtype), b.to(dtype)
    if a.device.type == "cuda":
        return torch.mm(a, b, out_dtype=torch.float32)
    return (a @ b).float()


def reference_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``F.linear(x, w, b)`` in float32 as :func:`reference_mm` takes it (``x``: any leading
    dimensions; the bias added in float32)."""
    if dtype == torch.float32:
        return F.linear(x.float(), w.float(), None if b is None else b.float())
    out = reference_mm(x.reshape(-1, x.shape[-1]), w.t(), dtype).reshape(*x.shape[:-1], w.shape[0])
    return out if b is None else out + b.float()
