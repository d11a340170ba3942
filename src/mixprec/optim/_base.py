"""The shell shared by :class:`mixprec.optim.AdamW` and :class:`mixprec.optim.SGD`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn
from torch.optim.optimizer import _default_to_fused_or_foreach

from mixprec._unscale import inverse_scale
from mixprec.scaling.protocol import lent_scale
from mixprec.optim._functional import COMPENSATIONS, compute_dtype
from mixprec.optim._fused import any_candidate, native_ops
from mixprec.optim.exact import check_exact_dtype, exact_write_
from mixprec.optim.kahan import kahan_write_

__all__ = ["CompensatedOptimizer"]


_FLOAT8 = tuple(getattr(torch, n) for n in dir(torch) if n.startswith("float8_"))
#: ``state_dtype`` asking for block-wise quantized 8-bit moments (AdamW only).
STATE_8BIT = "8bit"


def _check_options(compensation: Any, state_dtype: Any, squared_state: bool) -> None:
    """Validate ``compensation`` and ``state_dtype``. ``squared_state``: the optimizer keeps a
    moment of squared gradients (AdamW), which float16 and float8 flush to zero."""
    if compensation not in COMPENSATIONS:
        raise ValueError(
            f"compensation must be None, 'kahan', 'exact' or 'stochastic', got {compensation!r}"
        )
    if squared_state and state_dtype == STATE_8BIT:
        return
    if state_dtype is not None and not (
        isinstance(state_dtype, torch.dtype) and state_dtype.is_floating_point
    ):
        eight = ", or '8bit'" if squared_state else ""
        raise ValueError(
            f"state_dtype must be None (float32 or wider) or a floating torch.dtype{eight}, "
            f"got {state_dtype!r}"
        )
    if state_dtype in _FLOAT8 or (squared_state and state_dtype == torch.float16):
        held = "exp_avg_sq (~ grad**2)" if squared_state else "the momentum"
        instead = "torch.bfloat16 (float32's range in 2 bytes) or '8bit' (block-wise scaled)"
        raise ValueError(
            f"state_dtype={state_dtype} cannot hold {held}: small values fall below its smallest "
            f"number and become 0, and the update blows up. Use {instead if squared_state else 'torch.bfloat16'}"
        )


def _check_params(params: list[Tensor], compensation: Any) -> None:
    for p in params:
        if not p.is_floating_point():
            raise ValueError(f"can only optimize floating-point tensors, got {p.dtype}")
        if compensation == "exact":
            check_exact_dtype(p.dtype)


def _scalar(x: Any) -> float:
    """A Python float from a hyper-parameter (a tensor learning rate costs one host sync)."""
    return x.item() if isinstance(x, Tensor) else x


def _rounds_stochastically(compensation: Any, state_dtype: Any) -> bool:
    """Whether a group draws random numbers: stochastic weights or narrow float moments."""
    return compensation == "stochastic" or state_dtype in (torch.bfloat16, torch.float16)


def _own_generator(device: torch.device) -> torch.Generator:
    """A generator on ``device`` seeded from the global (CPU) random number generator."""
    seed = int(torch.empty((), dtype=torch.int64).random_().item())
    return torch.Generator(device=device).manual_seed(seed)


class CompensatedOptimizer(torch.optim.Optimizer):
    """An optimizer whose low-precision parameters are written back with ``compensation``.

    Subclasses implement :meth:`step` with a functional update, multi-tensor when the group's
    ``foreach`` says so. Each param group carries ``compensation``, ``state_dtype`` and
    ``foreach`` (so they can differ per group and are saved in ``state_dict()``).

    Randomness: stochastic rounding (``compensation="stochastic"``, and bfloat16/float16 state)
    draws from the optimizer's ``generator``. Without one, the optimizer makes its own when a
    group first needs it, on that group's device, seeded from the global RNG (one draw from
    ``torch``'s default CPU generator): a run is reproducible under ``torch.manual_seed``. The
    generator's state is saved in ``state_dict()``, so a run resumes bitwise.

    Loss scalers: the class implements their fused protocol (``_step_supports_amp_scaling``).
    ``mixprec.GradScaler`` and ``torch.amp.GradScaler`` then only check the gradients for
    inf/NaN (so float16 gradients are accepted) and set ``grad_scale``/``found_inf`` on the
    optimizer for the duration of ``step``, which skips on overflow (one ``found_inf.item()``
    host sync, as the scalers' non-fused path) and otherwise unscales each gradient on the fly,
    in float32, without writing ``.grad``.
    """

    _step_supports_amp_scaling = True
    #: The state holds squared gradients (AdamW's exp_avg_sq): no float16/float8 state.
    _squared_state = False

    def __init__(
        self,
        params: Any,
        defaults: dict[str, Any],
        *,
        generator: Optional[torch.Generator] = None,
    ) -> None:
        _check_options(defaults["compensation"], defaults["state_dtype"], self._squared_state)
        if defaults["fused"] and defaults["foreach"]:
            raise ValueError("`fused` and `foreach` cannot be `True` together.")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None, got {type(generator)}")
        self.generator = generator
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        compensation = param_group.get("compensation", self.defaults["compensation"])
        state_dtype = param_group.get("state_dtype", self.defaults["state_dtype"])
        _check_options(compensation, state_dtype, self._squared_state)
        params = param_group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        _check_params(params, compensation)
        super().add_param_group({**param_group, "params": params})
        if self.generator is None and params and _rounds_stochastically(compensation, state_dtype):
            self.generator = _own_generator(params[0].device)
        fused = param_group.get("fused", self.defaults.get("fused"))
        foreach = param_group.get("foreach", self.defaults.get("foreach"))
        kernel = fused or (fused is None and foreach is None)  # see AdamW's fused=
        if kernel and any_candidate(params):
            native_ops()  # decide on the C++ kernel now, not inside a step torch.compile traces

    # -- helpers for subclasses -------------------------------------------------------------
    def _begin_step(self, closure: Optional[Callable[[], Any]]) -> tuple[Any, bool, Optional[Tensor]]:
        """Run ``closure`` (with grad enabled) and read the loss scaler's inputs.

        Returns ``(loss, skip, inv_scale)``: ``skip`` when a scaler found inf/NaN gradients.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        skip, inv_scale = self._scaler_inputs()
        return loss, skip, inv_scale

    def _scaler_inputs(self) -> tuple[bool, Optional[Tensor]]:
        """``(skip, inv_scale)`` from what a loss scaler lent this step (``grad_scale``,
        ``found_inf``: :mod:`mixprec.scaling.protocol`).

        ``skip`` reads ``found_inf`` on the host (a device sync when a scaler set it).
        """
        lent = lent_scale(self)
        if lent is None:
            return False, None
        if float(lent.found_inf) != 0:
            return True, None
        if lent.grad_scale is None:
            return False, None
        return False, inverse_scale(lent.grad_scale)  # as the scalers' unscale_

    @staticmethod
    def _uses_foreach(group: dict[str, Any]) -> bool:
        """The group's ``foreach``; ``None`` decides as ``torch.optim`` does (on for CUDA)."""
        if group["foreach"] is not None:
            return bool(group["foreach"])
        return _default_to_fused_or_foreach(group["params"], differentiable=False, use_fused=False)[1]

    def _compensation_buffer(self, group: dict[str, Any], p: Tensor) -> Optional[Tensor]:
        """The Kahan buffer (parameter dtype) or exact low bits (int16) of ``p``, created at
        zero, or None if ``p`` does not use one."""
        compensation = group["compensation"]
        if compensation not in ("kahan", "exact") or p.dtype == compute_dtype(p.dtype):
            return None
        state = self.state[p]
        if compensation == "kahan":
            if "kahan_comp" not in state:
                state["kahan_comp"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            return state["kahan_comp"]
        if "low_bits" not in state:
            check_exact_dtype(p.dtype)
            state["low_bits"] = torch.zeros_like(p, dtype=torch.int16, memory_format=torch.preserve_format)
        return state["low_bits"]

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``torch.optim.Optimizer.state_dict()`` (Kahan buffers included in ``"state"``), plus
        ``"generator_state"`` when the optimizer has a ``generator``, so that stochastic rounding
        resumes bitwise. ``torch.optim`` optimizers load it (they ignore the extra key)."""
        state = super().state_dict()
        if self.generator is not None:
            state["generator_state"] = self.generator.get_state()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``state_dict()`` of this class or of the matching ``torch.optim`` optimizer.

        Unlike ``torch.optim.Optimizer.load_state_dict``, state tensors keep the dtype they were
        saved in (torch would cast float32 moments, 8-bit codes and int16 low bits to a bfloat16
        parameter's dtype). Param
        groups saved without ``compensation``/``state_dtype`` (a torch checkpoint) get this
        optimizer's defaults. A saved ``"generator_state"`` is restored into this optimizer's
        ``generator``, if it has one.
        """
        state_dict = dict(state_dict)
        generator_state = state_dict.pop("generator_state", None)
        super().load_state_dict(state_dict)
        if generator_state is not None and self.generator is not None:
            self.generator.set_state(generator_state.cpu())
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for saved_id, p in zip(saved_ids, params):
            saved = state_dict["state"].get(saved_id)
            if saved is None:
                continue
            for key, value in saved.items():  # torch casts them all to p's dtype, codes and bits too
                if key != "step" and isinstance(value, Tensor):
                    self.state[p][key] = value.detach().to(device=p.device, copy=True)
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)

    @torch.no_grad()
    def load_fp32_weights(
        self,
        weights: Iterable[Tensor] | Mapping[str, Tensor],
        model: Optional[nn.Module] = None,
    ) -> None:
        """Set the parameters from float32 (or wider) weights, keeping their low bits.

        Each parameter becomes ``round(w)`` (to nearest); with ``compensation="kahan"`` its
        buffer is seeded with ``w - round(w)``, with ``"exact"`` its low bits hold the rest of
        ``w`` exactly, so training resumes from the float32 weights themselves rather than from
        their rounding. Use it to continue an fp32 (or
        :class:`mixprec.MasterWeights`) run in pure bf16. Float32 parameters are copied exactly.

        Args:
            weights: one tensor per parameter in this optimizer's order (``[p for g in
                param_groups for p in g["params"]]``), or a state dict such as
                ``fp32_model.state_dict()``, with ``model`` to map its names to parameters
                (entries that are not parameters of ``model``, e.g. buffers, are ignored).
            model: the module owning this optimizer's parameters; required with a state dict.

        Raises:
            TypeError: a state dict without ``model``.
            ValueError: a count, name or shape mismatch.

        Example:
            >>> import torch, mixprec
            >>> fp32_model = torch.nn.Linear(4, 4)
            >>> bf16_model = mixprec.to_low_precision(torch.nn.Linear(4, 4))
            >>> opt = mixprec.optim.AdamW(bf16_model.parameters(), compensation="kahan")
            >>> opt.load_fp32_weights(fp32_model.state_dict(), model=bf16_model)
            >>> w, p = fp32_model.weight, bf16_model.weight
            >>> bool(torch.allclose(p.float() + opt.state[p]["kahan_comp"].float(), w, rtol=2**-14))
            True
        """
        params = [p for g in self.param_groups for p in g["params"]]
        if isinstance(weights, Mapping):
            if model is None:
                raise TypeError("load_fp32_weights(state_dict) needs model= to map names to parameters")
            name_of = {id(p): n for n, p in model.named_parameters()}
            sources = []
            for p in params:
                name = name_of.get(id(p))
                if name is None:
                    raise ValueError("a parameter of this optimizer is not a parameter of model")
                if name not in weights:
                    raise ValueError(f"the state dict has no entry {name!r}")
                sources.append(weights[name])
        else:
            sources = list(weights)
            if len(sources) != len(params):
                raise ValueError(
                    f"got {len(sources)} weights for {len(params)} parameters; pass one per "
                    "parameter in param_groups order, or a state dict with model="
                )
        groups = [g for g in self.param_groups for _ in g["params"]]
        for p, src, group in zip(params, sources, groups):
            if tuple(src.shape) != tuple(p.shape):
                raise ValueError(f"shape mismatch: weight {tuple(src.shape)} for parameter {tuple(p.shape)}")
            comp = self._compensation_buffer(group, p)
            src = src.detach().to(device=p.device, dtype=compute_dtype(p.dtype), copy=comp is not None)
            if comp is None:
                p.copy_(src)
            elif comp.dtype == torch.int16:
                exact_write_(p, comp, src)  # overwrites src: a copy
            else:
                kahan_write_(p, comp, src)
