"""Per-window amax histories for export: layer inputs and the key/value projections' outputs."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import reprlib
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from mixprec._modules import named_modules
from mixprec.export._layers import CACHE_ARGUMENTS, KVSource, kv_sources, linear_layers, plan_layers
from mixprec.export._fp4 import forward_recipe
from mixprec.fp8 import Cast, Float8Conv1D, Float8Linear, Float8Recipe, layer_state
from mixprec.fp8.internals import INPUT

__all__ = ["Recorder", "calibrate", "recipe_from_dict", "recipe_to_dict"]


def recipe_to_dict(recipe: Float8Recipe) -> dict[str, Any]:
    """A recipe as plain values (what ``torch.load(weights_only=True)`` reads back)."""
    return dataclasses.asdict(recipe)


def recipe_from_dict(data: dict[str, Any]) -> Float8Recipe:
    """The recipe :func:`recipe_to_dict` wrote (ValueError when it is not one)."""
    if not isinstance(data, dict):
        raise ValueError(f"export statistics: not a recorded recipe (a dict of its fields), got {type(data).__name__}")
    try:
        return Float8Recipe(**{k: Cast(**v) if isinstance(v, dict) else v for k, v in data.items()})
    except (TypeError, ValueError, AttributeError, KeyError) as e:  # a field missing, unknown or of a wrong type
        raise ValueError(f"export statistics: not a recorded recipe ({_first_line(e)})") from None


class _CacheProbe:
    """Stands in for an attention module's KV cache argument for one call: ``update(keys, values,
    ...)`` reports the keys and values, then is the wrapped cache's (or returns them as they are when
    the call had no cache), which is what compressed-tensors' ``QuantizedKVCache`` does. Any other
    attribute is the wrapped cache's."""

    def __init__(self, cache: Any, report: Any) -> None:
        self._cache, self._report = cache, report

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self._report(key_states, value_states)
        if self._cache is None:
            return key_states, value_states
        return self._cache.update(key_states, value_states, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        cache = self.__dict__.get("_cache")
        if cache is None:
            raise AttributeError(f"{name!r}: the attention module was called without a KV cache")
        return getattr(cache, name)


def _amax(t: torch.Tensor) -> torch.Tensor:
    amax = t.detach().abs().amax().float() if t.numel() else t.new_zeros((), dtype=torch.float32)
    return amax.full_tensor() if hasattr(amax, "full_tensor") else amax  # a DTensor (tensor parallelism): global


def _fp8_input_amax(module: nn.Module) -> torch.Tensor | None:
    """The input amax the fp8 cast of a converted layer has just measured (its ``LayerState`` keeps
    the last cast's amax on the device), or None when this call did not cast its input to fp8."""
    if not isinstance(module, (Float8Linear, Float8Conv1D)):
        return None
    st = layer_state(module, create=False)
    if st is None or st.fallback or not (st.recipe or module.recipe).input.is_fp8:
        return None
    return st.last_amax(INPUT)


class Recorder:
    """Records, on the device and without host syncs, the amax of every linear layer's input and
    of every attention layer's keys and values, as a history of windows.

    Forward hooks on the layers: each call raises the open step's running max; :meth:`step`
    (once per optimizer step) folds the step into the open window and closes the window every
    ``every`` steps (match ``Guard(every=...)`` to have the windows of the fp8 statistics). A step
    whose amaxes are not all finite (an inf or NaN input: a step a loss scaler skips) is left out
    of its window, decided on the device; a window of such steps only is left out of ``history``.
    :func:`mixprec.export.export` turns the history into static scales with a :class:`ScaleRule`.
    The keys and values are what an attention module hands its KV cache (after RoPE and any
    ``k_norm``: what an fp8 KV cache stores, where compressed-tensors' KV hooks observe them): a
    forward pre-hook passes the module a stand-in for its cache argument
    (``cache``/``past_key_values``) whose ``update`` reports them and then is the real cache's (or
    returns them as they are when the call had none). A module without a cache argument (mixprec's
    demo model) is measured at its ``k_proj``/``v_proj`` outputs or the middle and last thirds of a
    fused ``c_attn``/``qkv`` (see :class:`KVSource`).

    A layer converted by :func:`mixprec.fp8.convert` gives the amax its fp8 input cast measured
    (no extra reduction); any other layer's hook takes the amax of the input as the module receives
    it (before an autocast cast: rounding is monotonic, so the amax of the cast input is the cast
    of this amax). Remove them with
    :meth:`close` (or use it as a context manager). ``history`` keeps the last ``keep`` windows
    (less those left out). Create it after :func:`mixprec.fp8.convert` (which replaces the modules
    it would hook). ``model`` may be wrapped (torch.compile, DDP): the series are named as in the
    bare model.

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
        >>> with Recorder(model) as rec:
        ...     _ = model(torch.ones(2, 16)); rec.step()
        >>> rec.history.shape  # (windows, series)
        torch.Size([1, 2])
    """

    def __init__(self, model: nn.Module, every: int = 1, keep: int = 1024) -> None:
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"Recorder.every must be an int >= 1 (optimizer steps per window), got {every!r}")
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"Recorder.keep must be an int >= 1 (windows kept), got {keep!r}")
        self.every, self.keep = every, keep
        self._model = model
        layers = linear_layers(model)
        self.kv: list[KVSource] = kv_sources(model)
        #: series names: ``"<layer>:input"`` then ``"<attention>:k"`` / ``"<attention>:v"``
        self.names: list[str] = [f"{n}:input" for n in layers] + [f"{s.attention}:{s.which}" for s in self.kv]
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self._step = torch.zeros(len(self.names), device=device)  # the open step's amaxes
        self._window = torch.zeros(len(self.names), device=device)  # the max over the window's finite steps
        self._window_finite = torch.zeros((), dtype=torch.bool, device=device)  # a finite step is in it
        self._windows: list[torch.Tensor] = []  # closed windows; NaN: none of its steps was finite
        self._steps = 0
        self._stepped = False  # a forward ran in the open step
        self._seen = False  # a step with a forward was folded into the open window
        self._handles = []
        for i, (fqn, mod) in enumerate(layers.items()):
            self._handles.append(mod.register_forward_hook(self._input_hook(i)))
        by_layer: dict[str, list[tuple[int, KVSource]]] = {}
        by_attention: dict[str, list[tuple[int, KVSource]]] = {}
        for j, src in enumerate(self.kv):
            (by_layer if src.cache is None else by_attention).setdefault(
                src.layer if src.cache is None else src.attention, []).append((len(layers) + j, src))
        for fqn, sources in by_layer.items():
            self._handles.append(layers[fqn].register_forward_hook(self._output_hook(sources)))
        modules = dict(named_modules(model))
        for fqn, sources in by_attention.items():
            attn = modules[fqn]
            self._handles.append(attn.register_forward_pre_hook(self._cache_hook(attn, sources[0][1].cache, sources),
                                                                with_kwargs=True))

    def _raise(self, i: int, amax: torch.Tensor) -> None:
        if self._step.device != amax.device:
            self._step, self._window, self._window_finite = (
                t.to(amax.device) for t in (self._step, self._window, self._window_finite))
        self._step[i] = torch.maximum(self._step[i], amax)  # (an inf stays, a NaN propagates)
        self._stepped = True

    def _fold_step(self) -> None:
        """Fold the open step's amaxes into the window when they are all finite (else leave them out),
        on the device."""
        if not self._stepped:
            return
        finite = torch.isfinite(self._step).all()
        torch.maximum(self._window, self._step.where(finite, 0.0), out=self._window)
        self._window_finite.logical_or_(finite)
        self._step.zero_()
        self._stepped, self._seen = False, True

    def _input_hook(self, i: int) -> Any:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            measured = _fp8_input_amax(module)
            if measured is not None:
                self._raise(i, measured)
            elif args and isinstance(args[0], torch.Tensor):
                self._raise(i, _amax(args[0]))
        return hook

    def _cache_hook(self, module: nn.Module, name: str, sources: list[tuple[int, KVSource]]) -> Any:
        """A forward pre-hook that hands the attention module a :class:`_CacheProbe` in place of its
        cache argument ``name`` (passed by keyword, under a deprecated name, or by position)."""
        params = list(inspect.signature(module.forward).parameters)
        position = params.index(name)

        def report(keys: torch.Tensor, values: torch.Tensor) -> None:
            for i, src in sources:
                self._raise(i, _amax(keys if src.which == "k" else values))

        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            given = next((n for n in CACHE_ARGUMENTS if n in kwargs), None)
            if given is not None:
                kwargs[given] = _CacheProbe(kwargs[given], report)
            elif len(args) > position:
                args = (*args[:position], _CacheProbe(args[position], report), *args[position + 1:])
            else:
                kwargs[name] = _CacheProbe(None, report)
            return args, kwargs
        return hook

    def _output_hook(self, sources: list[tuple[int, KVSource]]) -> Any:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if isinstance(output, torch.Tensor):
                for i, src in sources:
                    part = output if src.start is None else output[..., src.start:src.stop]
                    self._raise(i, _amax(part))
        return hook

    def step(self) -> None:
        """Count one optimizer step (its amaxes join the window when all are finite); every ``every``
        steps close the window (no host sync)."""
        self._fold_step()
        self._steps += 1
        if self._steps % self.every == 0:
            self.end_window()

    def end_window(self) -> None:
        """Close the open window now (if any forward ran in it), the open step with it."""
        self._fold_step()
        if self._seen:
            self._windows.append(self._window.where(self._window_finite, torch.nan))
            self._windows = self._windows[-self.keep:]
            self._window.zero_()
            self._window_finite.zero_()
            self._seen = False

    @property
    def history(self) -> torch.Tensor:
        """``(windows, series)`` float32 amaxes of the closed windows (series: :attr:`names`), those
        without a finite step left out (one host sync)."""
        if not self._windows:
            return torch.zeros(0, len(self.names), device=self._window.device)
        h = torch.stack(self._windows)
        return h[h.isfinite().all(1)]

    @property
    def kv_sites(self) -> dict[str, str]:
        """``{"<attention>:k": where the keys are measured, ...}`` (see :class:`KVSource`)."""
        return {f"{s.attention}:{s.which}": s.site for s in self.kv}

    def series(self) -> dict[str, torch.Tensor]:
        """``{name: (windows,) amaxes}``."""
        h = self.history
        return {n: h[:, i] for i, n in enumerate(self.names)}

    def close(self) -> None:
        """Close the open window and remove the hooks."""
        self.end_window()
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _fp8_layers(self) -> list[str]:
        try:
            return list(plan_layers(self._model).fp8)
        except ValueError:  # no fp8 layer: a calibrated model
            return []

    def _fallback(self) -> dict[str, str]:
        """The layers a Guard or Controller keeps above fp8 now, with the reason."""
        try:
            kept = plan_layers(self._model).kept
        except ValueError:
            return {}
        return {fqn: why for fqn, why in kept.items() if why.startswith("in fallback")}

    @property
    def recipes(self) -> dict[str, Float8Recipe]:
        """``{layer: the recipe its forward runs now}`` of the model's fp8 layers (a Controller's
        rung, a converted layer's recipe, a ``Policy.fp8``'s): what the export writes them in."""
        linears = linear_layers(self._model)
        ran = {fqn: forward_recipe(linears[fqn]) for fqn in self._fp8_layers()}
        return {fqn: r for fqn, r in ran.items() if r is not None}

    def state_dict(self) -> dict[str, Any]:
        """The closed windows, for a checkpoint or for ``mixprec export --stats``; with the model's fp8
        layers at this moment (``fp8_layers``: those not in fallback, ``fallback``: those in it; none
        for a model without fp8)
        and the recipe each runs (``recipes``, see :attr:`recipes`: the CLI exports them as they ran)."""
        return {"names": list(self.names), "history": self.history.cpu(), "every": self.every,
                "fp8_layers": self._fp8_layers(), "fallback": self._fallback(), "kv_sites": self.kv_sites,
                "recipes": {fqn: recipe_to_dict(r) for fqn, r in self.recipes.items()}}

    def save(self, path: str | Path) -> None:
        """``torch.save`` the :meth:`state_dict` (what ``mixprec export --stats PATH`` reads)."""
        torch.save(self.state_dict(), path)


#: what to do about a file that is not statistics (the end of :func:`load_stats`'s errors)
_REDO = "pass the file that rec.save(path) of a mixprec.export.Recorder wrote, or record one again"


def _first_line(e: BaseException) -> str:
    """The first line of ``e``'s message, or its type's name when it has none (EOFError of an empty file)."""
    lines = str(e).strip().splitlines()
    return lines[0][:160] if lines else type(e).__name__


def _strs(state: dict[str, Any], key: str, what: str) -> list[str]:
    value = state.get(key, [])
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"'{key}' must be a list of {what} (str), got {_kind(value)}")
    return list(value)


def _str_dict(state: dict[str, Any], key: str, what: str) -> dict[str, Any]:
    value = state.get(key, {})
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ValueError(f"'{key}' must be a dict {what}, got {_kind(value)}")
    return dict(value)


def _kind(value: Any) -> str:
    """``value`` shown in an error: its type and a short repr (``int 5``, ``list [1, 2]``)."""
    return f"{type(value).__name__} {reprlib.repr(value)}"


class _Loaded:
    """Windows read back from :meth:`Recorder.save` (same ``names``/``history`` interface). Each field is
    checked: ValueError naming the first one that is not what ``Recorder.save`` writes."""

    def __init__(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or not {"names", "history"} <= set(state):
            missing = "" if not isinstance(state, dict) else ", no " + " or ".join(
                repr(k) for k in ("names", "history") if k not in state)
            raise ValueError(f"export statistics must be what mixprec.export.Recorder.save wrote (a dict with "
                             f"'names' and 'history'), got {type(state).__name__}{missing}")
        self.names = _strs(state, "names", "the recorded series' names")
        history = state["history"]
        if not isinstance(history, torch.Tensor) or history.ndim != 2 or not history.is_floating_point() \
                or history.shape[1] != len(self.names):
            got = (f"a {history.dtype} tensor of shape {tuple(history.shape)}" if isinstance(history, torch.Tensor)
                   else type(history).__name__)
            raise ValueError(f"'history' must be a floating-point (windows, len(names)) = (*, {len(self.names)}) "
                             f"tensor, got {got}")
        if bool((history < 0).any()):
            raise ValueError("'history' holds a negative amax (an amax is a magnitude, >= 0): the file was edited or "
                             "is not what Recorder.save wrote; record the statistics again")
        self.history = history
        self.fp8_layers = _strs(state, "fp8_layers", "layer names")
        #: the layers a Guard or Controller kept above fp8 when the statistics were saved, with the reason
        self.fallback: dict[str, str] = _str_dict(state, "fallback", "{layer: why it was in fallback}")
        #: where each key/value series was measured; absent from files saved before mixprec measured the
        #: keys in the cache (their key statistics were taken before RoPE: export does not use them)
        self.kv_sites: dict[str, str] | None = (
            _str_dict(state, "kv_sites", "{'<attention>:k': where it was measured}") if "kv_sites" in state else None)
        #: the recipe each fp8 layer ran when the statistics were saved
        self.recipes: dict[str, Float8Recipe] = {}
        for fqn, d in _str_dict(state, "recipes", "{layer: its recipe's fields}").items():
            try:
                self.recipes[fqn] = recipe_from_dict(d)
            except ValueError as e:
                raise ValueError(f"'recipes'[{fqn!r}] is {str(e).removeprefix('export statistics: ')}") from None

    def series(self) -> dict[str, torch.Tensor]:
        return {n: self.history[:, i] for i, n in enumerate(self.names)}


def load_stats(path: str | Path) -> _Loaded:
    """Statistics saved by :meth:`Recorder.save`. Raises ValueError when ``path`` is not such a file
    (not a torch file, an empty one, or not the dict ``Recorder.save`` writes: the message names the
    field, e.g. ``'fp8_layers' must be a list of layer names``); OSError when it cannot be read."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except OSError:
        raise
    except Exception as e:  # torch.load's UnpicklingError, RuntimeError ("invalid magic number"), EOFError etc.
        empty = Path(path).is_file() and Path(path).stat().st_size == 0
        why = "the file is empty" if empty else f"torch.load: {_first_line(e)}"
        raise ValueError(f"{path} is not a statistics file written by mixprec.export.Recorder.save ({why}); "
                         f"{_REDO}") from None
    try:
        return _Loaded(state)
    except ValueError as e:
        raise ValueError(f"{path} is not a statistics file written by mixprec.export.Recorder.save: {e}; "
                         f"{_REDO}") from None


@contextlib.contextmanager
def calibrate(model: nn.Module, every: int = 1) -> Iterator[Recorder]:
    """A short calibration pass for a model trained without fp8 (or to re-measure one): every
    ``every`` forward calls of ``model`` make one window. Gradients are off inside.

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
        >>> with calibrate(model) as rec:
        ...     for _ in range(3):
        ...         _ = model(torch.randn(2, 16))
        >>> rec.history.shape
        torch.Size([3, 2])
    """
    rec = Recorder(model, every=every)
    handle = model.register_forward_hook(lambda *_: rec.step())
    try:
        with torch.no_grad():
            yield rec
    finally:
        handle.remove()
        rec.close()
