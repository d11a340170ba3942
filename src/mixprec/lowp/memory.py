"""Measure the memory a model and its optimizer hold, from the tensors themselves."""

from __future__ import annotations

from typing import Any, Iterator, Optional

import torch
from torch import Tensor, nn

__all__ = ["memory_bytes"]


def _tensors(value: Any) -> Iterator[Tensor]:
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def memory_bytes(model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> dict[str, Any]:
    """Bytes held by ``model``'s parameters and gradients and by ``optimizer``, measured.

    Every tensor is counted by the size of its storage (``untyped_storage().nbytes()``), each
    storage once (by device and data pointer, so tied weights and views of one buffer count
    once), in the first category that reaches it. Meta tensors are counted too, so a model built
    on ``device="meta"`` can be sized without memory:

    * ``params``: the model's parameters;
    * ``grads``: their ``.grad``;
    * ``master``: tensors in ``optimizer.param_groups`` that are not model parameters (e.g.
      :class:`mixprec.MasterWeights`' float32 masters) and their ``.grad``;
    * ``optimizer_state``: every tensor in ``optimizer.state`` (moments, Kahan buffers, step
      counters).

    Also returned: ``total``, ``numel`` (the model's parameter count) and ``bytes_per_param``
    (``total / numel``). Buffers and activations are not counted. No host sync.

    Example:
        >>> model = torch.nn.Linear(100, 100)
        >>> opt = torch.optim.AdamW(model.parameters())
        >>> model(torch.randn(1, 100)).sum().backward(); opt.step()
        >>> round(memory_bytes(model, opt)["bytes_per_param"])
        16
    """
    seen: set[tuple[str, int]] = set()

    def size(tensors: Any) -> int:
        total = 0
        for t in _tensors(tensors):
            storage = t.untyped_storage()
            # Storages without data (meta tensors, empty ones) all have data pointer 0: tell
            # them apart by the storage object itself, which views share.
            ptr = storage.data_ptr()
            key = (str(t.device), ptr) if ptr else ("storage", storage._cdata)
            if key in seen:
                continue
            seen.add(key)
            total += storage.nbytes()
        return total

    params = list(model.parameters())
    out: dict[str, Any] = {
        "params": size(params),
        "grads": size([p.grad for p in params if p.grad is not None]),
        "master": 0,
        "optimizer_state": 0,
    }
    if optimizer is not None:
        held = [t for g in optimizer.param_groups for t in g["params"]]
        out["master"] = size(held) + size([t.grad for t in held if t.grad is not None])
        out["optimizer_state"] = size(list(optimizer.state.values()))
    out["total"] = out["params"] + out["grads"] + out["master"] + out["optimizer_state"]
    out["numel"] = sum(p.numel() for p in params)
    out["bytes_per_param"] = out["total"] / max(out["numel"], 1)
    return out
