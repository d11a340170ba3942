"""Fake CUDA on a CPU-only PyTorch: mixprec's CUDA branches run over tensors with no data.

Under ``torch._subclasses.fake_tensor.FakeTensorMode``, a tensor made with ``device="cuda"``
dispatches through PyTorch's real ``AutocastCUDA`` kernels and its meta functions (shapes,
dtypes, strides and layout rules such as ``torch._scaled_mm``'s "mat2 must be col_major"),
with no data and no CUDA build. :func:`cuda_patches` makes ``torch.cuda`` answer as a CUDA
machine of a given compute capability would; :class:`HostReads` counts, and answers, the host
reads (``item``, ``tolist``, ``bool`` ...) a fake tensor refuses: each would be a host sync on
a GPU. Backward cannot run this way (autograd on fake CUDA tensors aborts the process on a
CPU-only build: no CUDA device guard), and values cannot be read.

This module never imports mixprec: ``_fake_cuda_oracle.py`` runs PyTorch's own CUDA autocast
kernels with it in a process where no mixprec kernel exists.
"""

from __future__ import annotations

import contextlib
import traceback
import warnings
from collections import Counter
from typing import Any, Callable, Iterator

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensor, FakeTensorMode

#: the lists of torch's CUDA autocast tests (test/test_cuda.py), and the module their ops live in
AUTOCAST_LISTS = {
    "torch_expect_builtin_promote": "torch", "methods_expect_builtin_promote": None,
    "torch_fp16": "torch", "torch_fp32": "torch", "torch_need_autocast_promote": "torch",
    "nn_fp16": "nn", "nn_fp32": "nn", "linalg_fp16": "linalg", "methods_fp16": None,
    "methods_fp32": None, "banned": "banned",
}


def _basic_index(t: torch.Tensor, index: Any) -> torch.Tensor:
    """``t[index]`` for ints, slices, ``None`` and ``...`` through aten ops (no device guard)."""
    index = index if isinstance(index, tuple) else (index,)
    if any(not isinstance(i, (int, slice, type(None), type(Ellipsis))) or isinstance(i, bool) for i in index):
        raise TypeError(f"fake CUDA indexing: only ints, slices, None and ... (got {index!r})")
    if Ellipsis in index:
        at = index.index(Ellipsis)
        fill = t.dim() - sum(1 for i in index if i is not None and i is not Ellipsis)
        index = index[:at] + (slice(None),) * fill + index[at + 1:]
    dim = 0
    for i in index:
        if i is None:
            t = t.unsqueeze(dim)
            dim += 1
        elif isinstance(i, int):
            t = t.select(dim, i)
        else:
            start, stop, step = i.start or 0, i.stop if i.stop is not None else t.shape[dim], i.step or 1
            t = torch.ops.aten.slice.Tensor(t, dim, start, stop, step)
            dim += 1
    return t


def _getitem(original: Callable[..., Any]) -> Callable[..., Any]:
    """``Tensor.__getitem__`` whose C++ binding takes a CUDA device guard (refused by a CPU-only
    build): basic indexing of fake CUDA tensors runs through aten ops instead."""
    def getitem(t: torch.Tensor, index: Any) -> Any:
        if isinstance(t, FakeTensor) and t.is_cuda:
            return _basic_index(t, index)
        return original(t, index)
    return getitem


def _copy(original: Callable[..., Any]) -> Callable[..., Any]:
    """``Tensor.copy_``, whose binding takes a device guard too: the aten op for fake CUDA."""
    def copy_(t: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        if isinstance(t, FakeTensor) and t.is_cuda:
            return torch.ops.aten.copy_.default(t, src, non_blocking)
        return original(t, src, non_blocking)
    return copy_


def _contiguous(original: Callable[..., Any]) -> Callable[..., Any]:
    """``Tensor.contiguous`` (a guarded binding when it copies): ``aten.clone`` for fake CUDA."""
    def contiguous(t: torch.Tensor, memory_format: torch.memory_format = torch.contiguous_format) -> torch.Tensor:
        if isinstance(t, FakeTensor) and t.is_cuda and not t.is_contiguous(memory_format=memory_format):
            return torch.ops.aten.clone.default(t, memory_format=memory_format)
        return original(t, memory_format=memory_format)
    return contiguous


def _setitem(original: Callable[..., Any]) -> Callable[..., Any]:
    def setitem(t: torch.Tensor, index: Any, value: Any) -> None:
        if isinstance(t, FakeTensor) and t.is_cuda:
            target = _basic_index(t, index)
            if isinstance(value, torch.Tensor):
                torch.ops.aten.copy_.default(target, value)
            else:
                target.fill_(value)
            return
        original(t, index, value)
    return setitem


def cuda_patches(capability: tuple[int, int] = (9, 0)) -> list[tuple[Any, str, Any]]:
    """Dynamo's map of torch's functions is built first (:func:`_keep_dynamo_rules`). ``(object, attribute, value)`` triples that make ``torch.cuda`` answer as one CUDA device of
    ``capability`` with bf16; ``torch.tensor``/``as_tensor`` with a CUDA device build the tensor on
    the CPU and give a fake CUDA one like it, and ``~t`` runs ``torch.bitwise_not`` (a CPU-only
    build refuses CUDA in both, even in a fake mode), as do ``copy_`` and ``contiguous`` (run as aten ops) and indexing: basic indexing of a fake
    CUDA tensor (ints, slices, None, ...) runs through aten ops."""
    _keep_dynamo_rules()
    tensor, as_tensor = torch.tensor, torch.as_tensor

    def on_cuda(make: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def build(data: Any, *args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
            if device is not None and torch.device(device).type == "cuda":
                return to_fake_cuda(make(data, *args, **kwargs), device)
            return make(data, *args, device=device, **kwargs)
        return build

    return [
        (torch.cuda, "is_available", lambda: True),
        (torch.cuda, "is_bf16_supported", lambda including_emulation=True: True),
        (torch.cuda, "get_device_capability", lambda device=None: capability),
        (torch.cuda, "device_count", lambda: 1),
        (torch.cuda, "current_device", lambda: 0),
        (torch.cuda, "get_device_name", lambda device=None: "fake CUDA device"),
        (torch, "tensor", on_cuda(tensor)),
        (torch, "as_tensor", on_cuda(as_tensor)),
        # the ``~`` operator's C++ binding takes a CUDA device guard, refused by a CPU-only build;
        # torch.bitwise_not is the same op without it
        (torch.Tensor, "__invert__", lambda self: torch.bitwise_not(self)),
        (torch.Tensor, "copy_", _copy(torch.Tensor.copy_)),
        (torch.Tensor, "contiguous", _contiguous(torch.Tensor.contiguous)),
        (torch.Tensor, "__getitem__", _getitem(torch.Tensor.__getitem__)),
        (torch.Tensor, "__setitem__", _setitem(torch.Tensor.__setitem__)),
    ]


def _keep_dynamo_rules() -> None:
    """Build Dynamo's map of torch's functions to their tracing rules (cached for the process, by
    the objects it finds under their names) before any patch replaces ``torch.tensor``: built while
    it is patched, the map would keep the wrapper, and every later compile of code calling the
    restored ``torch.tensor`` in an ``autograd.Function`` (the fp4 decode) would find it "skipped"."""
    from torch._dynamo import trace_rules

    trace_rules.get_torch_obj_rule_map()


def to_fake_cuda(t: torch.Tensor, device: Any = "cuda") -> torch.Tensor:
    """A fake CUDA tensor like ``t`` (shape, strides, dtype): ``t.to("cuda")`` itself is refused for
    a tensor whose value the fake mode knows (made by ``torch.tensor``). No data either way."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)


def cuda_module(build: Callable[[], torch.nn.Module], dtype: torch.dtype | None = None) -> torch.nn.Module:
    """``build()``'s module with fake CUDA parameters (call inside a fake mode): built on the meta
    device, then each parameter (in ``dtype`` if given) and buffer replaced by an empty one on CUDA (``Module.cuda()`` and CUDA initialisers are refused). The parameters do not require grad: an autograd kernel on a fake
    CUDA tensor aborts the process (assign ``.grad`` by hand instead)."""
    with torch.device("meta"):
        module = build()
    for mod in module.modules():
        for name, p in mod._parameters.items():
            if p is not None:
                mod._parameters[name] = torch.nn.Parameter(torch.empty(p.shape, dtype=dtype or p.dtype, device="cuda"),
                                                           requires_grad=False)
        for name, b in mod._buffers.items():
            if b is not None:
                mod._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device="cuda")
    return module


@contextlib.contextmanager
def patched(patches: list[tuple[Any, str, Any]]) -> Iterator[None]:
    """Apply ``patches`` for the block (outside pytest, where there is no monkeypatch)."""
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


def _zeros_like_list(t: torch.Tensor) -> Any:
    if t.dim() == 0:
        return False if t.dtype == torch.bool else 0
    return [_zeros_like_list(t[0])] * t.shape[0]


class HostReads:
    """Counts the host reads of fake CUDA tensors and answers each with zeros (a flag reads
    "no overflow", a count 0), so the code goes on to its next read.

    Counted: ``item``, ``tolist``, ``numpy``, ``bool``/``float``/``int``/``index`` conversions, and
    copies to the host (``cpu()``, ``to("cpu")``). Reads of fake CPU tensors are no syncs: they are
    answered the same way, not counted. ``sites`` names the code that read (``file:function``,
    which survives edits elsewhere in the file).
    """

    scalar_reads = ("item", "__bool__", "__float__", "__int__", "__index__")

    def __init__(self) -> None:
        self.count = 0
        self.sites: Counter[str] = Counter()
        self._saved: list[tuple[str, Any]] = []

    def _seen(self, t: torch.Tensor) -> None:
        if t.is_cuda:
            self.count += 1
            here = __file__
            for frame in reversed(traceback.extract_stack()):
                if frame.filename != here and "/torch/" not in frame.filename:
                    self.sites[f"{frame.filename.rsplit('/src/', 1)[-1]}:{frame.name}"] += 1
                    break

    def __enter__(self) -> HostReads:
        def scalar(name: str) -> Callable[..., Any]:
            original = getattr(torch.Tensor, name)
            zero = {"__bool__": False, "__float__": 0.0}.get(name, 0)

            def read(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                if not isinstance(t, FakeTensor):
                    return original(t, *args, **kwargs)
                self._seen(t)
                if t.constant is not None:
                    return original(t, *args, **kwargs)
                return (False if t.dtype == torch.bool else 0) if name == "item" else zero
            return read

        def tolist(t: torch.Tensor) -> Any:
            if not isinstance(t, FakeTensor):
                return original_tolist(t)
            self._seen(t)
            return _zeros_like_list(t)

        def cpu(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if isinstance(t, FakeTensor):
                self._seen(t)
            return original_cpu(t, *args, **kwargs)

        def to(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            target = kwargs.get("device", args[0] if args else None)
            if (isinstance(t, FakeTensor) and isinstance(target, (str, torch.device))
                    and torch.device(target).type == "cpu"):
                self._seen(t)
            return original_to(t, *args, **kwargs)

        def numpy(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if isinstance(t, FakeTensor):
                self._seen(t)
                raise DataDependentOutputException(torch.ops.aten._local_scalar_dense.default)
            return original_numpy(t, *args, **kwargs)

        original_tolist, original_cpu = torch.Tensor.tolist, torch.Tensor.cpu
        original_to, original_numpy = torch.Tensor.to, torch.Tensor.numpy
        replacements = {name: scalar(name) for name in self.scalar_reads}
        replacements.update(tolist=tolist, cpu=cpu, to=to, numpy=numpy)
        for name, fn in replacements.items():
            self._saved.append((torch.Tensor, name, getattr(torch.Tensor, name)))
            setattr(torch.Tensor, name, fn)
        self._saved.append((FakeTensor, "tolist", FakeTensor.__dict__["tolist"]))
        FakeTensor.tolist = tolist  # its own: one item() per element
        return self

    def __exit__(self, *exc: Any) -> None:
        for cls, name, fn in reversed(self._saved):
            setattr(cls, name, fn)
        self._saved.clear()

    def take(self) -> int:
        """The count since the last ``take`` (and reset it)."""
        count, self.count = self.count, 0
        self.sites.clear()
        return count


def fake_mode() -> FakeTensorMode:
    """A fake mode that keeps real CPU tensors out (every input must be made inside)."""
    return FakeTensorMode(allow_non_fake_inputs=False)


class FakeCuda:
    """The ``fake_cuda`` fixture: ``torch.cuda`` answers as one device of ``capability`` (9.0 unless
    set) through ``monkeypatch``, undone at teardown. Make tensors inside ``with fake_mode():``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.monkeypatch = monkeypatch
        self.set_capability((9, 0))

    def set_capability(self, capability: tuple[int, int]) -> None:
        for obj, name, value in cuda_patches(capability):
            self.monkeypatch.setattr(obj, name, value)


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    """``torch.cuda`` answers as a CUDA machine for this test only (see :class:`FakeCuda`)."""
    return FakeCuda(monkeypatch)


# --- torch's CUDA autocast test lists, run over fake CUDA tensors -----------------------------

def autocast_test_lists() -> type:
    """torch's ``AutocastTestLists`` class (torch/testing/_internal/autocast_test_lists.py), loaded
    from its source without the module's import of ``common_utils``, which needs ``expecttest``
    (not a dependency here) for its test base class; ``TEST_WITH_ROCM`` is False off ROCm."""
    import importlib.util

    path = importlib.util.find_spec("torch.testing._internal").submodule_search_locations[0]
    source = open(f"{path}/autocast_test_lists.py").read()
    source = source.split("class AutocastCPUTestLists", 1)[0]
    source = "\n".join(line for line in source.splitlines() if "common_utils import" not in line)
    namespace: dict[str, Any] = {"TEST_WITH_ROCM": torch.version.hip is not None}
    exec(compile(source, f"{path}/autocast_test_lists.py", "exec"), namespace)
    return namespace["AutocastTestLists"]


def autocast_cases() -> list[tuple[str, Callable[[], Any]]]:
    """``(case id, thunk)`` for every case of ``AutocastTestLists``, called through the torch
    function and the Tensor method where each exists, as test/test_cuda.py does (its
    ``_run_autocast_outofplace``). Call inside a fake mode with :func:`cuda_patches` applied.

    The lists are built on the (fake) CPU, then moved to CUDA: ``torch.tensor(..., device="cuda")``
    is refused by a CPU-only build even in a fake mode. An entry test_cuda.py skips (a true
    third element that is not a kwargs dict: ``einsum``, whose arguments do not fit its
    equation, and the ROCm-only skips, false here) is skipped here too.
    """
    lists = autocast_test_lists()(torch.device("cpu"))
    cuda = torch.device("cuda")
    cases = []
    for list_name, module_name in AUTOCAST_LISTS.items():
        for i, entry in enumerate(getattr(lists, list_name)):
            op, args = entry[0], entry[1]
            kwargs: dict[str, Any] = {}
            module: Any = {"torch": torch, "nn": torch._C._nn, "linalg": torch._C._linalg, None: None}.get(
                module_name)
            if len(entry) == 3:
                if isinstance(entry[2], dict):
                    kwargs = entry[2]
                elif list_name == "banned":
                    module = entry[2]
                elif isinstance(entry[2], torch.dtype):
                    pass  # builtin promote: the expected dtype, checked against the oracle
                elif entry[2]:
                    continue
            args = torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: to_fake_cuda(t, cuda), args)
            if module is not None and hasattr(module, op):
                cases.append((f"{list_name}[{i}] {op} (function)",
                              lambda f=getattr(module, op), a=args, k=kwargs: f(*a, **k)))
            if module is torch or module is None:
                if hasattr(torch.Tensor, op):
                    cases.append((f"{list_name}[{i}] {op} (method)",
                                  lambda op=op, a=args, k=kwargs: getattr(a[0], op)(*a[1:], **k)))
    return cases


def outcome(thunk: Callable[[], Any]) -> str:
    """What the call gave: each output tensor's dtype, shape and strides, or the error's type
    and first line."""
    try:
        out = thunk()
    except Exception as e:  # the same error in both processes is conformance too
        return f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    leaves = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    return "; ".join(f"{t.dtype} {tuple(t.shape)} {t.stride()} {t.device.type}" for t in leaves)


def run_autocast_cases(ctx: Callable[[torch.dtype], Any], dtype: torch.dtype) -> dict[str, str]:
    """``{case id: outcome}`` of every list case under ``ctx(dtype)`` (an autocast region), over
    fake CUDA tensors. Call with :func:`cuda_patches` applied."""
    with fake_mode(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(chain_matmul is deprecated|torch.cross without)")
        cases = autocast_cases()
        results = {}
        for case_id, thunk in cases:
            with ctx(dtype):
                results[case_id] = outcome(thunk)
    return results


def optional_argument_cases() -> list[tuple[str, Callable[[], Any]]]:
    """``(case id, thunk)`` of promote ops whose optional ``Tensor?`` argument has another dtype
    than the weighed ones (``bilinear``'s bias: ATen's ``promote_type`` weighs ``Tensor`` and
    ``Tensor[]`` arguments only, and casts the optional one). Call inside a fake mode with
    :func:`cuda_patches` applied."""
    cuda = torch.device("cuda")

    def make(*shape: int, dtype: torch.dtype) -> torch.Tensor:
        return to_fake_cuda(torch.randn(*shape, dtype=dtype), cuda)

    cases = []
    for bias_dtype in (torch.float32, torch.float16, torch.bfloat16):
        for half in (torch.float16, torch.bfloat16):
            args = (make(2, 3, dtype=half), make(2, 4, dtype=half), make(5, 3, 4, dtype=half),
                    make(5, dtype=bias_dtype))
            name = f"bilinear {str(half)[6:]} inputs, {str(bias_dtype)[6:]} bias"
            cases.append((name, lambda a=args: torch.bilinear(*a)))
            cases.append((name + " (keyword)", lambda a=args: torch.nn.functional.bilinear(*a[:3], bias=a[3])))
    return cases


def run_optional_argument_cases(ctx: Callable[[torch.dtype], Any], dtype: torch.dtype) -> dict[str, str]:
    """``{case id: outcome}`` of :func:`optional_argument_cases` under ``ctx(dtype)``."""
    with fake_mode():
        results = {}
        for case_id, thunk in optional_argument_cases():
            with ctx(dtype):
                results[case_id] = outcome(thunk)
    return results


#: the edited policy of the conformance tests: op -> the kind it moves to
EDITS = {"fp32": ["mm", "bmm", "addmm", "linear"], "lower": ["exp", "softmax", "sum", "layer_norm"],
         "promote": ["mv"], "passthrough": ["conv2d"]}


def edited_expectation(oracle: dict[str, str], dtype: torch.dtype) -> dict[str, str]:
    """What :data:`EDITS` makes of torch's outcomes: an op moved to fp32 (or promoted over fp32
    inputs) gives float32, one moved to the lower list gives ``dtype``; ``conv2d`` made
    passthrough still runs in ``dtype`` (through ``convolution``, on the lower list, as an op on
    no list does); every other case as torch."""
    kinds = {op: kind for kind, ops in EDITS.items() for op in ops}
    expected = {}
    for case_id, result in oracle.items():
        op = case_id.split(" ")[1]
        target = {"fp32": torch.float32, "promote": torch.float32, "lower": dtype}.get(kinds.get(op, ""))
        if target is not None and result.startswith("torch."):  # not an error
            result = "; ".join(f"{target} {part.split(' ', 1)[1]}" for part in result.split("; "))
        expected[case_id] = result
    return expected
