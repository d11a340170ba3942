"""Audit a model's numerics and recommend a mixed-precision :class:`mixprec.Policy`.

:func:`audit` runs a few forward/backward passes on one batch, in float32 and under
:func:`mixprec.autocast` with each candidate dtype, and returns an :class:`AuditReport`: per-module
ranges, ranked risks, the modules to keep in float32, the chosen dtype, an initial loss scale
and a policy that passes straight to ``mixprec.autocast(device_type, policy=report.policy)``.

The procedure, per candidate dtype ``d``:

1. float32 pass with :func:`collect_ranges` and :func:`trace_nonfinite` (a non-finite value
   here is a model bug: :class:`RuntimeError`). The largest gradient gives the float16 loss
   scale: the largest power of two ``S`` with ``max|grad| * S * margin < 65504``, at most
   ``2**15`` (the loss's own gradient is ``S``: it must fit a float16 loss) and at least
   ``2**-24``; a second float32 pass measures the gradients at ``S``.
2. Modules whose float32 outputs would overflow in ``d``, or flush more than
   ``underflow_threshold`` of their values to zero, are candidates to keep in float32 (innermost
   ones only: a parent is dropped when one of its descendants is flagged).
3. A pass under the default policy (``Policy(compute=d)``) records what actually goes wrong.
4. Verification loop: a pass under the candidate policy with a deferred tracer; if a forward
   value still becomes non-finite, the named module is added to the keep set; if a gradient
   does, the float16 scale is divided by 8 (down to 1), then the module is kept. At most
   ``max_fixes`` rounds; ``report.verified[d]`` says whether the last pass was clean **and** its
   loss finite and within ``loss_rtol`` of the float32 loss (``loss_fn``'s own code runs
   outside every module: an overflow there is seen only in the loss, and no module rule fixes
   it). ``report.losses`` holds the losses of the float32 pass and of each verification pass.

An empty batch, or a float32 loss that is not finite, is an error: there is nothing to measure.

Choice among the dtypes asked: a single dtype is used as is (its problems fixed with module
rules). With both, float16 (3 more mantissa bits) is chosen when it verified clean with no module
kept and its gradients lose at most ``underflow_threshold`` to flush-to-zero at ``S``; otherwise
bfloat16 if it verified, otherwise the dtype with fewer modules kept (with a warning in
``reason``). ``init_scale`` is ``S`` for
float16 and 1.0 for bfloat16 (no loss scaling needed).

With ``fp8=recipe``, a last step picks the ``nn.Linear`` layers that run in fp8 under the chosen
policy (``diagnostics/_fp8_audit.py``): every default candidate in fp8 for one trial pass, the
ones whose operands flush more than ``underflow_threshold`` after scaling, hold an inf/NaN, or
whose output SQNR is below ``fp8_min_sqnr_db`` stay in the compute dtype (the
:class:`mixprec.fp8.Guard` rule), then a verification pass.
With ``fp8="auto"`` each layer gets the cheapest format of ``tensorwise < rowwise < mxfp8 <
blockwise`` that passes the same rule (one trial pass per format), and ``report.policy`` names
each layer's format (``Policy.fp8(recipes=...)``).

The decisions are made by exact module names (``report.full_policy``); ``report.policy`` is the
same choice in its shortest equivalent form on this model (``diagnostics/_shortest.py``). The
audit judges numerics only: it times nothing, and float16 is never chosen for speed.

The model's parameters, gradients, buffers, fp8 layer statistics and the RNG state are restored
afterwards; every pass starts from the same RNG state, so dropout masks agree between passes.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Any, Callable, Iterable, NamedTuple

import torch
from torch import nn

from mixprec._dtype_names import dtype_name, lookup, parse_dtype
from mixprec.diagnostics._fp8_audit import recommend_fp8
from mixprec.diagnostics._passes import FixedScale, Passes
from mixprec.diagnostics._shortest import bare_modules, exact_names, shortest
from mixprec.diagnostics.event import NonFiniteEvent
from mixprec.diagnostics.findings import AuditReport, Risk
from mixprec.diagnostics.ranges import KINDS, RangeStats, collect_ranges
from mixprec.fp8 import as_recipe
from mixprec.policy import Policy

__all__ = ["AuditReport", "Risk", "audit", "check_batch", "check_device", "dtype_names"]

_CANDIDATES = {name: parse_dtype(name) for name in ("float16", "bfloat16")}
_FP16_MAX = torch.finfo(torch.float16).max


def _dtype_name(dtype: torch.dtype | str, fp8_option: str) -> str:
    if isinstance(dtype, torch.dtype):
        name = dtype_name(dtype)
    elif isinstance(dtype, str):
        named = lookup(dtype)
        name = dtype.strip().lower() if named is None else dtype_name(named)
    else:
        raise TypeError(f"dtypes must hold torch.dtype or str values, got {type(dtype).__name__}")
    if name not in _CANDIDATES:
        hint = (f"; fp8 is not a compute dtype: pass {fp8_option} (or another recipe) to have "
                "the audit choose the Linear layers that run in fp8" if "float8" in name else "")
        raise ValueError(f"audit chooses among float16 and bfloat16 only, got {dtype!r}{hint}")
    return name


def dtype_names(dtypes: Iterable[torch.dtype | str] | torch.dtype | str, *,
                fp8_option: str = "fp8='tensorwise'") -> tuple[str, ...]:
    """The candidate dtypes as canonical names, in order, without repeats (``fp8_option``: how
    the error for an fp8 dtype spells the fp8 option, ``"--fp8 tensorwise"`` on the command line).

    Example:
        >>> dtype_names(["fp16", torch.bfloat16, "half"])
        ('float16', 'bfloat16')

    Raises:
        ValueError: an empty list, or a dtype other than float16/bfloat16 (or their aliases).
        TypeError: an entry that is neither a ``torch.dtype`` nor a ``str``.
    """
    if isinstance(dtypes, (torch.dtype, str)):
        dtypes = (dtypes,)
    names = tuple(dict.fromkeys(_dtype_name(d, fp8_option) for d in dtypes))
    if not names:
        raise ValueError("dtypes is empty; pass e.g. dtypes=(torch.float16, torch.bfloat16)")
    return names


def _policy(dtype: str, keep: set[str] | tuple[str, ...]) -> Policy:
    policy = Policy(compute=_CANDIDATES[dtype])
    return policy.keep(names=exact_names(keep), dtype=torch.float32) if keep else policy


def _minimal(flagged: set[str]) -> set[str]:
    """Drop every flagged module that has a flagged descendant (the innermost ones suffice)."""
    def has_flagged_child(m: str) -> bool:
        prefix = "" if m == "" else m + "."
        return any(o != m and o.startswith(prefix) for o in flagged)

    return {m for m in flagged if not has_flagged_child(m)}


def _init_scale(stats: dict[str, dict[str, RangeStats]], margin: float) -> float:
    gmax = max((s.absmax for kinds in stats.values() for k, s in kinds.items()
                if k in ("grad", "weight_grad")), default=0.0)
    # the loss's own gradient is the scale itself: a float16 loss needs scale <= 2**15
    k = 15 if gmax <= 0.0 else min(15, math.floor(math.log2(_FP16_MAX / (gmax * margin))))
    return 2.0 ** max(-24, k)


def _risks(dtype: str, ref: dict[str, dict[str, RangeStats]],
           scaled: dict[str, dict[str, RangeStats]],
           lowp: dict[str, dict[str, RangeStats]], origin: NonFiniteEvent | None) -> list[Risk]:
    """Risks measured in float32 (gradients at the loss scale), plus the inf/NaN origin of the
    default-policy run (its downstream consequences are not listed)."""
    out: list[Risk] = []
    for module in ref:
        for kind in KINDS:
            s = (scaled if kind in ("grad", "weight_grad") else ref).get(module, {}).get(kind)
            if s is None:
                continue
            for issue, fracs in (("overflow", s.overflow), ("underflow", s.underflow),
                                 ("subnormal", s.subnormal)):
                if fracs[dtype] > 0:
                    out.append(Risk(dtype, module, kind, issue, fracs[dtype]))
    if origin is not None:
        if origin.phase == "forward":
            kind = "activation"
        else:
            kind = "weight_grad" if origin.tensor.startswith("grad:") else "grad"
        s = lowp.get(origin.module, {}).get(kind)
        frac = s.nonfinite / s.count if s is not None and s.count and s.nonfinite else 1.0
        out.append(Risk(dtype, origin.module, kind, "nonfinite", frac))
    return out


_CRITERION_FIRST_ARGS = frozenset(
    {"input", "inputs", "output", "outputs", "out", "logits", "pred", "preds", "prediction",
     "predictions", "y_pred", "yhat", "y_hat"}
)


def _as_model_loss(loss_fn: Callable[..., torch.Tensor]) -> Callable[[nn.Module, Any], torch.Tensor]:
    """``loss_fn`` as ``(model, batch) -> loss``.

    A criterion (an ``nn.Module`` such as ``nn.CrossEntropyLoss()``, or a function whose first
    parameter is named like a prediction: ``input``, ``output``, ``logits``, ``pred``, ... as in
    ``F.cross_entropy``) is applied as ``loss_fn(model(inputs), target)`` to a
    ``batch = (inputs, target)``; anything else is called as ``loss_fn(model, batch)``.
    """
    criterion = isinstance(loss_fn, nn.Module)
    if not criterion:
        try:
            params = list(inspect.signature(loss_fn).parameters.values())
        except (TypeError, ValueError):
            params = []
        criterion = bool(params) and params[0].name in _CRITERION_FIRST_ARGS
    if not criterion:
        return loss_fn

    def model_loss(model: nn.Module, batch: Any) -> torch.Tensor:
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise ValueError(
                f"loss_fn {getattr(loss_fn, '__name__', type(loss_fn).__name__)} is a criterion "
                "(prediction, target): pass batch=(inputs, target), or pass "
                "loss_fn(model, batch) -> loss instead"
            )
        inputs, target = batch
        out = model(*inputs) if isinstance(inputs, (tuple, list)) else model(inputs)
        return loss_fn(out, target)

    return model_loss


def check_device(model: nn.Module, batch: Any, device_type: str, *, option: str = "device_type") -> None:
    """Raise unless the model (or, without parameters, the batch) is on ``device_type``.

    Autocast for one device type leaves tensors on another untouched: the audit would measure
    float32 and call it float16. ``option`` is how the caller spells the setting in the message:
    ``"device_type"`` (Python) or ``"--device"`` (the command line).

    Raises:
        ValueError: the model is elsewhere (the message says what to pass instead).
        TypeError: ``device_type`` is not a string.
    """
    from torch.utils._pytree import tree_leaves

    if not isinstance(device_type, str):
        raise TypeError(f"device_type must be a str such as 'cpu' or 'cuda', got {device_type!r}")
    tensors = [*model.parameters(), *model.buffers()] or [
        t for t in tree_leaves(batch) if isinstance(t, torch.Tensor)]
    found = sorted({t.device.type for t in tensors})
    if found and device_type not in found:
        given, fix = ((f"--device {device_type}", f"--device {found[0]}") if option == "--device"
                      else (f"{option}={device_type!r}", f"{option}={found[0]!r}"))
        raise ValueError(
            f"the model is on {', '.join(found)} but {given}: autocast for {device_type!r} would "
            f"leave it in float32; pass {fix} or move the model"
        )


def audit(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    *,
    device_type: str = "cpu",
    dtypes: tuple[torch.dtype | str, ...] | list[torch.dtype | str] = (torch.float16, torch.bfloat16),
    scaler: Any = None,
    steps: int = 1,
    margin: float = 8.0,
    underflow_threshold: float = 0.05,
    max_fixes: int = 8,
    fp8: Any = None,
    fp8_min_sqnr_db: float | None = 20.0,
    loss_rtol: float = 0.05,
    progress: Callable[[str], None] | None = None,
) -> AuditReport:
    """Audit ``model`` on ``batch`` and recommend a precision policy (see module docs).

    Args:
        model: the model, already on its device. Left exactly as found (parameters, gradients,
            buffers, RNG state); the audit holds one copy of its parameters and buffers.
        batch: whatever ``loss_fn`` takes.
        loss_fn: ``loss_fn(model, batch) -> scalar loss tensor``, which runs the forward pass
            (e.g. ``lambda m, b: F.cross_entropy(m(b[0]), b[1])``), or a criterion such as
            ``nn.CrossEntropyLoss()`` / ``F.cross_entropy`` with ``batch=(inputs, target)``,
            applied as ``loss_fn(model(inputs), target)``.
        device_type: ``"cpu"`` or ``"cuda"``, for :func:`mixprec.autocast`.
        dtypes: the candidates (``torch.float16``/``torch.bfloat16`` or names such as
            ``"fp16"``); the recommendation uses only these.
        scaler: optional loss scaler (``get_scale()``): float16 gradients are judged at its
            current scale instead of the recommended one.
        steps: forward/backward passes per configuration (same batch, RNG advancing between
            passes, so dropout varies; no optimizer step), statistics accumulated.
        margin: headroom factor between the largest scaled gradient and float16's max.
        underflow_threshold: share of a module's float32 outputs flushing to zero above which the
            module is kept in float32; also the gradient flush-to-zero share float16 may lose.
        max_fixes: verification rounds per dtype (and for the fp8 layers).
        fp8: a :class:`mixprec.fp8.Float8Recipe` or its name (``True``: ``"tensorwise"``): also
            recommend which ``nn.Linear`` layers run in fp8 (``report.fp8``, and
            ``Policy.fp8(names=...)`` in ``report.policy``). A layer stays in the compute dtype
            when, with every candidate in fp8, an operand flushes more than
            ``underflow_threshold`` to zero after scaling, holds an inf/NaN, or its output's
            SQNR against the high-precision GEMM is below ``fp8_min_sqnr_db``. ``"auto-fp4"``: as
            ``"auto"``, trying ``mxfp4`` and ``nvfp4`` first. ``"auto"``: a
            format per layer, the cheapest that passes (``report.fp8.recipes``; see
            ``docs/diagnostics.md``).
        fp8_min_sqnr_db: the SQNR floor for fp8 layers (``None``: not sampled).
        loss_rtol: how far (relative to the float32 loss, at least ``1e-6`` absolute) a
            verification pass's loss may be from float32's and still count as verified.
        progress: called with one line before every pass (the float32 reference's, each
            dtype's under the default policy and its verification rounds, the fp8 measurements;
            with ``steps > 1`` before every step), e.g. ``progress=print``; ``mixprec audit``
            prints them on stderr.

    Returns:
        An :class:`AuditReport`.

    Raises:
        ValueError: empty or unsupported ``dtypes``, a model (or batch) not on ``device_type``,
            ``steps < 1``, ``margin < 1``, ``underflow_threshold`` outside [0, 1],
            ``max_fixes < 0``, ``loss_rtol`` not > 0, a loss that is not a scalar tensor
            requiring grad, an empty batch (every tensor in it has no element).
        RuntimeError: the model (or ``loss_fn``) produces inf/NaN already in float32 (the
            message says where).

    Host syncs: many (it reads statistics after every pass); not for use inside a training step.

    Example:
        >>> model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
        >>> report = audit(model, torch.randn(4, 8), lambda m, x: m(x).square().mean())
        >>> with mixprec.autocast("cpu", policy=report.policy):
        ...     y = model(torch.randn(4, 8))
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"audit needs an nn.Module, got {type(model).__name__}")
    if not callable(loss_fn):
        raise TypeError("loss_fn must be callable as loss_fn(model, batch) -> scalar tensor")
    names = dtype_names(dtypes)
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    if not margin >= 1.0:
        raise ValueError(f"margin must be >= 1, got {margin!r}")
    if not 0.0 <= underflow_threshold <= 1.0:
        raise ValueError(f"underflow_threshold must be in [0, 1], got {underflow_threshold!r}")
    if not isinstance(max_fixes, int) or max_fixes < 0:
        raise ValueError(f"max_fixes must be an int >= 0, got {max_fixes!r}")
    if fp8 is True:
        fp8 = "tensorwise"
    if fp8 is not None and fp8 is not False and fp8 not in ("auto", "auto-fp4"):
        try:
            as_recipe(fp8)
        except ValueError as e:
            raise ValueError(f"audit fp8: {e}, or 'auto' (a format per layer)") from e
    if fp8_min_sqnr_db is not None and not isinstance(fp8_min_sqnr_db, (int, float)):
        raise ValueError(f"fp8_min_sqnr_db must be None or a number of dB, got {fp8_min_sqnr_db!r}")
    if not (isinstance(loss_rtol, (int, float)) and loss_rtol > 0):
        raise ValueError(f"loss_rtol must be a number > 0, got {loss_rtol!r}")
    if progress is not None and not callable(progress):
        raise TypeError(f"progress must be None or a callable taking a line, got {type(progress).__name__}")
    say = progress or (lambda line: None)
    check_device(model, batch, device_type)
    check_batch(batch)

    losses = _Losses(_as_model_loss(loss_fn), steps, loss_rtol)
    passes = Passes(model, batch, losses, device_type, steps, say)
    try:
        ref = _reference(passes, "float16" in names, margin, scaler, losses)
        ranges = dict(ref.ranges)
        keep: dict[str, tuple[str, ...]] = {}
        verified: dict[str, bool] = {}
        loss_ok: dict[str, bool] = {}
        default_events: dict[str, NonFiniteEvent | None] = {}
        risks: list[Risk] = []
        scale16 = ref.scale16
        for d in names:
            scale = ref.grad_scale if d == "float16" else 1.0
            kept = _candidates(ref.float32, d, underflow_threshold)
            default_events[d], ranges[d] = _default_run(passes, d, scale)
            judged = ref.scaled if d == "float16" else ref.float32
            risks += _risks(d, ref.float32, judged, ranges[d], default_events[d])
            first = default_events[d] if not kept else passes.traced(
                _policy(d, kept), scale, what=f"{d}: verifying with {len(kept)} module(s) kept in float32")
            kept, scale, clean = _verify(passes, d, kept, scale, first, max_fixes)
            loss_ok[d] = losses.check(d)  # the last pass ran the candidate policy
            verified[d] = clean and loss_ok[d]
            keep[d] = tuple(n for n in bare_modules(model) if n in kept)
            if d == "float16" and scaler is None:
                scale16 = scale
        chosen, reason = _choose(names, keep, verified, ref.scaled, underflow_threshold)
        reason += "".join(f"; {d}'s loss {losses.describe(d)}" for d in names if not loss_ok[d])
        risks.sort(key=lambda r: r.rank_key, reverse=True)
        policy, advice = _policy(chosen, keep[chosen]), None
        if fp8 is not None and fp8 is not False:
            policy, advice = recommend_fp8(
                passes, policy, fp8, scale16 if chosen == "float16" else 1.0,
                underflow_threshold=underflow_threshold, min_sqnr_db=fp8_min_sqnr_db, max_fixes=max_fixes)
            # its last pass verified the final policy: the loss counts too
            advice = dataclasses.replace(advice, verified=losses.check("fp8") and advice.verified)
        full, policy = policy, shortest(model, policy)
        return AuditReport(
            device_type=device_type,
            dtypes=names,
            dtype=chosen,
            policy=policy,
            full_policy=full,
            init_scale=scale16 if chosen == "float16" else 1.0,
            reason=reason,
            keep=keep,
            verified=verified,
            default_events=default_events,
            grad_scale=ref.grad_scale,
            risks=tuple(risks),
            modules={n: type(m).__name__ for n, m in bare_modules(model).items()},
            ranges=ranges,
            fp8=advice,
            losses=dict(losses.recorded),
        )
    finally:
        passes.snapshot.restore()


def check_batch(batch: Any) -> None:
    """Raise when every tensor in ``batch`` is empty: the audit would measure nothing (and a
    mean over no element is NaN in every dtype).

    Raises:
        ValueError: the batch holds tensors and all of them have no element.
    """
    from torch.utils._pytree import tree_leaves

    tensors = [t for t in tree_leaves(batch) if isinstance(t, torch.Tensor)]
    if tensors and all(t.numel() == 0 for t in tensors):
        shapes = ", ".join(str(tuple(t.shape)) for t in tensors[:4])
        raise ValueError(f"the batch is empty (tensors of shape {shapes}): the audit measures "
                         "ranges and losses on it; pass a batch with at least one sample")


class _Losses:
    """``loss_fn`` that records each pass's losses, and the check of a pass against float32's."""

    def __init__(self, loss_fn: Callable[[nn.Module, Any], torch.Tensor], steps: int, rtol: float) -> None:
        self.loss_fn, self.steps, self.rtol = loss_fn, steps, rtol
        self.last: list[torch.Tensor] = []
        self.recorded: dict[str, tuple[float, ...]] = {}

    def __call__(self, model: nn.Module, batch: Any) -> torch.Tensor:
        loss = self.loss_fn(model, batch)
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:  # Passes refuses anything else
            self.last = [*self.last, loss.detach().float().reshape(())][-self.steps:]
        return loss

    def take(self, name: str) -> tuple[float, ...]:
        """The losses of the last pass (one per step), recorded under ``name``."""
        values = tuple(float(v) for v in torch.stack(self.last).cpu()) if self.last else ()
        self.recorded[name] = values
        return values

    def check(self, name: str) -> bool:
        """Whether the last pass's losses are finite and within ``rtol`` of float32's."""
        ref = self.recorded["float32"]
        got = self.take(name)
        return len(got) == len(ref) and all(
            math.isfinite(g) and abs(g - r) <= self.rtol * max(abs(r), 1e-6) for g, r in zip(got, ref))

    def describe(self, name: str) -> str:
        got, ref = self.recorded[name], self.recorded["float32"]
        worst = max(range(len(got)), key=lambda i: abs(got[i] - ref[i]) if math.isfinite(got[i]) else math.inf)
        return (f"{got[worst]:.6g} vs float32's {ref[worst]:.6g} (loss_fn's own code runs outside "
                f"every module: no module rule fixes it)" if not math.isfinite(got[worst])
                else f"{got[worst]:.6g} is off float32's {ref[worst]:.6g} by more than loss_rtol")


class _Reference(NamedTuple):
    ranges: dict[str, dict[str, dict[str, RangeStats]]]  # "float32" and maybe "float32@scale"
    scale16: float  # the recommended float16 loss scale
    grad_scale: float  # the scale float16 gradients are judged at

    @property
    def float32(self) -> dict[str, dict[str, RangeStats]]:
        return self.ranges["float32"]

    @property
    def scaled(self) -> dict[str, dict[str, RangeStats]]:
        """The float32 ranges with gradients at ``grad_scale`` (float32's own without float16)."""
        return self.ranges.get("float32@scale", self.ranges["float32"])


def _reference(passes: Passes, float16: bool, margin: float, scaler: Any, losses: _Losses) -> _Reference:
    """Step 1: the float32 pass, the float16 loss scale, and (for float16) the gradients at it."""
    collector = collect_ranges(passes.model)
    event = passes.traced(None, 1.0, collector, what="float32 reference: ranges and gradients")
    if event is not None:
        raise RuntimeError(f"the model produces {event.kind} already in float32: {event}; "
                           "fix the model before choosing a precision")
    bad = [v for v in losses.take("float32") if not math.isfinite(v)]
    if bad:
        raise RuntimeError(f"the loss is {bad[0]} already in float32, with every module's outputs "
                           "and gradients finite: loss_fn's own code makes it; fix the loss before "
                           "choosing a precision")
    ranges = {"float32": collector.results()}
    scale16 = _init_scale(ranges["float32"], margin)
    grad_scale = float(scaler.get_scale()) if scaler is not None else scale16
    if float16 and grad_scale != 1.0:
        at_scale = collect_ranges(passes.model, scaler=FixedScale(grad_scale))
        passes.run(None, 1.0, at_scale, what=f"float32 reference: gradients at the float16 loss scale "
                                             f"{grad_scale:g}")
        ranges["float32@scale"] = at_scale.results()
    return _Reference(ranges, scale16, grad_scale)


def _candidates(float32: dict[str, dict[str, RangeStats]], dtype: str, threshold: float) -> set[str]:
    """Step 2: the innermost modules whose float32 outputs would overflow in ``dtype`` or flush
    more than ``threshold`` of their values to zero."""
    flagged = {m for m, kinds in float32.items()
               if (s := kinds.get("activation")) is not None
               and (s.overflow[dtype] > 0 or s.underflow[dtype] > threshold)}
    return _minimal(flagged)


def _default_run(passes: Passes, dtype: str, scale: float
                 ) -> tuple[NonFiniteEvent | None, dict[str, dict[str, RangeStats]]]:
    """Step 3: what goes wrong under the default policy: the first inf/NaN and the ranges."""
    collector = collect_ranges(passes.model)
    event = passes.traced(_policy(dtype, ()), scale, collector, what=f"{dtype}: the default policy")
    return event, collector.results()


def _verify(passes: Passes, dtype: str, kept: set[str], scale: float, event: NonFiniteEvent | None,
            max_fixes: int) -> tuple[set[str], float, bool]:
    """Step 4: fix what still goes wrong under the candidate policy (``event``: the first
    inf/NaN of a pass under it), at most ``max_fixes`` times: a backward inf/NaN in float16
    divides the scale by 8 (down to 1), any other keeps the module it names in float32.
    Returns the modules kept, the scale and whether the last pass was clean."""
    fixes = 0
    while event is not None and fixes < max_fixes:
        if event.phase == "backward" and dtype == "float16" and scale > 1.0:
            scale = max(1.0, scale / 8)
        elif event.module not in kept:
            kept.add(event.module)
        else:
            break  # keeping it in float32 did not help: nothing more to try
        fixes += 1
        event = passes.traced(_policy(dtype, kept), scale, what=(
            f"{dtype}: verifying with {len(kept)} module(s) kept in float32"
            + (f", loss scale {scale:g}" if dtype == "float16" else "") + f" (fix {fixes} of at most {max_fixes})"))
    return kept, scale, event is None


def _grad_flush(stats: dict[str, dict[str, RangeStats]]) -> float:
    """Largest per-module share of gradient values that flush to zero in float16."""
    return max((s.underflow["float16"] for kinds in stats.values() for k, s in kinds.items()
                if k in ("grad", "weight_grad")), default=0.0)


def _choose(names: tuple[str, ...], keep: dict[str, tuple[str, ...]], verified: dict[str, bool],
            scaled: dict[str, dict[str, RangeStats]], threshold: float) -> tuple[str, str]:
    if len(names) == 1:
        d = names[0]
        n = len(keep[d])
        return d, (f"{d} was the only dtype audited"
                   + (f"; {n} module(s) kept in float32" if n else "")
                   + ("" if verified[d] else "; WARNING: it did not verify (inf/NaN or its loss)"))
    flush = _grad_flush(scaled)
    if verified["float16"] and not keep["float16"] and flush <= threshold:
        return "float16", ("float16 ran clean with no module kept in float32 and its gradients "
                           f"lose at most {flush:.2%} to underflow at the loss scale; it keeps 3 "
                           "more mantissa bits than bfloat16")
    why = ("float16 needs modules kept in float32" if keep["float16"] else
           "float16 did not verify" if not verified["float16"] else
           f"{flush:.2%} of a module's float16 gradients flush to zero at the loss scale")
    if verified["bfloat16"]:
        return "bfloat16", f"bfloat16 ran clean and {why}"
    d = min(names, key=lambda n: (not verified[n], len(keep[n])))
    return d, f"no dtype ran clean; {d} needs the fewest fixes"

