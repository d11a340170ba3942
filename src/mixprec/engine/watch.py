"""A region's first pass over its module rules: each rule that selected no module warns once
per process (with the names seen, and the closest ones), unless it has selected one before."""

from __future__ import annotations

import difflib
import re
import warnings
from dataclasses import dataclass, field
from typing import Any

from mixprec.engine.runtime import Runtime
from mixprec.policy import Policy

__all__ = ["Watch", "start", "finish"]

# Registries, process-wide by nature (a warning is given once per process): rules that have
# selected a module in any region, or were reported as selecting none: regions stop watching them.
_MATCHED: set[Any] = set()
_WARNED: set[Any] = set()


@dataclass(eq=False)
class Watch:
    """A region's first pass: its rules that have matched no module yet, and what it called."""

    pending: list[Any]
    names: list[str] = field(default_factory=list)  # qualified names seen (for the message)
    outer: set[int] = field(default_factory=set)  # ids of the region's outermost modules

    def see(self, name: str, hits: list[Any]) -> None:
        """A module named ``name`` was called, selected by the rules ``hits``."""
        if name and len(self.names) < 256:
            self.names.append(name)
        for rule in hits:
            if rule in self.pending:
                self.pending.remove(rule)
            _MATCHED.add(rule)


def _rule_text(rule: Any) -> str:
    parts = []
    if rule.types:
        parts.append("types=(" + ", ".join(t.__name__ for t in rule.types) + ",)")
    if rule.names is not None:
        parts.append(f"names={rule.names!r}")
    return f"keep({', '.join(parts)}, dtype={str(rule.dtype).removeprefix('torch.')})"


def _unmatched(rule: Any, watch: Watch, region: Any) -> str:
    """The warning for a rule that matched no module in a region's first pass."""
    base = ("the model given as root=" if region.root is not None
            else "the outermost module called in the region")
    names = list(dict.fromkeys(watch.names))
    close = []
    if rule.names is not None:
        literal = re.sub(r"\\(.)", r"\1", re.sub(r"[\^$]", "", rule.names))
        close = difflib.get_close_matches(literal, names, n=3, cutoff=0.6)
    seen = (f"did you mean {' or '.join(repr(n) for n in close)}?" if close
            else "names seen: " + (", ".join(repr(n) for n in names[:8]) + (", ..." if len(names) > 8 else "")
                                   if names else "none"))
    fix = "" if region.root is not None else (
        "; when the region is entered inside the model's forward, pass root=model to mixprec.autocast")
    return (f"mixprec: the module rule {_rule_text(rule)} selected no module called in the region "
            f"(qualified names are relative to {base}; {seen}). Fix the pattern or the types{fix}")


def start(rt: Runtime, policy: Policy) -> Watch | None:
    """A first-pass watch of ``policy``'s rules that have neither matched nor warned yet."""
    pending = [r for r in policy.module_rules if r not in _MATCHED and r not in _WARNED]
    if not pending:
        return None
    watch = Watch(pending)
    rt.watches.append(watch)
    return watch


def finish(rt: Runtime, region: Any) -> None:
    """End a region's first pass: warn once for each rule that selected no module (when the
    region called any module at all)."""
    watch, region.watch = region.watch, None
    rt.watches.remove(watch)
    if not (watch.outer or watch.names):
        return
    for rule in watch.pending:
        if rule not in _MATCHED and rule not in _WARNED:
            _WARNED.add(rule)
            warnings.warn(_unmatched(rule, watch, region), UserWarning, stacklevel=4)
