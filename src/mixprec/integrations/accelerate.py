"""HF Accelerate and the HF ``Trainer`` with a mixprec policy and loss scaler.

Accelerate builds its own ``torch.autocast`` (around the forward of every prepared model and in
``accelerator.autocast()``) and its own ``torch.amp.GradScaler`` (used by
``accelerator.backward``, the prepared optimizer, ``clip_grad_norm_`` and checkpoints).
:func:`prepare` swaps both on one ``Accelerator``: prepared models then run their forward under
:func:`mixprec.autocast` with your :class:`mixprec.Policy` (outputs converted to float32 as
Accelerate does), and with ``mixed_precision="fp16"`` the loss is scaled by a
:class:`mixprec.GradScaler`. The ``Trainer`` builds its ``Accelerator`` itself and autocasts only
through it (a ``TrainerCallback`` runs outside the forward and cannot change autocast), so
:class:`MixprecTrainer` applies :func:`prepare` right after the ``Accelerator`` is created, in
``create_accelerator_and_postprocess``.

With the default policy and scaler, training is bitwise Accelerate's own mixed precision. On CPU,
Accelerate's ``mixed_precision="fp16"`` (and ``TrainingArguments(fp16=True)``) silently trains
in float32, with neither autocast nor a scaler; after :func:`prepare` it trains in fp16 with
loss scaling, bitwise a hand-written ``torch.autocast`` + ``torch.amp.GradScaler`` loop.

Example:
    >>> from accelerate import Accelerator
    >>> accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    >>> prepare(accelerator, policy=mixprec.Policy().keep(names=r"lm_head"))
    >>> model, optimizer = accelerator.prepare(model, optimizer)   # forward under the policy
"""

from __future__ import annotations

import contextlib
import functools
from types import MethodType
from typing import Any, Callable, Iterator

import torch

import mixprec
from mixprec.integrations._common import PRECISIONS, resolve_policy
from mixprec.policy import Policy

try:
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, convert_outputs_to_fp32
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "mixprec.integrations.accelerate needs HF Accelerate: pip install accelerate transformers"
    ) from e

__all__ = ["prepare", "MixprecTrainer"]

_PLAIN = (DistributedType.NO, DistributedType.MULTI_CPU)


def prepare(accelerator: Accelerator, policy: Policy | str | None = None, scaler: Any = None) -> Accelerator:
    """Make ``accelerator`` autocast with mixprec under ``policy`` and scale with ``scaler``.

    Call it once, before ``accelerator.prepare(model, ...)``; the accelerator is changed in place
    (its ``prepare_model`` and ``autocast`` methods, and ``scaler`` with fp16) and returned.

    Args:
        accelerator: an ``Accelerator`` created with ``mixed_precision="fp16"`` or ``"bf16"``.
        policy: the :class:`mixprec.Policy` (or its string form) of every prepared model's
            forward; None: PyTorch's op lists. Its ``compute`` dtype, if set, must match the
            accelerator's mixed precision.
        scaler: with ``"fp16"``, the loss scaler; None: ``mixprec.GradScaler`` with Accelerate's
            settings (``GradScalerKwargs`` of the accelerator, torch's defaults otherwise).
            Refused with ``"bf16"``, which scales nothing.

    Raises:
        ValueError: mixed precision is not "fp16"/"bf16" (or is handled by DeepSpeed/Megatron),
            a model or optimizer was already prepared (an ``AcceleratedOptimizer`` keeps the scaler
            it was built with), ``prepare`` was already applied, the policy's compute
            dtype contradicts the mixed precision, or a scaler is given with "bf16".
    """
    precision = accelerator.mixed_precision
    device_type = accelerator.device.type
    # Accelerate leaves fp16 on CPU off (no autocast, no scaler: plain fp32); mixprec has both
    cpu_fp16 = precision == "fp16" and device_type == "cpu" and accelerator.distributed_type in _PLAIN
    if precision not in ("fp16", "bf16") or not (accelerator.native_amp or cpu_fp16):
        raise ValueError(
            f"prepare() needs an Accelerator(mixed_precision='bf16' or 'fp16') that autocasts with torch, got "
            f"mixed_precision={precision!r} on {device_type} with {accelerator.distributed_type}"
        )
    if getattr(accelerator, "_mixprec_policy", None) is not None:
        raise ValueError("prepare() was already applied to this accelerator; apply it once")
    # a prepared optimizer captured the accelerator's scaler when it was wrapped: swapping it now
    # would scale the loss with one scaler and step, unscaled, with the other
    prepared = [kind for kind, objs in (("a model", accelerator._models), ("an optimizer", accelerator._optimizers))
                if objs]
    if prepared:
        raise ValueError(
            f"call prepare(accelerator, ...) before accelerator.prepare(...): {' and '.join(prepared)} "
            "was already prepared; create the Accelerator, apply prepare(), then prepare the model and optimizer"
        )
    dtype = PRECISIONS[precision]
    policy = resolve_policy(policy, dtype, "prepare")
    if precision == "bf16" and scaler is not None:
        raise ValueError("mixed_precision='bf16' uses no loss scaler; drop scaler= or use 'fp16'")
    if precision == "fp16":
        if scaler is None:
            kwargs = accelerator.scaler_handler.to_kwargs() if accelerator.scaler_handler is not None else {}
            scaler = mixprec.GradScaler(accelerator.device.type, **kwargs)
        accelerator.scaler = scaler
        accelerator.native_amp = True  # also what makes clip_grad_norm_ unscale first

    def autocast(handler: Any = None, root: torch.nn.Module | None = None) -> mixprec.autocast:
        handler = accelerator.autocast_handler if handler is None else handler
        kwargs = handler.to_kwargs() if handler is not None else {}
        return mixprec.autocast(device_type, dtype=dtype, policy=policy, root=root, **kwargs)

    accelerator._mixprec_policy = policy
    accelerator.prepare_model = _prepare_model(accelerator.prepare_model, accelerator, autocast)
    accelerator.autocast = _autocast_method(autocast)
    return accelerator


def _prepare_model(original: Callable[..., Any], accelerator: Accelerator, autocast: Callable[..., Any]) -> Callable[..., Any]:
    """``accelerator.prepare_model`` that wraps the forward in mixprec's autocast instead of
    torch's (Accelerate's own wrapping is switched off for the call)."""

    @functools.wraps(original)
    def prepare_model(model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if "_original_forward" not in model.__dict__:  # not wrapped yet (unwrap_model removes it)
            _wrap_forward(model, autocast)
        native, accelerator.native_amp = accelerator.native_amp, False
        try:
            return original(model, *args, **kwargs)
        finally:
            accelerator.native_amp = native

    return prepare_model


def _wrap_forward(model: torch.nn.Module, autocast: Callable[..., Any]) -> None:
    """What Accelerate does to a prepared model's forward, with mixprec's autocast: the forward
    runs in the region, its outputs are converted to float32, ``_original_forward`` is kept so
    that ``accelerator.unwrap_model(model, keep_fp32_wrapper=False)`` strips both. Module rules
    name modules from the model (``root=model``), as in a plain loop around ``model(...)``."""

    def in_region(forward: Callable[..., Any], bound: bool) -> Callable[..., Any]:
        @functools.wraps(forward)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            # a method names from the instance it is bound to: a deepcopy's (an EMA copy) is rebound
            # to the copy, whose modules the rules must name, not the original's
            with autocast(root=args[0] if bound else model):
                return forward(*args, **kwargs)

        return wrapped

    model._original_forward = model.forward
    func = getattr(model.forward, "__func__", None)
    if func is None:
        model.forward = convert_outputs_to_fp32(in_region(model.forward, bound=False))
    else:
        model.forward = MethodType(convert_outputs_to_fp32(in_region(func, bound=True)), model)


def _autocast_method(autocast: Callable[[Any], Any]) -> Callable[..., Any]:
    @contextlib.contextmanager
    def method(autocast_handler: Any = None) -> Iterator[None]:
        """``accelerator.autocast()`` under the mixprec policy (``autocast_handler`` as Accelerate's)."""
        with autocast(autocast_handler):
            yield

    return method


def __getattr__(name: str) -> Any:
    # MixprecTrainer subclasses transformers.Trainer: built on first use, so that Accelerate users
    # need not have (or import) transformers
    if name != "MixprecTrainer":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        from transformers import Trainer
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError("MixprecTrainer needs HF transformers: pip install accelerate transformers") from e

    class MixprecTrainer(Trainer):
        """The HF ``Trainer`` with a mixprec policy and scaler: the ``Trainer``, plus two keywords.

        Args:
            policy: the :class:`mixprec.Policy` of the model's forward (see :func:`prepare`).
            scaler: the loss scaler with ``fp16=True`` (default: ``mixprec.GradScaler``).
            *args, **kwargs: the ``Trainer``'s; ``TrainingArguments(bf16=True)`` or ``fp16=True``
                selects the dtype (fp16 on CPU too, which the plain ``Trainer`` runs in fp32).

        Raises:
            ValueError: a policy or scaler without ``bf16=True``/``fp16=True``; see :func:`prepare`.

        Example:
            >>> trainer = MixprecTrainer(model=model, args=TrainingArguments("out", bf16=True),
            ...                          train_dataset=data, policy=mixprec.Policy().keep(names="lm_head"))
            >>> trainer.train()
        """

        def __init__(self, *args: Any, policy: Policy | str | None = None, scaler: Any = None, **kwargs: Any) -> None:
            self.mixprec_policy, self.mixprec_scaler = policy, scaler
            super().__init__(*args, **kwargs)

        def create_accelerator_and_postprocess(self) -> None:
            # the one place where the Trainer's Accelerator exists and no model is prepared yet
            super().create_accelerator_and_postprocess()
            if self.accelerator.mixed_precision in ("fp16", "bf16"):
                prepare(self.accelerator, self.mixprec_policy, self.mixprec_scaler)
            elif self.mixprec_policy is not None or self.mixprec_scaler is not None:
                raise ValueError("MixprecTrainer(policy=..., scaler=...) needs TrainingArguments(bf16=True) or fp16=True")

    MixprecTrainer.__module__ = __name__
    globals()[name] = MixprecTrainer
    return MixprecTrainer
