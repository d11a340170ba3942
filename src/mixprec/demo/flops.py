"""Which format each GEMM of each ``nn.Linear`` ran in, step by step, and the share of the linear
layers' GEMM FLOPs that ran in fp4 (or fp8) over a run.

A linear layer ``y = x W^T`` runs three GEMMs per training step (the keys of
:meth:`mixprec.fp8.Float8Recipe.gemms`): ``output`` (forward), ``grad_input`` (input gradient)
and ``grad_weight`` (weight gradient), each of ``2 * rows * in_features * out_features`` FLOPs for
``rows`` input rows. :class:`GemmCounter` reads, after each step, what :func:`mixprec.fp8.linear`
read in that step: whether the policy routed the layer to fp8 (its ``LayerState.routed``), its
fallback flag (a Guard's, or a Controller's compute and fp32 rungs), and the recipe its GEMMs ran
(``LayerState.recipe``, a Controller's rung, composed per GEMM when the controller decides per
GEMM; else the policy's recipe for the layer). The counts are exact, not sampled from the
controller's log; they assume every GEMM runs once per step with ``rows`` rows, as in the demo's
model (every Linear reads batch x sequence rows, and every layer's input needs a gradient). The
attention's own matmuls (``scaled_dot_product_attention``) are not linear layers and not counted.

Example:
    >>> from mixprec.fp8 import Cast
    >>> gemm_kind(Cast("e2m1", "1x16")), gemm_kind(Cast("e4m3fn")), gemm_kind(Cast("none"))
    ('fp4', 'fp8', 'high')
    >>> trace = {"layers": {"a": {"flops_per_gemm": 4, "gemms": {g: {"fp4": 3, "fp8": 0, "high": 1}
    ...          for g in GEMMS}}}, "steps": 4}
    >>> share(trace), share(trace, gemm="output")
    (0.75, 0.75)
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

from mixprec import fp8
from mixprec.fp8 import Cast, Float8Recipe

__all__ = ["GEMMS", "GEMM_WORDS", "KINDS", "GemmCounter", "gemm_kind", "share", "shares"]

#: The three GEMMs of a linear layer, as :meth:`Float8Recipe.gemms` names them.
GEMMS = ("output", "grad_input", "grad_weight")
#: Each GEMM in words, for the report.
GEMM_WORDS = {"output": "forward", "grad_input": "input gradient", "grad_weight": "weight gradient"}
#: What a GEMM can run in: 4-bit elements, 8-bit elements, or the layer's compute dtype.
KINDS = ("fp4", "fp8", "high")


def gemm_kind(cast: Cast) -> str:
    """``"fp4"``, ``"fp8"`` or ``"high"``: what a GEMM whose left operand is cast by ``cast`` runs
    in (a recipe casts both operands of a GEMM or neither)."""
    if not cast.is_fp8:
        return "high"
    return "fp4" if cast.is_fp4 else "fp8"


class GemmCounter:
    """Per ``nn.Linear`` of ``model`` and per GEMM, the steps it ran in each of :data:`KINDS`.

    Call :meth:`record` once per training step, after the backward pass and before a Guard or
    Controller steps (their switches apply from the next step): it reads Python attributes only
    (no host sync). ``recipe_for(name)`` is the recipe the policy gives the layer ``name``
    (``Policy.fp8_rule.recipe_for``).
    """

    def __init__(self, model: nn.Module, recipe_for: Callable[[str], Float8Recipe], rows: int) -> None:
        self._linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
        self._recipe_for = recipe_for
        self._flops = {name: 2 * rows * m.in_features * m.out_features for name, m in self._linears.items()}
        self._steps = {name: {g: dict.fromkeys(KINDS, 0) for g in GEMMS} for name in self._linears}
        self._recorded = 0

    def kinds(self, name: str) -> dict[str, str]:
        """What each GEMM of the layer ``name`` runs in now (see the module's docstring)."""
        state = fp8.layer_state(self._linears[name], create=False)
        if state is None or not state.routed or state.fallback:
            return dict.fromkeys(GEMMS, "high")
        recipe = state.recipe if state.recipe is not None else self._recipe_for(name)
        return {g: gemm_kind(left) for g, (left, _) in recipe.gemms().items()}

    def record(self) -> None:
        """Count one step: each GEMM of each layer in the kind it ran in."""
        for name, counts in self._steps.items():
            for gemm, kind in self.kinds(name).items():
                counts[gemm][kind] += 1
        self._recorded += 1

    def to_json(self) -> dict[str, Any]:
        """``{"steps": n, "layers": {name: {"flops_per_gemm": f, "gemms": {gemm: {kind: steps}}}},
        "fp4_share": ..., "fp8_share": ..., "per_gemm": {gemm: fp4 share},
        "per_layer": {name: fp4 share}}`` (shares of FLOPs, see :func:`share`)."""
        trace: dict[str, Any] = {
            "steps": self._recorded,
            "layers": {name: {"flops_per_gemm": self._flops[name],
                              "gemms": {g: dict(c) for g, c in counts.items()}}
                       for name, counts in self._steps.items()},
        }
        trace["fp4_share"] = share(trace)
        trace["fp8_share"] = share(trace, kind="fp8")
        trace["per_gemm"] = shares(trace, "gemm")
        trace["per_layer"] = shares(trace, "layer")
        return trace


def share(trace: dict[str, Any], kind: str = "fp4", *, layer: str | None = None, gemm: str | None = None) -> float:
    """The share of the GEMM FLOPs of ``trace`` (:meth:`GemmCounter.to_json`) that ran in
    ``kind``: over every linear layer and GEMM, or only ``layer``'s, or only ``gemm``'s; 0.0 when
    nothing was counted."""
    done = total = 0
    for name, entry in trace["layers"].items():
        if layer is not None and name != layer:
            continue
        for g, counts in entry["gemms"].items():
            if gemm is not None and g != gemm:
                continue
            done += entry["flops_per_gemm"] * counts[kind]
            total += entry["flops_per_gemm"] * sum(counts.values())
    return done / total if total else 0.0


def shares(trace: dict[str, Any], by: str, kind: str = "fp4") -> dict[str, float]:
    """:func:`share` of ``kind`` per GEMM (``by="gemm"``) or per layer (``by="layer"``)."""
    if by == "gemm":
        return {g: share(trace, kind, gemm=g) for g in GEMMS}
    if by == "layer":
        return {name: share(trace, kind, layer=name) for name in trace["layers"]}
    raise ValueError(f"by must be 'gemm' or 'layer', got {by!r}")
