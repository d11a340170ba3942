"""Numerics diagnostics: which layer overflowed, how much underflows, which precision suits a model.

* :func:`trace_nonfinite`: names the first module whose output or gradient became inf/NaN.
* :func:`collect_ranges`: per-module ranges and fp16/bf16/fp8 overflow/underflow fractions.
* :func:`audit`: runs a few steps in float32 and in each candidate dtype and recommends a
  :class:`mixprec.Policy` plus an initial loss scale, as an :class:`AuditReport`.

Nothing here registers anything outside its ``with`` block: with no diagnostics active, mixprec
pays nothing for them.
"""

from mixprec.diagnostics.audit import audit
from mixprec.diagnostics.event import NonFiniteError, NonFiniteEvent
from mixprec.diagnostics.findings import AuditReport, Risk
from mixprec.diagnostics.ranges import FORMATS, RangeCollector, RangeStats, collect_ranges
from mixprec.diagnostics.trace import NonFiniteTracer, trace_nonfinite

__all__ = [
    "FORMATS",
    "AuditReport",
    "NonFiniteError",
    "NonFiniteEvent",
    "NonFiniteTracer",
    "RangeCollector",
    "RangeStats",
    "Risk",
    "audit",
    "collect_ranges",
    "trace_nonfinite",
]
