"""Per-layer fp8 statistics, kept on the device, and the layer's fallback flag."""

from __future__ import annotations

import math
from typing import Any

import torch

from mixprec.fp8._quant import STAT_NAMES

__all__ = ["LayerState", "OPERANDS", "layer_state", "swap_layer_state"]

#: rows of :attr:`LayerState.stats`.
OPERANDS = ("input", "weight", "grad_output")
_ATTR = "_mixprec_fp8_state"


class LayerState:
    """What one fp8 linear layer saw since the last :meth:`reset`, on the device (no host sync).

    ``stats`` is a ``(3, 4)`` float32 tensor: one row per operand (``input``, ``weight``,
    ``grad_output``), columns ``amax``, ``saturated`` (fraction beyond the previous cast's amax:
    what a delayed scale would clip), ``underflow`` (fraction of nonzero values the cast flushed
    to zero) and ``nonfinite`` (count); each is the worst value over the steps of the window. ``output_sqnr_db`` is the lowest
    sampled SQNR of the fp8 output against the high-precision GEMM (inf when none was sampled).
    ``fallback`` (a Python bool, set by :class:`Guard`) makes :func:`linear` run in the compute
    dtype; ``sample_sqnr`` asks the next forward to measure the SQNR (one extra GEMM);
    ``recipe`` (set by :class:`Controller`), when not None, replaces the caller's recipe;
    ``probe`` (set by :class:`Controller`), when not None, is called by :func:`linear` as
    ``probe(input, weight_or_None, output) -> output`` after the GEMM (also in fallback).

    Example:
        >>> st = LayerState()
        >>> st.stats.shape, st.fallback
        (torch.Size([3, 4]), False)
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        # one more column than STAT_NAMES: the last cast's amax (saturation is judged against it)
        self._data = torch.zeros(len(OPERANDS), len(STAT_NAMES) + 1, device=device)
        self.output_sqnr_db = torch.full((), math.inf, device=device)
        self.fallback = False
        self.sample_sqnr = False
        self.routed = False  # a policy's call of the layer has reached fp8 (set by the routing)
        self.recipe = None  # a Float8Recipe that replaces the caller's (set by a Controller)
        self.probe = None  # measures the layer's operands after the GEMM (set by a Controller)

    @property
    def stats(self) -> torch.Tensor:
        """The window's ``(3, 4)`` statistics (a view of the device tensor)."""
        return self._data[:, :-1]

    @property
    def device(self) -> torch.device:
        return self._data.device

    def to(self, device: torch.device | str) -> LayerState:
        """Move the statistics to ``device`` (in place; returns self)."""
        self._data = self._data.to(device)
        self.output_sqnr_db = self.output_sqnr_db.to(device)
        return self

    def reset(self) -> None:
        """Start a new window (no host sync)."""
        self.stats.zero_()
        self.output_sqnr_db.fill_(math.inf)

    def read(self) -> dict[str, Any]:
        """The window as plain floats: ``{"input": {"amax": ...}, ..., "output_sqnr_db": ...}``.

        .. warning:: reads the device tensors: one host sync.
        """
        rows = self.stats.tolist()  # one sync
        out: dict[str, Any] = {op: dict(zip(STAT_NAMES, row)) for op, row in zip(OPERANDS, rows)}
        out["output_sqnr_db"] = float(self.output_sqnr_db)
        out["fallback"] = self.fallback
        return out

    def __repr__(self) -> str:
        return f"LayerState(device={self.device}, fallback={self.fallback})"


def layer_state(module: torch.nn.Module, create: bool = True) -> LayerState | None:
    """The :class:`LayerState` of ``module``, created on its weight's device on first use.

    Kept as a plain attribute of the module (not a buffer): it is not part of ``state_dict()``,
    so the keys do not change; it follows ``copy.deepcopy``. Fallback decisions that must survive
    a checkpoint live in :meth:`Guard.state_dict`. Create it before ``torch.compile`` traces the
    model (:func:`convert` and the policy do).

    Example:
        >>> lin = torch.nn.Linear(16, 16)
        >>> layer_state(lin) is layer_state(lin)
        True
    """
    state = module.__dict__.get(_ATTR)
    if state is None and create:
        weight = getattr(module, "weight", None)
        state = LayerState(weight.device if isinstance(weight, torch.Tensor) else None)
        module.__dict__[_ATTR] = state
    return state


def swap_layer_state(module: torch.nn.Module, state: LayerState | None) -> LayerState | None:
    """Give ``module`` the :class:`LayerState` ``state`` (``None``: no state); returns the one it
    had. For tools that measure a layer with fresh statistics and then leave it as found
    (:func:`mixprec.audit`).

    Example:
        >>> lin = torch.nn.Linear(16, 16)
        >>> old = swap_layer_state(lin, LayerState())
        >>> old is None, swap_layer_state(lin, old) is not None, layer_state(lin, create=False)
        (True, True, None)
    """
    old = module.__dict__.pop(_ATTR, None)
    if state is not None:
        module.__dict__[_ATTR] = state
    return old
