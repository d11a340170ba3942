"""Per-module value ranges, and how much of them fp16, bf16 and fp8 can represent.

:func:`collect_ranges` hooks every module of a model while its ``with`` block is active and
gathers, per module and per kind of tensor (``"activation"``: forward outputs; ``"grad"``: the
gradient with respect to those outputs; ``"weight"``: the module's own parameters;
``"weight_grad"``: their gradients):

* the absolute max and the smallest non-zero magnitude of the finite values;
* the count of inf/NaN values already present;
* for each format in :data:`FORMATS`, the fraction of values that would overflow (round to inf,
  or saturate/NaN for float8_e4m3fn), flush to zero, or land on a subnormal when cast to it,
  with round-to-nearest-even thresholds derived from :func:`torch.finfo`;
* a histogram of log2|x| of the non-zero values, one bin per binade (:data:`HIST_EDGES`);
* for fp8, an "after scaling" view (:class:`Fp8Scaled`): what an fp8 recipe with current
  scaling would flush to zero or make subnormal, each tensor (or row) first multiplied by the
  scale the recipe computes from it, ``finfo.max / amax``. The unscaled view above judges the
  raw values, which is right for float16/bfloat16 and for fp8 without a scale only.

The statistics are taken on ``|x|`` in float32 (float64 tensors are rounded to float32 first;
finite magnitudes beyond float32's range are counted at float32's max, i.e. as overflow).

All reductions stay on the tensors' device; the host reads them once, in
:meth:`RangeCollector.results` (called by ``__exit__``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from mixprec._modules import named_modules
from mixprec.diagnostics._fp8 import FP8_FORMATS, Fp8Scaled, fp8_casts, fp8_counts
from mixprec.diagnostics._module_hook import ModuleHook
from mixprec.diagnostics._tensors import FLOAT32_MAX, measured

__all__ = [
    "FORMATS",
    "FP8_FORMATS",
    "Fp8Scaled",
    "HIST_EDGES",
    "KINDS",
    "FormatLimits",
    "RangeCollector",
    "RangeStats",
    "collect_ranges",
    "format_limits",
]

#: The formats every statistic is judged against, by name.
FORMATS: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}

#: Kinds of tensors gathered per module.
KINDS = ("activation", "grad", "weight", "weight_grad")

_HIST_LO, _HIST_HI = -127, 128
#: log2-magnitude histogram bin edges: bin ``k`` counts ``[2^k, 2^(k+1))`` for ``k`` in
#: -126..127 (every normal float32); the first bin, ``-127``, holds all float32 subnormals.
HIST_EDGES: tuple[int, ...] = tuple(range(_HIST_LO, _HIST_HI + 1))

@dataclass(frozen=True)
class FormatLimits:
    """Magnitudes (as float32 values) where casting to a format changes class.

    ``|x| < zero_below`` rounds to zero; ``zero_below <= |x| < normal_from`` rounds to a
    subnormal; ``|x| >= overflow_from`` rounds past ``max`` (inf, or NaN/saturation for formats
    without inf). Ties follow round-to-nearest-even.
    """

    name: str
    dtype: torch.dtype
    max: float
    tiny: float
    smallest_subnormal: float
    zero_below: float
    normal_from: float
    overflow_from: float


def format_limits(dtype: torch.dtype) -> FormatLimits:
    """The :class:`FormatLimits` of a floating dtype, from :func:`torch.finfo`."""
    fi = torch.finfo(dtype)
    sub = fi.tiny * fi.eps  # 2^(emin - mantissa bits)
    top_ulp = fi.eps * 2.0 ** math.floor(math.log2(fi.max))
    half_sub = torch.tensor(sub / 2, dtype=torch.float32)
    zero_below = torch.nextafter(half_sub, torch.tensor(math.inf)).item()  # sub/2 ties to 0
    return FormatLimits(
        name=str(dtype).removeprefix("torch."),
        dtype=dtype,
        max=fi.max,
        tiny=fi.tiny,
        smallest_subnormal=sub,
        zero_below=zero_below,
        normal_from=fi.tiny - sub / 2,  # ties round up to tiny (even mantissa)
        overflow_from=fi.max + top_ulp / 2,  # ties round away from max (odd mantissa)
    )


_LIMITS = {name: format_limits(dt) for name, dt in FORMATS.items()}
_F32_SUB = torch.finfo(torch.float32).tiny * torch.finfo(torch.float32).eps
# bucket i counts |x| in [B[i-1], B[i]); bucket 0 holds exact zeros (and the non-finite values)
_BOUNDS: tuple[float, ...] = tuple(
    sorted({_F32_SUB} | {v for lim in _LIMITS.values()
                         for v in (lim.zero_below, lim.normal_from, lim.overflow_from)})
)


@dataclass(frozen=True)
class RangeStats:
    """What one module's tensors of one kind looked like (host values).

    Attributes:
        count: number of values seen (over every call, step and tensor).
        nonfinite: how many were already inf/NaN.
        absmax: largest finite magnitude (0.0 if none).
        min_nonzero: smallest non-zero finite magnitude (``math.inf`` if none).
        overflow, underflow, subnormal: per format name, the fraction of all ``count`` values
            that would overflow, flush to zero, or become subnormal when cast to that format
            *unscaled* (as they are: right for float16/bfloat16, wrong for scaled fp8).
        hist: counts of log2|x| per bin of :data:`HIST_EDGES` (non-zero finite values).
        fp8_scaled: the fp8 "after scaling" view (:class:`Fp8Scaled`), or ``None`` (weight
            gradients, which enter no fp8 GEMM, or ``collect_ranges(..., fp8_recipe=None)``).
    """

    count: int
    nonfinite: int
    absmax: float
    min_nonzero: float
    overflow: dict[str, float]
    underflow: dict[str, float]
    subnormal: dict[str, float]
    hist: tuple[int, ...]
    fp8_scaled: Fp8Scaled | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-able copy (``min_nonzero`` is ``None`` when there was no non-zero value)."""
        return {
            "count": self.count,
            "nonfinite": self.nonfinite,
            "absmax": self.absmax,
            "min_nonzero": None if math.isinf(self.min_nonzero) else self.min_nonzero,
            "overflow": dict(self.overflow),
            "underflow": dict(self.underflow),
            "subnormal": dict(self.subnormal),
            "hist": list(self.hist),
            "fp8_scaled": None if self.fp8_scaled is None else {
                **vars(self.fp8_scaled), "view": self.fp8_scaled.view},
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RangeStats":
        """Inverse of :meth:`to_dict`."""
        mn = d["min_nonzero"]
        f8 = d.get("fp8_scaled")  # absent in reports written before the fp8 view
        return cls(
            count=int(d["count"]), nonfinite=int(d["nonfinite"]), absmax=float(d["absmax"]),
            min_nonzero=math.inf if mn is None else float(mn), overflow=dict(d["overflow"]),
            underflow=dict(d["underflow"]), subnormal=dict(d["subnormal"]),
            hist=tuple(int(c) for c in d["hist"]),
            fp8_scaled=None if f8 is None else Fp8Scaled(
                recipe=f8["recipe"], granularity=f8["granularity"], pow2_scales=bool(f8["pow2_scales"]),
                count=int(f8["count"]), underflow=dict(f8["underflow"]), subnormal=dict(f8["subnormal"])),
        )


class _Acc:
    """Device-side running statistics of one (module, kind)."""

    __slots__ = ("count", "state", "cast", "fp8_count", "fp8_state")

    def __init__(self, cast: Any = None) -> None:
        self.count = 0
        # [nonfinite count, absmax, min non-zero, bucket counts, log2 histogram], on the device
        self.state: list[torch.Tensor] | None = None
        self.cast = cast  # the fp8 recipe's (recipe name, Cast, pow2) for this kind, or None
        self.fp8_count = 0
        self.fp8_state: torch.Tensor | None = None  # [flushed, subnormal] per fp8 format

    def update(self, x: torch.Tensor, scale: torch.Tensor | float | None, fp8: bool = True) -> None:
        """Fold ``x`` (times ``scale``) in; ``fp8=False`` leaves it out of the fp8 view. No host sync."""
        x = x.detach()
        finite = torch.isfinite(x)  # judged before any rounding or scaling
        nonfinite = x.numel() - finite.sum()
        a = torch.where(finite, x, 0.0).abs().float()
        if scale is not None:
            a = a * scale
        # finite values past float32 (float64 input, or a gradient times a large scale) round to
        # inf here: clamp them to float32's max, where they count as overflow in every format
        a = a.clamp(max=FLOAT32_MAX)
        new = [
            nonfinite,
            a.amax(),
            torch.where(a > 0, a, math.inf).amin(),
            _count(torch.bucketize(a.flatten(), _bounds(a.device), right=True), len(_BOUNDS) + 1),
            _log2_hist(a),
        ]
        self.count += a.numel()
        old = self.state
        self.state = new if old is None else [
            old[0] + new[0],
            torch.maximum(old[1], new[1]),
            torch.minimum(old[2], new[2]),
            old[3] + new[3],
            old[4] + new[4],
        ]
        if self.cast is not None and fp8:
            counts = fp8_counts(a, *self.cast[1:])
            self.fp8_count += a.numel()
            self.fp8_state = counts if self.fp8_state is None else self.fp8_state + counts

    def flat(self) -> torch.Tensor:
        """Everything as one float64 vector, for a single device-to-host copy."""
        assert self.state is not None, "flat() is only called on updated accumulators"
        s = self.state
        f8 = self.fp8_state if self.fp8_state is not None else torch.zeros(
            2 * len(FP8_FORMATS), dtype=torch.int64, device=s[0].device)
        return torch.cat([torch.stack(s[:3]).double(), s[3].double(), s[4].double(), f8.double()])


def _count(index: torch.Tensor, n: int) -> torch.Tensor:
    """``bincount(index, minlength=n)``; on CUDA without its host sync (it reads ``index.max()``)."""
    if index.device.type == "cpu":
        return torch.bincount(index, minlength=n)
    return torch.zeros(n, dtype=torch.int64, device=index.device).index_add_(
        0, index, torch.ones_like(index))


def _log2_hist(a: torch.Tensor) -> torch.Tensor:
    """Counts per :data:`HIST_EDGES` bin of the non-zero values of ``a`` (float32, >= 0).

    The biased exponent field of a non-negative float32 (its bits shifted right by 23) is the
    bin index: 0 for subnormals, ``k + 127`` for ``[2^k, 2^(k+1))``. Zeros go to one extra bin
    that is dropped.
    """
    n = len(HIST_EDGES) - 1
    flat = a.flatten()
    index = torch.where(flat > 0, flat.view(torch.int32) >> 23, n).long()
    return _count(index, n + 1)[:n]


_BOUNDS_ON: dict[torch.device, torch.Tensor] = {}


def _bounds(device: torch.device) -> torch.Tensor:
    """:data:`_BOUNDS` on ``device``, copied there once (a copy per call would sync on CUDA)."""
    b = _BOUNDS_ON.get(device)
    if b is None:
        b = _BOUNDS_ON[device] = torch.tensor(_BOUNDS, dtype=torch.float32, device=device)
    return b


def _stats(acc: _Acc, v: list[float]) -> RangeStats:
    count = acc.count
    nb = len(_BOUNDS) + 1
    nonfinite, absmax, min_nonzero = v[0], v[1], v[2]
    buckets = v[3:3 + nb]
    hist = v[3 + nb:-2 * len(FP8_FORMATS)]
    f8 = v[-2 * len(FP8_FORMATS):]

    def below(bound: float) -> float:  # non-zero finite values with |x| < bound
        k = _BOUNDS.index(bound)
        return sum(buckets[1:k + 1])

    total = max(count, 1)
    over, under, subn = {}, {}, {}
    for name, lim in _LIMITS.items():
        k = _BOUNDS.index(lim.overflow_from)
        over[name] = sum(buckets[k + 1:]) / total
        under[name] = below(lim.zero_below) / total
        subn[name] = (below(lim.normal_from) - below(lim.zero_below)) / total
    return RangeStats(
        count=count, nonfinite=int(nonfinite), absmax=float(absmax),
        min_nonzero=float(min_nonzero), overflow=over, underflow=under, subnormal=subn,
        hist=tuple(int(round(c)) for c in hist),
        fp8_scaled=None if acc.cast is None or not acc.fp8_count else Fp8Scaled(
            recipe=acc.cast[0], granularity=acc.cast[1].granularity, pow2_scales=acc.cast[2],
            count=acc.fp8_count,
            underflow={n: f8[2 * i] / acc.fp8_count for i, n in enumerate(FP8_FORMATS)},
            subnormal={n: f8[2 * i + 1] / acc.fp8_count for i, n in enumerate(FP8_FORMATS)}),
    )


class RangeCollector:
    """The object :func:`collect_ranges` returns; use it as a context manager."""

    def __init__(self, model: nn.Module, scaler: Any = None, *, fp8_recipe: Any = "tensorwise") -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"collect_ranges needs an nn.Module, got {type(model).__name__}")
        if scaler is not None and not callable(getattr(scaler, "get_scale", None)):
            raise TypeError("scaler must have a get_scale() method (mixprec.GradScaler or "
                            f"torch.amp.GradScaler), got {type(scaler).__name__}")
        self.model = model
        self.scaler = scaler
        self._casts = fp8_casts(fp8_recipe)
        self._accs: dict[tuple[str, str], _Acc] = {}
        self._handles: list[Any] = []
        self._active = False
        self._scale: torch.Tensor | float | None = None
        self._results: dict[str, dict[str, RangeStats]] | None = None

    def __enter__(self) -> "RangeCollector":
        if self._active:
            raise RuntimeError("this collector is already active; create a new one to nest")
        self._active = True
        self._results = None
        if self.scaler is not None:
            scale = self.scaler.get_scale()
            # a copy: a scaler updates its scale tensor in place
            self._scale = (scale.detach().float().clone() if isinstance(scale, torch.Tensor)
                           else float(scale))
        for t in (*self.model.parameters(), *self.model.buffers()):
            _bounds(t.device)  # copy the bucket bounds to each device now, not in a hook
        for name, module in dict(named_modules(self.model)).items():  # the names rules match
            self._handles.append(module.register_forward_hook(ModuleHook(self._make_hook(name))))
            for pname, p in module.named_parameters(recurse=False):
                if p.requires_grad:
                    self._handles.append(p.register_hook(self._make_grad_hook(name, "weight_grad")))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if exc[0] is None:
            self._results = self._compute()
        self._active = False

    def _acc(self, name: str, kind: str) -> _Acc:
        acc = self._accs.get((name, kind))
        if acc is None:
            acc = self._accs[(name, kind)] = _Acc(self._casts.get(kind))
        return acc

    def _make_hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not self._active:
                return
            floats = measured(output)
            if not floats:  # e.g. an argmax head: no accumulator, nothing to report
                return
            acc = self._acc(name, "activation")
            for t in floats:
                acc.update(t, None)
                if t.requires_grad:
                    handle = t.register_hook(self._make_grad_hook(name, "grad"))
                    if t.grad_fn is None:  # a leaf (a returned parameter) outlives the graph
                        self._handles.append(handle)

        return hook

    def _make_grad_hook(self, name: str, kind: str) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if self._active and grad.is_floating_point() and grad.numel() > 0:
                self._acc(name, kind).update(grad, self._scale)

        return hook

    def _compute(self) -> dict[str, dict[str, RangeStats]]:
        weights: dict[tuple[str, str], _Acc] = {}
        for name, module in dict(named_modules(self.model)).items():
            params = [p for p in module.parameters(recurse=False) if p.numel() > 0]
            if params:
                acc = weights[(name, "weight")] = _Acc(self._casts.get("weight"))
                for p in params:
                    acc.update(p, None, fp8=p.dim() >= 2)  # GEMM operands: matrices, not biases
        accs = {**self._accs, **weights}
        keys = list(accs)
        rows: dict[tuple[str, str], list[float]] = {}
        by_device: dict[torch.device, list[tuple[str, str]]] = {}
        for k in keys:
            by_device.setdefault(accs[k].state[0].device, []).append(k)  # type: ignore[index]
        for dev_keys in by_device.values():  # one device-to-host copy per device
            host = torch.stack([accs[k].flat() for k in dev_keys]).cpu().tolist()
            rows.update(zip(dev_keys, host))
        by_module: dict[str, dict[str, RangeStats]] = {}
        order = {name: i for i, name in enumerate(dict(named_modules(self.model)))}
        for key in sorted(keys, key=lambda k: (order.get(k[0], 0), KINDS.index(k[1]))):
            by_module.setdefault(key[0], {})[key[1]] = _stats(accs[key], rows[key])
        return by_module

    def results(self) -> dict[str, dict[str, RangeStats]]:
        """``{module name: {kind: RangeStats}}`` in module order.

        Inside the block this reads the device statistics now (one host sync per device); after
        the block it returns what ``__exit__`` read. Weights are measured at that moment.
        """
        if self._results is not None and not self._active:
            return self._results
        return self._compute()


def collect_ranges(model: nn.Module, scaler: Any = None, *, fp8_recipe: Any = "tensorwise") -> RangeCollector:
    """Context manager gathering per-module ranges and fp16/bf16/fp8 fit (see module docs).

    Args:
        model: every submodule is watched (forward outputs, gradients of those outputs, own
            parameters and their gradients).
        scaler: optional loss scaler (anything with ``get_scale()``, read once on entry).
            Gradients are then judged at that loss scale, i.e. multiplied by it: pass it when the
            backward runs on the *unscaled* loss (as :func:`mixprec.audit` does in float32). If
            you backpropagate ``scaler.scale(loss)``, the gradients already carry the scale:
            leave ``scaler=None``.
        fp8_recipe: a :class:`mixprec.fp8.Float8Recipe` or its name (``"tensorwise"``,
            ``"rowwise"``, ...) for the fp8 "after scaling" view (``RangeStats.fp8_scaled``):
            activations are scaled as the recipe's ``input`` cast, gradients as its
            ``grad_output`` cast, weight matrices as its ``weight`` cast; ``None`` skips the view.

    Host syncs: none while hooks run; one read of all statistics on exit (or per
    :meth:`RangeCollector.results` call), plus ``scaler.get_scale()`` if it syncs.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4))
        >>> with collect_ranges(model) as ranges:
        ...     model(torch.full((2, 4), 1e5)).sum().backward()
        >>> ranges.results()["0"]["activation"].overflow["float16"] > 0
        True
        >>> ranges.results()["0"]["activation"].fp8_scaled.underflow["float8_e4m3fn"]  # scaled: fits
        0.0
    """
    return RangeCollector(model, scaler, fp8_recipe=fp8_recipe)
