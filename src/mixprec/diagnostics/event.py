"""What :func:`mixprec.trace_nonfinite` reports: :class:`NonFiniteEvent` and the error that
carries one."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import torch

__all__ = ["NonFiniteError", "NonFiniteEvent", "Phase"]

Phase = Literal["forward", "backward"]


@dataclass(frozen=True)
class NonFiniteEvent:
    """Where an inf or NaN first appeared.

    Attributes:
        module: qualified name of the module to blame (``""`` is the model itself).
        module_type: class name of that module.
        phase: ``"forward"`` or ``"backward"``.
        tensor: which tensor held the first inf/NaN:
            ``"output"``: the module's forward output (its inputs were finite);
            ``"input"``: the model's own input (the batch) was already non-finite;
            ``"intermediate"``: a tensor made by the module's own code, between its children
            (``detail`` says where it went);
            ``"grad_input"``: the gradient with respect to the module's input, computed by its
            backward (the gradients arriving at its outputs were finite);
            ``"grad_output"``: the gradient arriving at the model's output was non-finite (the
            loss, or the code between the model and the loss);
            ``"grad:<param>"``: the gradient of the module's parameter ``<param>``.
        kind: ``"nan"`` if a NaN was seen, else ``"inf"``.
        dtype: dtype of the (first) non-finite tensor.
        input_ranges: ``(min, max)`` of each floating input of the module in that phase: its
            forward inputs, or in backward the gradients that arrived at its outputs.
        op: the ATen op that produced it (``precise=True`` only), else ``None``.
        step: how many times the model had been called before the event (forward index of the
            step, starting at 0).
        detail: one extra fact, e.g. which child received the non-finite intermediate.
        fp8_layer, fp8_operand: when the non-finite tensor was an operand of an fp8 layer's
            cast (that layer ran :func:`mixprec.fp8.linear` in that call, through
            ``Policy.fp8`` or :func:`mixprec.fp8.convert`): the layer and the operand,
            ``"input"``, ``"weight"`` or ``"grad_output"``. Its amax, hence its scale, was
            non-finite, which turns the whole GEMM output into NaN. ``None`` otherwise.
    """

    module: str
    module_type: str
    phase: Phase
    tensor: str
    kind: Literal["inf", "nan"]
    dtype: torch.dtype
    input_ranges: tuple[tuple[float, float], ...]
    op: str | None = None
    step: int = 0
    detail: str = ""
    fp8_layer: str | None = None
    fp8_operand: str | None = None

    def __str__(self) -> str:
        name = self.module or "<model>"
        op = f", op {self.op}" if self.op else ""
        ranges = ", ".join(f"[{lo:.4g}, {hi:.4g}]" for lo, hi in self.input_ranges) or "n/a"
        detail = f" ({self.detail})" if self.detail else ""
        fp8 = (f"; fp8 layer {self.fp8_layer!r} took it as its {self.fp8_operand}: "
               f"non-finite amax" if self.fp8_layer is not None else "")
        return (
            f"{self.kind} in {self.phase} {self.tensor} of module {name!r} "
            f"({self.module_type}{op}), dtype {str(self.dtype).removeprefix('torch.')}, "
            f"input ranges {ranges}, step {self.step}{detail}{fp8}"
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-able copy (dtype as a string)."""
        d = dataclasses.asdict(self)
        d["dtype"] = str(self.dtype).removeprefix("torch.")
        d["input_ranges"] = [list(r) for r in self.input_ranges]
        return d


class NonFiniteError(RuntimeError):
    """Raised by a tracer with ``raise_on_nonfinite=True``; ``.event`` says where."""

    def __init__(self, event: NonFiniteEvent) -> None:
        super().__init__(f"non-finite value detected: {event}")
        self.event = event
