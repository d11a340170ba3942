"""The optimizer protocol a loss scaler speaks: ``prepare_grads``, ``grad_scale``, ``found_inf``,
``master_pairs``.

``torch.amp.GradScaler`` talks to optimizers through attributes it never declares; this module
writes the contract down, once, for :class:`mixprec.GradScaler` (the scaler side),
:class:`mixprec.MasterWeights` and ``mixprec.optim`` (the optimizer side).

1. **Preparing gradients** (:class:`PreparesGrads`, mixprec only): before a scaler reads any
   gradient (in ``unscale_``, or in ``step`` for a fused optimizer), it calls
   ``optimizer.prepare_grads()`` if the optimizer has one. It must put the gradients to step on
   into ``optimizer.param_groups`` (``MasterWeights``: the float16/bfloat16 model gradients into
   the float32 master gradients), so that the scaler checks and unscales those.
2. **Unscaling and skipping by itself** (:class:`ScalesItself`, torch's fused protocol): an
   optimizer whose class sets ``_step_supports_amp_scaling = True`` is stepped with two
   attributes lent for the duration of ``step()`` (:func:`lend_scale`): ``grad_scale``, the scale
   the gradients still carry (a 0-dim float32 tensor; ``None`` when ``unscale_`` already divided
   them), and ``found_inf``, a 0-dim float32 tensor that is nonzero when a gradient is inf/NaN:
   the step must then leave parameters and state unchanged. The optimizer reads them with
   :func:`lent_scale`.
3. **Naming the model parameter behind each master** (:class:`HoldsMasters`, mixprec only): an
   optimizer that steps on copies of the model's parameters (``MasterWeights``' float32 masters)
   says which copy is whose, so that a per-layer scaler unscales a master's gradient by its
   model parameter's scale (:func:`master_pairs`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, NamedTuple, Optional, Protocol, Sequence, runtime_checkable

from torch import Tensor

__all__ = [
    "HoldsMasters", "LentScale", "PreparesGrads", "ScalesItself", "lend_scale", "lent_scale", "master_pairs",
    "prepare_grads",
]


@runtime_checkable
class PreparesGrads(Protocol):
    """An optimizer whose gradients must be prepared before a scaler reads them.

    Example:
        >>> class Masters(torch.optim.SGD):
        ...     def prepare_grads(self) -> None:
        ...         ...   # fill the param_groups' .grad from wherever they come from
        >>> isinstance(Masters([p], lr=0.1), PreparesGrads)
        True
    """

    def prepare_grads(self) -> None:
        """Put the gradients to step on into ``param_groups`` (idempotent until they change)."""


def prepare_grads(optimizer: Any) -> None:
    """Calls ``optimizer.prepare_grads()`` when it has one (what a scaler does first).

    Checked by attribute: as cheap as a ``getattr`` (``isinstance`` on a runtime protocol costs
    about 10 µs, paid every step).
    """
    prepare = getattr(optimizer, "prepare_grads", None)
    if callable(prepare):
        prepare()


class ScalesItself(Protocol):
    """An optimizer that unscales its gradients and skips on overflow inside its own ``step``.

    ``grad_scale`` and ``found_inf`` exist only while a scaler steps it (see :func:`lend_scale`).
    """

    _step_supports_amp_scaling: bool

    def step(self, closure: Any = None) -> Any:
        """Steps on ``grad / grad_scale``, or does nothing when ``found_inf`` is nonzero."""


class LentScale(NamedTuple):
    """What a scaler lends a :class:`ScalesItself` optimizer for one ``step()``."""

    grad_scale: Optional[Tensor]
    found_inf: Tensor


@contextlib.contextmanager
def lend_scale(optimizer: Any, grad_scale: Optional[Tensor], found_inf: Tensor) -> Iterator[None]:
    """Sets ``optimizer.grad_scale`` and ``optimizer.found_inf`` for the duration of the block.

    Example:
        >>> with lend_scale(optimizer, scale, found_inf):
        ...     optimizer.step()
    """
    optimizer.grad_scale = grad_scale
    optimizer.found_inf = found_inf
    try:
        yield
    finally:
        del optimizer.grad_scale
        del optimizer.found_inf


def lent_scale(optimizer: Any) -> Optional[LentScale]:
    """What a scaler lent ``optimizer`` for the step in progress, or ``None`` outside one.

    Reads the instance's own attributes only (no host sync).

    Example:
        >>> lent = lent_scale(self)   # inside step()
        >>> skip = lent is not None and bool(lent.found_inf)   # reading it syncs
    """
    attributes = vars(optimizer)
    if "found_inf" not in attributes:
        return None
    return LentScale(attributes.get("grad_scale"), attributes["found_inf"])


class HoldsMasters(Protocol):
    """An optimizer that steps on copies (masters) of some of the model's parameters.

    Example:
        >>> [(p.dtype, m.dtype) for p, m in MasterWeights(torch.optim.SGD(half_params, lr=0.1)).master_pairs()]
        [(torch.float16, torch.float32), ...]
    """

    def master_pairs(self) -> Sequence[tuple[Tensor, Tensor]]:
        """``(model parameter, master)`` for every parameter stepped on a copy, in a new sequence."""


def master_pairs(optimizer: Any) -> Sequence[tuple[Tensor, Tensor]]:
    """``optimizer.master_pairs()`` when it has one (a :class:`HoldsMasters`), else ``()``.

    Checked by attribute, as :func:`prepare_grads` (cheap enough for every step). No host sync.
    """
    pairs = getattr(optimizer, "master_pairs", None)
    return pairs() if callable(pairs) else ()
