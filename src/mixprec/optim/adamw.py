"""AdamW for parameters of any floating dtype, with compensated or stochastic-rounding updates."""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from mixprec.optim._base import STATE_8BIT, CompensatedOptimizer, _scalar
from mixprec.optim._foreach import adamw_foreach
from mixprec.optim._fused import adamw_native
from mixprec.optim._functional import State, adamw, compute_dtype
from mixprec.optim.quant8 import MIN_NUMEL, Quantized8, new_quantized8

__all__ = ["AdamW"]

_MOMENTS = (("exp_avg", True), ("exp_avg_sq", False), ("max_exp_avg_sq", False))  # (key, signed)


class AdamW(CompensatedOptimizer):
    """``torch.optim.AdamW`` that trains bfloat16/float16 parameters like float32 ones.

    Same hyper-parameters, defaults and arithmetic as ``torch.optim.AdamW``: on float32
    parameters the two agree bitwise, and with floating-point moments (``state_dtype`` not
    ``"8bit"``) each loads the other's ``state_dict()``; with 8-bit moments give torch
    :meth:`torch_state_dict` (float32 moments), as torch would read 8-bit codes as numbers.
    For a low-precision parameter the update is computed in float32 and written back by
    ``compensation``:

    * ``"auto"`` (default): ``"exact"`` for bfloat16 parameters, ``"kahan"`` for a param group
      holding a float16 one (:func:`~mixprec.optim._base.resolve_compensation`), resolved for
      the dtypes the parameters have at each step (an optimizer built before
      :func:`mixprec.to_low_precision` compensates the cast weights). The group keeps
      ``"auto"`` (``param_groups``, ``state_dict()``): :meth:`resolved_compensation` says the rule.
    * ``None`` (or ``"none"``): rounded to nearest. Updates below half a gap of the weight
      (``2**-9`` relative for bfloat16) are lost: this is naive pure-bf16 training, which
      stalls (README: 3.8x fp32's loss); choose it explicitly, e.g. for a baseline.
    * ``"exact"`` (bfloat16 only): the float32 value's low 16 bits are kept in an int16 buffer
      (``state["low_bits"]``, +2 bytes per parameter): parameter + low bits *is* the float32
      master, so updates are exactly float32's, as with ``mixprec.MasterWeights`` at 12
      instead of 20 bytes per parameter.
    * ``"kahan"``: the rounding error is kept in a buffer of the parameter's dtype (``state
      ["kahan_comp"]``, +2 bytes) and added back at the next step. Parameter + buffer holds
      about 16 significant bits, not float32's 24: a steady update below about ``2**-17`` of the
      weight never lands (the buffer's own rounding drops it). For float16 parameters, where
      ``"exact"`` does not apply; for bfloat16 ones ``"exact"`` is exact at the same cost.
    * ``"stochastic"``: rounded stochastically (unbiased), using ``generator``; no extra memory.

    Float32/float64 parameters ignore ``compensation``.

    Args:
        params: parameters or param groups, as for any ``torch.optim`` optimizer.
        lr, betas, eps, weight_decay, amsgrad, maximize: as ``torch.optim.AdamW``.
        compensation: ``"auto"``, ``None``/``"none"``, ``"exact"``, ``"kahan"`` or
            ``"stochastic"`` (per group).
        state_dtype: storage of ``exp_avg``/``exp_avg_sq``/``max_exp_avg_sq`` (per group).
            ``None`` (default): float32 for low-precision parameters (the parameter's dtype if
            wider). ``torch.bfloat16``: 2 bytes each, rounded stochastically (rounding to
            nearest would under-estimate ``exp_avg_sq`` and over-step). ``"8bit"``: block-wise
            quantized moments (:mod:`mixprec.optim.quant8`, about 1 byte each; parameters under
            4096 elements keep float32). ``torch.float16`` and float8 dtypes are refused:
            ``exp_avg_sq`` underflows in them.
        foreach: multi-tensor implementation (bitwise equal to the per-tensor one, faster,
            one float32 temporary per parameter more); ``None`` (default) uses it where
            ``torch.optim`` does (all parameters on CUDA).
        fused: the fused AdamW arithmetic (``torch.optim.AdamW(fused=True)``'s; it differs from
            the foreach/for-loop one in the last bit) on each parameter's float32 value. On the
            CPU, low-precision parameters run mixprec's one-pass C++ kernel (bitwise torch's
            fused kernel on a float32 copy, checked at first use; 3-4x faster than fp32 foreach
            AdamW), the others torch's fused kernel on float32 working copies. ``None``
            (default) with ``foreach=None``: the C++ kernel for the low-precision CPU
            parameters it takes, torch's default path for the rest. ``False``: never fused.
        generator: randomness for stochastic rounding, on the parameters' device; ``None``
            makes one when needed, seeded from the global RNG. Its state is saved in
            ``state_dict()``.

    Raises:
        ValueError: an invalid hyper-parameter or option (in the constructor, ``add_param_group``
            and ``load_state_dict`` alike).

    ``torch.compile(opt.step, fullgraph=True)`` traces every recipe but stochastic rounding (its
    generator breaks the graph; results unchanged): the C++ kernel runs in the graph as an op,
    the other paths as tensor math the compiler fuses, one graph for every step.

    Works with ``mixprec.GradScaler`` and ``torch.amp.GradScaler`` through their fused protocol,
    float16 parameters included: the scaler checks for overflow, ``step`` skips on it (one host
    sync) or unscales the gradients on the fly. A tensor ``lr`` is read with ``.item()`` (so on
    float32 parameters the step size is torch's for a float ``lr``; torch's for a tensor ``lr``,
    formed in float32, may differ in its last bits: docs/lowp.md).

    Example:
        >>> import torch, mixprec
        >>> model = mixprec.to_low_precision(torch.nn.Linear(8, 8))  # bf16 weights
        >>> opt = mixprec.optim.AdamW(model.parameters(), lr=1e-4)
        >>> opt.resolved_compensation(opt.param_groups[0])
        'exact'
    """

    _squared_state = True
    _signed_state = frozenset(key for key, signed in _MOMENTS if signed)

    def __init__(
        self,
        params: Any,
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: Optional[bool] = None,
        fused: Optional[bool] = None,
        compensation: Optional[str] = "auto",
        state_dtype: Optional[torch.dtype | str] = None,
        generator: Optional[torch.Generator] = None,
    ) -> None:
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            foreach=foreach,
            fused=fused,
            compensation=compensation,
            state_dtype=state_dtype,
        )
        super().__init__(params, defaults, generator=generator)

    @staticmethod
    def _check_hyperparameters(group: dict[str, Any]) -> None:
        lr, eps, betas, weight_decay = group["lr"], group["eps"], group["betas"], group["weight_decay"]
        if not 0.0 <= _scalar(lr):
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")

    def _required_state(self, group: dict[str, Any], p: Tensor) -> list[str]:
        return ["step", "exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group["amsgrad"] else [])

    def _start_state(self, group: dict[str, Any], p: Tensor) -> None:
        self.state[p].setdefault("step", torch.tensor(0.0, dtype=torch.float32))
        for key, signed in _MOMENTS:
            if key != "max_exp_avg_sq" or group["amsgrad"]:
                self._moment(group, p, key, signed)

    def _store_loaded_state(self, group: dict[str, Any], p: Tensor) -> None:
        """Store each loaded moment as ``group["state_dtype"]`` says (a torch checkpoint's
        float moments become 8-bit, bfloat16 or float32 ones; codes are kept as they are)."""
        state = self.state[p]
        for key, signed in _MOMENTS:
            value = state.get(key)
            if value is None or value.dtype in (torch.uint8, self._storage(group, p)):
                continue
            del state[key]
            stored = self._moment(group, p, key, signed)  # created at zero in the group's format
            if isinstance(stored, Quantized8):
                stored.quantize_(value.to(torch.float32))
            else:
                stored.copy_(value)

    @staticmethod
    def _storage(group: dict[str, Any], p: Tensor) -> torch.dtype | str:
        """How ``group`` stores ``p``'s moments: ``"8bit"`` or a dtype (float32 or wider by default)."""
        if group["state_dtype"] == STATE_8BIT:
            return STATE_8BIT if p.numel() >= MIN_NUMEL else compute_dtype(p.dtype)
        return group["state_dtype"] or compute_dtype(p.dtype)

    def _moment(self, group: dict[str, Any], p: Tensor, key: str, signed: bool) -> State:
        """``state[key]`` of ``p`` (created at zero): a tensor, or a :class:`Quantized8` view of
        ``state[key]`` (codes) and ``state[key + "_absmax"]``."""
        state = self.state[p]
        if key not in state:
            storage = self._storage(group, p)
            if storage == STATE_8BIT:
                state[key], state[key + "_absmax"] = new_quantized8(p, signed)
            else:
                state[key] = torch.zeros_like(p, dtype=storage, memory_format=torch.preserve_format)
        value = state[key]
        if value.dtype == torch.uint8:
            return Quantized8(value, state[key + "_absmax"], signed, p.shape)
        return value

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Perform one optimization step; ``closure`` re-evaluates the loss (returned)."""
        loss, skip, inv_scale = self._begin_step(closure)
        if skip:  # a loss scaler found inf/NaN gradients
            return loss
        for group in self.param_groups:
            rule = self.resolved_compensation(group)  # "auto" for the dtypes the parameters have now
            self._drop_stale_buffers(group, rule)  # another rule's buffer (the model's dtype changed)
            params, grads, moments, steps, comps = [], [], ([], [], []), [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "step" not in state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                params.append(p)
                grads.append(p.grad)
                for (key, signed), out in zip(_MOMENTS, moments):
                    used = key != "max_exp_avg_sq" or group["amsgrad"]
                    out.append(self._moment(group, p, key, signed) if used else None)
                steps.append(state["step"])
                comps.append(self._compensation_buffer(rule, p))
            if not params:
                continue
            beta1, beta2 = group["betas"]
            hyper = dict(lr=_scalar(group["lr"]), beta1=_scalar(beta1), beta2=_scalar(beta2), eps=group["eps"],
                         weight_decay=group["weight_decay"], amsgrad=group["amsgrad"], maximize=group["maximize"],
                         compensation=rule, generator=self.generator, inv_scale=inv_scale)
            if group["fused"] is None and group["foreach"] is None:  # the C++ kernel where it applies
                stored = list(moments[:3] if group["amsgrad"] else moments[:2])
                rest = adamw_native(params, grads, stored, comps, steps, increment=True, **hyper)
                if len(rest) < len(params):
                    params, grads, steps, comps = ([lst[i] for i in rest] for lst in (params, grads, steps, comps))
                    moments = tuple([lst[i] for i in rest] for lst in moments)
                    if not params:
                        continue
            if group["fused"]:
                update: Callable[..., None] = partial(adamw_foreach, fused=True)
            else:
                update = adamw_foreach if self._uses_foreach(group) else adamw
            update(params, grads, *moments, steps, comps, **hyper)
        return loss
