"""The fp8 step of :func:`mixprec.audit`: which ``nn.Linear`` (and transformers ``Conv1D``) layers go to fp8.

1. Candidates: the layers ``Policy.fp8`` would select by default (:func:`mixprec.fp8.select_layers`:
   eligible, first and last kept), minus those the compute-dtype policy keeps in float32.
2. Trial: one pass (``steps`` forward/backward passes) with every candidate in fp8 under the
   compute policy, with fresh :class:`mixprec.fp8.LayerState` statistics and a sampled output
   SQNR; the rule of :class:`mixprec.fp8.Guard` with the audit's thresholds decides on them, as
   the guard would during training (without its all-reduce: the audit may run on one rank of a
   job): a layer past a threshold stays in the compute dtype.
3. Verification: a traced pass under the final policy; an inf/NaN that an fp8 layer took as an
   operand (``event.fp8_layer``) moves that layer out, at most ``max_fixes`` times.

With ``recipe="auto"`` step 2 runs once per format of :data:`AUTO_FORMATS` (``"auto-fp4"``:
:data:`AUTO_FP4_FORMATS`, the fp4 ones first, judged by the underflow limit of fp4 rungs,
``ControllerSettings.fp4_max_underflow``, or ``underflow_threshold`` if higher, and the SQNR floor
:data:`FP4_MIN_SQNR_DB`, or ``min_sqnr_db`` if lower), cheapest first: each
pass tries, in that format, the layers that no cheaper format passed (and that are eligible for
it), with the layers decided so far in their formats; a layer takes the first format it passes.
The cost order: every format stores 1 byte per element, so they differ in their scales and in
what the hardware does with them: ``tensorwise`` (one float32 scale per tensor) < ``rowwise``
(one per row: 4/K bytes per element) < ``mxfp8`` (one E8M0 byte per 32 elements, power-of-two,
native on block-scaled GEMMs) < ``blockwise`` (float32 scales per 1x128 tile and 128x128 block,
not power-of-two, features multiples of 128).

The layers' own statistics are put back afterwards (the audit leaves the model as found).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

from torch import nn

from mixprec import fp8
from mixprec.diagnostics._passes import Passes
from mixprec.diagnostics._shortest import bare_modules, exact_names, in_kept
from mixprec.diagnostics.findings import Fp8Advice
from mixprec.fp8.internals import OPERANDS, is_linear_like, swap_layer_state

__all__ = ["recommend_fp8"]

_FIRST_LAST = "first or last Linear of the model (Policy.fp8 first_last='keep')"


#: ``fp8="auto"``: the formats tried per layer, cheapest first (see the module docs).
AUTO_FORMATS = ("tensorwise", "rowwise", "mxfp8", "blockwise")
#: ``fp8="auto-fp4"``: the fp4 formats tried first (half a byte per element; MXFP4's E8M0 byte per
#: 32 elements < NVFP4's e4m3 byte per 16 and its tensor scale), then :data:`AUTO_FORMATS`.
AUTO_FP4_FORMATS = ("mxfp4", "nvfp4", *AUTO_FORMATS)
#: the output SQNR floor of an fp4 trial (at most ``fp8_min_sqnr_db``): an e2m1 cast in blocks keeps
#: about 15-19 dB of an ordinary layer's output (fp8 e4m3 about 30), so fp8's floor of 20 dB would
#: refuse fp4 everywhere; 13 dB refuses a layer whose output loses several times that noise.
FP4_MIN_SQNR_DB = 13.0


def _with_fp8(policy: Any, formats: dict[str, Any]) -> Any:
    """``policy`` plus an fp8 rule selecting exactly the layers of ``formats`` (by escaped full
    names), each in its recipe: the most common one is the rule's, the others go in ``recipes``."""
    if not formats:
        return policy
    values = list(formats.values())
    default = max(dict.fromkeys(values), key=values.count)  # ties: the first (cheapest) one
    return policy.fp8(default, names=exact_names(formats), first_last="fp8",
                      recipes={n: r for n, r in formats.items() if r != default})


def _past_threshold(read: dict[str, Any], max_underflow: float, min_sqnr_db: float | None) -> str | None:
    """Why a layer leaves fp8, by :class:`mixprec.fp8.Guard`'s rule (``max_nonfinite=0``), or None."""
    for op in OPERANDS:
        if read[op]["nonfinite"] > 0:
            return f"{op} nonfinite = {read[op]['nonfinite']:.4g} > 0"
        if read[op]["underflow"] > max_underflow:
            return f"{op} underflow = {read[op]['underflow']:.4g} > {max_underflow:g}"
    sqnr = read["output_sqnr_db"]
    if min_sqnr_db is not None and not math.isinf(sqnr) and not sqnr >= min_sqnr_db:
        return f"output sqnr_db = {sqnr:.4g} < {min_sqnr_db:g}"
    return None


def _candidates(model: nn.Module, policy: Any, recipe: Any) -> tuple[list[str], dict[str, str]]:
    modules = bare_modules(model)
    stay: dict[str, str] = {}
    linears = [n for n, m in modules.items() if is_linear_like(m)]
    for name in linears:
        ok, reason = fp8.eligible(modules[name], name, recipe)
        if not ok:
            stay[name] = reason.split(": ", 1)[-1]
    with warnings.catch_warnings():  # the ineligible layers are reported in ``stay``
        warnings.simplefilter("ignore")
        chosen = fp8.select_layers(model, recipe=recipe)
    for name in linears:
        if name not in stay and name not in chosen:
            stay[name] = _FIRST_LAST
        elif name in chosen and in_kept(policy, modules, name):
            stay[name] = "kept in float32 by the policy"
    return [n for n in chosen if n not in stay], stay


def _named(recipe: Any) -> Any:
    """A named recipe by its name (a policy can save it as JSON), a custom one as itself."""
    try:
        return recipe.name if fp8.Float8Recipe.from_name(recipe.name) == recipe else recipe
    except ValueError:
        return recipe


def recommend_fp8(passes: Passes, policy: Any, recipe: Any, scale: float, *,
                  underflow_threshold: float, min_sqnr_db: float | None,
                  max_fixes: int) -> tuple[Any, Fp8Advice]:
    """``(policy with the fp8 layers, Fp8Advice)`` for the compute ``policy`` (see module docs);
    ``recipe``: a recipe, its name, or ``"auto"`` (a format per layer); each pass is announced
    through ``passes``."""
    auto = recipe in ("auto", "auto-fp4")
    formats_tried = AUTO_FP4_FORMATS if recipe == "auto-fp4" else AUTO_FORMATS if auto else (recipe,)
    tried = [fp8.as_recipe(r) for r in formats_tried]
    model = passes.model
    modules = bare_modules(model)
    candidates, stay = _candidates(model, policy, None if auto else tried[0])
    states = {n: fp8.LayerState(modules[n].weight.device) for n in candidates}
    old = {n: swap_layer_state(modules[n], st) for n, st in states.items()}
    formats: dict[str, Any] = {}  # layer -> its (named) recipe
    rejected: dict[str, dict[str, str]] = {n: {} for n in candidates}
    stats: dict[str, dict[str, Any]] = {}
    try:
        for r in tried:
            trial = []
            for n in candidates:
                if n in formats:
                    continue
                ok, reason = fp8.eligible(modules[n], n, r)
                if ok:
                    trial.append(n)
                else:
                    rejected[n][r.name] = "not eligible: " + reason.split(": ", 1)[-1]
            if not trial:
                continue
            for n, st in states.items():
                st.reset()
                st.sample_sqnr = min_sqnr_db is not None and n in trial
            passes.run(_with_fp8(policy, {**formats, **{n: _named(r) for n in trial}}), scale,
                       what=f"fp8 {r.name}: measuring {len(trial)} Linear layer(s)")
            for n in trial:
                read = states[n].read()
                stats[n] = {**{op: {k: read[op][k] for k in ("amax", "underflow", "nonfinite")}
                               for op in OPERANDS},
                            "output_sqnr_db": read["output_sqnr_db"]}
                # an e2m1 block flushes 7-11% of Gaussian data: fp4 has the controller's limit
                limit, floor = underflow_threshold, min_sqnr_db
                if r.fp4:
                    limit = max(limit, fp8.ControllerSettings.fp4_max_underflow)
                    floor = None if floor is None else min(floor, FP4_MIN_SQNR_DB)
                why = _past_threshold(read, limit, floor)
                if why is None:
                    formats[n] = _named(r)
                else:
                    rejected[n][r.name] = why
        for n in candidates:
            if n not in formats:
                stay[n] = (next(iter(rejected[n].values())) if not auto else "no format meets the thresholds: "
                           + "; ".join(f"{f}: {why}" for f, why in rejected[n].items()))
        formats = {n: formats[n] for n in candidates if n in formats}  # model order
        for fixes in range(max_fixes + 1):
            for st in states.values():
                st.reset()
                st.route(fallback=False)
                st.sample_sqnr = False
            event = passes.traced(_with_fp8(policy, formats), scale, what=f"fp8: verifying {len(formats)} "
                                  "layer(s) in fp8" + (f" (round {fixes + 1})" if fixes else ""))
            culprit = None if event is None else event.fp8_layer
            if culprit not in formats or fixes == max_fixes:
                break
            stay[culprit] = f"{event.fp8_operand} non-finite ({event.kind}) in the verification pass"
            del formats[culprit]
    finally:
        for n, st in old.items():
            swap_layer_state(modules[n], st)
    order = {n: i for i, n in enumerate(modules)}
    name = {n: r if isinstance(r, str) else r.name for n, r in formats.items()}
    advice = Fp8Advice(recipe="auto" if auto else tried[0].name, layers=tuple(formats),
                       stay=dict(sorted(stay.items(), key=lambda kv: order[kv[0]])),
                       stats=stats, verified=event is None, recipes=name,
                       rejected={n: why for n, why in rejected.items() if auto and n in formats and why})
    return _with_fp8(policy, formats), advice
