"""The shell shared by :class:`mixprec.optim.AdamW` and :class:`mixprec.optim.SGD`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn
from torch.optim.optimizer import _default_to_fused_or_foreach

from mixprec._unscale import inverse_scale
from mixprec.scaling.protocol import lent_scale
from mixprec.optim._functional import COMPENSATIONS, NARROW, compute_dtype
from mixprec.optim._fused import any_candidate, native_ops
from mixprec.optim.exact import check_exact_dtype, exact_write_
from mixprec.optim.kahan import kahan_write_
from mixprec.optim.quant8 import BLOCK, Quantized8

__all__ = ["CompensatedOptimizer", "resolve_compensation"]


_FLOAT8 = tuple(getattr(torch, n) for n in dir(torch) if n.startswith("float8_"))
#: ``state_dtype`` asking for block-wise quantized 8-bit moments (AdamW only).
STATE_8BIT = "8bit"
#: The ``compensation`` values a user may pass: the rules, plus ``"auto"`` (the default) and
#: ``"none"`` (the same as ``None``: round to nearest).
CHOICES = ("auto", "none", *COMPENSATIONS)
#: State keys of the compensation buffers, by rule.
_BUFFERS = {"kahan_comp": "kahan", "low_bits": "exact"}


def resolve_compensation(compensation: Any, params: Iterable[Tensor]) -> Optional[str]:
    """The rule a param group's low-precision parameters are written back with.

    ``"auto"``: ``"kahan"`` if the group has a float16 parameter (``"exact"`` does not apply to
    float16), else ``"exact"`` if it has a bfloat16 one (float32 updates at +2 bytes per
    parameter), else ``None`` (float32/float64 parameters are never compensated). ``"none"``:
    ``None``. Any other value is returned as is (see :func:`_check_options`).

    Example:
        >>> resolve_compensation("auto", [torch.zeros(2, dtype=torch.bfloat16)])
        'exact'
    """
    if compensation == "none":
        return None
    if compensation != "auto":
        return compensation
    dtypes = {p.dtype for p in params}
    if torch.float16 in dtypes:
        return "kahan"
    return "exact" if torch.bfloat16 in dtypes else None


def _check_options(compensation: Any, state_dtype: Any, squared_state: bool) -> None:
    """Validate ``compensation`` and ``state_dtype``. ``squared_state``: the optimizer keeps a
    moment of squared gradients (AdamW), which float16 and float8 flush to zero."""
    if not isinstance(compensation, (str, type(None))) or compensation not in CHOICES:
        raise ValueError(
            "compensation must be 'auto' (the default), None or 'none' (round to nearest), 'kahan', "
            f"'exact' or 'stochastic', got {compensation!r}"
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


def _check_params(params: list[Tensor]) -> None:
    for p in params:
        if not isinstance(p, Tensor):
            raise TypeError(f"optimizer can only optimize Tensors, got {type(p).__name__}")
        if not p.is_floating_point():
            raise ValueError(f"can only optimize floating-point tensors, got {p.dtype}")


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
    #: State keys whose 8-bit codes use the signed map (AdamW's exp_avg).
    _signed_state: frozenset[str] = frozenset()

    def __init__(
        self,
        params: Any,
        defaults: dict[str, Any],
        *,
        generator: Optional[torch.Generator] = None,
    ) -> None:
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None, got {type(generator)}")
        self.generator = generator
        super().__init__(params, defaults)

    def __getstate__(self) -> dict[str, Any]:
        """Pickling and ``copy.deepcopy``: torch's state (defaults, state, param groups) and the
        generator as its device and state, so a copy steps, and draws what the original would."""
        state = super().__getstate__()
        g = self.generator
        state["generator"] = None if g is None else (str(g.device), g.get_state())
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        saved = state.pop("generator", None)
        super().__setstate__(state)
        self.generator = None
        if saved is not None:
            self.generator = torch.Generator(saved[0])
            self.generator.set_state(saved[1])

    @staticmethod
    def _check_hyperparameters(group: dict[str, Any]) -> None:
        """Raise ``ValueError`` on an invalid hyper-parameter of ``group`` (subclasses)."""

    def _validated_group(self, param_group: dict[str, Any]) -> dict[str, Any]:
        """``param_group`` completed with the defaults and checked (``"none"`` kept as ``None``;
        ``"auto"`` is kept, and resolved for the parameters' dtypes at each step:
        :meth:`resolved_compensation`): what the constructor, ``add_param_group`` and
        ``load_state_dict`` all keep. Raises ``ValueError``/``TypeError`` on an invalid option,
        hyper-parameter or parameter."""
        params = param_group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        group = {**self.defaults, **param_group, "params": params}
        _check_options(group["compensation"], group["state_dtype"], self._squared_state)
        if group["fused"] and group["foreach"]:
            raise ValueError("`fused` and `foreach` cannot be `True` together.")
        self._check_hyperparameters(group)
        _check_params(params)
        if group["compensation"] == "none":
            group["compensation"] = None
        if resolve_compensation(group["compensation"], params) == "exact":
            for p in params:
                check_exact_dtype(p.dtype)
        return group

    @staticmethod
    def resolved_compensation(group: dict[str, Any]) -> Optional[str]:
        """The rule ``group``'s low-precision parameters are written back with now: its
        ``compensation``, ``"auto"`` resolved for the dtypes its parameters have now
        (:func:`resolve_compensation`), so that an optimizer built before
        :func:`mixprec.to_low_precision` casts its parameters compensates them after it.

        Example:
            >>> import mixprec
            >>> model = torch.nn.Linear(4, 4)
            >>> opt = mixprec.optim.AdamW(model.parameters())
            >>> opt.param_groups[0]["compensation"], opt.resolved_compensation(opt.param_groups[0])
            ('auto', None)
            >>> _ = mixprec.to_low_precision(model)
            >>> opt.resolved_compensation(opt.param_groups[0])
            'exact'
        """
        return resolve_compensation(group["compensation"], group["params"])

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        group = self._validated_group(param_group)
        super().add_param_group(group)
        self._ensure_generator()
        kernel = group["fused"] or (group["fused"] is None and group["foreach"] is None)  # see AdamW's fused=
        if kernel and any_candidate(group["params"]):
            native_ops()  # decide on the C++ kernel now, not inside a step torch.compile traces

    def _ensure_generator(self, state: Optional[Tensor] = None) -> None:
        """Give the optimizer a generator if a group draws random numbers and it has none: on
        that group's device, set to ``state`` (a saved ``generator_state``) or else seeded from
        the global RNG. A given ``state`` is loaded into an existing generator."""
        if self.generator is None:
            drawing = [g["params"][0].device for g in self.param_groups
                       if g["params"] and _rounds_stochastically(g["compensation"], g["state_dtype"])]
            if not drawing:
                return
            self.generator = _own_generator(drawing[0]) if state is None else torch.Generator(drawing[0])
        if state is not None:
            self.generator.set_state(state.cpu())

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

    def _compensation_buffer(self, compensation: Optional[str], p: Tensor) -> Optional[Tensor]:
        """The Kahan buffer (parameter dtype) or exact low bits (int16) of ``p`` under the rule
        ``compensation`` (resolved: :meth:`resolved_compensation`), created at zero, or None if
        ``p`` does not use one."""
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

    def _drop_stale_buffers(self, group: dict[str, Any], compensation: Optional[str]) -> None:
        """Drop each compensation buffer of ``group``'s parameters that the rule resolved now
        (``compensation``, for the dtype each parameter has now) does not use: after the model's
        dtype changed (``model.float()``, ``model.half()``) ``"auto"`` resolves to another rule,
        and the earlier rule's buffer describes weights that are gone. Kept, it was saved in
        :meth:`state_dict` (which :meth:`load_state_dict` then refused) and, back in bfloat16,
        stale low bits were added to the new weights; dropped, the rule's buffer restarts at zero
        (the weights as they are). Called per group at each step and by :meth:`state_dict`."""
        for p in group["params"]:
            state = self.state.get(p)
            if not state:
                continue
            used = compensation if p.dtype != compute_dtype(p.dtype) else None
            for key, rule in _BUFFERS.items():
                if rule != used and key in state:
                    del state[key]

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``torch.optim.Optimizer.state_dict()`` with mixprec's state as it is stored (Kahan
        buffers, int16 low bits, 8-bit codes and their ``*_absmax``), plus ``"generator_state"``
        when the optimizer has a ``generator``, so that stochastic rounding resumes bitwise.

        Only this class loads it faithfully. ``torch.optim`` optimizers load it correctly when
        the moments are floating-point (``state_dtype`` ``None`` or a float dtype); they would
        read 8-bit codes as numbers (0-255): give them :meth:`torch_state_dict` instead. A
        compensation buffer the rule resolved now does not use (the model's dtype changed since
        the last step) is dropped first, as the next step would drop it."""
        for group in self.param_groups:
            self._drop_stale_buffers(group, self.resolved_compensation(group))
        state = super().state_dict()
        if self.generator is not None:
            state["generator_state"] = self.generator.get_state()
        return state

    def torch_state_dict(self) -> dict[str, Any]:
        """The state in ``torch.optim``'s format, for ``torch.optim.AdamW``/``SGD``.

        The moments are float32 (8-bit ones dequantized), the param groups lose
        ``compensation``/``state_dtype``, and what torch has no use for is left out (Kahan
        buffers, low bits, ``*_absmax``, ``generator_state``): the torch optimizer resumes with
        the same moments. Loading it back into this class quantizes them again where a group's
        ``state_dtype`` says so (lossy for 8-bit state, like any requantization).

        Example:
            >>> import mixprec
            >>> model = torch.nn.Linear(64, 64)
            >>> opt = mixprec.optim.AdamW(model.parameters(), state_dtype="8bit")
            >>> model(torch.randn(2, 64)).sum().backward(); opt.step()
            >>> torch.optim.AdamW(model.parameters()).load_state_dict(opt.torch_state_dict())
        """
        state = super().state_dict()
        for group in state["param_groups"]:
            for key in ("compensation", "state_dtype"):
                group.pop(key, None)
        params = [p for g in self.param_groups for p in g["params"]]  # torch's indices
        state["state"] = {index: self._torch_format(params[index], saved) for index, saved in state["state"].items()}
        return state

    def _torch_format(self, p: Tensor, saved: Mapping[str, Any]) -> dict[str, Any]:
        """``p``'s state as ``torch.optim`` keeps it: float32 moments, no mixprec buffers."""
        out = {}
        for key, value in saved.items():
            if key in _BUFFERS or key.endswith("_absmax"):
                continue
            if isinstance(value, Tensor) and value.dtype == torch.uint8:
                value = Quantized8(value, saved[key + "_absmax"], key in self._signed_state, p.shape).dequantize()
            elif key != "step" and isinstance(value, Tensor) and value.dtype in NARROW:
                value = value.float()
            out[key] = value
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict` of this class or a ``torch.optim`` optimizer's state dict.

        Each saved param group is validated exactly as the constructor validates one (its
        options, hyper-parameters and the parameters it now holds); groups saved without
        ``compensation``/``state_dtype`` (a torch checkpoint) get this optimizer's defaults,
        ``compensation="auto"`` resolved for their parameters. Each parameter's saved state must
        hold what its group's step reads (AdamW: ``step``, ``exp_avg``, ``exp_avg_sq``, and
        ``max_exp_avg_sq`` with ``amsgrad``; SGD with momentum: ``momentum_buffer``; no buffer of
        another compensation). Unlike ``torch.optim.Optimizer.load_state_dict``, state tensors
        keep the dtype they were saved in (torch would cast float32 moments, 8-bit codes and
        int16 low bits to a bfloat16 parameter's dtype), except that moments are stored as their
        group's ``state_dtype`` says (a torch checkpoint's float moments become 8-bit, bfloat16
        or float32 ones). A saved ``"generator_state"`` is restored into the ``generator``,
        created if the optimizer has none (on the device of the first group that rounds
        stochastically); a group that rounds stochastically gets a generator as in the
        constructor.

        Raises:
            ValueError, TypeError: the state dict does not match this optimizer (group or
                parameter count), or a group or a parameter's state is invalid (a missing key,
                another compensation's buffer, a tensor whose shape does not fit its parameter:
                8-bit codes and ``*_absmax`` are checked against the parameter's block count).
                Everything is checked before anything changes: a refused load leaves the
                optimizer (hyper-parameters, state, generator) exactly as it was.
        """
        state_dict = dict(state_dict)
        generator_state = state_dict.pop("generator_state", None)
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        groups = []
        for saved, current in zip(saved_groups, self.param_groups):
            if len(saved["params"]) != len(current["params"]):
                raise ValueError(
                    "loaded state dict contains a parameter group that doesn't match the size of optimizer's group"
                )
            group = self._validated_group({**saved, "params": current["params"]})
            rule = self.resolved_compensation(group)  # a saved "auto": for the parameters held now
            for index, p in zip(saved["params"], group["params"]):
                self._check_saved_state(group, rule, p, index, state_dict["state"].get(index) or {})
            groups.append({**group, "params": saved["params"]})
        if generator_state is not None and not isinstance(generator_state, Tensor):
            raise TypeError(f"generator_state must be a torch.Generator's state (a uint8 tensor), got "
                            f"{type(generator_state).__name__}")
        before = self.state, self.param_groups, self.generator
        generator_before = None if self.generator is None else self.generator.get_state()
        try:
            super().load_state_dict({**state_dict, "param_groups": groups})
            for saved, group in zip(groups, self.param_groups):
                for index, p in zip(saved["params"], group["params"]):
                    kept = state_dict["state"].get(index) or {}
                    for key, value in kept.items():  # torch casts them all to p's dtype, codes and bits too
                        if key != "step" and isinstance(value, Tensor):
                            self.state[p][key] = value.detach().to(device=p.device, copy=True)
                    if kept:
                        self._store_loaded_state(group, p)
            self._ensure_generator(generator_state)
        except BaseException:  # e.g. a generator state of another device: back to what was
            self.state, self.param_groups, self.generator = before
            if generator_before is not None:
                self.generator.set_state(generator_before)
            raise

    def _check_saved_state(self, group: dict[str, Any], compensation: Optional[str], p: Tensor, index: Any,
                           saved: Mapping[str, Any]) -> None:
        """Raise ``ValueError`` if ``saved`` (one parameter's state) lacks what ``group``'s step
        reads or holds another rule's buffer than ``compensation`` (the group's, resolved)."""
        for key, rule in _BUFFERS.items():
            if key in saved and compensation != rule:
                raise ValueError(
                    f"the saved state of parameter {index} holds {key!r} (compensation={rule!r}) but its "
                    f"param group says compensation={compensation!r}: the checkpoint was edited "
                    "or mixes two optimizers"
                )
        missing = [k for k in self._required_state(group, p) if saved and k not in saved]
        missing += [k + "_absmax" for k, v in saved.items()
                    if isinstance(v, Tensor) and v.dtype == torch.uint8 and k + "_absmax" not in saved]
        if missing:
            raise ValueError(
                f"the saved state of parameter {index} lacks {', '.join(map(repr, missing))} (it has "
                f"{', '.join(map(repr, saved))}): it is not the state of a {type(self).__name__} with these "
                "options; load the state dict it was saved with, or drop the parameter's entry to start it afresh"
            )
        for key, value in saved.items():
            if not isinstance(value, Tensor):
                continue
            expected = _saved_numel(key, value, p, saved)
            fits = value.numel() == expected if expected is not None else tuple(value.shape) == tuple(p.shape)
            if not fits:
                want = f"{expected} elements" if expected is not None else f"shape {tuple(p.shape)}"
                raise ValueError(
                    f"the saved state of parameter {index} holds {key!r} of shape {tuple(value.shape)} for a "
                    f"parameter of shape {tuple(p.shape)} (expected {want}): the checkpoint belongs to "
                    "another model or parameter order; load the matching checkpoint, or drop the "
                    "parameter's entry to start it afresh"
                )

    def _required_state(self, group: dict[str, Any], p: Tensor) -> list[str]:
        """The state keys a parameter's step reads once it has stepped (subclasses)."""
        return []

    def _start_state(self, group: dict[str, Any], p: Tensor) -> None:
        """Give ``p``, not stepped yet, the state its first step would create (subclasses):
        :meth:`load_fp32_weights` seeds a compensation buffer, and a state dict saved then must
        hold what :meth:`load_state_dict` asks of a started state."""

    def _store_loaded_state(self, group: dict[str, Any], p: Tensor) -> None:
        """Convert ``p``'s loaded state to what ``group`` stores (subclasses)."""

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
        A parameter given a buffer gets the rest of the state its first step would create, so a
        :meth:`state_dict` saved before that step loads and resumes bitwise.

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
        rules = [rule for g in self.param_groups for rule in [self.resolved_compensation(g)] * len(g["params"])]
        for p, src, rule in zip(params, sources, rules):
            if tuple(src.shape) != tuple(p.shape):
                raise ValueError(f"shape mismatch: weight {tuple(src.shape)} for parameter {tuple(p.shape)}")
            comp = self._compensation_buffer(rule, p)
            src = src.detach().to(device=p.device, dtype=compute_dtype(p.dtype), copy=comp is not None)
            if comp is None:
                p.copy_(src)
            elif comp.dtype == torch.int16:
                exact_write_(p, comp, src)  # overwrites src: a copy
            else:
                kahan_write_(p, comp, src)
        for group in self.param_groups:  # a seeded buffer in an otherwise empty state would not load
            for p in group["params"]:
                if self.state.get(p):
                    self._start_state(group, p)


def _saved_numel(key: str, value: Tensor, p: Tensor, saved: Mapping[str, Any]) -> Optional[int]:
    """How many elements a saved state tensor of ``p`` must have where its shape is not ``p``'s
    (``None``: it must have ``p``'s shape): one for ``step``, whole blocks of 8-bit codes and one
    ``*_absmax`` per block."""
    blocks = -(-p.numel() // BLOCK)
    if key == "step":
        return 1
    if key.endswith("_absmax") and key[: -len("_absmax")] in saved:
        return blocks
    if value.dtype == torch.uint8:
        return blocks * BLOCK
    return None
