"""The demo's report: a terminal table, ``results.json``, PNG figures and ``index.html``.

matplotlib is needed only by :func:`write_report` (``pip install -e '.[report]'`` from a checkout) and is
imported there, with the non-interactive Agg backend.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from mixprec.demo import fp4_figure, fp8_figure, layerwise_figure
from mixprec.demo.alternate import pair_words
from mixprec.demo.environment import native_lowp, steady_slowdown
from mixprec.demo.fp4 import fp4_summary
from mixprec.demo.results import DemoResult, ModeResult, checks, format_fp8, rank, smooth, summarize
from mixprec.demo.speed import KINDS, kind_name, speed_sentence
from mixprec.demo.verdict import verdict

__all__ = ["MEMORY_PARTS", "format_table", "format_checks", "format_verdict", "hardware_note", "time_ratio",
           "write_report"]

#: The memory categories of a mode, in plotting order (keys of ``ModeResult.memory``).
MEMORY_PARTS = ("params", "grads", "master", "optimizer_state", "activations")

_REFERENCE = "torch-amp"


def _mib(n: float) -> float:
    return n / 2**20


def hardware_note(result: DemoResult) -> str | None:
    """A sentence when this CPU emulates float16/bfloat16 matmuls (no native units), else None.

    Native or not is :func:`mixprec.demo.environment.native_lowp` (the CPU flags; where they are
    unknown, a matmul measured steadily more than 1.5x slower than float32). The measured
    slowdown (median of repeated rounds, with its interquartile band) is quoted when it is steady
    (:func:`mixprec.demo.environment.steady_slowdown`: a small spread, or a lower quartile
    itself well above 1); otherwise the note says it was too noisy.
    """
    support = result.environment.get("cpu_lowp", {})
    emulated = [dtype for dtype, native in native_lowp(result.environment).items() if native is False]
    if not emulated:
        return None
    quoted = [f"{dtype} {_band(support[dtype])}" for dtype in emulated if steady_slowdown(support[dtype])]
    timing = (f" (a matmul is {', '.join(quoted)} slower than float32, median and interquartile band of "
              "repeated rounds)" if quoted else " (the matmul slowdown was too noisy to quote on this busy machine)")
    return (
        f"this CPU has no native {'/'.join(emulated)} matmul units{timing}, so low-precision modes run "
        "slower than fp32 here while on a GPU they run faster: compare their losses and memory, not "
        "their speed; their results also depend on this CPU's emulation kernels."
    )


def _band(info: dict[str, float]) -> str:
    """``41.0x (35.2-47.9x)``: a slowdown with its interquartile band, when it was recorded."""
    if "low" in info and "high" in info:
        return f"{info['slowdown']:.1f}x ({info['low']:.1f}-{info['high']:.1f}x)"
    return f"{info['slowdown']:.1f}x"


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


def _speed_caption(result: DemoResult) -> str:
    """The throughput figure's last sentence: the emulation note, or the detected capability
    and where the speed panel puts the crossover."""
    note = hardware_note(result)
    if note is not None:
        return _sentence(note)
    if "cpu_lowp" not in result.environment:
        return "Speed on a GPU depends on its tensor cores: compare with benchmarks/gpu.py."
    native = [dtype for dtype, v in native_lowp(result.environment).items() if v]
    here = (_native_words(result, native) if native else
            "Whether this CPU has native float16/bfloat16 matmul units is unknown (no CPU flags, a noisy timing)")
    if result.speed.get("sizes"):
        return f"{here}; whether they pay depends on the model's size: the speed panel (speed.png) times it."
    return f"{here}; whether they pay depends on the model's size (the speed panel was not run)."


def _native_words(result: DemoResult, native: list[str]) -> str:
    """What the CPU flags say of the native ``native`` dtypes, as far as this run's measured
    speed bears it out: when every other mode took longer per token than the base (fp32), the
    units are said not to pay here, with those times; else the fastest other mode's."""
    base = result.modes[0]
    others = result.modes[1:]
    flags = f"this CPU's flags list native {'/'.join(native)} matmul units"
    if not others:
        return _sentence(flags)
    ratios = sorted(time_ratio(m, base) for m in others)
    seed = f", seed {base.seed}" if len(result.seeds) > 1 else ""
    if ratios[0] > 1.0:
        spread = f"{ratios[0]:.1f}x" if ratios[-1] - ratios[0] < 0.05 else f"{ratios[0]:.1f}-{ratios[-1]:.1f}x"
        return _sentence(f"{flags}, but every other mode took {spread} {base.mode}'s time per token in this run "
                         f"(measured{seed}): at this size they do not pay here")
    fastest = min(others, key=lambda m: time_ratio(m, base))
    return _sentence(f"{flags}, and {fastest.mode} took {time_ratio(fastest, base):.2f}x {base.mode}'s time per "
                     f"token in this run (measured{seed})")


def time_ratio(mode: ModeResult, ref: ModeResult) -> float:
    """Time per token of ``mode`` over that of ``ref``: the project's one ratio convention
    (``x / reference``, lower is better: 0.5 is twice as fast)."""
    return ref.tokens_per_s / mode.tokens_per_s


def _reference(result: DemoResult) -> ModeResult:
    """The mode speeds are compared to: torch-amp when it ran, else the first mode."""
    return next((m for m in result.modes if m.mode == _REFERENCE), result.modes[0])


def format_table(result: DemoResult) -> str:
    """The final table printed in the terminal: one row per mode (with several seeds the losses
    are mean ± standard deviation over the seeds), then one line per fp8 mode
    (:func:`mixprec.demo.results.format_fp8`)."""
    return "\n".join([_table(result), *format_fp8(result)])


def format_verdict(result: DemoResult) -> list[str]:
    """The verdict (:func:`mixprec.demo.verdict.verdict`), after a line saying where a Ctrl-C
    stopped the run when it did."""
    lines = verdict(result)
    return ([f"INTERRUPTED: {result.interrupted}."] if result.interrupted else []) + lines


def _table(result: DemoResult) -> str:
    """The rows of :func:`format_table`, without the fp8 lines."""
    ref = _reference(result)
    stats = {s.mode: s for s in summarize(result)}
    several = len(result.seeds) > 1
    header = ("mode", "final loss", "eval loss", "tokens/s", f"time / {ref.mode}", "memory MiB", "skipped")
    rows = [header]
    for m in result.modes:
        st = stats[m.mode]
        rows.append((
            m.mode,
            f"{st.final_loss:.4f} ± {st.final_spread:.4f}" if several else f"{m.final_loss:.4f}",
            f"{st.eval_loss:.4f} ± {st.eval_spread:.4f}" if several else f"{m.eval_loss:.4f}",
            f"{m.tokens_per_s:,.0f}",
            _time_cell(result, m, ref),
            f"{_mib(m.total_memory):.2f}",
            str(len(m.skipped_steps)) if m.scales else "-",
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    seeds = (f"{len(result.seeds)} seeds: losses mean ± standard deviation over them; tokens/s, time and memory: "
             f"seed {result.seeds[0]}" if several else f"seed {result.seeds[0]}")
    alternated = (f"; {', '.join(p.split(' = ')[0] for p in _ref_pairs(result, ref))}: steps timed in alternation "
                  f"with {ref.mode} (same kernels), median ratio and its noise band" if _ref_pairs(result, ref) else "")
    lines.append(f"({seeds}; time / {ref.mode}: time per token relative to {ref.mode}, lower is faster{alternated})")
    return "\n".join(lines)


def _ref_pairs(result: DemoResult, ref: ModeResult) -> dict[str, dict[str, Any]]:
    """The alternated timings (``DemoResult.pairs``) against the table's reference mode."""
    return {pair: t for pair, t in result.pairs.items() if pair.split(" = ")[1] == ref.mode}


def _time_cell(result: DemoResult, mode: ModeResult, ref: ModeResult) -> str:
    """The table's time ratio: from the alternated timing when ``mode`` was timed against
    ``ref`` that way (``1.01x (0.93-1.10)``: median and noise band), else from the throughputs."""
    timing = result.pairs.get(f"{mode.mode} = {ref.mode}")
    if timing is None:
        return f"{time_ratio(mode, ref):.2f}x"
    return f"{timing['ratio']:.2f}x ({timing['low']:.2f}-{timing['high']:.2f})"


def format_checks(result: DemoResult) -> list[str]:
    """One line per bitwise check (a mode against its reference), e.g.
    ``mixprec-fp16 = torch-amp: identical (losses, scales, skipped steps)``; then one line per
    pair whose steps were timed in alternation (:func:`mixprec.demo.alternate.pair_words`)."""
    lines = [f"{pair}: {verdict}" for pair, verdict in checks(result).items()]
    return lines + [f"{pair.replace(' = ', ' against ')}, steps timed in alternation: "
                    f"{pair_words(timing, pair.split(' = ')[1])}" for pair, timing in result.pairs.items()]


def _timing(result: DemoResult) -> str:
    s = result.settings
    untimed = s.steps - len(s.timed_steps)
    if not untimed:
        return "every step timed"
    return "first step excluded" if untimed == 1 else f"first {untimed} steps excluded"


def _figures(result: DemoResult) -> list[dict[str, Any]]:
    """What each figure shows: file name, title, every series it plots, and its two-sentence
    caption."""
    modes = result.modes
    base = modes[0]
    scaled = [m for m in modes if m.scales]
    ref = _reference(result)
    lowest = min(modes, key=lambda m: m.total_memory)
    smoothed = {m.mode: smooth(m.losses) for m in modes}
    seed = f" (seed {result.seeds[0]})"  # every figure states its seeds
    scale_caption = (
        f"The loss scale of every mode that uses one{seed} (log scale), with its skipped steps marked "
        "by crosses: the scaler skips the update and halves the scale when a gradient overflows, "
        "and doubles it after a run of clean steps. "
        + (f"Skipped steps: {', '.join(f'{m.mode} {len(m.skipped_steps)}' for m in scaled)} "
           f"of {len(scaled[0].scales)}"
           + "".join(f"; {line}" for line in format_checks(result)) + "."
           if scaled else "No mode of this run uses a loss scaler.")
    )
    figures = [
        {
            "name": "loss",
            "file": "loss.png",
            "title": "Training loss",
            "data": {
                "raw": {m.mode: m.losses for m in modes},
                "smoothed": smoothed,
                "minus": base.mode,
                "identical_to": {pair.split(" = ")[0]: pair.split(" = ")[1]
                                 for pair, verdict in checks(result).items() if verdict.startswith("identical")},
                "difference": {
                    m.mode: [a - b for a, b in zip(smoothed[m.mode], smoothed[base.mode])] for m in modes
                },
                "decisions": _decision_markers(modes, smoothed),
            },
            "caption": (
                f"Training loss per step of every mode{seed} on the same batches from the same "
                "initial weights (thin: raw, thick: trailing mean; "
                f"{base.mode} dashed, on top), so the curves differ only by the numerics of each "
                f"precision mode; the lower panel shows each minus {base.mode}. "
                + _markers_caption(modes)
                + rank(summarize(result))
            ),
        },
        {
            "name": "scale",
            "file": "scale.png",
            "title": "Loss scale and skipped steps",
            "data": {m.mode: {"scales": m.scales, "skipped_steps": m.skipped_steps} for m in scaled},
            "caption": scale_caption,
        },
        {
            "name": "memory",
            "file": "memory.png",
            "title": "Memory per mode",
            "data": {m.mode: m.memory for m in modes},
            "caption": (
                f"Bytes held per mode{seed}, stacked: parameters, gradients, float32 master weights, "
                "optimizer state, and peak activations "
                f"({modes[0].activation_method}). "
                f"{lowest.mode} needs the least ({_mib(lowest.total_memory):.2f} MiB); "
                "bf16/fp16 weights halve params and grads, and autocast stores 16-bit activations "
                "but adds 16-bit copies of the weights it casts."
            ),
        },
        {
            "name": "throughput",
            "file": "throughput.png",
            "title": "Throughput",
            "data": {
                "tokens_per_s": {m.mode: m.tokens_per_s for m in modes},
                "ratio_to": ref.mode,
                "ratio": {m.mode: time_ratio(m, ref) for m in modes},
            },
            "caption": (
                f"Training tokens per second of each mode{seed} ({_timing(result)}), with its time "
                f"per token relative to {ref.mode} on each bar (lower is faster). "
                + _speed_caption(result)
            ),
        },
    ]
    if result.speed.get("sizes"):
        figures.append(_speed_figure(result))
    fp8 = fp8_figure.figure_spec(result)
    fp4 = fp4_figure.figure_spec(result)
    layered = layerwise_figure.figure_spec(result)
    return figures + [spec for spec in (fp8, fp4, layered) if spec is not None]


def _decision_markers(modes: list[ModeResult], smoothed: dict[str, list[float]]) -> dict[str, list[dict[str, Any]]]:
    """Per fp8 mode with a controller, its decisions as loss-curve markers: the step (after that
    many optimizer steps), layer, action and the smoothed loss there."""
    return {m.mode: [{"step": d["step"], "layer": d["layer"], "action": d["action"],
                      "loss": smoothed[m.mode][min(d["step"], len(m.losses)) - 1]} for d in m.fp8["decisions"]]
            for m in modes if m.fp8.get("judge") == "controller"}


def _markers_caption(modes: list[ModeResult]) -> str:
    """The loss caption's sentence on the controller's markers; empty when no mode has one."""
    counted = [(m.mode, len(m.fp8["decisions"])) for m in modes if m.fp8.get("judge") == "controller"]
    if not counted:
        return ""
    return ("Triangles on an fp8 mode's curve mark its controller's decisions (up: a layer promoted to a "
            "wider format, down: demoted back): " + ", ".join(f"{name} {n}" for name, n in counted) + ". ")


def _speed_figure(result: DemoResult) -> dict[str, Any]:
    panel = result.speed
    return {
        "name": "speed",
        "file": "speed.png",
        "title": "Speed panel: time per training step relative to fp32",
        "data": {"sizes": [e["size"] for e in panel["sizes"]],
                 "ratio": {k: [e["ratio"][k] for e in panel["sizes"]] for k in KINDS if k != "fp32"},
                 "seconds": {k: [e["seconds"][k] for e in panel["sizes"]] for k in KINDS},
                 "skipped": panel["skipped"], "device": panel.get("device", "cpu")},
        "caption": (
            f"Time per training step of each kind relative to fp32's at each model size (its own models, "
            f"weights from seed 0, one batch; batch "
            f"{panel['batch_size']}, AdamW, the median over {panel['rounds']} rounds of the ratio within a round; "
            f"lower is faster, the line at 1 is fp32; {panel['seconds']:.0f} s in all). "
            + _sentence(speed_sentence(panel, result.device))
        ),
    }


def _plot(fig_spec: dict[str, Any], result: DemoResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    name = fig_spec["name"]
    if name == "fp8":
        fp8_figure.plot(fig_spec, path)
        return
    if name == "layer_scales":
        layerwise_figure.plot(fig_spec, path)
        return
    if name == "fp4":
        fp4_figure.plot(fig_spec, path)
        return
    colors = {m.mode: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(result.modes)}
    if name == "speed":
        _plot_speed(fig_spec, path, plt)
        return
    if name == "loss":
        fig, (ax, diff) = plt.subplots(2, 1, figsize=(9, 6.5), dpi=100, sharex=True,
                                       gridspec_kw={"height_ratios": (2, 1)})
        data = fig_spec["data"]
        base = data["minus"]
        for mode, raw in data["raw"].items():
            steps = range(1, len(raw) + 1)
            # the base mode (fp32) is drawn last, dashed and in black, so that modes lying on it
            # leave it visible
            style = {"color": "black", "linestyle": "--", "zorder": 5} if mode == base else {"color": colors[mode]}
            label = mode
            if data["identical_to"].get(mode):  # dotted over its reference, which stays visible
                style["linestyle"] = ":"
                label = f"{mode} (= {data['identical_to'][mode]})"
            ax.plot(steps, raw, alpha=0.2, linewidth=0.8, **style)
            ax.plot(steps, data["smoothed"][mode], linewidth=1.8 if mode == base else 1.4, label=label, **style)
            diff.plot(steps, data["difference"][mode], linewidth=1.2, **style)
        for mode, marks in data.get("decisions", {}).items():  # the fp8 controller's switches
            for action, marker in (("promote", "^"), ("demote", "v")):
                at = [m for m in marks if m["action"] == action]
                ax.scatter([m["step"] for m in at], [m["loss"] for m in at], marker=marker, s=40,
                           color=colors[mode], edgecolors="black", linewidths=0.5, zorder=6)
        ax.set(ylabel="cross-entropy (nats/byte)")
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
        diff.set(xlabel="step", ylabel=f"minus {base}")
        diff.grid(alpha=0.3)
    else:
        fig, ax = plt.subplots(figsize=(9, 4.5), dpi=100)
    if name == "scale":
        scaled = [m for m in result.modes if m.scales]
        for i, m in enumerate(scaled):
            steps = list(range(1, len(m.scales) + 1))
            ax.step(steps, m.scales, where="post", color=colors[m.mode], label=m.mode,
                    linewidth=1.5, linestyle=("-", "--", ":", "-.")[i % 4])
            ax.scatter([s + 1 for s in m.skipped_steps], [m.scales[s] for s in m.skipped_steps],
                       marker="x", s=60, color=colors[m.mode])
        if scaled:
            ax.set_yscale("log", base=2)
            ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
        else:
            ax.text(0.5, 0.5, "no mode with a loss scaler in this run", ha="center", va="center",
                    transform=ax.transAxes)
        ax.set(xlabel="step", ylabel="loss scale (x: skipped step)")
    elif name == "memory":
        labels = [m.mode for m in result.modes]
        left = [0.0] * len(labels)
        for j, part in enumerate(MEMORY_PARTS):
            widths = [_mib(m.memory.get(part, 0)) for m in result.modes]
            ax.barh(labels, widths, left=left, label=part.replace("_", " "),
                    color=plt.get_cmap("Set2")(j))
            left = [a + b for a, b in zip(left, widths)]
        ax.invert_yaxis()
        ax.set(xlabel="MiB")
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    elif name == "throughput":
        data = fig_spec["data"]
        labels = list(data["tokens_per_s"])
        bars = ax.barh(labels, list(data["tokens_per_s"].values()), color=[colors[m] for m in labels])
        ax.bar_label(bars, labels=[f"{data['ratio'][m]:.2f}x" for m in labels], fontsize=8, padding=3)
        ax.margins(x=0.15)  # room for the labels inside the frame
        ax.invert_yaxis()
        ax.set(xlabel=f"tokens / s (label: time / {data['ratio_to']}, lower is faster)")
    ax.set_title(fig_spec["title"])
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _plot_speed(fig_spec: dict[str, Any], path: Path, plt: Any) -> None:
    """Grouped bars: per size, each kind's time relative to fp32 (log axis), the ratio on each bar."""
    data = fig_spec["data"]
    sizes, kinds = data["sizes"], list(data["ratio"])
    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=100)
    width = 0.8 / len(kinds)
    for j, kind in enumerate(kinds):
        xs = [i + (j - (len(kinds) - 1) / 2) * width for i in range(len(sizes))]
        # from the fp32 line: up is slower, down is faster
        bars = ax.bar(xs, [r - 1 for r in data["ratio"][kind]], width, bottom=1.0, label=kind_name(kind, data["device"]),
                      color=plt.get_cmap("Set2")(j))
        ax.bar_label(bars, labels=[f"{r:.2f}x" for r in data["ratio"][kind]], fontsize=8, padding=2)
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label="fp32")
    ax.set_yscale("log", base=2)
    ax.yaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.set_xticks(range(len(sizes)), [f"{s}\n(fp32 {data['seconds']['fp32'][i] * 1e3:.0f} ms/step)"
                                      for i, s in enumerate(sizes)])
    ax.margins(y=0.15)
    ax.set(xlabel="model size", ylabel="time per step / fp32 (lower is faster)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    ax.set_title(fig_spec["title"])
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _readable(value: Any) -> str:
    """A value for reading: a float to 3 significant digits (``load 6.89``, not ``6.8876953125``)."""
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def _seeds(result: DemoResult) -> str:
    seeds = result.seeds
    return f"seed {seeds[0]}" if len(seeds) == 1 else f"{len(seeds)} seeds ({seeds[0]} to {seeds[-1]})"


def _html(result: DemoResult, figures: list[dict[str, Any]]) -> str:
    s = result.settings
    note = hardware_note(result)
    env = ", ".join(f"{k} {_readable(v)}" for k, v in result.environment.items() if not isinstance(v, dict))
    modes = "".join(
        f"<li><b>{html.escape(m.mode)}</b>: {html.escape(m.summary)}</li>" for m in result.modes
    )
    verdict_items = "".join(f"<li>{html.escape(line)}</li>" for line in verdict(result))
    fp8_items = "".join(f"<li>{html.escape(line)}</li>" for line in format_fp8(result))
    figs = "".join(
        f'<figure><img src="{f["file"]}" alt="{html.escape(f["title"])}">'
        f"<figcaption>{html.escape(f['caption'])}</figcaption></figure>"
        for f in figures
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>mixprec demo report</title>
<style>
body {{ font-family: system-ui, sans-serif; max-width: 60rem; margin: 2rem auto; padding: 0 1rem; }}
pre {{ background: #f4f4f4; padding: 0.8rem; overflow-x: auto; }}
figure {{ margin: 2rem 0; }} img {{ max-width: 100%; }} figcaption {{ color: #333; }}
.note {{ background: #fff4d6; padding: 0.6rem; }}
.verdict {{ background: #e8f4ea; padding: 0.6rem 0.6rem 0.6rem 2rem; }}
</style></head><body>
<h1>mixprec demo report</h1>
{f'<p class="note"><b>Interrupted</b> (Ctrl-C): {html.escape(result.interrupted)}.</p>' if result.interrupted else ""}
<ul class="verdict">{verdict_items}</ul>
<p>A decoder-only transformer ({s.model.n_layers} layers, d={s.model.d_model},
{s.model.n_heads} heads, sequence {s.model.seq_len}, byte-level) trained {s.steps} step{"s" if s.steps > 1 else ""} with
batch {s.batch_size}, learning rate {s.lr}, {_seeds(result)}, on {html.escape(result.device)} in
each precision mode below, from the same initial weights and on the same batches.</p>
{f'<p class="note">Note: {html.escape(note)}</p>' if note else ""}
<ul>{modes}</ul>
<pre>{html.escape(_table(result))}</pre>
{f"<ul>{fp8_items}</ul>" if fp8_items else ""}
{"".join(f"<p><b>Check</b>: {html.escape(line)}</p>" for line in format_checks(result))}
{figs}
<p><small>{html.escape(env)}. Every number is also in <a href="results.json">results.json</a>.</small></p>
</body></html>
"""


def write_report(result: DemoResult, out: str | Path) -> dict[str, Path]:
    """Write ``results.json``, ``loss.png``, ``scale.png``, ``memory.png``, ``throughput.png``,
    ``speed.png`` (when the speed panel ran), ``fp8.png`` (when an fp8 mode ran), ``fp4.png``
    (when an fp4 mode ran),
    ``layer_scales.png`` (when ``mixprec-fp16-layerwise`` ran) and
    ``index.html`` into ``out`` (created if needed); return their paths by name.

    Raises:
        ImportError: when matplotlib is not installed (``results.json`` is written first).
        OSError: when ``out`` cannot be written.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    figures = _figures(result)
    paths = {"results": out / "results.json"}
    data = result.to_json()
    data["figures"] = figures
    data["verdict"] = format_verdict(result)
    data["fp4"] = fp4_summary(result)
    paths["results"].write_text(json.dumps(data, indent=1))
    for spec in figures:
        paths[spec["name"]] = out / spec["file"]
        _plot(spec, result, paths[spec["name"]])
    paths["index"] = out / "index.html"
    paths["index"].write_text(_html(result, figures), encoding="utf-8")
    return paths
