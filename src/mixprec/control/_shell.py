"""What a Guard and a Controller share as stateful shells around their settings: the settings
value read through the object, the warning for forwards that are never stepped, copying, and
where a model's live guard or controller is attached.

The ranks a shell agrees with are its own, a live object beside the settings value:
``process_group=`` (``"default"``, the world; a ProcessGroup; or ``(DeviceMesh, dim_name)``, see
:mod:`mixprec._groups`) is given to the constructor, used for every collective of a check, and
never pickled: pickling a shell that holds a group other than the default raises (save its
``state_dict()`` and build it again with the group in the new process).

A run's live Guard or Controller comes from the model (``ctl.attach(model)``, or
``fp8.convert(model, controller=ctl)``, or a policy built the old way, ``Policy.fp8(controller=ctl)``:
:func:`live_of` says which); the policy holds its settings only.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from typing import Any, Mapping

import torch
from torch import nn

from mixprec._groups import DEFAULT, check, describe, is_default
from mixprec._modules import unwrap
from mixprec.control._collective import agree_on_layers, all_reduce_max, distributed
from mixprec.formats._state import keep_rounding_state, layer_state

__all__ = ["NO_STEP_FORWARDS", "Shell", "attached", "live_of"]

#: training forwards of a policy's guard or controller, without a single ``step()``, before it warns.
NO_STEP_FORWARDS = 100

#: the model attribute that holds the Guard or Controller attached to it (``Shell.attach``)
_ATTRIBUTE = "_mixprec_fp8_control"


class Shell:
    """The stateful shell of a settings value (``settings``, a frozen dataclass): its fields read
    as the shell's attributes (``ctl.every``), never assigned (a shell runs with the settings it
    was built with). ``process_group``: the ranks it agrees with (module docstring); a rank
    outside that group gets a ValueError naming it. Subclasses set ``SETTINGS`` (the settings
    class), ``CALL`` (its step call, for messages) and ``DOES`` (what stepping does)."""

    SETTINGS: type
    CALL = "step()"
    DOES = "decides"

    def __init__(self, settings: Any = None, *, process_group: Any = DEFAULT, **changes: Any) -> None:
        check(process_group, type(self).__name__)
        if settings is None:
            settings = self.SETTINGS(**changes)
        elif not isinstance(settings, self.SETTINGS):
            raise ValueError(f"{type(self).__name__}(settings=...) must be a {self.SETTINGS.__name__}, got "
                             f"{type(settings).__name__}")
        elif changes:
            settings = settings.replace(**changes)
        object.__setattr__(self, "settings", settings)
        object.__setattr__(self, "_process_group", process_group)
        object.__setattr__(self, "_stepped", False)  # this process has called step()
        object.__setattr__(self, "_forwards", 0)  # training forwards before the first step()

    def __getattr__(self, name: str) -> Any:
        settings = self.__dict__.get("settings")
        if settings is not None and (name in settings.__dataclass_fields__
                                     or isinstance(getattr(type(settings), name, None), property)):
            return getattr(settings, name)  # a setting, or what follows from them (``demote_cost``)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        settings = self.__dict__.get("settings")
        if name == "settings" or (settings is not None and name in settings.__dataclass_fields__):
            raise AttributeError(f"{type(self).__name__}.{name} is a setting, fixed when it is built: build "
                                 f"{type(self).__name__}(settings=old.settings.replace({name}=...)) and load "
                                 f"old.state_dict() into it")
        object.__setattr__(self, name, value)

    def __eq__(self, other: object) -> bool:
        """Equal settings (what the object was built with; its runtime state is left out)."""
        if type(other) is not type(self):
            return NotImplemented
        return self.settings == other.settings

    __hash__ = None  # type: ignore[assignment]  (a mutable object: by identity in sets it would mislead)

    def __repr__(self) -> str:
        changed = ", ".join(f"{k}={v!r}" for k, v in self.settings.changed().items())
        return f"{type(self).__name__}({changed})"

    @property
    def process_group(self) -> Any:
        """The ranks it agrees with, as given to the constructor (``"default"``: the world)."""
        return self._process_group

    def _distributed(self) -> bool:
        return distributed(self._process_group)

    def _agree_on_layers(self, names: list[str], metadata: Any, code: int = 0) -> tuple[list[str], dict, int]:
        return agree_on_layers(names, metadata, code, self._process_group)

    def _all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        return all_reduce_max(t, self._process_group)

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickling (the subclass's ``__getstate__``), refused with a process group other than the default."""
        if not is_default(self._process_group):
            raise TypeError(f"this {type(self).__name__} agrees over {describe(self._process_group)}, a live object "
                            f"of this process that cannot be pickled: save its state_dict() instead and build it "
                            f"again in the new process with process_group=..., then load_state_dict()")
        return super().__reduce_ex__(protocol)

    def __deepcopy__(self, memo: dict) -> Any:
        """Every attribute copied (the settings are a value: shared; the process group too: a live
        object), not through pickling's settings and ``state_dict``."""
        memo[id(self._process_group)] = self._process_group
        new = object.__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new

    def config(self) -> dict[str, Any]:
        """The settings (the constructor's keyword arguments), as plain JSON data."""
        return self.settings.to_dict()

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Any:
        """A fresh one with the settings of :meth:`config`.

        Raises ValueError naming unknown keys.
        """
        return cls(cls.SETTINGS.from_dict(config))

    def attach(self, model: nn.Module) -> Any:
        """Make this the live one of ``model``'s regions: a policy's fp8 layers in ``model``
        (called as the region's model) are tracked and governed by it. Kept as a plain
        attribute of the bare model (without DDP's, FSDP's or torch.compile's wrapper), so a
        copy or a pickle of the model carries its own copy; ``model.load_state_dict`` restores its
        layers' fp4 call counts before their first forward (:func:`keep_rounding_state`). Returns itself
        (``ctl = Controller(every=10).attach(model)``).

        Raises ValueError when another Guard or Controller is attached to ``model`` already.
        """
        bare = unwrap(model)
        other = attached(bare)
        if other is not None and other is not self:
            raise ValueError(f"{type(bare).__name__} already has a {type(other).__name__} attached; a model has one "
                             f"(detach it first: {type(other).__name__}.detach(model))")
        bare.__dict__[_ATTRIBUTE] = self
        keep_rounding_state(bare)  # (its layers' fp4 call counts load before their first forward)
        return self

    @staticmethod
    def detach(model: nn.Module) -> None:
        """Remove the Guard or Controller attached to ``model`` (if any)."""
        unwrap(model).__dict__.pop(_ATTRIBUTE, None)

    def count_forward(self) -> None:
        """Count a training forward of a shell never stepped; at :data:`NO_STEP_FORWARDS` warn
        once that its step call is missing, so it never decides."""
        if self._stepped or not torch.is_grad_enabled():
            return
        self._forwards += 1
        if self._forwards == NO_STEP_FORWARDS:
            warnings.warn(f"fp8: the policy's {type(self).__name__} has seen {NO_STEP_FORWARDS} training "
                          f"forwards and no {self.CALL}: it never {self.DOES}. Call {self.CALL} once per optimizer "
                          f"step, on every rank", UserWarning, stacklevel=6)


def attached(model: nn.Module) -> Shell | None:
    """The Guard or Controller attached to ``model`` (:meth:`Shell.attach`), or None."""
    return unwrap(model).__dict__.get(_ATTRIBUTE)


def _enclosing(model: nn.Module) -> Shell | None:
    """The Controller attached to the model that holds ``model`` (a submodule of it, called directly),
    found through its layers' probes (a record knows the model that reached it); None: none found."""
    for module in model.modules():
        rec = getattr(getattr(layer_state(module, create=False), "probe", None), "rec", None)
        root = rec.root() if rec is not None else None
        if root is not None and attached(root) is not None:
            return attached(root)
    return None


def live_of(model: nn.Module, kind: str, settings: Any, legacy: Shell | None) -> Shell | None:
    """The live Guard or Controller of a region's ``model`` under a rule that names ``kind``
    (``"guard"``/``"controller"``; None: neither) with ``settings``: the one attached to the model
    (or, for a submodule called directly, the Controller attached to the model that holds it and
    governs its layers), else ``legacy`` (a policy built with the object, ``Policy.fp8(controller=ctl)``).

    Raises ValueError when the rule names one and none is found (saying how to attach it), or
    the one found is of another kind or has other settings than the rule's.
    """
    live = attached(model)
    if live is None and legacy is None and kind is not None:
        live = _enclosing(model)  # (a submodule called directly in the region)
    if live is None:
        live = legacy
    if live is None:
        if kind is None:
            return None
        cls = "Guard" if kind == "guard" else "Controller"
        raise ValueError(f"the policy's fp8 rule runs under a {cls} ({cls}Settings: {settings.changed() or 'defaults'}), "
                         f"and none is attached to {type(unwrap(model)).__name__}: build it and attach it before the "
                         f"forward, `live = mixprec.fp8.{cls}(policy.fp8_rule.{kind}); live.attach(model)`, then call "
                         f"live.step() once per optimizer step")
    if kind is not None:
        if type(live).SETTINGS is not type(settings):
            raise ValueError(f"the policy's fp8 rule runs under a {kind}, and the model has a {type(live).__name__} "
                             f"attached: attach a {kind}, or use a policy without one")
        if live.settings != settings:
            diff = {f.name: (getattr(settings, f.name), getattr(live.settings, f.name))
                    for f in dataclasses.fields(settings) if getattr(settings, f.name) != getattr(live.settings, f.name)}
            raise ValueError(f"the {type(live).__name__} attached to the model has other settings than the policy's "
                             f"fp8 rule ({{setting: (policy's, attached)}}: {diff}); build it from "
                             f"policy.fp8_rule.{kind}, or the policy from its .settings")
    return live
