"""The train-resume-compare harness of the precision-control tests: cases are data, one runner.

A :class:`Case` is a training run as a frozen value: its model (a builder of a seed), its data
(micro-batches and loss per step, :class:`Data`), the route into low precision (a Policy, also
through JSON; ``fp8.convert``; or bf16 autocast alone), the recipe, the Guard's or Controller's
settings (:class:`Supervisor`), the optimizer and loss scaler, what to record each step
(:data:`RECORDERS`) and where to checkpoint. :func:`train` runs it: straight through, or saved at
``resume_at`` (model, optimizer, scaler, supervisor or fp4 rounding steps, through
``torch.save``/``torch.load(weights_only=True)``; the supervisor's state also through JSON where
the case says so), loaded into objects rebuilt from scratch with other initial weights (in this
process, or in a fresh Python process), and finished. Every resume is checked absolutely too:
the loaded state saves back unchanged and the supervisor's step count is the resume step.

The features a case combines are tables (:data:`RECIPES`, :data:`SUPERVISORS`,
:data:`OPTIMIZERS`, :data:`SCALERS`, :data:`ROUTES`): cases and the adversarial harness's
generators name their keys, nothing branches on a feature's name, and a feature added to a table
reaches every test that draws from it. The cases of tests/fp8 are :data:`CASES`.
"""

from __future__ import annotations

import functools
import io
import json
import os
import pickle
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec import Controller, Policy, fp8
from mixprec.fp8 import Float8Recipe

from _models import fp8_stack, mlp

# ------------------------------------------------------------------------------- feature tables


@dataclass(frozen=True)
class RecipeFeature:
    """A recipe the harness trains with: ``recipe`` (a name, or a recipe object: not for the JSON
    route nor the Controller, ``named=False``), the block a layer's features must be a multiple
    of, whether its operands are e2m1 (``fp4``: the Guard and Controller judge them against the
    fp4 underflow limit), whether it rounds stochastically (draws from the layers' fp4 call
    counts), and its absolute reference: torchao's emulated ``Float8Linear`` (``reference="float8"``)
    or torchao's fp4 cast of the weights with ``cast`` (``"mx"``, ``"nvfp4"``)."""

    key: str
    recipe: Any
    block: int = 16
    fp4: bool = False
    named: bool = True
    stochastic: bool = False
    reference: str | None = None
    cast: tuple[str, str] | None = None
    underflow_reference: bool = False  # a tensorwise e4m3 input cast: its underflow has a plain-torch reference

    @property
    def widths(self) -> tuple[int, ...]:
        """The layer widths (of 16 and 32) that are multiples of the recipe's blocks."""
        return tuple(w for w in (16, 32) if w % self.block == 0)

    @property
    def guard_underflow(self) -> float:
        """The harness's Guard limit: the Controller's fp4 one for e2m1 operands (an e2m1 block
        flushes 7 to 11% of Gaussian data, so fp8's 0.05 falls back at once)."""
        return 0.15 if self.fp4 else 0.05

    @property
    def ladder(self) -> dict[str, tuple[str, ...]]:
        """The Controller keyword of its ladder: a named fp4 recipe starts an fp4 ladder (the
        Controller takes named recipes only)."""
        return {"ladder": (self.key, "tensorwise", "rowwise", "compute")} if self.fp4 and self.named else {}


RECIPES: dict[str, RecipeFeature] = {r.key: r for r in (
    RecipeFeature("tensorwise", "tensorwise", reference="float8", underflow_reference=True),
    RecipeFeature("rowwise", "rowwise", reference="float8"),
    RecipeFeature("mxfp4", "mxfp4", block=32, fp4=True, reference="mx", cast=("e2m1", "1x32")),
    RecipeFeature("nvfp4_rtn", Float8Recipe.nvfp4(stochastic_rounding=False), fp4=True, named=False,
                  reference="nvfp4", cast=("e2m1", "1x16")),
    RecipeFeature("nvfp4", "nvfp4", fp4=True, stochastic=True, reference="nvfp4", cast=("e2m1", "1x16")),
)}


def recipe_of(key: Any) -> Any:
    """What ``Policy.fp8``/``fp8.convert`` get for a recipe key (anything else: itself)."""
    return RECIPES[key].recipe if isinstance(key, str) and key in RECIPES else key


@dataclass(frozen=True)
class SupervisorFeature:
    """A precision supervisor: its class, the keyword ``Policy.fp8``/``fp8.convert`` take it by,
    its decisions as objects (``decided``) and as plain data (``decisions``: comparable across
    runs and processes), the absolute check of one decision against its own settings, and
    whether it takes a recipe object (``custom_recipes``; else recipe names only)."""

    key: str
    build: Callable[..., Any]
    keyword: str
    decided: Callable[[Any], list[Any]]
    decisions: Callable[[Any], Any]
    contradiction: Callable[[Any, Any, bool], str | None]
    custom_recipes: bool


def _guard_contradiction(guard: Any, d: Any, fp4: bool) -> str | None:
    if not d.value > d.threshold:
        return f"the Guard fell back without crossing its limit: {d}"
    limit = guard.fp4_max_underflow if fp4 else guard.max_underflow
    if d.statistic == "underflow" and d.threshold != limit:
        return f"the Guard judged {d.operand} against {d.threshold}, not {limit}: {d}"
    return None


def _controller_contradiction(ctl: Any, d: Any, fp4: bool) -> str | None:
    ok = d.value > d.threshold if d.action == "promote" else d.value <= d.threshold
    return None if ok else f"the Controller's decision contradicts its threshold: {d}"


SUPERVISORS: dict[str, SupervisorFeature] = {s.key: s for s in (
    SupervisorFeature("guard", fp8.Guard, "guard", lambda g: list(g.decisions.values()),
                      lambda g: sorted((n, str(d)) for n, d in g.decisions.items()), _guard_contradiction,
                      custom_recipes=True),
    SupervisorFeature("controller", Controller, "controller", lambda c: list(c.log), lambda c: [str(d) for d in c.log],
                      _controller_contradiction, custom_recipes=False),
)}


@dataclass(frozen=True)
class Supervisor:
    """A Guard or Controller as data: its :data:`SUPERVISORS` key and its settings."""

    kind: str
    settings: tuple[tuple[str, Any], ...] = ()

    @property
    def feature(self) -> SupervisorFeature:
        return SUPERVISORS[self.kind]

    @property
    def costed(self) -> bool:
        """Whether its step takes the loss scale (a Controller with ``max_loss_cost``)."""
        return dict(self.settings).get("max_loss_cost") is not None

    def build(self) -> Any:
        return self.feature.build(**dict(self.settings))

    def with_settings(self, **settings: Any) -> Supervisor:
        return Supervisor(self.kind, tuple({**dict(self.settings), **settings}.items()))


def guard(**settings: Any) -> Supervisor:
    return Supervisor("guard", tuple(settings.items()))


def controller(**settings: Any) -> Supervisor:
    return Supervisor("controller", tuple(settings.items()))


def _lowp_adamw(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    mixprec.to_low_precision(model, torch.bfloat16)
    return mixprec.optim.AdamW(model.parameters(), lr=lr, compensation="stochastic",
                               generator=torch.Generator().manual_seed(0))


@dataclass(frozen=True)
class OptimizerFeature:
    """An optimizer: its builder (model, lr, settings) and whether it trains bf16 weights
    (``to_low_precision``; no loss scaler then)."""

    key: str
    build: Callable[..., torch.optim.Optimizer]
    bf16_weights: bool = False


OPTIMIZERS: dict[str, OptimizerFeature] = {o.key: o for o in (
    OptimizerFeature("sgd", lambda model, **kw: torch.optim.SGD(model.parameters(), **kw)),
    OptimizerFeature("adam", lambda model, **kw: torch.optim.Adam(model.parameters(), **kw)),
    OptimizerFeature("adamw", lambda model, **kw: torch.optim.AdamW(model.parameters(), **kw)),
    OptimizerFeature("mixprec_adamw", lambda model, **kw: mixprec.optim.AdamW(model.parameters(), **kw)),
    OptimizerFeature("lowp", _lowp_adamw, bf16_weights=True),
)}


@dataclass(frozen=True)
class Optim:
    """An optimizer as data: its :data:`OPTIMIZERS` key and settings (``lr``, ``momentum``, ...)."""

    kind: str = "adamw"
    settings: tuple[tuple[str, Any], ...] = (("lr", 1e-2),)

    def build(self, model: nn.Module) -> torch.optim.Optimizer:
        return OPTIMIZERS[self.kind].build(model, **dict(self.settings))


def optim(kind: str, **settings: Any) -> Optim:
    return Optim(kind, tuple(settings.items()))


SCALERS: dict[str, Callable[..., Any]] = {
    "mixprec": lambda model, **kw: mixprec.GradScaler("cpu", **kw).watch(model),
    "torch": lambda model, **kw: torch.amp.GradScaler("cpu", **kw),
}


@dataclass(frozen=True)
class Scaler:
    """A loss scaler as data: its :data:`SCALERS` key and settings."""

    kind: str = "mixprec"
    settings: tuple[tuple[str, Any], ...] = ()

    def build(self, model: nn.Module) -> Any:
        return SCALERS[self.kind](model, **dict(self.settings))


def scaler(kind: str = "mixprec", **settings: Any) -> Scaler:
    return Scaler(kind, tuple(settings.items()))


# ------------------------------------------------------------------------------------ the data


class Data:
    """What a case trains on: the micro-batches of step ``t`` and the loss of one (its forward in
    ``region()``; None: a forward without backward, an evaluation). Subclasses are frozen
    dataclasses of module level (a case pickles into a fresh process)."""

    def micro_batches(self, t: int) -> Sequence[Any]:
        raise NotImplementedError

    def loss(self, model: nn.Module, region: Callable[[], Any], batch: Any, t: int) -> torch.Tensor | None:
        raise NotImplementedError


@functools.lru_cache(maxsize=16)
def drift_batches(steps: int, drift: bool, start: int, end: int, seed: int) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """Batches of 32 x 64 and class targets; feature 0 times 1.05**(t + start) while t < end."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in range(steps):
        x = torch.randn(32, 64, generator=g)
        if drift and t < end:
            x[:, 0] *= 1.05 ** (t + start)
        out.append((x, torch.randint(0, 64, (32,), generator=g)))
    return tuple(out)


@dataclass(frozen=True)
class Drift(Data):
    """A classifier's batches whose input feature 0 drifts (:func:`drift_batches`); cross-entropy."""

    steps: int = 380
    drift: bool = True
    start: int = 0
    end: int = 200
    seed: int = 7

    def batches(self) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        return drift_batches(self.steps, self.drift, self.start, self.end, self.seed)

    def micro_batches(self, t: int) -> Sequence[Any]:
        return (self.batches()[t],)

    def loss(self, model: nn.Module, region: Callable[[], Any], batch: Any, t: int) -> torch.Tensor:
        x, y = batch
        with region():
            return F.cross_entropy(model(x).float(), y)


@functools.lru_cache(maxsize=4)
def growing_batches(steps: int, growth: float, seed: int) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """Batches of 32 x 64 times ``growth ** t``, class targets, one generator."""
    g = torch.Generator().manual_seed(seed)
    return tuple((torch.randn(32, 64, generator=g) * growth ** t, torch.randint(0, 64, (32,), generator=g))
                 for t in range(steps))


@dataclass(frozen=True)
class Growing(Data):
    """A classifier's batches that grow by ``growth`` per step (toward fp16's range)."""

    steps: int = 230
    growth: float = 1.03
    seed: int = 0

    def micro_batches(self, t: int) -> Sequence[Any]:
        return (growing_batches(self.steps, self.growth, self.seed)[t],)

    def loss(self, model: nn.Module, region: Callable[[], Any], batch: Any, t: int) -> torch.Tensor:
        x, y = batch
        with region():
            return F.cross_entropy(model(x).float(), y)


@dataclass(frozen=True)
class Outliers(Data):
    """Inputs of ``rows`` x ``width`` from one generator, element (0, 0) set to ``value`` at the
    steps ``at``; the loss is the output's sum."""

    width: int = 16
    rows: int = 8
    at: tuple[int, ...] = (1, 9)
    value: float = 1e6
    seed: int = 1
    steps: int = 14

    def micro_batches(self, t: int) -> Sequence[Any]:
        return (self._inputs()[t],)

    @functools.cache
    def _inputs(self) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(self.seed)
        out = []
        for t in range(self.steps):
            x = torch.randn(self.rows, self.width, generator=g)
            if t in self.at:
                x[0, 0] = self.value
            out.append(x)
        return tuple(out)

    def loss(self, model: nn.Module, region: Callable[[], Any], batch: Any, t: int) -> torch.Tensor:
        with region():
            return model(batch).sum()


@dataclass(frozen=True)
class WeightedLoss(Data):
    """(input, loss weights) pairs: the loss is ``(model(x).float() * c).sum()``.

    ``kind="heavy_grad"``: inputs N(0, 1); the loss weights 1e-3 but one 1e7 while t < heavy
    (grad_output underflows in e5m2), N(0, 1) after. ``kind="heavy_inputs"``: every 8th input
    feature 100x the others while t < heavy (an NVFP4 block of 16 features holds two: the 14
    others flush), N(0, 1) after; the loss weights N(0, 1). ``again``: heavy a second time, on
    the ``heavy`` steps from step ``again``."""

    kind: str = "heavy_grad"
    steps: int = 70
    heavy: int = 20
    seed: int = 3
    again: int | None = None

    def is_heavy(self, t: int) -> bool:
        return t < self.heavy or (self.again is not None and self.again <= t < self.again + self.heavy)

    @functools.cache
    def _pairs(self) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        g = torch.Generator().manual_seed(self.seed)
        return tuple(_WEIGHTED[self.kind](g, self.is_heavy(t)) for t in range(self.steps))

    def micro_batches(self, t: int) -> Sequence[Any]:
        return (self._pairs()[t],)

    def loss(self, model: nn.Module, region: Callable[[], Any], batch: Any, t: int) -> torch.Tensor:
        x, c = batch
        with region():
            return (model(x).float() * c).sum()


def _heavy_grad(g: torch.Generator, heavy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(16, 32, generator=g)
    c = torch.randn(16, 32, generator=g)
    if heavy:
        c = torch.full((16, 32), 1e-3)
        c[0, 0] = 1e7
    return x, c


def _heavy_inputs(g: torch.Generator, heavy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(16, 32, generator=g)
    if heavy:
        x = x * torch.where(torch.arange(32) % 8 == 0, 100.0, 1.0)
    return x, torch.randn(16, 32, generator=g)


_WEIGHTED = {"heavy_grad": _heavy_grad, "heavy_inputs": _heavy_inputs}


def inject_outlier(module: nn.Module, args: tuple) -> tuple:
    """A forward pre-hook: the layer's input with element (0, 0) set to 1e6 (its other values underflow)."""
    h = args[0].clone()
    h[0, 0] = 1e6
    return (h,)


@dataclass(frozen=True)
class LayerOutliers(Data):
    """Inputs of ``rows`` x ``width`` seeded ``seed_scale * t + rank``; at step ``t`` of
    ``outliers`` that layer's input gets an outlier (:func:`inject_outlier`); the loss is the
    mean square of the output; ``evals`` forwards without backward follow each step's (an
    evaluation with grad enabled, on this rank only)."""

    outliers: tuple[tuple[int, str], ...] = ((6, "2"), (10, "4"))
    rows: int = 16
    width: int = 32
    seed_scale: int = 1
    rank: int = 0
    evals: int = 0

    def micro_batches(self, t: int) -> Sequence[Any]:
        x = torch.randn(self.rows, self.width, generator=torch.Generator().manual_seed(self.seed_scale * t + self.rank))
        return (("train", x),) + (("eval", x),) * self.evals

    def loss(self, model: nn.Module, region: Callable[[], Any], batch: Any, t: int) -> torch.Tensor | None:
        kind, x = batch
        if kind == "eval":
            with region():
                model(x).float().sum()
            return None
        layer = dict(self.outliers).get(t)
        handle = layer and model.get_submodule(layer).register_forward_pre_hook(inject_outlier)
        with region():
            loss = model(x).float().square().mean()
        if handle:
            handle.remove()
        return loss


@dataclass(frozen=True)
class SeededInputs(Data):
    """Inputs of ``rows`` x ``width`` seeded by the step; element ``at`` of step ``outlier_step``'s
    set to ``outlier``; the loss is the mean square of the output."""

    rows: int = 8
    width: int = 32
    outlier_step: int | None = None
    at: tuple[int, int] = (0, 1)
    outlier: float = 1e5

    def micro_batches(self, t: int) -> Sequence[Any]:
        x = torch.randn(self.rows, self.width, generator=torch.Generator().manual_seed(t))
        if t == self.outlier_step:
            x[self.at] = self.outlier
        return (x,)

    def loss(self, model: nn.Module, region: Callable[[], Any], batch: Any, t: int) -> torch.Tensor:
        with region():
            return model(batch).float().pow(2).mean()


# ----------------------------------------------------------------------------------- the case


def two_linear(width: int = 32, *, seed: int = 0) -> nn.Sequential:
    """``Linear(width, width)`` twice, no activation (layers ``'0'`` and ``'1'``)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(width, width), nn.Linear(width, width))


def linears(*widths: int, seed: int = 0) -> nn.Sequential:
    """``Linear(widths[0], widths[1])``, ``Linear(widths[1], widths[2])``, ...: no activation
    (layers ``'0'``, ``'1'``, ...)."""
    torch.manual_seed(seed)
    return nn.Sequential(*(nn.Linear(a, b) for a, b in zip(widths, widths[1:])))


def fp16_model(*, seed: int = 0) -> nn.Sequential:
    """Layer ``'2'``'s weight times 300: its output grows toward 65504 as the input grows."""
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 64),
                      nn.GELU(), nn.Linear(64, 64))
    with torch.no_grad():
        m[2].weight.mul_(300)
    return m


@dataclass(frozen=True)
class Case:
    """A training run as data (module docstring). ``model(seed=...)`` builds the model;
    ``fp8_names`` (a regular expression of qualified names; None: every eligible layer) selects
    the low-precision layers of the route (``""``: all); ``optimizer=None`` drops the gradients after each
    step (``model.zero_grad()``); ``record`` names :data:`RECORDERS`; ``resume_at`` checkpoints
    before that step into objects rebuilt with seed ``seed + 100`` (``resume_in="process"``: in
    a fresh Python process), ``checkpoint_json`` sends the supervisor's state through JSON,
    ``from_config`` rebuilds a Controller with ``Controller.from_config(old.config())``."""

    name: str
    model: Callable[..., nn.Module]
    data: Data
    steps: int
    seed: int = 0
    route: str = "policy"
    recipe: Any = "tensorwise"
    compute: str = "bf16"
    fp8_names: str | None = None
    first_last: str = "fp8"
    backend: str | None = None
    policy_json: bool = False
    supervisor: Supervisor | None = None
    optimizer: Optim | None = None
    scaler: Scaler | None = None
    record: tuple[str, ...] = ()
    resume_at: int | None = None
    resume_in: str = "here"
    checkpoint_json: bool = False
    from_config: bool = False


_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _policy_route(trainer: Trainer, case: Case, kw: dict[str, Any]) -> None:
    """The policy names the supervisor's settings; the live one is attached to the model. Read
    back from JSON, the policy gives the settings the run's own supervisor is built from."""
    options = {k: v for k, v in (("names", case.fp8_names), ("backend", case.backend)) if v is not None}
    settings = {key: live.settings for key, live in kw.items()}
    policy = Policy.parse(f"compute={case.compute}").fp8(recipe_of(case.recipe), first_last=case.first_last,
                                                        **options, **settings)
    if case.policy_json:
        policy = Policy.from_json(policy.to_json())
        if case.supervisor is not None:
            keyword = case.supervisor.feature.keyword
            trainer.supervisor = type(trainer.supervisor)(getattr(policy.fp8_rule, keyword))
    if trainer.supervisor is not None:
        trainer.supervisor.attach(trainer.model)
    trainer.region = lambda: mixprec.autocast("cpu", policy=policy)


def _convert_route(trainer: Trainer, case: Case, kw: dict[str, Any]) -> None:
    options: dict[str, Any] = {"backend": case.backend} if case.backend is not None else {}
    if case.fp8_names is not None:  # else fp8.convert's own selection (select_layers)
        names = re.compile(case.fp8_names)
        options["filter_fn"] = lambda m, fqn: bool(names.search(fqn))
    trainer.model = fp8.convert(trainer.model, recipe_of(case.recipe), **options, **kw)
    trainer.region = lambda: mixprec.autocast("cpu", dtype=_DTYPES[case.compute])


def _autocast_route(trainer: Trainer, case: Case, kw: dict[str, Any]) -> None:
    trainer.region = lambda: mixprec.autocast("cpu", dtype=_DTYPES[case.compute])


#: how a case's model gets into low precision: a Policy (``Policy.fp8``), ``fp8.convert``, or
#: none (the compute dtype's autocast alone).
ROUTES: dict[str, Callable[[Any, Case, dict[str, Any]], None]] = {
    "policy": _policy_route, "convert": _convert_route, "none": _autocast_route}


@dataclass(frozen=True)
class Recorder:
    """What a run records each step: ``phase`` ``"backward"`` (after the step's backwards),
    ``"optimizer"`` (after the optimizer's step, before the supervisor's) or ``"step"`` (after the
    supervisor's step); ``read(trainer)`` is the step's record (a check may assert in it)."""

    phase: str
    read: Callable[[Any], Any]


def _windows(tr: Trainer) -> Any:
    """Right after a Controller's check: the windows it judged, per (layer, operand)."""
    if tr.supervisor.steps % tr.supervisor.every:
        return None
    rows = fp8.stats(tr.model).to_list()
    assert {r["window"] for r in rows} == {"last"}
    return {(r["layer"], r["operand"]): r for r in rows}


def _fallbacks_applied(tr: Trainer) -> None:
    """A Guard's fallback takes effect at once, not a check later."""
    for name in getattr(tr.supervisor, "decisions", {}):
        st = fp8.layer_state(tr.model.get_submodule(name), create=False)
        assert st is None or st.fallback, f"step {tr.t}: the Guard decided {name} falls back, it runs in fp8"


RECORDERS: dict[str, Recorder] = {
    "losses": Recorder("backward", lambda tr: [loss.item() for loss in tr.losses]),
    "grads": Recorder("backward", lambda tr: torch.cat([p.grad.flatten() for p in tr.model.parameters()])),
    "precisions": Recorder("optimizer", lambda tr: tr.supervisor.precisions()),
    "gemm_precisions": Recorder("optimizer", lambda tr: {
        n: tuple(tr.supervisor.precision(n, g) for g in ("output", "grad_input", "grad_weight"))
        for n in tr.supervisor.precisions()}),
    "skipped": Recorder("optimizer", lambda tr: tr.scaler.get_scale() < tr.scale_before),
    "windows": Recorder("step", _windows),
    "fallbacks_applied": Recorder("step", _fallbacks_applied),
}


def _without_counts(state: dict[str, Any]) -> dict[str, Any]:
    """A Guard's or Controller's ``state_dict()`` without the layers' fp4 call counts."""
    entries = state.get("windows", state.get("layers", {}))
    for entry in entries.values():
        entry.pop("rounding_step", None)
    return state


class Trainer:
    """One case's objects, built from scratch (``seed`` picks the initial weights): model,
    supervisor (or the one given), route and region, optimizer, scaler; :meth:`step` runs one
    optimizer step, :meth:`state`/:meth:`load` checkpoint them. ``records`` (name -> one entry
    per step) continue across a resume (pass the previous trainer's)."""

    def __init__(self, case: Case, seed: int, supervisor: Any = None,
                 records: dict[str, list[Any]] | None = None) -> None:
        self.case = case
        self.model = case.model(seed=seed)
        self.supervisor = supervisor if supervisor is not None or case.supervisor is None else case.supervisor.build()
        kw = {} if case.supervisor is None else {case.supervisor.feature.keyword: self.supervisor}
        self.region: Callable[[], Any] = lambda: None
        ROUTES[case.route](self, case, kw)
        fp8.keep_rounding_state(self.model)  # (fp4's stochastic-rounding call counts ride in the model's state_dict)
        self.optimizer = None if case.optimizer is None else case.optimizer.build(self.model)
        self.scaler = None if case.scaler is None else case.scaler.build(self.model)
        self.records = records if records is not None else {name: [] for name in case.record}
        self.calls: dict[str, int] = {}
        self.losses: list[torch.Tensor] = []
        self.scale_before: float = 1.0
        self.t = -1
        self.rebuilt_at: int | None = None  # the step whose checkpoint these objects were loaded from
        for name, module in self.model.named_modules():  # each low-precision candidate's non-empty calls
            if isinstance(module, nn.Linear) and re.search(case.fp8_names or "", name):
                def hook(module: Any, args: Any, name: str = name) -> None:
                    self.calls[name] = self.calls.get(name, 0) + (args[0].numel() > 0)
                module.register_forward_pre_hook(hook)

    def _record(self, phase: str) -> None:
        for name in self.case.record:
            if RECORDERS[name].phase == phase:
                self.records[name].append(RECORDERS[name].read(self))

    def step(self, t: int) -> list[Any]:
        """Optimizer step ``t``: each micro-batch's forward (in its own region) and backward
        (through the scaler), the optimizer's step, the supervisor's step. Its decisions."""
        self.t, self.losses = t, []
        for batch in self.case.data.micro_batches(t):
            loss = self.case.data.loss(self.model, self.region, batch, t)
            if loss is None:
                continue
            self.losses.append(loss)
            (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        self._record("backward")
        self.scale_before = self.scaler.get_scale() if self.scaler is not None else 1.0
        if self.optimizer is None:
            self.model.zero_grad()
        else:
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
            self.optimizer.zero_grad()
        self._record("optimizer")
        decided: list[Any] = []
        if self.supervisor is not None:
            costed = self.case.supervisor is not None and self.case.supervisor.costed
            decided = self.supervisor.step(**({"loss_scale": self.scale_before} if costed else {}))
        self._record("step")
        return decided

    def run(self, start: int, stop: int) -> None:
        for t in range(start, stop):
            self.step(t)

    def state(self) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model.state_dict()}
        if self.optimizer is not None:
            out["optimizer"] = self.optimizer.state_dict()
        if self.scaler is not None:
            out["scaler"] = self.scaler.state_dict()
        if self.supervisor is not None:  # (without its copy of the call counts: the model's state_dict has them)
            sd = _without_counts(self.supervisor.state_dict())
            out["supervisor"] = json.loads(json.dumps(sd)) if self.case.checkpoint_json else sd
        return out

    def load(self, state: Mapping[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])
        if self.supervisor is not None:
            self.supervisor.load_state_dict(state["supervisor"])

    def result(self) -> Result:
        sup = self.supervisor
        return Result(records=self.records, weights={n: p.detach().clone() for n, p in self.model.named_parameters()},
                      decisions=None if sup is None else self.case.supervisor.feature.decisions(sup),
                      scaler=None if self.scaler is None else self.scaler.state_dict(),
                      state=None if sup is None else sup.state_dict(), rebuilt_at=self.rebuilt_at, trainer=self)


@dataclass
class Result:
    """How a run ended: its records, weights, decisions (plain data), scaler state and
    supervisor state; ``rebuilt_at`` the step whose checkpoint its last objects were rebuilt
    from (None: run straight through); ``trainer`` its live objects (None when it ended in
    another process)."""

    records: dict[str, list[Any]]
    weights: dict[str, torch.Tensor]
    decisions: Any
    scaler: Any
    state: Any
    rebuilt_at: int | None = None
    trainer: Trainer | None = field(default=None, compare=False)

    @property
    def supervisor(self) -> Any:
        return self.trainer.supervisor

    @property
    def model(self) -> nn.Module:
        return self.trainer.model

    def plain(self) -> dict[str, Any]:
        return {"records": self.records, "weights": self.weights, "decisions": self.decisions,
                "scaler": self.scaler, "state": self.state, "rebuilt_at": self.rebuilt_at}


def differing_weights(a: Result, b: Result) -> list[str]:
    """The names of the parameters that differ bitwise between two results."""
    return [n for n in a.weights if not torch.equal(a.weights[n], b.weights[n])]


def first_difference(a: Any, b: Any, path: str = "") -> str | None:
    """The path of the first difference between two nested states (dicts, lists, tensors
    bitwise, numbers with NaN equal to NaN), or None."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return f"{path}: keys {sorted(map(str, a.keys() ^ b.keys()))} in one only"
        return next((d for k in a if (d := first_difference(a[k], b[k], f"{path}/{k}")) is not None), None)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{path}: lengths {len(a)} and {len(b)}"
        return next((d for i, (x, y) in enumerate(zip(a, b)) if (d := first_difference(x, y, f"{path}[{i}]")) is not None),
                    None)
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        same = a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0)) and \
            torch.equal(a.isnan(), b.isnan()) if a.is_floating_point() else a.dtype == b.dtype and torch.equal(a, b)
        return None if same else f"{path}: tensors {a} and {b}"
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return None
    return None if type(a) is type(b) and a == b else f"{path}: {a!r} and {b!r}"


def checkpoint(trainer: Trainer) -> dict[str, Any]:
    """The trainer's state through ``torch.save`` and ``torch.load(weights_only=True)``."""
    buffer = io.BytesIO()
    torch.save(trainer.state(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def resume(case: Case, saved: Mapping[str, Any], records: dict[str, list[Any]], supervisor: Any = None) -> Trainer:
    """Objects rebuilt from scratch with other initial weights (the load must set them), loaded
    from ``saved``; asserts the absolute checks: the state saves back unchanged (save, load,
    save) and the supervisor counts ``case.resume_at`` steps."""
    resumed = Trainer(case, case.seed + 100, supervisor=supervisor, records=records)
    resumed.load(saved)
    resumed.rebuilt_at = case.resume_at
    mismatch = first_difference(dict(saved), resumed.state())
    assert mismatch is None, f"state saved at step {case.resume_at}, loaded and saved again differs at {mismatch}"
    if resumed.supervisor is not None:
        assert resumed.supervisor.steps == case.resume_at, (resumed.supervisor.steps, case.resume_at)
    return resumed


def train(case: Case) -> Result:
    """Run ``case`` in this process: straight through, or checkpointed before step ``resume_at``
    and finished by objects rebuilt from scratch (:func:`resume`). A case resumed in a fresh
    process runs through :func:`train_resumed_in_a_process` (a test that starts a process is slow)."""
    if case.resume_in == "process":
        raise ValueError("train(case) runs in this process: use train_resumed_in_a_process(case, tmp)")
    trainer = Trainer(case, case.seed)
    if case.resume_at is None:
        trainer.run(0, case.steps)
        return trainer.result()
    trainer.run(0, case.resume_at)
    saved = checkpoint(trainer)
    fresh = None
    if case.from_config:
        fresh = type(trainer.supervisor).from_config(trainer.supervisor.config())
    resumed = resume(case, saved, trainer.records, fresh)
    resumed.run(case.resume_at, case.steps)
    return resumed.result()


_FRESH = """
import pickle, sys, torch
import _train_cases as c
case, records = pickle.loads(open(sys.argv[1], "rb").read())
run = c.resume(case, torch.load(sys.argv[2], weights_only=True), records)
run.run(case.resume_at, case.steps)
torch.save(run.result().plain(), sys.argv[3])
"""


def train_resumed_in_a_process(case: Case, tmp: Path) -> Result:
    """Run ``case`` here up to ``resume_at``, checkpoint it, and finish it in a new Python process
    (no state left in mixprec's or torch's process-wide caches, registries and generators) that
    loads the checkpoint and runs the remaining steps; files under ``tmp``."""
    trainer = Trainer(case, case.seed)
    trainer.run(0, case.resume_at)
    saved, records = checkpoint(trainer), trainer.records
    torch.save(saved, tmp / "state.pt")
    (tmp / "case.pkl").write_bytes(pickle.dumps((case, records)))
    here = Path(__file__).resolve().parent
    path = [str(Path(mixprec.__file__).resolve().parents[1]), str(here), str(here / "adversarial")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path + [os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", _FRESH, str(tmp / "case.pkl"), str(tmp / "state.pt"), str(tmp / "out.pt")],
                   env=env, check=True, timeout=300)
    return Result(**torch.load(tmp / "out.pt", weights_only=True))


# ------------------------------------------------------------------------------- the cases


#: The cases of tests/fp8 (the adversarial harness draws its own from the same tables).
CASES: dict[str, Case] = {c.name: c for c in (
    # a drifting input feature promotes layer 0 of an MLP before its underflow crosses 5%, and
    # demotes it after the drift (tests/fp8/test_controller.py)
    Case("controller-drift", functools.partial(mlp, 64, 64, 64, 64, 64), Drift(), steps=380,
         supervisor=controller(), optimizer=optim("sgd", lr=1e-3), record=("precisions", "windows"),
         checkpoint_json=True),
    # an outlier at steps 1 and 9: promote, demote, promote again (resumed at any step)
    Case("controller-outlier", functools.partial(mlp, 16, 16, 16), Outliers(), steps=14,
         supervisor=controller(every=2, horizon=1, demote_windows=1, min_dwell=2),
         optimizer=optim("sgd", lr=1e-7), record=("precisions",)),  # lr 1e-7: the outliers stay small
    # outliers of 1e6 at steps 0 and 4 (underflow about 1): promote, demote after 2 clean windows
    # and 3 steps of dwell, promote again; then the switch budget of 3 keeps the layer promoted
    Case("controller-switch-budget", functools.partial(mlp, 16, 16), Outliers(at=(0, 4), seed=0, steps=20), steps=20,
         supervisor=controller(every=1, horizon=1, demote_windows=2, min_dwell=3, max_switches=3,
                               ladder=("tensorwise", "compute")), record=("precisions",)),
    # fp16 compute, inputs growing toward 65504: the range rung (plain: the same without a Controller)
    Case("controller-fp16", fp16_model, Growing(), steps=230, compute="fp16", supervisor=controller(),
         optimizer=optim("sgd", lr=1e-3), scaler=scaler("torch", init_scale=1.0, growth_interval=10 ** 6),
         record=("precisions", "skipped")),
    Case("plain-fp16", fp16_model, Growing(), steps=230, compute="fp16", optimizer=optim("sgd", lr=1e-3),
         scaler=scaler("torch", init_scale=1.0, growth_interval=10 ** 6), record=("skipped",)),
    # an input outlier at step 2 reaches fp8.convert's middle layers (no activation): their
    # input GEMMs promote, then demote after 3 clean windows, the GEMMs' clean counts apart
    # (tests/fp8/test_controller_resume_counters.py)
    Case("controller-gemm-counters", functools.partial(linears, 32, 32, 32, 32, 1), SeededInputs(outlier_step=2),
         steps=12, route="convert", supervisor=controller(every=1, per_gemm=True, trend_windows=1, min_dwell=2,
                                                          demote_windows=3), optimizer=optim("sgd", lr=1e-6)),
    # heavy loss weights: grad_output underflows in e5m2, the per-GEMM ladder moves the backward
    # GEMMs (tests/fp8/test_ladder.py); no optimizer (the heavy gradients would wreck the weights)
    Case("ladder-heavy-grad", two_linear, WeightedLoss(), steps=70,
         supervisor=controller(every=5, demote_windows=2, min_dwell=10, per_gemm=True),
         record=("gemm_precisions", "grads"), checkpoint_json=True, from_config=True),
    # heavy-tailed inputs on the NVFP4 ladder
    Case("ladder-fp4", two_linear, WeightedLoss("heavy_inputs", steps=60, seed=5), steps=60, recipe="nvfp4",
         supervisor=controller(every=5, demote_windows=2, min_dwell=10, per_gemm=True,
                               ladder=("nvfp4", "tensorwise", "compute")),
         record=("gemm_precisions", "grads"), checkpoint_json=True, from_config=True),
    # the Guard's schedule: outliers into layers '2' (step 6) and '4' (step 10), checks every 4
    # steps (tests/fp8/test_fp8_guard_step.py), by the policy and the convert route
    Case("guard-outliers-policy", fp8_stack, LayerOutliers(), steps=12, supervisor=guard(max_saturated=0.5, every=4),
         optimizer=optim("adam", lr=1e-2), record=("losses",)),
    Case("guard-outliers-convert", fp8_stack, LayerOutliers(), steps=12, route="convert", fp8_names="",
         supervisor=guard(max_saturated=0.5, every=4), optimizer=optim("adam", lr=1e-2), record=("losses",)),
    # rank 0's view of two ranks that run different numbers of forwards: two evaluations (grad
    # enabled, no backward) after each step's; rank 1 (``replace`` its data) an outlier into
    # layer '2' at step 2
    Case("guard-ranks", fp8_stack, LayerOutliers(outliers=(), rows=8, seed_scale=10, rank=0, evals=2), steps=6,
         supervisor=guard(every=2), optimizer=optim("sgd", lr=0.1)),
)}
