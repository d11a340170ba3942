"""What :func:`mixprec.audit` returns: :class:`AuditReport` and its :class:`Risk` entries.

Plain values: the audit (``audit.py``) builds them, the renderers (``report.py``) read them, and
neither of those imports the other.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mixprec.diagnostics import report as _render
from mixprec.diagnostics.ranges import RangeStats
from mixprec.diagnostics.event import NonFiniteEvent

if TYPE_CHECKING:
    from mixprec.policy import Policy

__all__ = ["AuditReport", "Fp8Advice", "Risk"]

_SEVERITY = {"nonfinite": 3, "overflow": 2, "underflow": 1, "subnormal": 0}


@dataclass(frozen=True)
class Risk:
    """One problem a dtype would cause in one module.

    Attributes:
        dtype: ``"float16"`` or ``"bfloat16"``.
        module: qualified module name.
        tensor: ``"activation"``, ``"grad"``, ``"weight"`` or ``"weight_grad"``.
        issue: ``"nonfinite"`` (inf/NaN seen in the default-policy run), ``"overflow"``,
            ``"underflow"`` (flush to zero) or ``"subnormal"`` (measured in float32, gradients
            at the float16 loss scale).
        fraction: share of the tensor's values affected.
    """

    dtype: str
    module: str
    tensor: str
    issue: str
    fraction: float

    @property
    def rank_key(self) -> tuple[int, float]:
        """Sort key, most severe first when sorted in descending order."""
        return (_SEVERITY[self.issue], self.fraction)


@dataclass(frozen=True)
class Fp8Advice:
    """Which ``nn.Linear`` layers :func:`audit` sends to fp8 (``audit(..., fp8=recipe)``).

    Attributes:
        recipe: the :class:`mixprec.fp8.Float8Recipe` name, or ``"auto"`` (a format per layer).
        layers: the layers that go to fp8 (``report.policy``'s ``Policy.fp8(names=...)``).
        stay: ``{layer: why}`` for every other ``nn.Linear``: not eligible (dims not multiples of
            16), first or last Linear (``first_last="keep"``), kept in float32 by the policy, a
            statistic of the trial pass past its threshold (what :class:`mixprec.fp8.Guard`
            would decide), or an inf/NaN in the verification pass.
        stats: per layer of the trial pass (every candidate in fp8), each operand's ``amax``,
            ``underflow`` (after scaling) and ``nonfinite``, and ``output_sqnr_db`` against the
            high-precision GEMM (``None`` when not sampled or not finite).
        verified: whether a pass under the final policy had no inf/NaN.
        recipes: ``{layer: recipe name}`` of the fp8 layers (with ``fp8="auto"``, each its own).
        rejected: with ``fp8="auto"``, for an fp8 layer, ``{format: why}`` of the cheaper formats
            it did not pass (``stats`` are of the pass in its chosen format).
    """

    recipe: str
    layers: tuple[str, ...]
    stay: dict[str, str]
    stats: dict[str, dict[str, Any]]
    verified: bool
    recipes: dict[str, str] = field(default_factory=dict)
    rejected: dict[str, dict[str, str]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able copy (non-finite numbers as ``None``)."""
        def clean(v: Any) -> Any:
            if isinstance(v, dict):
                return {k: clean(x) for k, x in v.items()}
            return None if isinstance(v, float) and not math.isfinite(v) else v

        return {"recipe": self.recipe, "layers": list(self.layers), "stay": dict(self.stay),
                "stats": clean(self.stats), "verified": self.verified,
                "recipes": dict(self.recipes), "rejected": dict(self.rejected)}


@dataclass(frozen=True)
class AuditReport:
    """What :func:`audit` found and recommends. ``policy`` and ``init_scale`` are the answer.

    Attributes:
        device_type: the device the audit ran on.
        dtypes: the dtype names that were audited.
        dtype: the chosen dtype name.
        policy: the recommended :class:`mixprec.Policy` (``compute`` = chosen dtype, a float32
            module rule for ``keep[dtype]``, the fp8 layers), in its shortest form that decides
            as ``full_policy`` does on the audited model (a rule over module types or over the
            last parts of their names, fp8's own layer selection: ``diagnostics/_shortest.py``).
        full_policy: the same decisions by exact module names (``None``: ``policy``).
        init_scale: recommended initial loss scale (1.0 for bfloat16).
        reason: one sentence on why ``dtype`` was chosen.
        keep: per audited dtype, the modules its policy keeps in float32.
        verified: per audited dtype, whether a pass under its policy had no inf/NaN and a finite
            loss within ``loss_rtol`` of float32's.
        default_events: per audited dtype, the first inf/NaN under the default policy, or None.
        grad_scale: the loss scale float16 gradients were judged at.
        risks: all risks found, most severe first.
        modules: ``{name: type name}`` of every module, in model order.
        ranges: ``{"float32": ..., "float32@scale": ..., "<dtype>": ...}`` per-module statistics
            (``{module: {kind: RangeStats}}``) of each pass; ``float32@scale`` has gradients
            multiplied by ``grad_scale``.
        fp8: with ``audit(..., fp8=recipe)``, the :class:`Fp8Advice` (its layers are in
            ``policy``); ``None`` otherwise.
        losses: the loss of each step of the float32 pass (``"float32"``), of each dtype's last
            verification pass and, with ``fp8``, of the fp8 verification pass (``"fp8"``).
    """

    device_type: str
    dtypes: tuple[str, ...]
    dtype: str
    policy: "Policy"
    init_scale: float
    reason: str
    keep: dict[str, tuple[str, ...]]
    verified: dict[str, bool]
    default_events: dict[str, NonFiniteEvent | None]
    grad_scale: float
    risks: tuple[Risk, ...]
    modules: dict[str, str]
    ranges: dict[str, dict[str, dict[str, RangeStats]]] = field(repr=False)
    fp8: Fp8Advice | None = None
    losses: dict[str, tuple[float, ...]] = field(default_factory=dict)
    full_policy: "Policy | None" = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of everything in the report.

        ``policy`` is the complete policy as :meth:`mixprec.Policy.to_dict` writes it, so
        ``mixprec.Policy.load("<out>/report.json")`` gives it back; ``policy_text`` is its
        string form; ``policy_full`` and ``policy_full_text`` the same for ``full_policy``.
        """
        return {
            "device_type": self.device_type,
            "dtypes": list(self.dtypes),
            "dtype": self.dtype,
            "policy": self.policy.to_dict(),
            "policy_text": str(self.policy),
            "policy_full": (self.full_policy or self.policy).to_dict(),
            "policy_full_text": str(self.full_policy or self.policy),
            "keep_float32": list(self.keep[self.dtype]),
            "init_scale": self.init_scale,
            "reason": self.reason,
            "keep": {d: list(v) for d, v in self.keep.items()},
            "verified": dict(self.verified),
            "default_events": {d: None if e is None else e.to_dict()
                               for d, e in self.default_events.items()},
            "grad_scale": self.grad_scale,
            "risks": [vars(r).copy() for r in self.risks],
            "modules": dict(self.modules),
            "range_views": {  # which view each fraction of "ranges" takes
                "overflow, underflow, subnormal": "unscaled: the values as they are (float16, "
                                                  "bfloat16; fp8 only without a scale)",
                "fp8_scaled": "after the scale of the fp8 recipe's cast, finfo.max / amax "
                              "(each entry's 'view' says which)"},
            "ranges": {run: {m: {k: s.to_dict() for k, s in kinds.items()}
                             for m, kinds in mods.items()}
                       for run, mods in self.ranges.items()},
            "fp8": None if self.fp8 is None else self.fp8.to_dict(),
            "losses": {run: [v if math.isfinite(v) else None for v in values]  # JSON: no inf/NaN
                       for run, values in self.losses.items()},
        }

    def summary(self, *, top: int = 12, policy_file: str | None = None, full: bool = False) -> None:
        """Print the recommendation and the ``top`` risks as a table (with ``rich`` when it is
        installed, as plain text otherwise); returns nothing: :meth:`summary_text` is the text.
        ``policy_file``: where the policy was saved (``report.json``); the "use it" line then
        loads it from there (what ``mixprec audit`` prints). The policy is in its shortest form
        and groups of more than 4 modules are counted; ``full=True``: ``full_policy``, by exact
        names, and every module named (``mixprec audit --full``)."""
        _render.print_summary(self, top=top, policy_file=policy_file, full=full)

    def summary_text(self, *, top: int = 12, policy_file: str | None = None, full: bool = False) -> str:
        """What :meth:`summary` prints, as plain text (no ``rich``); prints nothing.

        Example:
            >>> print(report.summary_text(top=3))  # doctest: +SKIP
        """
        return _render.summary_text(self, top=top, policy_file=policy_file, full=full)

    def to_html(self, path: str | os.PathLike[str]) -> None:
        """Write a self-contained HTML page (figures embedded as PNG data URIs) to ``path``.

        Needs matplotlib for the figures (``pip install matplotlib rich``); without it the
        page has the tables only and says so.
        """
        _render.write_html(self, path)

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Write ``index.html`` and ``report.json`` into ``directory`` (created if missing)."""
        os.makedirs(directory, exist_ok=True)
        self.to_html(os.path.join(directory, "index.html"))
        with open(os.path.join(directory, "report.json"), "w") as f:
            json.dump(self.to_dict(), f, indent=1, allow_nan=False)
