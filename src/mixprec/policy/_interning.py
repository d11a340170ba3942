"""One canonical object per policy value: what a region inside torch.compile passes to trace time,
so that Dynamo's identity guard holds for every equal policy (:func:`canonical`)."""

from __future__ import annotations

import weakref
from typing import Any

__all__ = ["canonical", "intern", "twin"]

# An interning registry (weak: see _canonical): one canonical object per policy value and attachment.
_CANONICAL: "weakref.WeakValueDictionary[tuple[Any, int | None], Any]" = weakref.WeakValueDictionary()


def canonical(policy: Any) -> Any:
    """The one object that stands for ``policy``'s value (and its fp8 guard or controller): the
    object a region inside torch.compile passes to trace time, so that Dynamo's identity guard
    holds for every equal policy. Held weakly: it lives while a policy equal to it does."""
    found = policy._canonical  # type: ignore[attr-defined]
    return policy if found is None else found


def intern(policy: Any) -> Any:
    """The object :func:`canonical` returns, found or made: keyed by the policy's value and the
    identity of the live Guard or Controller its fp8 rule carries, if any (equality leaves that
    object out, the key does not: a region never runs with another policy's guard or controller;
    the id cannot be reused while the entry lives, as the canonical object holds that object).
    The canonical object is interned weakly and lives while a policy equal to it does (each holds
    it as ``_canonical``; the canonical object itself holds None, not itself: no reference cycle,
    so it goes, and with it its hold on the live object, as soon as the last equal policy does),
    so a policy rebuilt each step with a fresh Controller leaves nothing behind."""
    rule = policy.fp8_rule
    detached = twin(policy, _canonical=None)
    live = None if rule is None else rule.live
    if live is not None:
        object.__setattr__(detached, "fp8_rule", rule.detached())
    key = (detached, None if live is None else id(live))
    try:
        found = _CANONICAL.get(key)
    except TypeError:  # an unhashable field (a custom recipe): guarded by identity
        return policy
    if found is None:
        found = twin(policy, _canonical=None)  # never the caller's object, which Dynamo would guard on
        found = _CANONICAL.setdefault(key, found)
    return found


def twin(policy: Any, **changes: Any) -> Any:
    """A shallow copy of ``policy`` (its fields as they are: no validation, no interning)."""
    twin = object.__new__(type(policy))
    twin.__dict__.update(policy.__dict__, **changes)
    return twin
