"""Per-layer fp8 statistics, kept on the device, and the layer's fallback flag.

This module is the one owner of the statistics' layout: a *window* is a ``(3, 5)`` tensor, one
row per operand (:data:`OPERANDS`, indexed by :data:`INPUT`, :data:`WEIGHT`,
:data:`GRAD_OUTPUT`), the columns :data:`~mixprec.formats._quant.STAT_NAMES` (the worst value over
the window) and, last, the amax of the operand's previous cast (what ``saturated`` is judged
against). :func:`record_cast` writes one cast into a window, :func:`window_stats` and
:func:`clear_window` read and restart one; :class:`LayerState` holds a layer's window, its
sampled output SQNR and the flags routing, Guard and Controller set. Other modules pass a
window around whole (to the GEMM, to a checkpoint) and never index it.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Mapping

import torch

from mixprec._modules import clean_name, named_modules
from mixprec.formats._quant import STAT_NAMES, fold_cast_stats

__all__ = ["LayerState", "OPERANDS", "INPUT", "WEIGHT", "GRAD_OUTPUT", "layer_state", "swap_layer_state",
           "new_window", "record_cast", "window_stats", "clear_window", "rounding_steps", "load_rounding_steps",
           "ROUNDING_KEY", "CountsInStateDict", "keep_rounding_state"]

#: rows of :attr:`LayerState.stats`.
OPERANDS = ("input", "weight", "grad_output")
#: the row of each operand in a window.
INPUT, WEIGHT, GRAD_OUTPUT = range(len(OPERANDS))
_ATTR = "_mixprec_fp8_state"
_DRAWN = 64  # steps a layer's state remembers for activation checkpoints' recomputes
_AMAX = STAT_NAMES.index("amax")
#: the entry a layer's fp4 call count takes in its module's ``state_dict()`` (after the module's prefix)
ROUNDING_KEY = "_mixprec_rounding_step"


def new_window(device: torch.device | str | None = None) -> torch.Tensor:
    """An empty window (nothing recorded, no previous amax) of the default dtype on ``device``."""
    return torch.zeros(len(OPERANDS), len(STAT_NAMES) + 1, device=device)


def record_sqnr(sqnr: torch.Tensor, reference: torch.Tensor, error: torch.Tensor) -> None:
    """Lower the running minimum ``sqnr`` (dB, float32) to this GEMM's signal-to-quantization-noise
    ratio, ``20 log10(|reference| / |error|)`` in float64 (no host sync). An exact output (zero
    error: a zero weight, an all-zero batch) is ``+inf`` dB, never the NaN of ``0 / 0``, which
    every threshold would read as a failure."""
    signal, noise = torch.linalg.vector_norm(reference), torch.linalg.vector_norm(error)
    db = torch.where(noise == 0, torch.inf, 20 * torch.log10(signal / noise))
    torch.minimum(sqnr, db.float(), out=sqnr)


def record_cast(window: torch.Tensor | None, operand: int, x: torch.Tensor, q: torch.Tensor,
                amax: torch.Tensor) -> None:
    """Fold one cast of ``x`` (to ``q``, with ``amax``) into row ``operand`` of ``window``: the
    worst of each statistic (:func:`~mixprec.formats._quant.cast_stats`, saturation judged against
    the row's previous amax), and this cast's amax as the new previous one. ``window`` None:
    nothing is recorded. In place, on the device (no host sync); traceable."""
    if window is not None:
        fold_cast_stats(window[operand], x, q, amax)


def window_stats(window: torch.Tensor) -> torch.Tensor:
    """The ``(3, 4)`` statistics of ``window`` (a view, without the previous amaxes)."""
    return window[:, :-1]


def clear_window(window: torch.Tensor) -> None:
    """Start ``window`` over (in place): statistics to zero, the previous amaxes kept."""
    window[:, :-1].zero_()


class LayerState:
    """What one fp8 linear layer saw since the last :meth:`reset`, on the device (no host sync).

    ``stats`` is a ``(3, 4)`` float32 tensor: one row per operand (``input``, ``weight``,
    ``grad_output``), columns ``amax``, ``saturated`` (fraction beyond the previous cast's amax:
    what a delayed scale would clip), ``underflow`` (fraction of nonzero values the cast flushed
    to zero) and ``nonfinite`` (count); each is the worst value over the steps of the window. ``output_sqnr_db`` is the lowest
    sampled SQNR of the fp8 output against the high-precision GEMM (inf when none was sampled).
    ``fallback`` (a Python bool, set by :class:`Guard`) makes :func:`linear` run in the compute
    dtype; ``sample_sqnr`` asks the next forward to measure the SQNR (one extra GEMM);
    ``recipe`` (set by :class:`Controller`), when not None, replaces the caller's recipe;
    ``policy_recipe`` (set when a ``Policy.fp8`` selects the layer) is the recipe the policy runs
    it in, kept so that :func:`mixprec.export.export` writes the layer in the format it ran;
    ``probe`` (set by :class:`Controller`), when not None, is called by :func:`linear` as
    ``probe(input, weight_or_None, output, bias) -> output`` after the GEMM (also in fallback),
    and, where it has one, its ``probe.tap(input, weight) -> (input, weight)`` before a GEMM
    that casts (what the GEMM then reads: views whose gradients it may watch).

    Example:
        >>> st = LayerState()
        >>> st.stats.shape, st.fallback
        (torch.Size([3, 4]), False)
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        self._data = new_window(device)  # the window (see the module's docstring)
        self.output_sqnr_db = torch.full((), math.inf, device=device)
        self.fallback = False
        self.sample_sqnr = False
        self.routed = False  # a policy's call of the layer has reached fp8 (set by the routing)
        # whether the last fp8 call cast input, weight, grad_output to e2m1 (set by linear; a Guard
        # judges such an operand's underflow against its fp4 limit)
        self.e2m1 = (False, False, False)
        self.backend = None  # how the last fp8 call's GEMMs ran: "scaled_mm" or "emulated" (set by linear)
        self.recipe = None  # a Float8Recipe that replaces the caller's (set by a Controller)
        self.policy_recipe = None  # the recipe the Policy.fp8 that selected the layer runs it in (set by the routing)
        self.probe = None  # measures the layer's operands after the GEMM (set by a Controller)
        self.name: str | None = None  # the layer's name in its model (set by the routing and fp8.convert), for errors
        # fp4 calls so far, on the device: seeds their stochastic rounding (advanced by linear)
        self._rounding = torch.zeros((), dtype=torch.int64, device=device)
        self.draws = False  # an fp4 call of the layer has rounded stochastically: the count is in its state_dict
        # the steps eager forwards drew, newest last: what an activation checkpoint's recompute takes
        self._drawn: deque[torch.Tensor] = deque(maxlen=_DRAWN)
        self._completed: tuple[torch.Tensor, torch.Tensor] | None = None  # the window the last reset closed

    def route(self, recipe: Any = ..., fallback: bool | None = None) -> None:
        """The one writer of the layer's routing in mixprec (its Guard, Controller and audit call
        it): ``recipe``, a Float8Recipe that replaces the caller's (None: the caller's; ``...``:
        unchanged), ``fallback``, whether it runs in the compute dtype (None: unchanged)."""
        if recipe is not ...:
            self.recipe = recipe
        if fallback is not None:
            self.fallback = bool(fallback)

    @property
    def stats(self) -> torch.Tensor:
        """The window's ``(3, 4)`` statistics (a view of the device tensor)."""
        return window_stats(self._data)

    @property
    def window(self) -> torch.Tensor:
        """The device window itself (the statistics, then the previous amaxes): what the fp8 GEMM
        passes to :func:`record_cast`, and what a checkpoint saves (``tolist()``) and loads
        (:meth:`load_window`) whole."""
        return self._data

    def record(self, operand: int, x: torch.Tensor, q: torch.Tensor, amax: torch.Tensor) -> None:
        """:func:`record_cast` into this layer's window (no host sync)."""
        record_cast(self._data, operand, x, q, amax)

    def window_amax(self, operand: int) -> torch.Tensor:
        """The window's amax of ``operand`` so far, a ``(1,)`` view of the device tensor."""
        return self._data[operand, _AMAX:_AMAX + 1]

    def last_amax(self, operand: int) -> torch.Tensor:
        """The amax of the last cast of ``operand`` (0 before any), a 0-d view of the device tensor."""
        return self._data[operand, -1]

    def load_window(self, window: torch.Tensor, output_sqnr_db: float | None = None) -> None:
        """Copy ``window`` (a saved :attr:`window`) in, and ``output_sqnr_db`` when given.

        Raises ValueError when its shape is not a window's.
        """
        if window.shape != self._data.shape:
            raise ValueError(f"a window of shape {tuple(window.shape)}, expected {tuple(self._data.shape)}")
        self._data.copy_(window)
        if output_sqnr_db is not None:
            self.output_sqnr_db.fill_(output_sqnr_db)

    @property
    def rounding_step(self) -> int:
        """How many fp4 calls of the layer :func:`linear` has run: the ``step`` of the next one's
        stochastic rounding (:class:`~mixprec.formats._fp4.RoundingKey`). What a bitwise resume of
        an fp4 run needs (saved by :meth:`Guard.state_dict`, :meth:`Controller.state_dict` and
        :func:`rounding_steps`); set it to restore one.

        .. warning:: reads the device counter: one host sync.
        """
        return int(self._rounding)

    @rounding_step.setter
    def rounding_step(self, step: int) -> None:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"LayerState.rounding_step must be an int >= 0, got {step!r}")
        self._rounding = torch.full((), step, dtype=torch.int64, device=self._rounding.device)

    def next_rounding_step(self, stochastic: bool = True) -> torch.Tensor:
        """The step of this fp4 call (a 0-d int64 device tensor, never changed afterwards: its
        backward reads it), and count the call: on the device, no host sync; traceable, no
        recompile as it advances. The counter is replaced, not updated in place: under
        ``torch.compile`` a backward that recomputed the step from an input mutated in place
        would read the next call's.

        A call with gradients off (``torch.no_grad()``, ``torch.inference_mode()``: an evaluation
        between steps, a reentrant checkpoint's first forward) has no backward to round: it takes
        the current count and counts nothing, so evaluating leaves the training's draws as they
        were (and inference mode leaves no counter that a later forward could not save).

        A call inside the backward (eager) is an activation checkpoint's recompute
        (``torch.utils.checkpoint``): a non-reentrant one's takes the step its forward drew, the
        latest not yet taken, and counts nothing, so it draws what the forward drew; a reentrant
        one's forward drew nothing (above), so its recompute draws and counts the step the
        forward would have. (A layer called twice inside one non-reentrant segment recomputes in
        forward order and would take its steps in reverse: checkpoint such a layer's calls
        separately.)

        ``stochastic``: whether the call rounds stochastically; from the first such call on, the
        module's ``state_dict()`` carries the count (:data:`ROUNDING_KEY`)."""
        if not torch.is_grad_enabled():
            return self._rounding
        if stochastic:
            self.draws = True  # (written, never read here: Dynamo guards nothing on it)
        if torch.compiler.is_compiling():  # (a compiled recompute replays the traced step itself)
            step = self._rounding
            self._rounding = step + 1
            return step
        recompute = torch._C._current_graph_task_id() != -1
        if recompute and self._drawn:
            return self._drawn.pop()
        step = self._rounding
        self._rounding = step + 1
        if not recompute:  # (a recompute that finds none drew here: its forward ran without gradients)
            self._drawn.append(step)
        return step

    @property
    def device(self) -> torch.device:
        return self._data.device

    def to(self, device: torch.device | str) -> LayerState:
        """Move the statistics to ``device`` (in place; returns self), as normal tensors also under
        ``torch.inference_mode()`` (a layer's first call on a device may be an evaluation: the
        training after it updates them in place)."""
        with torch.inference_mode(False), torch.no_grad():
            self._data = self._data.to(device)
            self.output_sqnr_db = self.output_sqnr_db.to(device)
            self._rounding = self._rounding.to(device)
            self._drawn = deque((t.to(device) for t in self._drawn), maxlen=_DRAWN)
            if self._completed is not None:
                self._completed = (self._completed[0].to(device), self._completed[1].to(device))
        return self

    def reset(self) -> None:
        """Start a new window, keeping the one it closes for :meth:`read` (no host sync)."""
        if self._completed is None or self._completed[0].device != self.device:
            self._completed = (self._data.clone(), self.output_sqnr_db.clone())
        else:
            self._completed[0].copy_(self._data)
            self._completed[1].copy_(self.output_sqnr_db)
        clear_window(self._data)
        self.output_sqnr_db.fill_(math.inf)

    def read(self) -> dict[str, Any]:
        """The window as plain floats: ``{"input": {"amax": ...}, ..., "output_sqnr_db": ...,
        "fallback": ..., "window": ...}``. ``window`` is ``"open"`` (the statistics since the
        last :meth:`reset`, a Guard or Controller check) or, when nothing was recorded since (a
        check just ran), ``"last"``: the window that check closed, so a table printed right
        after a check shows what it judged (this rank's own values, before the all-reduce).

        .. warning:: reads the device tensors: one host sync.
        """
        data, sqnr = self._data, self.output_sqnr_db
        if self._completed is not None:
            data = torch.cat([data, self._completed[0]])
            sqnr = torch.stack([sqnr, self._completed[1]])
        values, sqnrs = data[:, :-1].tolist(), sqnr.reshape(-1).tolist()  # one sync (data and sqnr on one device)
        window = "open"
        if self._completed is not None and not any(map(any, values[:len(OPERANDS)])) and math.isinf(sqnrs[0]):
            values, sqnrs, window = values[len(OPERANDS):], sqnrs[1:], "last"
        out: dict[str, Any] = {op: dict(zip(STAT_NAMES, row)) for op, row in zip(OPERANDS, values)}
        out["output_sqnr_db"] = float(sqnrs[0])
        out["fallback"] = self.fallback
        out["window"] = window
        out["backend"] = self.__dict__.get("backend")  # (None: no fp8 call yet, or pickled before it existed)
        return out

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickling; a state pickled when the fp4 call count was a Python int (``rounding_step``)
        or before it existed (0) gets it as the device counter."""
        state = dict(state)
        step = state.pop("rounding_step", 0)
        self.__dict__.update(state)
        if "_rounding" not in state:
            self._rounding = torch.tensor(step, dtype=torch.int64, device=self._data.device)
        if "_drawn" not in state:
            self._drawn = deque(maxlen=_DRAWN)
        self.__dict__.setdefault("draws", False)
        self.__dict__.setdefault("name", None)

    def __repr__(self) -> str:
        return f"LayerState(device={self.device}, fallback={self.fallback})"


def layer_state(module: torch.nn.Module, create: bool = True) -> LayerState | None:
    """The :class:`LayerState` of ``module``, created on its weight's device on first use.

    Kept as a plain attribute of the module (not a buffer); it follows ``copy.deepcopy``. Its
    statistics are not part of ``state_dict()`` (fallback decisions that must survive a checkpoint
    live in :meth:`Guard.state_dict`); its fp4 call count is, once a call has rounded
    stochastically, in a layer :func:`convert` made (:class:`CountsInStateDict`) or a model
    :func:`keep_rounding_state` marked. Create it before ``torch.compile`` traces the model
    (:func:`convert` and the policy do).

    Example:
        >>> lin = torch.nn.Linear(16, 16)
        >>> layer_state(lin) is layer_state(lin)
        True
    """
    state = module.__dict__.get(_ATTR)
    if state is None and create:
        weight = getattr(module, "weight", None)
        state = LayerState(weight.device if isinstance(weight, torch.Tensor) else None)
        module.__dict__[_ATTR] = state
    return state


def _load_count(module: torch.nn.Module, key: str, value: Any, error_msgs: list[str]) -> None:
    """Set ``module``'s fp4 call count from the state-dict entry ``key`` (or say why not)."""
    if (not isinstance(value, torch.Tensor) or value.dim() != 0 or value.dtype != torch.int64
            or bool(value < 0)):  # (one host sync, at load)
        error_msgs.append(f"{key!r} is mixprec's fp4 call count of the layer (it seeds stochastic rounding) and "
                          f"must be a 0-d int64 tensor >= 0, got {value!r}: load a state_dict that model.state_dict() "
                          f"wrote, or drop the entry to restart the count at 0")
        return
    state = layer_state(module)
    state._rounding = value.detach().to(state.device, copy=True)
    state._drawn.clear()
    state.draws = True


class CountsInStateDict(torch.nn.Module):
    """A layer class whose ``state_dict()`` carries its fp4 call count (:data:`ROUNDING_KEY`, a
    0-d int64 tensor: no copy, no host sync) once a call has rounded stochastically, and whose
    ``load_state_dict`` restores it, so an ordinary checkpoint resumes the draws bitwise. A mixin
    of the layers :func:`convert` makes."""

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        state = self.__dict__.get(_ATTR)
        if state is not None and state.draws:
            destination[prefix + ROUNDING_KEY] = state._rounding  # (replaced by each call, never written in place)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, local_metadata: Any, strict: bool,
                              missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
        if prefix + ROUNDING_KEY in state_dict:  # (this module's own copy of the dict)
            _load_count(self, prefix + ROUNDING_KEY, state_dict.pop(prefix + ROUNDING_KEY), error_msgs)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)


def keep_rounding_state(model: torch.nn.Module) -> torch.nn.Module:
    """Put the fp4 call counts of ``model``'s layers in ``model.state_dict()`` and restore them in
    ``model.load_state_dict``, so an ordinary checkpoint of a run with stochastic rounding on the
    policy route resumes its draws bitwise: an entry ``"<layer>._mixprec_rounding_step"``
    (:data:`ROUNDING_KEY`, a 0-d int64 tensor, no host sync) for each layer one of whose fp4 calls
    rounded stochastically. Loading works before the first forward (the layer's state is created).
    A Guard's or Controller's ``attach`` does it; layers :func:`convert` made always carry their
    count. Call it on the model that saves and on the one that loads (a model without it refuses
    the entries as unexpected keys, torch's strict load). Returns ``model``.

    At ``load_state_dict``, an entry that is not a 0-d int64 tensor >= 0 is an error naming it.

    Example:
        >>> m = keep_rounding_state(torch.nn.Sequential(torch.nn.Linear(4, 4)))
        >>> _ = m.load_state_dict({**m.state_dict(), "0." + ROUNDING_KEY: torch.tensor(3)})
        >>> layer_state(m[0]).rounding_step, "0." + ROUNDING_KEY in m.state_dict()
        (3, True)
    """
    if _save_counts not in model._state_dict_hooks.values():
        model.register_state_dict_post_hook(_save_counts)
        model.register_load_state_dict_pre_hook(_load_counts)
    return model


def _save_counts(model: torch.nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    for name, module in model.named_modules():
        state = module.__dict__.get(_ATTR)
        if state is not None and state.draws and not isinstance(module, CountsInStateDict):
            state_dict[prefix + (name + "." if name else "") + ROUNDING_KEY] = state._rounding


def _load_counts(model: torch.nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any,
                 strict: bool, missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
    modules: dict[str, torch.nn.Module] | None = None
    for key in [k for k in state_dict if k.startswith(prefix) and k.endswith(ROUNDING_KEY)]:
        name = key[len(prefix):-len(ROUNDING_KEY)]
        if name and not name.endswith("."):
            continue
        modules = dict(model.named_modules()) if modules is None else modules
        module = modules.get(name[:-1])
        if module is not None and not isinstance(module, CountsInStateDict):
            # popped here, before torch hands the children their share: never an unexpected key
            _load_count(module, key, state_dict.pop(key), error_msgs)


def swap_layer_state(module: torch.nn.Module, state: LayerState | None) -> LayerState | None:
    """Give ``module`` the :class:`LayerState` ``state`` (``None``: no state); returns the one it
    had. For tools that measure a layer with fresh statistics and then leave it as found
    (:func:`mixprec.audit`).

    Example:
        >>> lin = torch.nn.Linear(16, 16)
        >>> old = swap_layer_state(lin, LayerState())
        >>> old is None, swap_layer_state(lin, old) is not None, layer_state(lin, create=False)
        (True, True, None)
    """
    old = module.__dict__.pop(_ATTR, None)
    if state is not None:
        module.__dict__[_ATTR] = state
    return old


def rounding_steps(model: torch.nn.Module) -> dict[str, int]:
    """``{fqn: LayerState.rounding_step}`` of the layers of ``model`` that have a
    :class:`LayerState`: the fp4 call counts that seed stochastic rounding, as plain data. Save it
    with a checkpoint of a run without a Guard or Controller (theirs hold the counts already) and
    give it to :func:`load_rounding_steps` to resume bitwise.

    .. warning:: reads each layer's device counter: one host sync per layer.

    Example:
        >>> m = torch.nn.Sequential(torch.nn.Linear(16, 16))
        >>> _ = layer_state(m[0]); rounding_steps(m)
        {'0': 0}
    """
    return {name: st.rounding_step for name, module in named_modules(model)  # (the bare model's names)
            if (st := layer_state(module, create=False)) is not None}


def load_rounding_steps(model: torch.nn.Module, steps: Mapping[str, int]) -> None:
    """Set the fp4 call counts of :func:`rounding_steps` on ``model``'s layers (a layer without a
    :class:`LayerState` yet gets one, which the policy's or :func:`convert`'s routing then uses:
    load before or after the first forward).

    Raises ValueError when ``steps`` names a module ``model`` does not have, or a count that is
    not an int >= 0.
    """
    modules = dict(named_modules(model))
    steps = {clean_name(n): s for n, s in steps.items()}
    missing = sorted(set(steps) - set(modules))
    if missing:
        raise ValueError(f"load_rounding_steps: the model has no module {', '.join(map(repr, missing))} "
                         f"(steps saved by rounding_steps() of another model?)")
    for name, step in steps.items():
        layer_state(modules[name]).rounding_step = step
