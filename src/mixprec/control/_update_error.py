"""How a backward GEMM's error moves the update it steers (:mod:`._backward`'s terms): the share
of a step's gain an error takes to first order (:func:`cost_ratio`), the error as an optimizer
that normalizes its updates sees it (:func:`step_error`), and the empirical Fisher's curvature
along a layer's weights (:func:`mean_curvature`, :func:`projections`, :func:`update_terms`).
Pure functions of float32 tensors, no host sync."""

from __future__ import annotations

import torch

from mixprec.control._cost import share_of_rows
from mixprec.control._reference import reference_mm

__all__ = ["TINY", "along_update", "cost_ratio", "mean_curvature", "projections", "step_error", "update_terms"]

#: the least squared length a ratio divides by (an all-zero reference reads as this long)
TINY = 1e-30
#: the smallest rescale of a result :func:`step_error` divides by (a gradient shrunk further reads as shrunk this much)
_MIN_RESCALE = 2.0 ** -10


def cost_ratio(reference: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    """``-<R, E> / |R|**2`` of ``result = R + E`` against ``reference = R`` (float32): the
    share of a step's gain that the error takes from it to first order.

    Example:
        >>> r = torch.tensor([1.0, 2.0])
        >>> float(cost_ratio(r, r)), float(cost_ratio(r, torch.zeros(2)))  # exact; a gradient lost
        (0.0, 1.0)
    """
    return (reference * (reference - result.float())).sum() / reference.square().sum().clamp(min=TINY)


def step_error(reference: torch.Tensor, error: torch.Tensor) -> torch.Tensor:
    """The error ``E`` of a backward GEMM's result ``R + E`` as an optimizer that normalizes its
    updates (Adam, AdamW, Lion, Adafactor) sees it: the part along ``R``, ``a R`` with ``a =
    <R, E> / |R|**2``, rescales the result to ``(1 + a) R``, a scale such an optimizer takes out
    of its step; what moves the step is the part across ``R``, against the rescaled result:
    ``(E - a R) / (1 + a)``. A result that points against ``R`` or nowhere (``1 + a <= 0``)
    keeps its whole error. Orthogonal to ``R``: its first-order cost is 0 (float32, no host sync).

    Example:
        >>> r = torch.tensor([1.0, 0.0])
        >>> step_error(r, torch.tensor([-0.5, 0.0])), step_error(r, torch.tensor([1.0, 1.0]))  # shrunk; grown, turned
        (tensor([0., 0.]), tensor([0.0000, 0.5000]))
        >>> step_error(r, torch.tensor([-3.0, 0.0]))  # flipped: costed whole
        tensor([-3.,  0.])
    """
    r, e = reference.float(), error.float()
    a = (r * e).sum() / r.square().sum().clamp(min=TINY)
    return torch.where(1 + a > 0, (e - a * r) / (1 + a).clamp(min=_MIN_RESCALE), e)


def mean_curvature(g2: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    """``tr(H) / n`` for the empirical Fisher ``H`` of a linear layer's ``n`` weights over the rows
    of its output gradient ``g2`` and input ``x2`` (``rows * sum_t |g_t|**2 |x_t|**2 / n``): the
    mean of ``u'Hu / |u|**2`` over directions ``u``.

    Example:
        >>> float(mean_curvature(torch.tensor([[1.0, 1.0]]), torch.tensor([[2.0]])))  # 1 * (2 * 4) / 2
        4.0
    """
    n = g2.shape[1] * x2.shape[1]
    return g2.shape[0] * (g2.square().sum(-1) * x2.square().sum(-1)).sum() / max(n, 1)


def projections(g2: torch.Tensor, x2: torch.Tensor, u: torch.Tensor, dtype: torch.dtype = torch.float32
                ) -> torch.Tensor:
    """Per row ``t``, ``g_t' u x_t`` for a weight-sized ``u``: ``u'Hv = rows * sum_t`` of the
    products of two directions' projections (the empirical Fisher). One GEMM of ``g2`` with ``u``
    (a reference GEMM from ``dtype`` operands: :func:`~mixprec.control._reference.reference_mm`)."""
    return (reference_mm(g2, u, dtype) * x2).sum(-1)


def update_terms(g2: torch.Tensor, x2: torch.Tensor, reference: torch.Tensor, result: torch.Tensor,
                 along_reference: torch.Tensor | None = None, dtype: torch.dtype = torch.float32,
                 rows: int | None = None) -> torch.Tensor:
    """The weight-gradient error's cost terms ``[c1, c2]`` (float32 ``x2``; ``g2`` float32 or in
    ``dtype``, the GEMMs' operands): the cost
    of a step whose gain was ``gain`` is ``gain * c1 + gain**2 * c2`` (:mod:`._backward`; ``eta =
    gain / |G|**2``). Two GEMMs of ``g2`` with a weight-sized matrix (``G`` and ``E``), one where
    the caller gives ``projections(g2, x2, reference)`` (``along_reference``: shared by the
    results it measures against the same reference; ``dtype``: the GEMMs' operands, :func:`projections`).
    ``rows``: the row count of the output whose sample ``g2``, ``x2`` are (None: they are all of
    it): the curvature's sums over rows scaled up to it.

    Example:
        >>> g2, x2 = torch.tensor([[0.5]]), torch.tensor([[2.0]])
        >>> [round(float(t), 4) for t in update_terms(g2, x2, torch.tensor([[1.0]]), torch.tensor([[0.5]]))]
        [0.5, -0.375]
    """
    e = result.float() - reference
    gg = reference.square().sum().clamp(min=TINY)
    pr = projections(g2, x2, reference, dtype) if along_reference is None else along_reference
    pe = projections(g2, x2, e, dtype)
    if rows is None or rows == g2.shape[0]:
        rows = g2.shape[0]
        curvature = rows * (pr * pe).sum() + 0.5 * (rows * (pe * pe).sum())
    else:  # (a sample of the rows: each sum scaled by rows / sampled)
        curvature = rows * (rows / g2.shape[0]) * ((pr * pe).sum() + 0.5 * (pe * pe).sum())
    return torch.stack([cost_ratio(reference, result), curvature / (gg * gg)])


def along_update(grad: torch.Tensor, x2: torch.Tensor, update: torch.Tensor, dtype: torch.dtype = torch.float32,
                 share: float = 1.0, step: int = 0) -> torch.Tensor | None:
    """``<G', dW>`` for the weight gradient ``G' = g' x`` of a linear layer's output gradient
    ``grad`` and input rows ``x2`` along a weight-sized ``update``: one reference GEMM of the
    gradient with the update (from ``dtype`` operands: :func:`projections`), a sum over the rows:
    on the ``share`` of them ``step`` draws (:func:`~mixprec.control._cost.share_of_rows`),
    scaled up to all. None: no rows.

    Example:
        >>> g, x, u = torch.tensor([[1.0], [2.0]]), torch.tensor([[3.0], [4.0]]), torch.tensor([[0.5]])
        >>> float(along_update(g, x, u)), along_update(g[:0], x[:0], u)  # 0.5 * (1 * 3 + 2 * 4)
        (5.5, None)
    """
    g2 = grad.detach().reshape(-1, grad.shape[-1])
    total = g2.shape[0]
    if not total:
        return None
    sample = share_of_rows(total, share, step, g2.device)
    if sample is not None:
        g2, x2 = g2.index_select(0, sample), x2.index_select(0, sample)
    dot = (reference_mm(g2, update, dtype) * x2.float()).sum()
    return dot if sample is None else dot * (total / sample.numel())
