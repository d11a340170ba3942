"""What the integrations share: the precision names frameworks use, checked against a policy."""

from __future__ import annotations

import torch

from mixprec._dtype_names import parse_dtype
from mixprec.policy import Policy

#: Lightning's names of the two mixed precisions -> Accelerate's, which are dtype names
_LIGHTNING = {"16-mixed": "fp16", "bf16-mixed": "bf16"}
#: Lightning's and Accelerate's names of the two mixed precisions -> the autocast dtype.
PRECISIONS: dict[str, torch.dtype] = {name: parse_dtype(_LIGHTNING.get(name, name))
                                      for name in ("16-mixed", "bf16-mixed", "fp16", "bf16")}


def resolve_policy(policy: Policy | str | None, dtype: torch.dtype, where: str) -> Policy:
    """``policy`` as a :class:`Policy` (``None``: the default), refused when its ``compute`` dtype
    contradicts the framework's precision ``dtype``.

    Raises:
        TypeError: ``policy`` is not a Policy, a str or None.
        ValueError: the policy's compute dtype is not ``dtype``.
    """
    policy = Policy.coerce(policy, where=f"{where}: policy")
    if policy.compute is not None and policy.compute != dtype:
        raise ValueError(
            f"{where}: the policy computes in {policy.compute} but the precision asks for {dtype}; "
            "drop compute= from the policy or pick the matching precision"
        )
    return policy


def default_device() -> str:
    """``"cuda"`` when CUDA is available, else ``"cpu"`` (what the frameworks' "auto" picks)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def device_type(device: str | torch.device, where: str) -> str:
    """The device type mixprec autocasts for ``device`` (``"cuda:1"`` -> ``"cuda"``).

    Raises:
        ValueError: not a device string, or a device type other than ``"cpu"`` and ``"cuda"``.
    """
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError):
        raise ValueError(f"{where}(device={device!r}): not a device; use 'cpu', 'cuda' or 'cuda:<index>'") from None
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"{where}(device={device!r}): mixprec autocasts 'cpu' or 'cuda' (also 'cuda:<index>')")
    return kind
