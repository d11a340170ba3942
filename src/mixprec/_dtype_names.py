"""The names of the floating dtypes mixprec computes in, one table for every reader and writer:
policies and their text form, the audit's candidates, the integrations' precisions and the
Controller's rung names. A leaf module: it imports torch only.

Names are read case-blind, stripped, with an optional ``torch.`` prefix; the canonical name of a
dtype is torch's own without the prefix (``"bfloat16"``), the short name the one rung and
precision names use (``"bf16"``).

Example:
    >>> parse_dtype(" Torch.BF16 "), dtype_name(torch.half), short_name(torch.float32, "?")
    (torch.bfloat16, 'float16', 'fp32')
    >>> parse_dtype("fp8", "policy 'compute'")
    Traceback (most recent call last):
    ValueError: policy 'compute': unknown dtype 'fp8'; use one of bf16, bfloat16, f16, f32, float, float16, float32, fp16, fp32, half, single
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

import torch

__all__ = ["DTYPE_NAMES", "SHORT_NAMES", "dtype_name", "lookup", "parse_dtype", "short_name"]

#: every name accepted for a dtype (lower case, without ``torch.``) -> the dtype
DTYPE_NAMES: Mapping[str, torch.dtype] = MappingProxyType({
    "float32": torch.float32,
    "f32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "single": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "f16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
})

#: the short name of each dtype in :data:`DTYPE_NAMES` (rung names, framework precisions)
SHORT_NAMES: Mapping[torch.dtype, str] = MappingProxyType({
    torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"})


def lookup(name: str) -> torch.dtype | None:
    """The dtype ``name`` (case-blind, stripped, ``torch.`` optional) names, else ``None``."""
    return DTYPE_NAMES.get(str(name).strip().lower().removeprefix("torch."))


def parse_dtype(name: str | torch.dtype, where: str | None = None) -> torch.dtype:
    """``"bf16"``, ``"bfloat16"``, ``"half"``, ``"f32"``, ... (or a dtype, returned as is) ->
    ``torch.dtype``.

    Raises:
        ValueError: a name not in :data:`DTYPE_NAMES`; the message starts with ``where`` (the
            setting read, when given) and lists the accepted names.
    """
    if isinstance(name, torch.dtype):
        return name
    dtype = lookup(name)
    if dtype is None:
        prefix = f"{where}: " if where else ""
        raise ValueError(f"{prefix}unknown dtype {name!r}; use one of {', '.join(sorted(DTYPE_NAMES))}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (what :func:`parse_dtype` reads back)."""
    return str(dtype).removeprefix("torch.")


def short_name(dtype: torch.dtype, default: str) -> str:
    """``torch.bfloat16`` -> ``"bf16"``; ``default`` for a dtype without a short name."""
    return SHORT_NAMES.get(dtype, default)
