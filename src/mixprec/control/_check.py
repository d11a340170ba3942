"""What a check of the controller decides with besides a layer's record and measurements (a
value): :class:`Check`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Mapping

import torch

from mixprec.control._settings import LOW_RUNGS, ControllerSettings, rung_name
from mixprec.formats._recipe import Float8Recipe

__all__ = ["Check"]


@dataclass(frozen=True)
class Check:
    """What a check decides with besides a layer's record and measurements: the controller's
    ``settings`` (``ControllerSettings.late``'s at ``steps``), its step count, the compute dtype
    (None while unknown), the recipe of each low rung of the ladder (one per rung) and, under
    ``cost_scope="model"``, each layer's share of the controlled GEMM FLOPs (:meth:`for_layer`)."""

    settings: ControllerSettings
    steps: int = 0
    compute: torch.dtype | None = None
    recipes: Mapping[str, Float8Recipe] = field(default_factory=dict)
    shares: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:  # the late phase's cost limits (ControllerSettings.late)
        object.__setattr__(self, "settings", self.settings.late(self.steps))

    @classmethod
    def of(cls, settings: ControllerSettings, steps: int = 0, compute: torch.dtype | None = None) -> "Check":
        """A check with the recipes of ``settings``' ladder built here (a Controller passes its own).

        Example:
            >>> Check.of(ControllerSettings(ladder=("tensorwise", "compute"))).recipes["tensorwise"].name
            'tensorwise'
        """
        recipes = {r: Float8Recipe.from_name(r) for r in settings.ladder if r in LOW_RUNGS}
        return cls(settings, steps, compute, recipes)

    def for_layer(self, name: str) -> "Check":
        """The check the layer ``name`` is decided by: under ``cost_scope="model"``, with the
        loss-cost limits shared out by its FLOPs (``ControllerSettings.shared``: its share of the
        forward limits, half of it of the backward ones); else this one."""
        if self.settings.cost_scope == "gemm":
            return self
        share = self.shares.get(name, 0.0)
        return dataclasses.replace(self, settings=self.settings.shared(share, share / 2), shares={})

    def rung_name(self, rung: int) -> str:
        """:func:`rung_name` of ``rung`` on the settings' ladder."""
        return rung_name(self.settings.ladder, rung, self.compute)
