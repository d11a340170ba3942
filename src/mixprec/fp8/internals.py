"""The fp8 internals that mixprec's other packages use: one seam instead of private reach-ins.

Diagnostics (the audit's fp8 advice, the non-finite tracer) and export (the calibrated scales)
need a few pieces of fp8 that are not public API: the cast with its statistics, the fp4 cast,
the rows of a layer's statistics window, swapping a layer's state, the Linear-like test. They import them from
here, never from ``mixprec.fp8._*``, so fp8 can move its private modules around without breaking
them, and this file lists exactly what crosses the package boundary. Not public API: nothing here
is in ``mixprec.fp8.__all__``, and the names may change with fp8 (users: ``mixprec.fp8``).
"""

from __future__ import annotations

from mixprec.formats._fp4 import quantize as fp4_quantize
from mixprec.formats._like import is_linear_like
from mixprec.formats._quant import STAT_NAMES, cast_to_fp8
from mixprec.formats._state import GRAD_OUTPUT, INPUT, OPERANDS, WEIGHT, swap_layer_state
from mixprec.formats._tensor_parallel import gathered_copy  # export's: a tensor-parallel model's full tensors
from mixprec.fp8._target import Fp8Target, select_targets, traced_output  # the engine's (mixprec.engine)

__all__ = ["GRAD_OUTPUT", "INPUT", "OPERANDS", "STAT_NAMES", "WEIGHT", "Fp8Target", "cast_to_fp8", "fp4_quantize",
           "gathered_copy", "is_linear_like", "select_targets", "swap_layer_state", "traced_output"]
