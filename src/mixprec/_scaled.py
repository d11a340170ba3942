"""What the last :meth:`mixprec.GradScaler.scale` of this thread multiplied the backward by: for
readers of gradients that are not the optimizer's (the fp8 Controller's loss cost reads the
gradient at each layer's output, before any unscale).

A per-thread runtime value, not a setting: ``scale()`` notes it (no host sync), a reader takes the
notes made since its own last look (:func:`scaled_since`). A note scales only the backward from
the loss it scaled: a reader that noted the :func:`latest_count` when a layer's forward ran and when
its gradient came takes the note made in between (:func:`scaled_between`), none where there is none
(another model's scaled loss in the same thread, before that forward or after that gradient)."""

from __future__ import annotations

import collections
import itertools
import threading
from dataclasses import dataclass
from typing import Mapping

import torch

__all__ = ["Scaled", "last_count", "latest_count", "note_of", "note_scaled", "scaled_between", "scaled_since"]

_counter = itertools.count(1)  # over all threads: a reader made in one thread never takes another's count
_local = threading.local()
# the count of the last note of any thread: what a gradient hook reads (it may run in an autograd device thread)
_latest = [0]
_KEPT = 64  # this thread's last notes kept for scaled_between (micro-batches of one step between two reads)


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
    _local.last = last = Scaled(regions, region_of, next(_counter))
    if getattr(_local, "notes", None) is None:
        _local.notes = collections.deque(maxlen=_KEPT)
    _local.notes.append(last)
    _latest[0] = max(_latest[0], last.count)


def latest_count() -> int:
    """The count of the last note of any thread (0: none); readable from any thread (a gradient hook)."""
    return _latest[0]


def last_count() -> int:
    """The count of this thread's last note (0: none): a reader made now takes only later ones."""
    last = getattr(_local, "last", None)
    return 0 if last is None else last.count


def scaled_since(count: int) -> Scaled | None:
    """This thread's last note when it is newer than ``count`` (a reader's last look), else None:
    no loss was scaled since."""
    last = getattr(_local, "last", None)
    return last if last is not None and last.count > count else None


def scaled_between(after: int, until: int) -> Scaled | None:
    """This thread's last note with ``after < count <= until`` (counts of :func:`latest_count`: when a
    layer's forward ran, when its gradient came), else None: no loss of this thread was scaled in
    between, so that gradient carries none of its scales.

    Example:
        >>> note_scaled(torch.ones(1), {}); n = latest_count()
        >>> scaled_between(n - 1, n).count == n, scaled_between(n, n)
        (True, None)
    """
    for note in reversed(getattr(_local, "notes", None) or ()):
        if after < note.count <= until:
            return note
        if note.count <= after:
            return None
    return None


def note_of(last: Scaled | None, forward: int | None, gradient: int | None) -> Scaled | None:
    """The note whose scales a layer's gradient carries: None where no loss was scaled since the
    reader's last look (``last`` None); ``last`` where the reader noted neither when the layer's
    forward ran nor when its gradient came (``forward``, ``gradient``: :func:`latest_count` then;
    None: compiled code, nothing measured); else the note made in between (:func:`scaled_between`;
    a forward not noted, a checkpoint's recompute: any before the gradient), None where none was
    (another model's scaled loss) or no gradient came.

    Example:
        >>> note_scaled(torch.ones(1), {}); n = latest_count()
        >>> note_of(None, n - 1, n), note_of(scaled_since(0), None, None).count == n, note_of(scaled_since(0), n, n)
        (None, True, None)
    """
    if last is None or (forward, gradient) == (None, None):
        return last
    return None if gradient is None else scaled_between(-1 if forward is None else forward, gradient)
