"""The decision for one module call under a region's policy: its qualified name, the keep rule that
matches it, whether it runs inside a kept module, and its fp8 layer (see :func:`decide`).

Run by the eager module hooks and, at trace time, by the traced ones
(:mod:`mixprec.engine.module_calls`), on the runtime's call stack or a trace's shadow stack, so that
both paths decide alike.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mixprec._modules import is_wrapper_key, named_modules, unwrap
from mixprec.engine.runtime import Frame, Runtime
from mixprec.engine.watch import Watch
from mixprec.fp8.internals import Fp8Target, select_targets
from mixprec.policy import Policy

__all__ = ["Region", "decide", "name_of", "casts_output", "rule_state", "region_of", "warn_no_fp8_candidates"]

# Registry, process-wide by nature (a warning is given once per process): the sets of module
# types warned about as having no fp8 candidate layer.
_NO_CANDIDATES_WARNED: set[tuple[str, ...]] = set()

@dataclass(eq=False)
class Region:
    """A region whose policy needs the module hooks, as the hooks see it."""

    frame: Frame | None  # None: a region traced inside compiled code (its frame is made later)
    root: nn.Module | None = None  # names are paths in root (Policy.keep, fp8 selection)
    depth: int = 0  # len(calls) at entry: a call at this depth is an outermost call of the region
    replay: bool = False  # a checkpoint's recompute: the fp8 layers are the forward's
    selected: bool = False  # a region with a root selects its fp8 layers once
    watch: Watch | None = None
    fp8_ran: bool = False  # an fp8 selection ran on a module with candidate layers
    fp8_without: list[str] = field(default_factory=list)  # types of outermost modules without any
    training: bool = False  # grad on as it entered (not a replay): a reentrant checkpoint may recompute
    members: set[int] | None = None  # ids of root's modules, taken at the first outermost call of another
    edits: bool = False  # its policy edits ops (fp8 routing aside), not warned yet about a reentrant checkpoint



def warn_no_fp8_candidates(region: Region) -> None:
    """As a region exits: warn (once per set of module types) when its policy has an fp8 rule and
    none of the modules called in it had a layer the rule could select."""
    if region.fp8_ran or not region.fp8_without or region.replay:
        return
    called = tuple(dict.fromkeys(region.fp8_without))
    if called not in _NO_CANDIDATES_WARNED:
        _NO_CANDIDATES_WARNED.add(called)
        warnings.warn(f"fp8: no layer selected, nothing runs in fp8: no module called in the region has an "
                      f"nn.Linear or Linear-equivalent layer (called: {', '.join(called)}); call the model "
                      f"inside the region, or pass root=model", UserWarning, stacklevel=4)


def _fp8_layers(root: nn.Module, policy: Policy, region: Region | None = None) -> dict[int, Any]:
    """The fp8 layers of the model called as ``root`` (``mixprec.fp8.internals.select_targets``); a
    model without candidate layers (a loss criterion called in the region) selects nothing and
    is noted in ``region``, which warns as it exits if no call had such layers."""
    targets = select_targets(root, policy)
    if targets is None:
        if region is not None and len(region.fp8_without) < 8:
            region.fp8_without.append(type(unwrap(root)).__name__)
        return {}
    if region is not None:
        region.fp8_ran = True
    return targets


# --------------------------------------------------------------------------- the decision
def _path(root: nn.Module, module: nn.Module) -> str:
    """``module``'s name under ``root``, without wrappers' parts (:func:`mixprec._modules.named_modules`)."""
    root = unwrap(root)
    if module is root or unwrap(module) is root:
        return ""
    for name, m in named_modules(root):
        if m is module:
            return name
    return ""  # not under root: only type rules can match it


def _qualified_name(module: nn.Module, calls: list[tuple[nn.Module, str, Any, bool]],
                    root: nn.Module | None = None) -> str:
    if not calls:
        return ""  # the outermost module of the region
    parent, parent_name = calls[-1][0], calls[-1][1]
    holder = parent  # the parent, then the modules it wraps: wrappers (DDP, FSDP1, compile) are transparent
    while True:
        inner = None
        for key, child in holder._modules.items():
            if child is module:
                return parent_name if is_wrapper_key(holder, key) else f"{parent_name}.{key}" if parent_name else key
            if child is not None and inner is None and is_wrapper_key(holder, key):
                inner = child
        if inner is None:
            break
        holder = inner
    return _path(calls[0][0] if root is None else root, module)


def region_of(rt: Runtime, frame: Frame) -> Region | None:
    """The record of ``frame``'s region: eager, or traced inside compiled code (while tracing)."""
    for region in reversed(rt.regions):
        if region.frame is frame:
            return region
    if frame.traced and rt.traced_regions:
        return rt.traced_regions[-1]
    return None


def name_of(module: nn.Module, every: list, region: Region | None) -> str:
    """``module``'s qualified name, called inside the calls ``every`` in ``region``."""
    root = region.root if region is not None else None
    if root is not None and len(every) <= region.depth:  # an outermost call: its path in root
        return _path(root, module)
    return _qualified_name(module, every, root)


def casts_output(region: Region | None, module: nn.Module) -> bool:
    """Whether ``output=`` casts the output of ``module``, called outside every other module call:
    the region's outermost module. With a ``root``, that is root (or a module outside it, such as
    a loss criterion), not a submodule: one called there runs in root's forward, inside which the
    region was entered (a decorated forward; the decorator casts the forward's result itself)."""
    root = None if region is None else region.root
    if root is None or module is root or unwrap(module) is unwrap(root):
        return True
    if region.members is None:
        region.members = {id(m) for _, m in named_modules(unwrap(root))}
    return id(module) not in region.members


def decide(rt: Runtime, calls: list, frame: Frame, module: nn.Module,
            region: Region | None = None) -> tuple[str, Any, bool, Fp8Target | None]:
    """``(name, keep rule, kept, fp8 target)`` of ``module`` called under ``frame``'s policy
    (``region``: its record, looked up if not given), inside the calls ``calls`` (eager, or the
    shadow stack of a trace)."""
    policy = frame.policy
    rules, fp8_rule = policy.module_rules, policy.fp8_rule
    every = rt.calls + calls if calls is not rt.calls else calls
    if region is None:
        region = region_of(rt, frame)
    root = region.root if region is not None else None
    name = name_of(module, every, region) if rules or fp8_rule is not None else ""
    if rt.watches:  # a rule that takes effect here counts for the enclosing regions too
        hits = [r for r in rules if r.matches(module, name)]
        for watch in rt.watches:
            watch.see(name, hits)
    kept = bool(every) and every[-1][3]  # inside a kept module
    rule = next((r for r in rules if r.matches(module, name)), None) if rules else None
    kept = kept or rule is not None
    target = None
    if fp8_rule is not None:
        # a recompute keeps the forward's layers; a region with a root selects once
        if region is None or not (region.replay or region.selected):
            if root is not None:  # select on the model
                rt.fp8, region.selected = _fp8_layers(root, policy, region), True
            elif not every:  # the outermost call: select the layers (the model may have changed)
                rt.fp8 = _fp8_layers(module, policy, region)
        target = rt.fp8.get(id(module)) if not kept else None
        if target is not None and not target.runs:
            target = None  # (a Controller's probe measures its fallback layers in fp8.linear)
    if not torch.is_autocast_enabled(frame.device_type):
        # autocast turned off inside the region (a nested torch.autocast(enabled=False); while
        # Dynamo traces, the traced state): the module runs in float32, as asked; a half-dtype
        # rule or an fp8 layer would not run as selected (half inputs meet float32 weights)
        rule = rule if rule is not None and rule.dtype is torch.float32 else None
        target = None
    return name, rule, kept, target


def rule_state(rule: Any, device_type: str) -> tuple[tuple[str, bool | None, torch.dtype | None], bool | None]:
    """``(device state, cache flag)`` that runs a module a keep rule matched in ``rule.dtype``:
    autocast off for float32, else that dtype.

    PyTorch's weight-cast cache is keyed by the weight alone, not the dtype: a weight cast to
    the rule's dtype would be handed to every later use of that weight (a tied weight, another
    thread) in the region's dtype, and a cast cached before to the rule's module. A half dtype
    other than the region's therefore runs with the cache off (its weights are cast per use)."""
    if rule.dtype is torch.float32:
        return (device_type, False, None), None
    cache = False if rule.dtype != torch.get_autocast_dtype(device_type) else None
    return (device_type, None, rule.dtype), cache


