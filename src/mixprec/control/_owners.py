"""One Guard or Controller per model: its records of layers are keyed by their names in the model
(``"0"``, ``"blocks.3.attn.qkv"``), so a second model whose layers share those names (a GAN's
generator and discriminator, a teacher and its student) would take the records over at each of its
forwards, undoing the first model's decisions. :func:`refuse_shared` tells that apart from what
legitimately brings another module under a known name (a layer replaced on purpose, a model that
replaced the old one, a submodule called directly) and refuses it with a ValueError that says what
to do; the records remember the model that reached them (:func:`root_of`)."""

from __future__ import annotations

import weakref
from typing import Any, Callable

from torch import nn

from mixprec._modules import unwrap
from mixprec.control._shell import attached

__all__ = ["refuse_shared", "root_of"]


def root_of(model: nn.Module) -> weakref.ref:
    """A weak reference to the bare ``model`` (without DDP's, FSDP's or torch.compile's wrapper)."""
    return weakref.ref(unwrap(model))


def refuse_shared(shell: Any, name: str, old_root: nn.Module | None, new_root: nn.Module,
                  holds: Callable[[nn.Module], bool]) -> None:
    """Raise ValueError when ``new_root`` brings, under ``name``, another layer than the one
    ``shell`` (a Guard or Controller) keeps of ``old_root``: a second model under the same shell.

    Precondition: the layer ``new_root`` brings is not the one the record holds. Nothing is
    refused where the record's model is gone (None, or collected), is ``new_root`` or holds it or
    is held by it (a layer replaced, a submodule called directly), no longer holds the record's
    layer (``holds(old_root)`` False: replaced on purpose), or is no longer ``shell``'s (another is
    attached to it, or it was detached and ``new_root`` attached: the new model takes over).
    """
    new_root = unwrap(new_root)
    if old_root is None or old_root is new_root:
        return
    if attached(old_root) is not shell and (attached(old_root) is not None or attached(new_root) is shell):
        return
    if _within(old_root, new_root) or _within(new_root, old_root) or not holds(old_root):
        return
    kind = type(shell).__name__
    raise ValueError(f"{kind}: {type(new_root).__name__} brings a layer named {name!r} that is not the one of the same "
                     f"name in the {type(old_root).__name__} this {kind} controls already; a {kind} controls one model "
                     f"(its records are keyed by the layers' names, so two models' decisions would undo each other). "
                     f"Build one {kind} per model, attach each (`mixprec.fp8.{kind}(settings).attach(model)`) and "
                     f"step each; to move this {kind} to the new model, detach it from the old one first "
                     f"(`{kind}.detach(old_model)`)")


def _within(outer: nn.Module, inner: nn.Module) -> bool:
    """Whether ``inner`` is ``outer`` or one of its submodules."""
    return any(m is inner for m in outer.modules())
