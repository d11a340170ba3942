"""What the last :meth:`mixprec.GradScaler.scale` of this thread multiplied the backward by: for
readers of gradients that are not the optimizer's (the fp8 Controller's loss cost reads the
gradient at each layer's output, before any unscale).

A per-thread runtime value, not a setting: ``scale()`` notes it (no host sync), a reader takes the
notes made since its own last look (:func:`scaled_since`)."""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import Mapping

import torch

__all__ = ["Scaled", "last_count", "note_scaled", "scaled_since"]

_counter = itertools.count(1)  # over all threads: a reader made in one thread never takes another's count
_local = threading.local()


@dataclass(frozen=True)
class Scaled:
    """The scales one ``scale(loss)`` gave the gradients of the backward from that loss.

    ``regions[r]`` (a device tensor, no host sync) is the scale a gradient in region ``r``
    carries: region 0, above every cut point, the loss scale; per-layer scaling's region below
    cut points ``K``, the loss scale times ``prod(s_k for k in K)``. ``region_of`` maps
    ``id(parameter)`` to its region (a parameter it does not name: region 0). ``count`` tells
    notes apart (increasing).
    """

    regions: torch.Tensor
    region_of: Mapping[int, int]
    count: int

    def of(self, param: torch.Tensor | None) -> torch.Tensor:
        """The scale the gradient of ``param``'s layer carries (0-d, on the scale's device): its
        region's. ``None``: the loss scale."""
        return self.regions[0 if param is None else self.region_of.get(id(param), 0)]


def note_scaled(regions: torch.Tensor, region_of: Mapping[int, int]) -> None:
    """Called by ``GradScaler.scale``: the gradients of the coming backward carry ``regions``."""
    _local.last = Scaled(regions, region_of, next(_counter))


def last_count() -> int:
    """The count of this thread's last note (0: none): a reader made now takes only later ones."""
    last = getattr(_local, "last", None)
    return 0 if last is None else last.count


def scaled_since(count: int) -> Scaled | None:
    """This thread's last note when it is newer than ``count`` (a reader's last look), else None:
    no loss was scaled since."""
    last = getattr(_local, "last", None)
    return last if last is not None and last.count > count else None
