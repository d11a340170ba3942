"""The experts' grouped GEMMs on torch's grouped scaled GEMM, and what a device lacks for it.

:mod:`._grouped` casts each expert on its own rows; where the device has the kernel for a GEMM's
casts, the experts' GEMM runs as one ``torch._scaled_grouped_mm`` on those casts (torch 2.13;
the meta check of ``_meta_grouped_mm_common``): e4m3 operands, the contracted dimension 16-byte
aligned, int32 offsets, bfloat16 output (cast to the output dtype after). Two kinds:

* **rowwise** (e4m3 scaled per tensor or per row; CUDA sm90 and sm100): float32 inverse scales,
  one per row (a tensor scale repeated over the expert's rows).
* **mxfp8** (e4m3 ``1x32`` blocks, E8M0 scales; sm100): each expert's scales in the
  ``SWIZZLE_32_4_4`` layout (:func:`~._swizzle.to_blocked`), laid out as torchao's MXFP8 grouped
  GEMM lays them: a jagged operand's groups one after another, each padded to whole 128x4 tiles
  (along the rows: ``round_up(rows, 128)`` rows a group; along the tokens: ``round_up(blocks, 4)``
  columns a group); an expert's weight scales one row of ``[E, tiles]``.

The layouts of each GEMM:

* **rows** (forward, input gradient): ``A`` ``[tokens, K]`` row-major, jagged by the offsets;
  ``B`` ``[E, K, N]`` column-major; rowwise scales ``[tokens]`` and ``[E, N]``.
* **jagged contracted dimension** (weight gradient): ``A`` ``[N, tokens]`` row-major, ``B``
  ``[tokens, K]`` column-major, rowwise scales ``[E * N]`` and ``[E * K]``; each expert's tokens
  are zero-padded to a multiple of 16 (rowwise) or 32 (mxfp8: whole blocks; the partial block's
  scale is the cast's) with zero codes, whose products are zeros.

An expert without rows, or one whose GEMM runs elsewhere (a fallback in high precision, a
Controller rung of another recipe), takes zero rows here (its output rows are zeros; its weight
gradient is masked to zeros) and its GEMM runs emulated; the caller adds the two.
Blockwise and fp4 recipes run emulated and say so.
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec.formats._native_gemm import _e8m0, _pad_cols, _round_up, note_emulated
from mixprec.formats._recipe import Cast, Float8Recipe
from mixprec.formats._swizzle import blocked_numel, to_blocked

__all__ = ["grouped_kind", "split_native", "missing_grouped", "resolve_grouped", "grouped_rows", "grouped_jagged"]

#: what each kind needs of the device: (whether a capability has it, in words)
_NEEDS = {"rowwise": (lambda c: c == (9, 0) or c[0] == 10, "compute capability 9.0 or 10.x (sm90, sm100)"),
          "mxfp8": (lambda c: c[0] == 10, "compute capability 10.x (sm100)")}
#: what each expert's tokens are padded to in the weight-gradient GEMM
_ALIGN = {"rowwise": 16, "mxfp8": 32}
_E4M3 = torch.float8_e4m3fn


def grouped_kind(a: Cast, b: Cast) -> str | None:
    """The kind of grouped scaled GEMM (a key of :data:`_NEEDS`) a GEMM of the casts ``a`` and
    ``b`` makes: both e4m3 scaled per tensor or per row (``"rowwise"``), both e4m3 ``1x32`` with
    E8M0 scales (``"mxfp8"``), else None."""
    if not all(c.is_fp8 and not c.is_fp4 and c.dtype == _E4M3 for c in (a, b)):
        return None
    if a.block is None and b.block is None:
        return "rowwise"
    mx = all(c.block == (1, 32) and c.scale_format == "e8m0" for c in (a, b))
    return "mxfp8" if mx else None


def _kinds(device: torch.device) -> set[str]:
    """The kinds the device runs (on the CPU every kind: only a test's stand-in kernel runs there)."""
    if device.type != "cuda":
        return set(_NEEDS)
    capability = torch.cuda.get_device_capability(device)
    return {kind for kind, (has, _) in _NEEDS.items() if has(capability)}


def split_native(groups: list[Any], backend: str, device: torch.device) -> tuple[dict[str, list[Any]], list[Any]]:
    """``({kind: native}, emulated)``: the experts' GEMMs (``(a, ca, b, cb)`` or None) that torch's
    grouped scaled GEMM runs under ``backend`` on ``device``, by kind, and the rest; None elsewhere."""
    kinds = [grouped_kind(g[1], g[3]) if backend == "scaled_mm" and g is not None else None for g in groups]
    runs = _kinds(device) if any(kinds) else set()
    native = {k: [g if kind == k else None for g, kind in zip(groups, kinds)]
              for k in _NEEDS if k in runs and k in kinds}  # (in a fixed order: the sum's)
    return native, [g if kind not in native else None for g, kind in zip(groups, kinds)]


def missing_grouped(recipe: Float8Recipe, input: torch.Tensor, weight: torch.Tensor) -> str | None:
    """What the device, the torch build, the recipe or the expert weights (``[E, out, in]``) lack
    for every fp8 GEMM of ``recipe`` to run on torch's grouped scaled GEMM (in words), or None."""
    if not input.is_cuda:
        kinds = [grouped_kind(a, b) for a, b in recipe.gemms().values() if a.is_fp8]
        words = _NEEDS[next((k for k in kinds if k is not None), "rowwise")][1]
        return f"for the experts' grouped GEMMs a CUDA device of {words} (the input is on {input.device.type})"
    if torch.version.hip is not None:
        return "for the experts' grouped GEMMs NVIDIA's grouped scaled GEMM (this torch build is for ROCm)"
    if not hasattr(torch, "_scaled_grouped_mm"):
        return f"for the experts' grouped GEMMs torch._scaled_grouped_mm (torch {torch.__version__} has none)"
    capability = torch.cuda.get_device_capability(input.device)
    for name, (a, b) in recipe.gemms().items():
        kind = grouped_kind(a, b) if a.is_fp8 else "rowwise"
        if kind is None:
            return (f"for the experts' grouped GEMMs e4m3 operands scaled per tensor or per row, or MXFP8 "
                    f"blocks (the {name} GEMM casts {a.format} {a.granularity} and {b.format} {b.granularity}; "
                    f"mixprec runs the experts' other recipes emulated)")
        has, words = _NEEDS[kind]
        if not has(capability):
            return (f"for the experts' {kind} grouped GEMMs {words}; this device has "
                    f"{capability[0]}.{capability[1]}")
    if any(f % 16 for f in weight.shape[1:]):
        return (f"for the experts' grouped GEMMs expert features that are multiples of 16 "
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


def _blocked(deq: torch.Tensor | None, rows: int, blocks: int, device: torch.device) -> torch.Tensor:
    """An MXFP8 operand's ``[rows, blocks]`` scales (float32 powers of 2) as E8M0 in the swizzled
    layout, flattened; None: zero bytes (the scales of zero codes)."""
    if deq is None:
        return torch.zeros(blocked_numel(rows, blocks), dtype=torch.uint8, device=device).view(torch.float8_e8m0fnu)
    return to_blocked(_e8m0(deq))


def _scales(kind: str, op: Any, rows: int, blocks: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernel of ``kind`` reads for the scales of ``op``'s two operands (None: zeros),
    ``rows`` and ``blocks`` each: ``(rows_a, rows_b)`` and the contracted dimension's blocks."""
    if kind == "rowwise":
        if op is None:
            return torch.ones(rows[0], device=device), torch.ones(rows[1], device=device)
        return _inverse(op[0][1], rows[0]), _inverse(op[2][1], rows[1])
    return tuple(_blocked(None if op is None else op[i][1], r, blocks, device) for i, r in zip((0, 2), rows))


def grouped_rows(kind: str, ops: list[Any], bounds: list[int], n: int, k: int, device: torch.device) -> torch.Tensor:
    """``[bounds[-1], n]`` bfloat16: ``A_e @ B_e.t()`` of each expert on its rows, on the kernel of
    ``kind``. ``ops[e]``: ``((qa, sa), ca, (qb, sb), cb)`` of :func:`~._fp4_linear.cast_operand`
    (``qa``: the expert's ``[rows, k]``; ``qb``: ``[n, k]``), None for an expert whose rows are
    zeros here. Precondition: :func:`grouped_kind` of each is ``kind``, ``k`` a multiple of 16."""
    qa, sa, qb, sb = [], [], [], []
    for e, op in enumerate(ops):
        rows = bounds[e + 1] - bounds[e]
        qa.append(torch.zeros(rows, k, dtype=_E4M3, device=device) if op is None else op[0][0])
        qb.append(torch.zeros(n, k, dtype=_E4M3, device=device) if op is None else op[2][0])
        scale_a, scale_b = _scales(kind, op, (rows, n), -(-k // 32), device)
        sa.append(scale_a)
        sb.append(scale_b)
    offs = torch.tensor(bounds[1:], dtype=torch.int32, device=device)
    scale_a = torch.cat(sa) if kind == "rowwise" else torch.cat(sa).view(-1, _round_up(-(-k // 32), 4))
    return torch._scaled_grouped_mm(torch.cat(qa), torch.stack(qb).transpose(-2, -1), scale_a,
                                    torch.stack(sb), offs=offs, out_dtype=torch.bfloat16)


def grouped_jagged(kind: str, ops: list[Any], n: int, k: int, device: torch.device) -> torch.Tensor:
    """``[E, n, k]`` bfloat16: ``A_e @ B_e.t()`` of each expert, its tokens the contracted
    dimension (the weight gradient), on the kernel of ``kind``. ``ops[e]``: ``((qa, sa), ca, (qb,
    sb), cb)`` (``qa``: ``[n, tokens]``; ``qb``: ``[k, tokens]``), None for an expert whose result
    is zeros here. Precondition: :func:`grouped_kind` of each is ``kind``."""
    qa, sa, qb, sb, ends, end = [], [], [], [], [], 0
    for op in ops:
        padded = 0 if op is None else _round_up(op[0][0].shape[1], _ALIGN[kind])
        if op is not None:
            qa.append(_pad_cols(op[0][0], padded))
            qb.append(_pad_cols(op[2][0], padded))
        if op is not None or kind == "rowwise":  # (MXFP8: an empty group has no scales)
            scale_a, scale_b = _scales(kind, op, (n, k), padded // 32, device)
            sa.append(scale_a)
            sb.append(scale_b)
        end += padded
        ends.append(end)
    offs = torch.tensor(ends, dtype=torch.int32, device=device)
    scale_a, scale_b = torch.cat(sa), torch.cat(sb)
    if kind == "mxfp8":  # each group's tiles one after another (torchao's K-groups layout)
        scale_a, scale_b = scale_a.view(_round_up(n, 128), -1), scale_b.view(_round_up(k, 128), -1)
    out = torch._scaled_grouped_mm(torch.cat(qa, dim=1), torch.cat(qb, dim=1).t(), scale_a, scale_b,
                                   offs=offs, out_dtype=torch.bfloat16)
    if any(op is None for op in ops):  # (an empty group's result is the kernel's to leave)
        keep = torch.tensor([op is not None for op in ops], device=device)
        out = torch.where(keep[:, None, None], out, torch.zeros((), dtype=out.dtype, device=device))
    return out
