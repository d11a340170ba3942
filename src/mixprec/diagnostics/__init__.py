"""Numerics diagnostics: which layer overflowed, how much underflows, which precision suits a model.

* :func:`trace_nonfinite`: names the first module whose output or gradient became inf/NaN.
* :func:`collect_ranges`: per-module ranges and fp16/bf16/fp8 overflow/underflow fractions,
  with an "after scaling" view for fp8 (:class:`Fp8Scaled`).
* :func:`audit`: runs a few steps in float32 and in each candidate dtype and recommends a
  :class:`mixprec.Policy` plus an initial loss scale, as an :class:`AuditReport`; with
  ``fp8=recipe`` also the Linear layers that run in fp8 (:class:`Fp8Advice`).

Nothing here registers anything outside its ``with`` block: with no diagnostics active, mixprec
pays nothing for them.
"""

from mixprec.diagnostics.audit import audit
from mixprec.diagnostics.event import NonFiniteError, NonFiniteEvent
from mixprec.diagnostics.findings import AuditReport, Fp8Advice, Risk
from mixprec.diagnostics.ranges import FORMATS, Fp8Scaled, RangeCollector, RangeStats, collect_ranges
from mixprec.diagnostics.trace import NonFiniteTracer, trace_nonfinite

__all__ = [
    "FORMATS",
    "AuditReport",
    "Fp8Advice",
    "Fp8Scaled",
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
