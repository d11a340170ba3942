"""The demo's precision modes: a registry of :class:`Mode` values, each building its optimizer,
scaler and autocast around a freshly built float32 model.

- ``fp32``: float32 weights and compute, ``torch.optim.AdamW``.
- ``torch-amp``: ``torch.autocast`` (float16) + ``torch.amp.GradScaler``: the reference.
- ``mixprec-fp16``: ``mixprec.autocast`` (float16) + ``mixprec.GradScaler``.
- ``mixprec-bf16``: ``mixprec.autocast`` (bfloat16), no scaler.
- ``bf16-naive``: bfloat16 weights (``mixprec.to_low_precision``), plain ``torch.optim.AdamW``.
- ``bf16-kahan``: the same weights, ``mixprec.optim.AdamW(compensation="kahan")``.
- ``bf16-stochastic``: the same weights, ``mixprec.optim.AdamW(compensation="stochastic")``.
- ``mixprec-fp16-layerwise`` (not run by default): ``mixprec-fp16`` with
  ``mixprec.GradScaler(per_layer=True)``: a power-of-two factor per transformer block on top of the
  loss scale (see docs/scaling.md, "Per-layer scaling").
- ``fp16-master``: float16 weights, float32 master copies (``mixprec.MasterWeights``) +
  ``mixprec.GradScaler``.
- ``mixprec-fp8``: ``mixprec.autocast`` with ``Policy.parse("compute=bf16").fp8("tensorwise")``:
  the Linear layers between the first and the last run their GEMMs in fp8 (emulated on CPU), the
  rest in bf16, with a :class:`mixprec.Controller` that moves a layer up its ladder (rowwise, then
  bf16) before its statistics fail and back down when they calm; the training loop records the
  layers' fp8 statistics every :data:`FP8_EVERY` steps, and the controller's decisions.
- ``mixprec-fp8-rowwise``: the same with the ``rowwise`` recipe (its ladder starts there).
- ``mixprec-fp8-guard``, ``mixprec-fp8-rowwise-guard`` (not run by default): the same two with
  an :class:`mixprec.fp8.Guard` instead, which moves a layer back to bf16 for good when it goes
  wrong.
- ``torch-amp-bf16`` (not run by default): ``torch.autocast`` (bfloat16), the reference of
  ``mixprec-bf16``.
- ``mixprec-fp4``, ``mixprec-fp4-all``, ``mixprec-fp4-hand`` (:data:`FP4_MODES`, not run by
  default: :data:`FP4_RECIPE` is emulated on CPU at about 3x the fp8 modes' cost, 11x fp32's on
  the tiny model, and three of them would more than double the default demo's time):
  ``mixprec.autocast`` bf16 with every Linear layer in NVFP4 and a :class:`mixprec.Controller`
  moving each of its GEMMs up :data:`FP4_LADDER` (fp4, fp8 tensorwise, fp8 rowwise, bf16) as its
  statistics need (``per_gemm=True``); every Linear layer in NVFP4 with no controller; and the
  hand recipe of the published fp4 runs, the first and last Linear layers in bf16 and the rest in
  NVFP4 (``Policy.fp8``'s ``first_last="keep"``), no controller. The loop counts per layer and
  GEMM the steps each ran in fp4 (:mod:`mixprec.demo.flops`).

To add a mode, append a :class:`Mode` to ``_ALL_MODES``: its name, a one-line summary, the mixprec
APIs it needs, its setup function, whether ``mixprec demo`` runs it by default, the mode it must
reproduce bitwise (checked in the report) and its cost per step on a CPU without native
fp16/bf16 relative to fp32 (for the time estimate).

Example:
    >>> MODES["mixprec-fp16"].reference
    'torch-amp'
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Protocol

import torch
from torch import nn

import mixprec
from mixprec.demo.settings import Settings

if TYPE_CHECKING:
    from mixprec import Controller, Policy
    from mixprec.fp8 import Guard

__all__ = ["MODES", "DEFAULT_MODES", "FP8_EVERY", "FP4_MODES", "FP4_RECIPE", "FP4_LADDER", "Mode", "Setup",
           "check_modes"]


class _Scaler(Protocol):
    def scale(self, outputs: torch.Tensor) -> torch.Tensor: ...
    def step(self, optimizer: Any) -> Any: ...
    def update(self) -> None: ...


@dataclass
class Setup:
    """One mode, ready to train: what a step calls, and how to read its loss scale."""

    model: nn.Module
    optimizer: torch.optim.Optimizer  # what zero_grad()/step() are called on
    autocast: Callable[[], ContextManager[Any]] = contextlib.nullcontext
    scaler: _Scaler | None = None
    # after scaler.update(): (current scale, whether the step was skipped), both device tensors
    scale_state: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None
    # fp8 modes: the guard (``guard.step(model)``) or controller (``controller.step()``) the loop
    # steps after every optimizer step, reading the layers' statistics at the end of each of its
    # windows (one of the two); and the recipe's name
    fp8_guard: Guard | None = None
    fp8_controller: Controller | None = None
    fp8_recipe: str = ""
    # modes with an fp8 rule: the policy, whose layers' GEMMs the loop counts per format
    # (mixprec.demo.flops.GemmCounter)
    fp8_policy: Policy | None = None


@dataclass(frozen=True)
class Mode:
    """A precision mode of the demo.

    Attributes:
        name: the name used by ``--modes``.
        summary: one line for the report.
        requires: mixprec attributes the mode needs, as dotted paths under ``mixprec``.
        setup: builds the mode's optimizer/scaler/autocast around a freshly built float32 model.
        default: whether ``mixprec demo`` runs it when ``--modes`` is not given.
        reference: a mode this one must reproduce bitwise (losses, scales, skipped steps); the
            report checks it when both ran.
        cpu_cost: time per step relative to fp32 on a CPU without native fp16/bf16 matmuls
            (measured on 2 AVX2 cores; a first guess for the time estimate, corrected as it runs).
        speed_kind: the kind of the speed panel (:data:`mixprec.demo.speed.KINDS`) whose compute
            this mode runs: the estimate scales that kind's measured step time by ``cpu_cost``.
    """

    name: str
    summary: str
    requires: tuple[str, ...]
    setup: Callable[[nn.Module, Settings, torch.device], Setup] = field(repr=False)
    default: bool = True
    reference: str | None = None
    cpu_cost: float = 1.0
    speed_kind: str = "fp32"


# Every scaler of the demo starts at torch's default scale but grows after 20 clean steps
# instead of 2000, so that a run of a hundred steps shows the scale growing and backing off.
_INIT_SCALE = 2.0**16
_GROWTH_INTERVAL = 20


def _adamw(params: Any, s: Settings) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=s.lr, betas=(0.9, 0.95), weight_decay=0.01, fused=s.fused)


def _torch_scale_state(scaler: torch.amp.GradScaler) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    # torch's scaler has no hysteresis: a step was skipped exactly when update() lowered the scale.
    previous: list[torch.Tensor] = []

    def state() -> tuple[torch.Tensor, torch.Tensor]:
        scale = scaler._get_scale_async().detach().clone()  # device tensor: no host sync
        before = previous[0] if previous else torch.full_like(scale, _INIT_SCALE)
        previous[:] = [scale]
        return scale, scale < before

    return state


def _mixprec_scale_state(scaler: Any) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    def state() -> tuple[torch.Tensor, torch.Tensor]:
        return scaler.state.scale.detach().clone(), scaler.last_step_skipped.detach().clone()

    return state


def _mixprec_scaler(device: torch.device) -> tuple[Any, Callable[[], tuple[torch.Tensor, torch.Tensor]]]:
    scaler = mixprec.GradScaler(device.type, init_scale=_INIT_SCALE, growth_interval=_GROWTH_INTERVAL)
    return scaler, _mixprec_scale_state(scaler)


def _torch_scaler(device: torch.device) -> tuple[Any, Callable[[], tuple[torch.Tensor, torch.Tensor]]]:
    scaler = torch.amp.GradScaler(device.type, init_scale=_INIT_SCALE, growth_interval=_GROWTH_INTERVAL)
    return scaler, _torch_scale_state(scaler)


# engine -> (autocast, scaler factory): torch.amp and mixprec get the same settings
_ENGINES: dict[str, tuple[Callable[..., Any], Callable[[torch.device], Any]]] = {
    "torch": (lambda device_type, dtype: torch.autocast(device_type, dtype=dtype), _torch_scaler),
    "mixprec": (lambda device_type, dtype: mixprec.autocast(device_type, dtype=dtype), _mixprec_scaler),
}


def _setup_fp32(model: nn.Module, s: Settings, device: torch.device) -> Setup:
    return Setup(model, _adamw(model.parameters(), s))


def _setup_amp(engine: str, dtype: torch.dtype) -> Callable[[nn.Module, Settings, torch.device], Setup]:
    """fp32 weights, ``engine``'s autocast in ``dtype``, and its loss scaler for float16."""
    make_autocast, make_scaler = _ENGINES[engine]

    def setup(model: nn.Module, s: Settings, device: torch.device) -> Setup:
        opt = _adamw(model.parameters(), s)
        autocast = lambda: make_autocast(device.type, dtype)  # noqa: E731
        if dtype != torch.float16:
            return Setup(model, opt, autocast)
        scaler, scale_state = make_scaler(device)
        return Setup(model, opt, autocast, scaler, scale_state)

    return setup


def _setup_bf16(compensation: str | None) -> Callable[[nn.Module, Settings, torch.device], Setup]:
    def setup(model: nn.Module, s: Settings, device: torch.device) -> Setup:
        mixprec.to_low_precision(model, torch.bfloat16)
        if compensation is None:
            opt = _adamw(model.parameters(), s)
        else:
            opt = mixprec.optim.AdamW(
                model.parameters(), lr=s.lr, betas=(0.9, 0.95), weight_decay=0.01,
                compensation=compensation,
            )
        return Setup(model, opt)

    return setup


def _setup_fp16_layerwise(model: nn.Module, s: Settings, device: torch.device) -> Setup:
    scaler = mixprec.GradScaler(
        device.type, init_scale=_INIT_SCALE, growth_interval=_GROWTH_INTERVAL, per_layer=True
    ).watch(model)
    autocast = lambda: mixprec.autocast(device.type, dtype=torch.float16)  # noqa: E731
    return Setup(model, _adamw(model.parameters(), s), autocast, scaler, _mixprec_scale_state(scaler))


def _setup_fp16_master(model: nn.Module, s: Settings, device: torch.device) -> Setup:
    mixprec.to_low_precision(model, torch.float16)
    scaler, scale_state = _mixprec_scaler(device)
    return Setup(model, mixprec.MasterWeights(_adamw(model.parameters(), s)), scaler=scaler, scale_state=scale_state)


#: Steps between two readings of the fp8 statistics (and two decisions of the guard or controller).
FP8_EVERY = 10


def _backend(s: Settings, default: str) -> str:
    """The fp8 backend of a mode: ``default``, or ``"emulate_tc"`` when the settings ask for
    tensor-core accumulation (``--fp8-accumulate tensor_core``)."""
    return "emulate_tc" if s.fp8_accumulate == "tensor_core" else default


def _setup_fp8(recipe: str, **thresholds: Any) -> Callable[[nn.Module, Settings, torch.device], Setup]:
    """fp32 weights, bf16 autocast whose selected Linear layers run in fp8 ``recipe``, and a
    guard checked every :data:`FP8_EVERY` steps with the default thresholds (underflow > 5% or
    any inf/NaN moves a layer back) unless ``thresholds`` (``Guard``'s arguments) say otherwise.

    The loop calls ``guard.step(model)`` after each optimizer step and reads the statistics
    just before each of its checks, so that its windows line up with what the report reads.
    """

    def setup(model: nn.Module, s: Settings, device: torch.device) -> Setup:
        guard = mixprec.fp8.Guard(every=FP8_EVERY, **thresholds)
        policy = mixprec.Policy.parse("compute=bf16").fp8(recipe, backend=_backend(s, "auto"))
        autocast = lambda: mixprec.autocast(device.type, policy=policy)  # noqa: E731
        return Setup(model, _adamw(model.parameters(), s), autocast, fp8_guard=guard, fp8_recipe=recipe,
                     fp8_policy=policy)

    return setup


#: The controller's ladder in the fp8 modes, from the mode's recipe up: a rowwise mode never goes
#: down to tensorwise, so that each mode measures its own recipe.
_LADDER = ("tensorwise", "rowwise", "compute", "fp32")


def _setup_fp8_controlled(recipe: str, **settings: Any) -> Callable[[nn.Module, Settings, torch.device], Setup]:
    """As :func:`_setup_fp8`, with a :class:`mixprec.Controller` deciding every
    :data:`FP8_EVERY` steps (its defaults unless ``settings``, ``Controller``'s arguments, say
    otherwise; its ladder starts at ``recipe``: tensorwise, rowwise, bf16) instead of a guard.
    (fp32, the ladder's last rung, is reached only under fp16 compute.)

    The loop calls ``controller.step()`` after each optimizer step and reads the statistics just
    before each of its checks (which reset the windows).
    """

    def setup(model: nn.Module, s: Settings, device: torch.device) -> Setup:
        ladder = _LADDER[_LADDER.index(recipe):]
        ctl = mixprec.Controller(every=FP8_EVERY, **{"ladder": ladder, **settings})
        policy = mixprec.Policy.parse("compute=bf16").fp8(recipe, controller=ctl, backend=_backend(s, "auto"))
        autocast = lambda: mixprec.autocast(device.type, policy=policy)  # noqa: E731
        return Setup(model, _adamw(model.parameters(), s), autocast, fp8_controller=ctl, fp8_recipe=recipe,
                     fp8_policy=policy)

    return setup


#: The recipe of the fp4 modes: NVFP4 as Transformer Engine's recipe runs it (16x16 weight blocks,
#: a random Hadamard transform on the weight-gradient GEMM's operands, stochastic rounding of the
#: gradients).
FP4_RECIPE = "nvfp4"
#: The controller's ladder in ``mixprec-fp4``: NVFP4, then the fp8 recipes, then the compute dtype.
FP4_LADDER = ("nvfp4", "tensorwise", "rowwise", "compute")
#: How the fp4 modes' GEMMs are emulated: dequantized and multiplied in float32, the product rounded
#: once, as an fp4 tensor core accumulates (``"emulate"``, torchao's emulation, multiplies in bf16,
#: which a CPU without native bf16 GEMMs runs 5-20x slower than float32; the fp8 modes' tensorwise
#: and rowwise GEMMs are float32 under either backend).
FP4_BACKEND = "emulate_fp32"
#: The most a forward GEMM's output error may cost the loss in ``mixprec-fp4``, in nats
#: (``Controller.max_loss_cost``): the head's NVFP4 forward costs 0.003-0.012 nats a step on tiny
#: and small, every other layer's at most 0.0008 (docs/fp8.md, "FP4 acceptance").
FP4_MAX_LOSS_COST = 1e-3
#: The most a backward GEMM's error may cost the loss per step through the update in
#: ``mixprec-fp4`` (``Controller.max_backward_cost``; it replaces their flush rule): a cost per
#: step, paid again on every step the GEMM runs, against a forward's level, so the forward's
#: limit spread over the steps the controller forecasts (``horizon`` windows of
#: :data:`FP8_EVERY` steps: 3.3e-5). With each input gradient charged by its reach (``_reach``)
#: and AdamW's noise cost, the heads' NVFP4 backward GEMMs read 5e-5 to 2e-4 a step on tiny and
#: the Llama, every hidden one at most 1.5e-5 after the first window: at 3.3e-5 the heads' are
#: promoted and no other (docs/controller.md, "The limit, like with like"; issue 39).
FP4_MAX_BACKWARD_COST = FP4_MAX_LOSS_COST / (FP8_EVERY * mixprec.ControllerSettings.horizon)
#: The share of a forward GEMM's output rows its loss cost measures a step in ``mixprec-fp4``
#: (``Controller.cost_row_share``; the backward costs' per-row terms take them too): a quarter of
#: the reference GEMMs' work for a noisier estimate,
#: which the plan meets with more measured steps where it needs them; the same losses and fp4
#: share on tiny and the Llama within their seed noise (docs/controller.md, "A share of the rows").
FP4_COST_ROW_SHARE = 0.25
#: The fp4 modes: with the controller, all-fp4 without it, the hand recipe (first and last in bf16).
FP4_MODES = ("mixprec-fp4", "mixprec-fp4-all", "mixprec-fp4-hand")


def _setup_fp4(first_last: str, controlled: bool, recipe: str = FP4_RECIPE,
               ladder: tuple[str, ...] = FP4_LADDER) -> Callable[[nn.Module, Settings, torch.device], Setup]:
    """fp32 weights, bf16 autocast whose Linear layers run in ``recipe`` (the first and last too
    with ``first_last="fp8"``), with a :class:`mixprec.Controller` on ``ladder`` (starting at
    ``recipe``) deciding each GEMM of each layer on its own (``per_gemm=True``) every
    :data:`FP8_EVERY` steps when ``controlled``, else nothing moving them; the GEMMs emulated by
    :data:`FP4_BACKEND`."""

    def setup(model: nn.Module, s: Settings, device: torch.device) -> Setup:
        ctl = mixprec.Controller(every=FP8_EVERY, ladder=ladder, per_gemm=True,
                                 max_loss_cost=FP4_MAX_LOSS_COST, max_backward_cost=FP4_MAX_BACKWARD_COST,
                                 cost_row_share=FP4_COST_ROW_SHARE) if controlled else None
        policy = mixprec.Policy.parse("compute=bf16").fp8(recipe, first_last=first_last, controller=ctl,
                                                          backend=_backend(s, FP4_BACKEND))
        autocast = lambda: mixprec.autocast(device.type, policy=policy)  # noqa: E731
        return Setup(model, _adamw(model.parameters(), s), autocast, fp8_controller=ctl, fp8_recipe=recipe,
                     fp8_policy=policy)

    return setup


_ALL_MODES = (
    Mode("fp32", "float32 weights and compute", (), _setup_fp32),
    Mode("torch-amp", "torch.autocast fp16 + torch.amp.GradScaler (reference)", (),
         _setup_amp("torch", torch.float16), cpu_cost=7.5, speed_kind="fp16"),
    Mode("mixprec-fp16", "mixprec.autocast fp16 + mixprec.GradScaler", ("autocast", "GradScaler"),
         _setup_amp("mixprec", torch.float16), reference="torch-amp", cpu_cost=7.5, speed_kind="fp16"),
    Mode("mixprec-fp16-layerwise", "mixprec.autocast fp16 + mixprec.GradScaler(per_layer=True)",
         ("autocast", "GradScaler"), _setup_fp16_layerwise, default=False, cpu_cost=7.6, speed_kind="fp16"),
    Mode("mixprec-bf16", "mixprec.autocast bf16", ("autocast",), _setup_amp("mixprec", torch.bfloat16),
         reference="torch-amp-bf16", cpu_cost=1.5, speed_kind="bf16"),
    Mode("bf16-naive", "bf16 weights, plain torch AdamW", ("to_low_precision",), _setup_bf16(None), cpu_cost=1.2,
         speed_kind="bf16"),
    Mode("bf16-kahan", "bf16 weights, mixprec AdamW with Kahan summation",
         ("to_low_precision", "optim.AdamW"), _setup_bf16("kahan"), cpu_cost=1.4, speed_kind="bf16"),
    Mode("bf16-stochastic", "bf16 weights, mixprec AdamW with stochastic rounding",
         ("to_low_precision", "optim.AdamW"), _setup_bf16("stochastic"), cpu_cost=2.2, speed_kind="bf16"),
    Mode("fp16-master", "fp16 weights + fp32 MasterWeights + mixprec.GradScaler",
         ("to_low_precision", "MasterWeights", "GradScaler"), _setup_fp16_master, cpu_cost=8.0,
         speed_kind="fp16"),
    Mode("mixprec-fp8", "mixprec.autocast bf16 + fp8 tensorwise Linear layers (policy, controller)",
         ("autocast", "Policy.fp8", "Controller"), _setup_fp8_controlled("tensorwise"), cpu_cost=5.0,
         speed_kind="fp8"),
    Mode("mixprec-fp8-rowwise", "mixprec.autocast bf16 + fp8 rowwise Linear layers (policy, controller)",
         ("autocast", "Policy.fp8", "Controller"), _setup_fp8_controlled("rowwise"), cpu_cost=5.5,
         speed_kind="fp8"),
    Mode("mixprec-fp8-guard", "mixprec.autocast bf16 + fp8 tensorwise Linear layers (policy, guard)",
         ("autocast", "Policy.fp8", "fp8.Guard"), _setup_fp8("tensorwise"), default=False, cpu_cost=5.0,
         speed_kind="fp8"),
    Mode("mixprec-fp8-rowwise-guard", "mixprec.autocast bf16 + fp8 rowwise Linear layers (policy, guard)",
         ("autocast", "Policy.fp8", "fp8.Guard"), _setup_fp8("rowwise"), default=False, cpu_cost=5.5,
         speed_kind="fp8"),
    Mode("torch-amp-bf16", "torch.autocast bf16 (reference of mixprec-bf16)", (),
         _setup_amp("torch", torch.bfloat16), default=False, cpu_cost=1.2, speed_kind="bf16"),
    Mode("mixprec-fp4", "mixprec.autocast bf16 + every Linear layer NVFP4, controller per GEMM nvfp4 -> fp8 -> bf16",
         ("autocast", "Policy.fp8", "Controller", "fp8.Float8Recipe.nvfp4"), _setup_fp4("fp8", True), default=False,
         cpu_cost=10.5, speed_kind="fp8"),
    Mode("mixprec-fp4-all", "mixprec.autocast bf16 + every Linear layer NVFP4, no controller",
         ("autocast", "Policy.fp8", "fp8.Float8Recipe.nvfp4"), _setup_fp4("fp8", False), default=False,
         cpu_cost=6.5, speed_kind="fp8"),
    Mode("mixprec-fp4-hand", "mixprec.autocast bf16 + NVFP4 Linear layers, first and last in bf16 (hand recipe)",
         ("autocast", "Policy.fp8", "fp8.Float8Recipe.nvfp4"), _setup_fp4("keep", False), default=False,
         cpu_cost=6.0, speed_kind="fp8"),
)

#: Every mode by name.
MODES: dict[str, Mode] = {m.name: m for m in _ALL_MODES}
#: The modes ``mixprec demo`` runs when ``--modes`` is not given.
DEFAULT_MODES: tuple[str, ...] = tuple(m.name for m in _ALL_MODES if m.default)


def _missing(path: str) -> str | None:
    obj: Any = mixprec
    for part in path.split("."):
        try:
            obj = getattr(obj, part)
        except (AttributeError, ImportError) as e:
            return f"mixprec.{path} ({type(e).__name__}: {e})"
    return None


def check_modes(names: tuple[str, ...] | list[str]) -> None:
    """Check that every mode exists and that the mixprec APIs it needs import.

    Raises:
        ValueError: for an unknown or repeated mode name, or an empty list.
        RuntimeError: naming each mode whose mixprec API is missing.
    """
    if not names:
        raise ValueError(f"no modes given; choose from {', '.join(MODES)}")
    unknown = [n for n in names if n not in MODES]
    if unknown:
        raise ValueError(f"unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)}")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"mode(s) given more than once: {', '.join(repeated)}; give each mode once")
    problems = [
        f"{n} needs {miss}" for n in names for req in MODES[n].requires if (miss := _missing(req))
    ]
    if problems:
        raise RuntimeError("cannot run: " + "; ".join(problems))
