"""One rule for which tensors autocast may cast, and one way to cast the tensors of a container.

Every place in mixprec that casts "the floating tensors" of something (a policy's
``cast_to_compute``, a module rule's inputs, ``custom_fwd(cast_inputs=...)``, a region's output)
uses :func:`castable` and :func:`cast_tree`, so the rule lives here only. The dispatcher's per-op
casts use :func:`castable` as well.

Example:
    >>> cast_tree({"x": torch.ones(2), "n": 3}, torch.bfloat16)["x"].dtype
    torch.bfloat16
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["CASTABLE_DTYPES", "castable", "cast_tree", "refuse_tracing", "tracing"]

#: Floating dtypes autocast may cast: every floating dtype but float64 (as PyTorch's autocast).
CASTABLE_DTYPES = frozenset(
    d for d in vars(torch).values()
    if isinstance(d, torch.dtype) and d.is_floating_point and d is not torch.float64
)


def castable(t: torch.Tensor, device_type: str | None = None) -> bool:
    """Whether autocast may cast ``t``: floating, not float64, and on ``device_type`` if given.

    ``"cpu"`` includes mkldnn tensors and ``"cuda"`` XLA tensors, as in PyTorch's
    ``is_autocast_eligible``.
    """
    if t.dtype not in CASTABLE_DTYPES:
        return False
    if device_type is None:
        return True
    if device_type == "cpu":
        return t.is_cpu or t.is_mkldnn
    if device_type == "cuda":
        return t.is_cuda or t.device.type == "xla"
    return t.device.type == device_type


def cast_tree(tree: Any, dtype: torch.dtype, device_type: str | None = None) -> Any:
    """``tree`` with each :func:`castable` tensor cast to ``dtype``; containers are rebuilt
    (lists, tuples, namedtuples, dicts and every registered pytree node), other leaves kept."""
    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dtype is not dtype and castable(x, device_type):
            return x.to(dtype)
        return x

    if isinstance(tree, torch.Tensor):  # the common case, without the pytree walk
        return cast(tree)
    return pytree.tree_map(cast, tree)


#: Whether Dynamo is tracing the calling code (not merely running inside a compile).
tracing = getattr(torch.compiler, "is_dynamo_compiling", None) or torch.compiler.is_compiling  # < 2.5


def refuse_tracing(what: str) -> None:
    """Policies are values built once, outside compiled code: Dynamo's emulation of a frozen
    dataclass drops fields, which would silently lose op edits or module rules. Raising here
    makes Dynamo run the construction eagerly (a graph break; an error under fullgraph=True)."""
    if tracing():
        raise RuntimeError(
            f"build mixprec {what} outside torch.compile (a global, an argument, or a string "
            "policy= that mixprec.autocast parses at trace time)"
        )
