"""The experts' grouped GEMMs on torch's grouped scaled GEMM, and what a device lacks for it.

:mod:`._grouped` casts each expert on its own rows; where every operand of a GEMM is e4m3 scaled
per tensor or per row (the ``rowwise`` recipes), the experts' GEMM runs as one
``torch._scaled_grouped_mm`` (torch 2.13: CUDA sm90 and sm100; the meta check of
``_meta_grouped_mm_common``): fp8 operands, the contracted dimension 16-byte aligned, float32
inverse scales (one per row: a tensor scale is repeated over the expert's rows), int32 offsets,
bfloat16 output (cast to the output dtype after, as the single GEMMs' rowwise kernel).

* **rows** (forward, input gradient): ``A`` ``[tokens, K]`` row-major, jagged by the offsets;
  ``B`` ``[E, K, N]`` column-major; scales ``[tokens]`` and ``[E, N]``.
* **jagged contracted dimension** (weight gradient): ``A`` ``[N, tokens]`` row-major, ``B``
  ``[tokens, K]`` column-major, scales ``[E * N]`` and ``[E * K]``; each expert's tokens are
  zero-padded to a multiple of 16 (zero codes: their products are zeros), the kernel's alignment.

An expert without rows, or one whose GEMM runs elsewhere (a fallback in high precision, a
Controller rung of another recipe), takes zero rows here (its output rows are zeros; its weight
gradient is masked to zeros) and its GEMM runs emulated; the caller adds the two.
Torch's MXFP8 grouped GEMM (sm100, per-group swizzled E8M0 scales) is not wired: block and fp4
recipes run emulated and say so.
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec.formats._native_gemm import _pad_cols, _round_up, note_emulated
from mixprec.formats._recipe import Cast, Float8Recipe

__all__ = ["native_cast", "split_native", "missing_grouped", "resolve_grouped", "grouped_rows", "grouped_jagged"]

_NEEDS = "compute capability 9.0 or 10.x (sm90, sm100: torch's grouped scaled GEMM)"
_ALIGN = 16
_E4M3 = torch.float8_e4m3fn


def native_cast(a: Cast, b: Cast) -> bool:
    """Whether torch's grouped scaled GEMM takes a GEMM of the casts ``a`` and ``b``: both e4m3,
    scaled per tensor or per row."""
    return all(c.is_fp8 and not c.is_fp4 and c.block is None and c.dtype == _E4M3 for c in (a, b))


def split_native(groups: list[Any], backend: str) -> tuple[list[Any], list[Any]]:
    """``(native, emulated)``: the experts' GEMMs (``(a, ca, b, cb)`` or None) that torch's grouped
    scaled GEMM runs under ``backend`` (:func:`native_cast`), and the rest; None in the other list."""
    native = [g if backend == "scaled_mm" and g is not None and native_cast(g[1], g[3]) else None for g in groups]
    return native, [g if n is None else None for g, n in zip(groups, native)]


def missing_grouped(recipe: Float8Recipe, input: torch.Tensor, weight: torch.Tensor) -> str | None:
    """What the device, the torch build, the recipe or the expert weights (``[E, out, in]``) lack
    for every fp8 GEMM of ``recipe`` to run on torch's grouped scaled GEMM (in words), or None."""
    if not input.is_cuda:
        return f"for the experts' grouped GEMMs a CUDA device of {_NEEDS} (the input is on {input.device.type})"
    if torch.version.hip is not None:
        return "for the experts' grouped GEMMs NVIDIA's grouped scaled GEMM (this torch build is for ROCm)"
    if not hasattr(torch, "_scaled_grouped_mm"):
        return f"for the experts' grouped GEMMs torch._scaled_grouped_mm (torch {torch.__version__} has none)"
    capability = torch.cuda.get_device_capability(input.device)
    if capability != (9, 0) and capability[0] != 10:
        return f"for the experts' grouped GEMMs {_NEEDS}; this device has {capability[0]}.{capability[1]}"
    for name, (a, b) in recipe.gemms().items():
        if a.is_fp8 and not native_cast(a, b):
            return (f"for the experts' grouped GEMMs e4m3 operands scaled per tensor or per row (the {name} "
                    f"GEMM casts {a.format} {a.granularity} and {b.format} {b.granularity}; mixprec runs the "
                    f"experts' block and fp4 recipes emulated)")
    if any(f % _ALIGN for f in weight.shape[1:]):
        return (f"for the experts' grouped GEMMs expert features that are multiples of {_ALIGN} "
                f"(out, in = {weight.shape[1]}, {weight.shape[2]})")
    return None


def resolve_grouped(backend: str, input: torch.Tensor, weight: torch.Tensor, recipe: Float8Recipe) -> str:
    """The experts' backend of this call (``backend`` already checked): ``"scaled_mm"`` where
    :func:`missing_grouped` finds nothing missing and ``backend`` is ``"auto"`` or ``"scaled_mm"``;
    else ``"emulate"`` for ``"auto"`` (said once on the ``mixprec`` logger), or ``backend`` itself.

    Raises ValueError for ``"scaled_mm"`` where it cannot run, naming what is missing."""
    if backend not in ("auto", "scaled_mm"):
        return backend
    gap = missing_grouped(recipe, input, weight)
    if gap is None:
        return "scaled_mm"
    if backend == "scaled_mm":
        raise ValueError(f"fp8 backend 'scaled_mm' for the {recipe.name!r} recipe needs {gap}; "
                         f"use backend='emulate' or 'auto'")
    if not torch.compiler.is_compiling():
        note_emulated(recipe, gap, input.is_cuda)
    return "emulate"


def _inverse(scale: torch.Tensor, rows: int) -> torch.Tensor:
    """A cast's scale (0-d, or ``[rows, 1]``) as the ``[rows]`` float32 inverse scales the kernel
    multiplies by (a tensor scale repeated over the rows)."""
    return scale.float().reciprocal().reshape(-1).expand(rows).contiguous()


def grouped_rows(ops: list[Any], bounds: list[int], n: int, k: int, device: torch.device) -> torch.Tensor:
    """``[bounds[-1], n]`` bfloat16: ``A_e @ B_e.t()`` of each expert on its rows. ``ops[e]``:
    ``((qa, sa), ca, (qb, sb), cb)`` of :func:`~._fp4_linear.cast_operand` (``qa``: the expert's
    ``[rows, k]``; ``qb``: ``[n, k]``), None for an expert whose rows are zeros here.
    Precondition: :func:`native_cast` of each, ``k`` a multiple of 16."""
    qa, sa, qb, sb = [], [], [], []
    for e, op in enumerate(ops):
        rows = bounds[e + 1] - bounds[e]
        if op is None:
            qa.append(torch.zeros(rows, k, dtype=_E4M3, device=device))
            sa.append(torch.ones(rows, device=device))
            qb.append(torch.zeros(n, k, dtype=_E4M3, device=device))
            sb.append(torch.ones(n, device=device))
        else:
            (a, scale_a), _, (b, scale_b), _ = op
            qa.append(a)
            sa.append(_inverse(scale_a, rows))
            qb.append(b)
            sb.append(_inverse(scale_b, n))
    offs = torch.tensor(bounds[1:], dtype=torch.int32, device=device)
    return torch._scaled_grouped_mm(torch.cat(qa), torch.stack(qb).transpose(-2, -1), torch.cat(sa),
                                    torch.stack(sb), offs=offs, out_dtype=torch.bfloat16)


def grouped_jagged(ops: list[Any], n: int, k: int, device: torch.device) -> torch.Tensor:
    """``[E, n, k]`` bfloat16: ``A_e @ B_e.t()`` of each expert, its tokens the contracted
    dimension (the weight gradient). ``ops[e]``: ``((qa, sa), ca, (qb, sb), cb)`` (``qa``:
    ``[n, tokens]``; ``qb``: ``[k, tokens]``), None for an expert whose result is zeros here.
    Precondition: :func:`native_cast` of each."""
    qa, sa, qb, sb, ends, end = [], [], [], [], [], 0
    for op in ops:
        if op is not None:
            (a, scale_a), _, (b, scale_b), _ = op
            padded = _round_up(a.shape[1], _ALIGN)
            qa.append(_pad_cols(a, padded))
            qb.append(_pad_cols(b, padded))
            sa.append(_inverse(scale_a, n))
            sb.append(_inverse(scale_b, k))
            end += padded
        else:
            sa.append(torch.ones(n, device=device))
            sb.append(torch.ones(k, device=device))
        ends.append(end)
    offs = torch.tensor(ends, dtype=torch.int32, device=device)
    out = torch._scaled_grouped_mm(torch.cat(qa, dim=1), torch.cat(qb, dim=1).t(), torch.cat(sa), torch.cat(sb),
                                   offs=offs, out_dtype=torch.bfloat16)
    if any(op is None for op in ops):  # (an empty group's result is the kernel's to leave)
        keep = torch.tensor([op is not None for op in ops], device=device)
        out = torch.where(keep[:, None, None], out, torch.zeros((), dtype=out.dtype, device=device))
    return out
