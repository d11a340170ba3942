"""Rendering of an :class:`~mixprec.diagnostics.findings.AuditReport`: text table and HTML page.

matplotlib and rich are optional (``pip install matplotlib rich``) and imported inside the
functions that use them.
"""

from __future__ import annotations

import base64
import html
import io
import math
import os
from typing import TYPE_CHECKING, Any

from mixprec.diagnostics.ranges import FORMATS, format_limits

if TYPE_CHECKING:  # findings.py imports this module; the report is only read here
    from mixprec.diagnostics.findings import AuditReport

__all__ = ["print_summary", "summary_text", "use_it", "write_html"]

_MAX_MODULES = 80  # figures show at most this many modules (model order)


def _scale_str(scale: float) -> str:
    k = math.log2(scale) if scale > 0 else float("nan")
    return f"2**{int(k)}" if k == int(k) else f"{scale:g}"


def use_it(report: "AuditReport", policy_file: str | None = None) -> str:
    """How to apply the recommendation, for the chosen dtype (a loss scaler only for float16);
    ``policy_file``: the ``report.json`` (or a :meth:`Policy.save` file) holding the policy, for
    a reader who has the file and not the report object (``mixprec audit``).

    Example:
        >>> print(use_it(report))
        with mixprec.autocast('cpu', policy=report.policy): ...; bfloat16 needs no loss scaling
        >>> print(use_it(report, "mixprec-audit/report.json"))
        in your training script: with mixprec.autocast('cpu', policy=mixprec.Policy.load('mixprec-audit/report.json')): ...; bfloat16 needs no loss scaling
    """
    if policy_file is None:
        region = f"with mixprec.autocast({report.device_type!r}, policy=report.policy): ..."
    else:
        region = (f"in your training script: with mixprec.autocast({report.device_type!r}, "
                  f"policy=mixprec.Policy.load({policy_file!r})): ...")
    if report.dtype == "float16":
        return (f"{region}; scaler = mixprec.GradScaler({report.device_type!r}, "
                f"init_scale={_scale_str(report.init_scale)})")
    return f"{region}; {report.dtype} needs no loss scaling"


#: the short summary lists a group of modules by name up to this many, else counts them
_LISTED = 4

#: what the summary says of speed: the audit times nothing
_NUMERICS_ONLY = ("speed: not measured; the audit judges numerics only (ranges, inf/NaN, the loss), so "
                 "float16 is never chosen for speed: time a few training steps before choosing (on a CPU "
                 "without native float16 matmul, float16 autocast can be slower than float32)")


def _names(names: list[str] | tuple[str, ...], full: bool) -> str:
    """``'a', 'b'``; past :data:`_LISTED` names (short form) the first ones and a count."""
    shown = [repr(n) for n in names]
    if full or len(shown) <= _LISTED:
        return ", ".join(shown)
    return ", ".join(shown[:_LISTED - 1]) + f" and {len(shown) - _LISTED + 1} more"


def _fp8_lines(report: "AuditReport", full: bool) -> list[str]:
    f8 = report.fp8
    warn = "" if f8.verified else " (WARNING: did not verify: inf/NaN or its loss)"
    if full:
        line = f"fp8 ({f8.recipe}): " + (", ".join(repr(m) + (f" {f8.recipes[m]}" if f8.recipe == "auto" else "")
                                                   for m in f8.layers) or "(no layer)")
        return [line + warn] + [f"  stays {m!r}: {why}" for m, why in f8.stay.items()]
    by_format, by_why = _fp8_groups(report)
    groups = [f"{fmt} for {'all ' if len(by_format) == 1 else ''}{len(ms)} layer(s)"
              if len(ms) > _LISTED else f"{fmt} {_names(ms, full)}" for fmt, ms in by_format.items()]
    lines = [f"fp8 ({f8.recipe}): " + ("; ".join(groups) or "(no layer)") + warn]
    return lines + [f"  {'stays' if len(ms) == 1 else 'stay'} {_names(ms, full)}: {why}" for why, ms in by_why.items()]


def _fp8_groups(report: "AuditReport") -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """The fp8 layers by format and the layers that stay by reason, each in model order (empty
    without fp8): what the short summary states once per group."""
    by_format: dict[str, list[str]] = {}
    by_why: dict[str, list[str]] = {}
    if report.fp8 is not None:
        for m in report.fp8.layers:
            by_format.setdefault(report.fp8.recipes.get(m, report.fp8.recipe), []).append(m)
        for m, why in report.fp8.stay.items():
            by_why.setdefault(why, []).append(m)
    return by_format, by_why


def _header(report: "AuditReport", policy_file: str | None = None, full: bool = False) -> list[str]:
    kept = report.keep[report.dtype]
    scale = f", init_scale={_scale_str(report.init_scale)}" if report.dtype == "float16" else ""
    policy = report.full_policy if full and report.full_policy is not None else report.policy
    lines = [
        f"mixprec audit ({report.device_type}): compute={report.dtype}{scale}",
        f"policy: {policy}",
        "keep in float32: " + (_names(kept, full) if kept else "(none)"),
        f"reason: {report.reason}",
    ]
    if report.fp8 is not None:
        lines += _fp8_lines(report, full)
    lines.append(_NUMERICS_ONLY)
    if not full and (str(policy) != str(report.full_policy or policy) or _abbreviated(report)):
        lines.append("(shortest form, the same choice on this model; every module by name: "
                     "mixprec audit --full, report.summary(full=True))")
    return lines + [f"use it: {use_it(report, policy_file)}"]


def _abbreviated(report: "AuditReport") -> bool:
    """Whether the short summary counts some modules instead of naming them."""
    by_format, by_why = _fp8_groups(report)
    return any(len(g) > _LISTED for g in [report.keep[report.dtype], *by_format.values(), *by_why.values()])


def _fp8_rows(report: "AuditReport") -> list[tuple[str, ...]]:
    f8 = report.fp8
    if f8 is None:
        return []

    def cell(layer: str, op: str, key: str) -> str:
        v = f8.stats.get(layer, {}).get(op, {}).get(key)
        return "" if v is None else f"{v:.2%}" if key == "underflow" else f"{v:.4g}"

    rows = []
    for m in [*f8.layers, *f8.stay]:
        sqnr = f8.stats.get(m, {}).get("output_sqnr_db")
        rows.append((m, f"fp8 {f8.recipes.get(m, '')}".rstrip() if m in f8.layers else f"stays: {f8.stay[m]}",
                     *(cell(m, op, "underflow") for op in ("input", "weight", "grad_output")),
                     "" if sqnr is None or math.isinf(sqnr) else f"{sqnr:.1f}"))
    return rows


def _dtype_rows(report: "AuditReport") -> list[tuple[str, str, str, str]]:
    rows = []
    for d in report.dtypes:
        ev = report.default_events[d]
        rows.append((d, "yes" if report.verified[d] else "NO", str(len(report.keep[d])),
                     "none" if ev is None else str(ev)))
    return rows


def _risk_rows(report: "AuditReport", top: int) -> list[tuple[str, str, str, str, str]]:
    return [(r.dtype, r.module or "<model>", r.tensor, r.issue, f"{r.fraction:.3%}")
            for r in report.risks[:top]]


def _table(headers: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    return [line, "-" * len(line)] + ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]


def summary_text(report: "AuditReport", top: int = 12, policy_file: str | None = None,
                 full: bool = False) -> str:
    """The summary as plain text (``policy_file``: see :func:`use_it`; ``full``: the policy by
    exact module names and every module named, not the shortest form)."""
    lines = _header(report, policy_file, full) + [""]
    lines += _table(("dtype", "verified", "kept", "first inf/NaN under the default policy"),
                    _dtype_rows(report))
    lines += ["", f"top risks ({min(top, len(report.risks))} of {len(report.risks)}):"]
    lines += _table(("dtype", "module", "tensor", "issue", "fraction"), _risk_rows(report, top))
    return "\n".join(lines)


def print_summary(report: "AuditReport", top: int = 12, policy_file: str | None = None,
                  full: bool = False) -> None:
    """Print the summary: with rich tables when rich is installed, else the plain text. The
    header lines (the policy, the "use it" line) are never wrapped: they stay pasteable."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(summary_text(report, top, policy_file, full))
        return
    console = Console()
    for line in _header(report, policy_file, full):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    t = Table("dtype", "verified", "kept", "first inf/NaN under the default policy")
    for row in _dtype_rows(report):
        t.add_row(*row)
    console.print(t)
    t = Table("dtype", "module", "tensor", "issue", "fraction",
              title=f"top risks ({min(top, len(report.risks))} of {len(report.risks)})")
    for row in _risk_rows(report, top):
        t.add_row(*row)
    console.print(t)


# ---------------------------------------------------------------------------------- HTML
_COLORS = {"float16": "tab:red", "bfloat16": "tab:blue", "float8_e4m3fn": "tab:green",
           "float8_e5m2": "tab:purple"}


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _range_figure(report: "AuditReport") -> str:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    ref = report.ranges["float32"]
    grads = report.ranges.get("float32@scale", ref)
    panels = [("activation", ref, "activations (float32 run)"),
              ("grad", grads, f"output gradients (x {_scale_str(report.grad_scale)})"
               if grads is not ref else "output gradients")]
    modules = [m for m in report.modules if m in ref][:_MAX_MODULES]
    height = 1.2 + 0.22 * max(len(modules), 1)
    fig, axes = plt.subplots(1, 2, figsize=(13, height), sharey=True)
    xmin, xmax = -26.0, 17.0  # float16's range, widened to the data (bfloat16's is clipped)
    for ax, (kind, stats, title) in zip(axes, panels):
        for i, m in enumerate(modules):
            s = stats.get(m, {}).get(kind)
            if s is None or s.absmax <= 0 or math.isinf(s.min_nonzero):
                continue
            lo, hi = math.log2(s.min_nonzero), math.log2(s.absmax)
            xmin, xmax = min(xmin, lo), max(xmax, hi)
            ax.plot([lo, hi], [i, i], lw=5, color="0.3", solid_capstyle="butt")
        for name in FORMATS:
            lim = format_limits(FORMATS[name])
            c = _COLORS[name]
            ax.axvline(math.log2(lim.max), color=c, lw=1.2, label=f"{name} max / min normal")
            ax.axvline(math.log2(lim.tiny), color=c, lw=1.2)
            ax.axvline(math.log2(lim.smallest_subnormal), color=c, lw=1, ls=":",
                       label=f"{name} min subnormal")
        ax.set_title(title)
        ax.set_xlabel("log2 |x|")
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_xlim(xmin - 4, xmax + 4)  # shared y only: set both
    axes[1].set_xlim(xmin - 4, xmax + 4)
    axes[0].set_yticks(range(len(modules)))
    axes[0].set_yticklabels([m or "<model>" for m in modules], fontsize=7)
    axes[0].invert_yaxis()
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.06))
    url = _png(fig)
    plt.close(fig)
    return url


def underflow_shares(report: "AuditReport") -> dict[str, dict[str, list[float]]]:
    """``{kind: {dtype: [share per module]}}`` of values below each dtype's normal range (flushed or
    subnormal), for the figure's modules (``report.modules`` with float32 statistics, the first
    ``_MAX_MODULES``), as the audit judges them: float16's gradients at the loss scale
    (``grad_scale``), every other dtype's unscaled (bfloat16 needs no loss scaling)."""
    ref = report.ranges["float32"]
    grads = report.ranges.get("float32@scale", ref)
    modules = [m for m in report.modules if m in ref][:_MAX_MODULES]
    out: dict[str, dict[str, list[float]]] = {}
    for kind in ("activation", "grad"):
        for d in report.dtypes:
            stats = grads if kind == "grad" and d == "float16" else ref
            found = [stats.get(m, {}).get(kind) for m in modules]
            out.setdefault(kind, {})[d] = [0.0 if s is None else s.underflow[d] + s.subnormal[d] for s in found]
    return out


def _underflow_figure(report: "AuditReport") -> str:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    ref = report.ranges["float32"]
    modules = [m for m in report.modules if m in ref][:_MAX_MODULES]
    height = 1.2 + 0.22 * max(len(modules), 1) * max(len(report.dtypes), 1) / 2
    fig, axes = plt.subplots(1, 2, figsize=(13, height), sharey=True)
    width = 0.8 / max(len(report.dtypes), 1)
    top = 0.01
    for ax, (kind, by_dtype) in zip(axes, underflow_shares(report).items()):
        for j, (d, vals) in enumerate(by_dtype.items()):
            top = max(top, *vals)
            ax.barh([i + j * width for i in range(len(modules))], vals, height=width,
                    color=_COLORS[d], label=f"{d}: flush to zero or subnormal")
        ax.set_title(f"{kind}s: share of values below the normal range"
                     + (" (float16's at the loss scale)" if kind == "grad" and "float16" in by_dtype else ""))
        ax.set_xlabel("fraction of values")
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(range(len(modules)))
    axes[0].set_yticklabels([m or "<model>" for m in modules], fontsize=7)
    axes[0].set_xlim(0, min(1.0, 1.1 * top))  # the x axis is not shared: set both
    axes[1].set_xlim(0, min(1.0, 1.1 * top))
    axes[0].invert_yaxis()
    axes[1].legend(fontsize=7)
    url = _png(fig)
    plt.close(fig)
    return url


def _html_table(headers: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>"
                   for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _fp8_section(report: "AuditReport") -> str:
    if report.fp8 is None:
        return ("<p>The figures judge raw values against the fp8 range: right for unscaled fp8 only. "
                "Scaled fp8 (current scaling) is judged by <code>audit(..., fp8='tensorwise')</code> "
                "and <code>RangeStats.fp8_scaled</code>.</p>")
    return (f"<h2>fp8 layers ({html.escape(report.fp8.recipe)}; underflow after scaling, "
            "trial pass with every candidate in fp8)</h2>"
            + _html_table(("layer", "decision", "input underflow", "weight underflow",
                           "grad_output underflow", "output SQNR dB"), _fp8_rows(report)))


def write_html(report: "AuditReport", path: str | os.PathLike[str]) -> None:
    """Write the self-contained report page to ``path``."""
    try:
        figures = (
            "<h2>Ranges against each format</h2><p>Bars span the smallest non-zero to the largest "
            "magnitude per module; vertical lines mark each format's max, smallest normal and "
            f"smallest subnormal.</p><img src='{_range_figure(report)}'>"
            "<h2>Underflow per module</h2>"
            f"<img src='{_underflow_figure(report)}'>"
        )
    except ImportError:
        figures = "<p>Figures need matplotlib: <code>pip install matplotlib rich</code>.</p>"
    ref = report.ranges["float32"]
    grads = report.ranges.get("float32@scale", ref)
    rows = []
    for m, typ in report.modules.items():
        a = ref.get(m, {}).get("activation")
        g = grads.get(m, {}).get("grad")
        rows.append((m or "<model>", typ,
                     "" if a is None else f"{a.absmax:.3g}",
                     "" if a is None else f"{a.min_nonzero:.3g}",
                     "" if g is None else f"{g.absmax:.3g}",
                     "" if g is None else f"{g.min_nonzero:.3g}"))
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>mixprec audit</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1300px}}
table{{border-collapse:collapse;font-size:13px;margin:1em 0}}
td,th{{border:1px solid #ccc;padding:2px 8px;text-align:left}}
pre{{background:#f6f6f6;padding:1em}}</style></head><body>
<h1>mixprec audit</h1>
<pre>{html.escape(chr(10).join(_header(report, full=True)))}</pre>
<p>Use it: <code>{html.escape(use_it(report))}</code> (<code>report.policy</code> is
<code>mixprec.Policy.load("report.json")</code> next to this page).</p>
<h2>Dtypes audited</h2>
{_html_table(("dtype", "verified", "kept", "first inf/NaN under the default policy"),
             _dtype_rows(report))}
{figures}
{_fp8_section(report)}
<h2>Risks ({len(report.risks)}, most severe first)</h2>
{_html_table(("dtype", "module", "tensor", "issue", "fraction"), _risk_rows(report, 200))}
<h2>Modules (float32 run; gradients at x {_scale_str(report.grad_scale)} when float16 was audited)</h2>
{_html_table(("module", "type", "activation absmax", "activation min non-zero",
              "grad absmax", "grad min non-zero"), rows)}
</body></html>
"""
    with open(path, "w", encoding="utf-8") as f:
        f.write(page)
