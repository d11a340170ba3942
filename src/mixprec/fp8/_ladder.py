"""The controller's rungs and what it keeps per layer: the ladder's names, a layer's recipe
composed per GEMM from its GEMMs' rungs, the record of one layer (rungs, device windows, trends)
and the probe that :func:`mixprec.fp8.linear` calls to measure a controlled layer's operands
(the range under fp16; the shadow: what another rung's casts would do, on a sample)."""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from mixprec.fp8._quant import STAT_NAMES, _scale, cast_stats, cast_to_fp8
from mixprec.fp8._recipe import Cast, Float8Recipe
from mixprec.fp8._state import OPERANDS, LayerState
from mixprec.fp8._trend import Trend

__all__ = ["Decision", "FP4_RUNGS", "FP8_RUNGS", "GEMMS", "GEMM_OPERANDS", "LOW_RUNGS", "RUNGS", "LayerRecord", "Probe",
           "compose", "is_fp4", "measure"]

#: the rungs a ladder may hold, lowest precision first: fp4 recipes, fp8 recipes (the block-scaled
#: ones in the order of the audit's cost model), the compute dtype, fp32.
RUNGS = ("mxfp4", "nvfp4", "tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8", "blockwise", "compute", "fp32")
FP4_RUNGS = RUNGS[:2]
FP8_RUNGS = RUNGS[2:7]
LOW_RUNGS = RUNGS[:7]  # the rungs that run a recipe's casts
#: a linear layer's GEMMs (the keys of ``Float8Recipe.gemms()``) and the operands each reads, in
#: the order of its (left, right) casts, as rows of :class:`LayerState`'s windows.
GEMMS = ("output", "grad_input", "grad_weight")
GEMM_OPERANDS = {"output": ("input", "weight"), "grad_input": ("grad_output", "weight"),
                 "grad_weight": ("grad_output", "input")}
_CASTS = tuple(f.name for f in dataclasses.fields(Float8Recipe)[:6])  # the recipe's six casts, two per GEMM
_HP = Cast("none")
_NCOL = len(STAT_NAMES)
_RANGE = ("input", "output")  # the range row: the layer's input and output amax, in its own dtype


@dataclass(frozen=True)
class Decision:
    """One switch of one layer: at ``step`` (the :meth:`Controller.step` count), ``layer`` went
    from ``from_`` to ``to`` (``action``: ``"promote"`` up the ladder, ``"demote"`` down) because
    ``operand``'s ``statistic`` was ``value`` (against ``threshold``); ``reason`` says it in words.
    ``gemm``: the GEMM that switched (``"output"``, ``"grad_input"``, ``"grad_weight"``) under a
    ``Controller(per_gemm=True)``; None: all three together (the layer).

    Example:
        >>> d = Decision(190, "0", "input", "promote", "fp8-tensorwise", "fp8-rowwise",
        ...              "underflow_forecast", 0.07, 0.05, "input underflow forecast 0.07 > 0.05")
        >>> d.action, d.to
        ('promote', 'fp8-rowwise')
    """

    step: int
    layer: str
    operand: str
    action: str
    from_: str
    to: str
    statistic: str
    value: float
    threshold: float
    reason: str
    gemm: str | None = None


def is_fp4(cast: Cast) -> bool:
    """Whether ``cast`` quantizes to fp4 (e2m1 elements, block scales)."""
    return "e2m1" in cast.format


def compose(recipes: tuple[Float8Recipe | None, ...]) -> Float8Recipe | None:
    """The recipe whose GEMMs (:data:`GEMMS`, in order) run the casts of ``recipes`` (one per
    GEMM; None: the compute dtype, no cast), or None where they do not compose: the GEMMs' recipes
    must agree on every setting but their casts (scale rounding, block shapes, transforms) and the
    casts must make a valid recipe (no block scales beside tensor or row ones). A recipe the
    three GEMMs share is returned as it is.

    Example:
        >>> t = Float8Recipe.tensorwise()
        >>> compose((t, t, t)) is t, compose((t, None, None)).input_for_grad_weight.format
        (True, 'none')
        >>> compose((t, Float8Recipe.rowwise(), None)) is None  # power-of-2 scales or not
        True
    """
    used = [r for r in recipes if r is not None]
    if not used:
        return None
    base = used[0]
    if all(r is base for r in recipes):
        return base
    settings = [f.name for f in dataclasses.fields(Float8Recipe) if f.name not in (*_CASTS, "save_fp8", "name")]
    if any(getattr(r, s) != getattr(base, s) for r in used for s in settings):
        return None
    casts = {}
    for gemm, recipe, (left, right) in zip(GEMMS, recipes, zip(_CASTS[::2], _CASTS[1::2])):
        pair = recipe.gemms()[gemm] if recipe is not None else (_HP, _HP)
        casts[_field(gemm, 0)], casts[_field(gemm, 1)] = pair
    name = "+".join(r.name if r is not None else "compute" for r in recipes)
    try:
        return dataclasses.replace(base, **casts, save_fp8=False, name=name)
    except ValueError:
        return None


def _field(gemm: str, side: int) -> str:
    """The recipe field of ``gemm``'s left (0) or right (1) cast."""
    return {"output": ("input", "weight"), "grad_input": ("grad_output", "weight_for_grad_input"),
            "grad_weight": ("grad_output_for_grad_weight", "input_for_grad_weight")}[gemm][side]


class LayerRecord:
    """The controller's record of one layer: its rung per GEMM (one rung for all three unless the
    controller is ``per_gemm``), its device windows, its trends.

    ``gemm_windows`` (per-GEMM controllers only): ``(2, 3, 2, 5)``, the layer's own casts and the
    shadow's, per GEMM, per operand of that GEMM, in the layout of a LayerState row.
    """

    def __init__(self, module: nn.Module | None, state: LayerState, rung: int, floor: int,
                 allowed: tuple[bool, ...], per_gemm: bool = False) -> None:
        # None: a layer this rank has not run yet (Controller._detached)
        self.module = weakref.ref(module) if module is not None else _no_module
        self.state = state
        self.rungs = [rung] * len(GEMMS)
        self.floor = floor  # the lowest rung it may be demoted to
        self.allowed = allowed  # per rung of the ladder: whether the layer can run it (block multiples)
        # the rung below's casts measured on a sample (promoted layers): the layout of LayerState._data
        self.shadow = torch.zeros_like(state._data)
        self.range = torch.zeros(len(_RANGE), device=state.device)  # worst input/output amax
        self.gemm_windows = torch.zeros(2, len(GEMMS), 2, _NCOL + 1, device=state.device) if per_gemm else None
        # log2 amax per operand and range entry; underflow of the layer's casts and of the shadow's
        keys = (*OPERANDS, *(f"range_{r}" for r in _RANGE), *(f"underflow_{op}" for op in OPERANDS),
                *(f"shadow_{op}" for op in OPERANDS))
        if per_gemm:
            keys = (*(f"range_{r}" for r in _RANGE),
                    *(f"{g}.{kind}{op}" for g in GEMMS for kind in ("", "underflow_", "shadow_")
                      for op in GEMM_OPERANDS[g]))
        self.trends = {key: Trend() for key in keys}
        self.clean = 0  # consecutive windows in which the rung below was safe
        self.switches: list[int] = []  # steps of its switches (of the layer as a whole)
        self.gemm_clean = [0] * len(GEMMS)  # per GEMM (per-GEMM records)
        self.gemm_switches: list[list[int]] = [[] for _ in GEMMS]
        # per GEMM, the casts its current rung measures (per-GEMM) and the rung below's (its shadow)
        self.own: list[tuple[Cast, Cast, bool] | None] = [None] * len(GEMMS)
        self.below_gemm: list[tuple[Cast, Cast, bool] | None] = [None] * len(GEMMS)
        self.below: Float8Recipe | None = None  # the rung below, while it may go there: its shadow's casts
        self.probe: Any = None  # its Probe (also in state.probe)

    @property
    def rung(self) -> int:
        """The layer's rung (its forward GEMM's, for a per-GEMM record)."""
        return self.rungs[0]

    @rung.setter
    def rung(self, value: int) -> None:
        self.rungs = [value] * len(GEMMS)

    def windows(self) -> torch.Tensor:
        """The windows a check all-reduces, as one vector."""
        parts = [self.state.stats.flatten(), self.shadow[:, :-1].flatten(), self.range]
        if self.gemm_windows is not None:
            parts.append(self.gemm_windows[..., :-1].flatten())
        return torch.cat(parts)

    def reset(self) -> None:
        self.state.reset()
        self.shadow[:, :-1].zero_()
        self.range.zero_()
        if self.gemm_windows is not None:
            self.gemm_windows[..., :-1].zero_()


def _no_module() -> None:
    return None


class Probe:
    """What :func:`mixprec.fp8.linear` calls after a controlled layer's GEMM (``LayerState.probe``),
    in eager mode and traced alike: the range (fp16 inputs) and, on the last steps of each window,
    the shadow of a promoted layer; for a per-GEMM record, on every step, each GEMM's own casts
    (sampled) too. A copy or a pickle of the model (``copy.deepcopy``) drops it: the copy runs its
    rung without measurements."""

    def __init__(self, controller: Any, rec: LayerRecord) -> None:
        self.controller, self.rec = controller, rec
        self.fp32 = False  # the fp32 rung: fp8.linear's fallback runs the GEMM in float32

    def __deepcopy__(self, memo: dict) -> None:
        return None

    def __reduce__(self) -> tuple:
        return type(None), ()

    def __call__(self, x: torch.Tensor, weight: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
        """Measure ``x`` (the GEMM's input, in its dtype), ``weight`` (``(out, in)``; None: not
        measured) and ``out``; returns ``out``."""
        ctl, rec = self.controller, self.rec
        if ctl._compute is None:  # fp8.convert's layers: the dtype the layer computes in
            ctl._compute = x.dtype
        if x.dtype is torch.float16:
            _range(rec.range, x, out)
        if rec.gemm_windows is not None:
            _measure_gemms(rec, x, weight, out, ctl.sample, ctl._measuring)
            return out
        below = rec.below
        if below is None or not ctl._measuring:
            return out
        measure(rec.shadow[0], x, below.input, below.pow2_scales, ctl.sample)
        if weight is not None:
            measure(rec.shadow[1], weight.detach(), below.weight, below.pow2_scales, ctl.sample)
        if out.requires_grad:
            buf, sample = rec.shadow[2], ctl.sample
            out.register_hook(lambda g: measure(buf, g, below.grad_output, below.pow2_scales, sample))
        return out


def _measure_gemms(rec: LayerRecord, x: torch.Tensor, weight: torch.Tensor | None, out: torch.Tensor,
                   sample: int, shadow: bool) -> None:
    """Per GEMM, the statistics of its own casts (every step) and of the rung below's (``shadow``
    steps), each operand as that GEMM reads it (its contracted dimension last)."""
    x2 = x.detach().reshape(-1, x.shape[-1])
    w = weight.detach() if weight is not None else None
    reads = {"output": (x2, w), "grad_input": (None, None if w is None else w.t()),
             "grad_weight": (None, x2.t())}
    backward = []
    for g, gemm in enumerate(GEMMS):
        for kind, casts in ((0, rec.own[g]), (1, rec.below_gemm[g] if shadow else None)):
            if casts is None:
                continue
            left, right, pow2 = casts
            for side, (operand, cast) in enumerate(zip(reads[gemm], (left, right))):
                if operand is not None:
                    measure(rec.gemm_windows[kind, g, side], operand, cast, pow2, sample)
            if gemm != "output":
                backward.append((rec.gemm_windows[kind, g, 0], gemm, left, pow2))
    if backward and out.requires_grad:
        out.register_hook(lambda grad: _measure_grad(backward, grad, sample))


def _measure_grad(where: list, grad: torch.Tensor, sample: int) -> None:
    g2 = grad.detach().reshape(-1, grad.shape[-1])
    for buf, gemm, cast, pow2 in where:
        measure(buf, g2 if gemm == "grad_input" else g2.t(), cast, pow2, sample)


def _range(buf: torch.Tensor, x: torch.Tensor, out: torch.Tensor) -> None:
    """``buf`` (the range row) = max(``buf``, [amax of x, amax of out]). No host sync."""
    amax = torch.stack([x.detach().abs().amax().float(), out.detach().abs().amax().float()])
    torch.maximum(buf, amax, out=buf)


def measure(buf: torch.Tensor, x: torch.Tensor, cast: Any, pow2: bool, sample: int) -> None:
    """Accumulate into ``buf`` (one row of a LayerState window) the statistics ``cast`` would
    have on ``x``, measured on about ``sample`` elements: evenly strided rows (a row or block cast
    along the last dimension is exact on them), scaled by the whole tensor's amax for a tensor
    cast. No host sync."""
    x2 = x.detach().reshape(-1, x.shape[-1]) if x.dim() else x.detach().reshape(1, 1)
    if x2.numel() == 0:
        return
    # (a 2-D block, 128x128 or 16x16, is measured on the whole tensor: a sample of rows would cut it)
    two_d = cast.block is not None and cast.block[0] > 1
    stride = 1 if two_d else max(1, x2.numel() // sample // max(x2.shape[1], 1))
    rows = x2[::stride]
    if is_fp4(cast):
        amax = torch.max(torch.abs(x2))
        q = _fp4_nonzero(rows if not two_d else x2, cast, amax)
    elif cast.granularity == "tensor":
        amax = torch.max(torch.abs(x2))
        fmax = torch.finfo(cast.dtype).max
        q = (rows.to(torch.float32) * _scale(amax, cast.dtype, pow2)).clamp_(min=-fmax, max=fmax).to(cast.dtype)
    else:
        q, _, _ = cast_to_fp8(rows, cast, -1, pow2)
        amax = torch.max(torch.abs(x2)) if stride > 1 else torch.max(torch.abs(rows))
    new = cast_stats(rows, q, amax, buf[-1])
    buf.copy_(torch.cat([torch.maximum(buf[:-1], new), new[:1]]))


_E2M1_MAX, _E4M3_MAX = 6.0, 448.0


def _fp4_nonzero(x2: torch.Tensor, cast: Cast, amax: torch.Tensor) -> torch.Tensor:
    """For an fp4 (e2m1) block cast of ``x2``: uint8, 0 where an element quantizes to zero (at most
    a quarter of its block's scale: half of e2m1's smallest step 0.5, ties to even) and 1
    elsewhere, in the layout :func:`cast_stats` reads. The block scale is MXFP4's E8M0 power of 2
    rounded up (``2**ceil(log2(block amax / 6))``) or NVFP4's e4m3 scale of ``block amax / 6``
    under the fp32 tensor scale ``amax / (448 * 6)`` (blocks of ``cast.block``; 2-D blocks on the
    whole tensor). A measurement of the cast's flush-to-zero, not its numerics."""
    rows, cols = cast.block
    xf = x2.to(torch.float32)
    pr, pc = -xf.shape[0] % rows, -xf.shape[1] % cols
    xb = torch.nn.functional.pad(xf, (0, pc, 0, pr)).reshape(
        (xf.shape[0] + pr) // rows, rows, (xf.shape[1] + pc) // cols, cols)
    block_amax = xb.abs().amax(dim=(1, 3), keepdim=True)
    if cast.scale_format == "e8m0":
        scale = torch.exp2(torch.ceil(torch.log2(torch.clamp(block_amax / _E2M1_MAX, min=2.0 ** -127))))
    else:
        tensor_scale = torch.clamp(amax.to(torch.float32) / (_E4M3_MAX * _E2M1_MAX), min=2.0 ** -126)
        block = (block_amax / _E2M1_MAX / tensor_scale).clamp(max=_E4M3_MAX).to(torch.float8_e4m3fn)
        scale = block.to(torch.float32) * tensor_scale
    nonzero = xb.abs() > 0.25 * scale
    out = nonzero.reshape(xf.shape[0] + pr, xf.shape[1] + pc)[: xf.shape[0], : xf.shape[1]]
    return out.to(torch.uint8)
