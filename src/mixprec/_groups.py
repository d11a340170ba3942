"""Which ranks agree: the group a GradScaler, a Guard or a Controller runs its collectives over.

A group is given as ``"default"`` (``torch.distributed``'s default group, the world, when it is
initialized; no collective otherwise), as a ``torch.distributed.ProcessGroup``, or as
``(DeviceMesh, dim_name)``: the group of that mesh dimension that holds this rank (a pipeline
stage's data-parallel ranks, say). What was given is kept as given, a live object of this
process: it belongs to a stateful shell, never to a settings value or a checkpoint. It is resolved
at each collective, and a rank outside the group gets a ``ValueError`` naming the group (torch
itself would skip the collective with a warning, and the rank would go on alone).
"""

from __future__ import annotations

from typing import Any

__all__ = ["DEFAULT", "check", "describe", "is_default", "resolve", "size"]

#: the default group's spelling
DEFAULT = "default"

_FORMS = ("'default', a torch.distributed.ProcessGroup, or (DeviceMesh, dim_name) (the group of that mesh "
          "dimension holding this rank)")


def is_default(given: Any) -> bool:
    """Whether ``given`` names the default group."""
    return isinstance(given, str) and given == DEFAULT


def _mesh_dim(given: Any) -> tuple[Any, str] | None:
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(given, tuple) and len(given) == 2 and isinstance(given[0], DeviceMesh) and isinstance(given[1], str):
        return given
    return None


def describe(given: Any) -> str:
    """``given`` in words, for messages: the group's global ranks where this rank can know them."""
    import torch.distributed as dist

    if is_default(given):
        return "the default group"
    mesh_dim = _mesh_dim(given)
    if mesh_dim is not None:
        mesh, dim = mesh_dim
        return f"dimension {dim!r} of DeviceMesh {mesh.mesh.tolist()} (dims {mesh.mesh_dim_names})"
    if given == dist.GroupMember.NON_GROUP_MEMBER:
        return "a group this rank is not in (torch.distributed.new_group returned GroupMember.NON_GROUP_MEMBER)"
    try:
        return f"the process group of global ranks {dist.get_process_group_ranks(given)}"
    except (RuntimeError, ValueError):
        return f"process group {getattr(given, 'group_name', given)!r}"


def check(given: Any, owner: str) -> None:
    """Raise when ``given`` is none of the forms of the module docstring (TypeError), or names a
    group this rank is not in (ValueError). ``owner``: the class, for messages."""
    import torch.distributed as dist

    if is_default(given):
        return
    if _mesh_dim(given) is None and not isinstance(given, dist.ProcessGroup) \
            and given != dist.GroupMember.NON_GROUP_MEMBER:
        raise TypeError(f"{owner}(process_group=...) must be {_FORMS}; got {given!r}")
    resolve(given, owner)


def resolve(given: Any, owner: str) -> Any:
    """The ``group=`` argument of ``torch.distributed``'s collectives for ``given``: None for the
    default group, else a ProcessGroup holding this rank.

    Raises ValueError, naming the group and what to do, when this rank is not in it (or
    ``torch.distributed`` is not initialized for a group other than the default).
    """
    import torch.distributed as dist

    if is_default(given):
        return None
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"{owner}: process_group is {describe(given)}, and torch.distributed is not initialized "
                         f"in this process: initialize it first (dist.init_process_group), or leave the default")
    mesh_dim = _mesh_dim(given)
    if mesh_dim is not None:
        mesh, dim = mesh_dim
        if dim not in (mesh.mesh_dim_names or ()):
            raise ValueError(f"{owner}: DeviceMesh {mesh.mesh.tolist()} has no dimension {dim!r} (its dims: "
                             f"{mesh.mesh_dim_names}); name one of them")
        group = mesh.get_group(dim) if mesh.get_coordinate() is not None else None
    else:
        group = given
    if group is None or group == dist.GroupMember.NON_GROUP_MEMBER or dist.get_rank(group) < 0:
        raise ValueError(f"{owner}: this rank (global rank {dist.get_rank()}) is not in {describe(given)}, the "
                         f"process_group it agrees over: give each rank the group it belongs to (every rank calls "
                         f"dist.new_group for every group, in the same order, and keeps the one holding it), or "
                         f"build the {owner} only on the group's ranks")
    return group


def size(given: Any) -> int:
    """How many ranks agree over ``given`` (1 for the default group when ``torch.distributed`` is
    not initialized)."""
    import torch.distributed as dist

    if is_default(given):
        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return dist.get_world_size(resolve(given, "process_group"))
