"""The Hadamard transform of fp4 GEMMs' operands (Transformer Engine's weight-gradient RHT): the
16-point ``H16 diag(signs) / 4`` (orthogonal; the signs from a seed, :func:`hadamard_matrix`),
applied to both operands of a GEMM along its contracted dimension in blocks of 16
(:func:`hadamard`), which leaves the product unchanged and spreads outliers over their block
before the cast; :func:`hadamard_of` is the one tensor per seed and device the GEMMs read."""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _get_current_dispatch_mode

from mixprec.formats._fp4 import _PLAIN, _mix64

__all__ = ["HADAMARD_SIZE", "hadamard", "hadamard_matrix", "hadamard_of"]

HADAMARD_SIZE = 16


def hadamard_matrix(seed: int = 0, device: torch.device | str | None = None) -> torch.Tensor:
    """The 16x16 random Hadamard transform ``H16 @ diag(signs) / 4`` (float32, orthogonal), the
    signs the low 16 bits of ``seed`` mixed by SplitMix64.

    Example:
        >>> h = hadamard_matrix(3)
        >>> bool(torch.allclose(h @ h.t(), torch.eye(16), atol=1e-6))
        True
    """
    # (traced code builds the values itself: Dynamo traces through a cache's wrapper and warns)
    values = _sylvester(int(seed)) if torch.compiler.is_compiling() else _hadamard_values(int(seed))
    return torch.tensor(values, dtype=torch.float32, device=device)


#: the transforms :func:`hadamard_of` built, by (seed, device): a few (one per recipe seed and device)
_HADAMARDS: dict[tuple[int, torch.device], torch.Tensor] = {}


def hadamard_of(seed: int, like: torch.Tensor) -> torch.Tensor:
    """:func:`hadamard_matrix` of ``seed`` on ``like``'s device, for a GEMM's operand ``like``:
    for a plain tensor in eager code, one tensor per seed and device, built once (never written:
    every GEMM reads the same one; built outside inference mode, so autograd may save it);
    a fresh one under a tensor subclass (FakeTensor, DTensor), a dispatch mode or a trace.

    Example:
        >>> x = torch.zeros(2, 16)
        >>> hadamard_of(3, x) is hadamard_of(3, x), bool(torch.equal(hadamard_of(3, x), hadamard_matrix(3)))
        (True, True)
    """
    if type(like) not in _PLAIN or torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return hadamard_matrix(seed, like.device)
    key = (int(seed), like.device)
    h = _HADAMARDS.get(key)
    if h is None:
        with torch.inference_mode(False):
            h = _HADAMARDS.setdefault(key, hadamard_matrix(seed, like.device))
    return h


def _sylvester(seed: int) -> tuple[tuple[float, ...], ...]:
    """The entries of :func:`hadamard_matrix` for ``seed``, as Python floats (a call builds one
    small tensor, under any mode, fake or compiled, alike)."""
    bits = _mix64(seed)  # 16 sign bits from the seed: no generator (a constant under torch.compile)
    h = [[1.0]]
    while len(h) < HADAMARD_SIZE:  # Sylvester's construction
        h = [row + row for row in h] + [row + [-v for v in row] for row in h]
    signs = [1.0 - 2.0 * ((bits >> i) & 1) for i in range(HADAMARD_SIZE)]
    norm = math.sqrt(HADAMARD_SIZE)
    return tuple(tuple(v * s / norm for v, s in zip(row, signs)) for row in h)


#: :func:`_sylvester`, cached for eager code
_hadamard_values = functools.lru_cache(maxsize=None)(_sylvester)


def hadamard(x2: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``x2`` (2-D) in float32 with its last dimension transformed by ``h`` in blocks of 16
    (``block @ h.t()``), zero-padded to a multiple of 16 (so ``hadamard(a, h) @ hadamard(b, h).t()``
    equals ``a @ b.t()`` up to rounding). ``hadamard(y, h.t())`` inverts it (then crop). A strided
    ``x2`` (a transposed operand: the weight gradient's) is made contiguous first: the same bits,
    and on a CPU 5-7x faster than the strided batched GEMM its blocks' view would run."""
    pad = -x2.shape[-1] % HADAMARD_SIZE
    x = F.pad(x2.to(torch.float32), (0, pad)) if pad else x2.to(torch.float32).contiguous()
    xb = x.reshape(x.shape[0], -1, HADAMARD_SIZE)
    return (xb @ h.t().to(x.device)).reshape(x.shape)
