"""Threads: a region's policy holds whatever other threads do, and registering or releasing
kernels never crashes a thread that runs ops (plain torch.autocast included).

The crash tests run in a subprocess with a timeout (a segfault fails the test, not pytest) at
``sys.setswitchinterval(1e-6)``, with the C++ kernel and with Python kernels only."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import mixprec
from mixprec import Policy
from mixprec.engine import kernels, runtime

SOFTMAX_FP32 = Policy().with_ops(fp32=["softmax"])


def _release_once_alone() -> None:
    """release_kernels() with no other thread left: removes every kernel. (Another thread that
    outlives its test, e.g. tqdm's monitor started by torch.compile, makes it refuse instead.)"""
    others = [t.name for t in threading.enumerate() if t is not threading.current_thread()]
    if others:
        with pytest.raises(RuntimeError, match="other threads are alive"):
            mixprec.release_kernels()
        return
    assert mixprec.release_kernels() >= 1 and not kernels.registered("cpu")


def test_release_from_another_thread_leaves_an_active_region_alone():
    """release_kernels() in thread B while thread A is inside an edited region: refused, and A's
    softmax stays float32 (before: the kernel went and A's softmax silently ran in bf16)."""
    x = torch.randn(4, 4).bfloat16()
    inside, released = threading.Event(), threading.Event()
    dtypes = []

    def region():
        with mixprec.autocast("cpu", policy=SOFTMAX_FP32):
            dtypes.append(torch.softmax(x, -1).dtype)
            inside.set()
            released.wait(10)
            dtypes.append(torch.softmax(x, -1).dtype)

    a = threading.Thread(target=region)
    a.start()
    assert inside.wait(10)
    try:
        with pytest.raises(RuntimeError, match=r"0 in this thread, 1 in other threads"):
            mixprec.release_kernels()
    finally:
        released.set()
        a.join(10)
    assert dtypes == [torch.float32, torch.float32]
    _release_once_alone()  # all regions have exited: allowed
    with mixprec.autocast("cpu", policy=SOFTMAX_FP32):  # and later regions register again
        assert torch.softmax(x, -1).dtype == torch.float32


def test_release_refuses_while_other_threads_are_alive():
    """Removing a kernel races with other threads' dispatch (PyTorch frees a Python kernel under
    a thread running it): refused, nothing removed, while another thread lives."""
    x = torch.randn(4, 4).bfloat16()
    with mixprec.autocast("cpu", policy=SOFTMAX_FP32):
        torch.softmax(x, -1)
    done = threading.Event()
    other = threading.Thread(target=done.wait, args=(10,), name="worker")
    other.start()
    try:
        with pytest.raises(RuntimeError, match=r"other threads are alive \(.*worker"):
            mixprec.release_kernels()
        assert "softmax.int" in kernels.registered("cpu")
        with torch.autocast("cpu"):  # a kept kernel gives PyTorch's kind (softmax: none on CPU)
            assert torch.softmax(x, -1).dtype == torch.bfloat16
    finally:
        done.set()
        other.join(10)
    _release_once_alone()


def test_frames_leave_by_identity():
    """Nested frames with equal policies are distinct: leaving the middle one out of order (a
    generator's region) leaves the outer one (before: list.remove took the first equal frame)."""
    outer, middle = (runtime.Frame("cpu", {}, Policy()) for _ in range(2))
    inner = runtime.Frame("cpu", {}, Policy(compute=torch.float16))
    entries = {id(frame): runtime.enter(frames=(frame,)) for frame in (outer, middle, inner)}
    try:
        runtime.leave(entries[id(middle)])
        assert [f is g for f, g in zip(runtime.RUNTIME.frames["cpu"], (outer, inner))] == [True, True]
    finally:
        runtime.leave(entries[id(inner)])
        runtime.leave(entries[id(outer)])
    assert runtime.top("cpu") is None and runtime.RUNTIME.depth == 0


_STRESS = """
import sys, threading, time, torch, mixprec
sys.setswitchinterval(1e-6)
policy = mixprec.Policy().with_ops(fp32=["softmax"])
if {fp8}:
    policy = policy.fp8()
xb, lin, x = torch.randn(4, 4).bfloat16(), torch.nn.Linear(16, 16), torch.randn(2, 16)
with mixprec.autocast("cpu", policy=policy):  # warm: op names, tables, the C++ build
    torch.softmax(xb, -1), lin(x)
mixprec.release_kernels()
stop, problems, cycles = threading.Event(), [], [0]

def plain():  # only torch.autocast: PyTorch's casts, whatever the other thread does
    try:
        while not stop.is_set():
            # without the C++ build fp8's linear has a Python kernel: it runs PyTorch's kind
            # itself, never PyTorch's kernel and its cast-cache lock while holding the GIL
            with torch.autocast("cpu"):
                if torch.softmax(xb, -1).dtype != torch.bfloat16 or lin(x).dtype != torch.bfloat16:
                    problems.append("torch.autocast changed")
    except Exception as e:
        problems.append(f"plain thread: {{e}}"[:300])

threads = [threading.Thread(target=plain) for _ in range(2)]
for t in threads:
    t.start()
end = time.monotonic() + {seconds}
try:
    while time.monotonic() < end:
        with mixprec.autocast("cpu", policy=policy):
            if torch.softmax(xb, -1).dtype != torch.float32:
                problems.append("edit lost")
        try:  # refused while the plain threads live: nothing is removed under them
            mixprec.release_kernels()
        except RuntimeError as e:
            assert "other threads are alive" in str(e) or "inside mixprec kernels" in str(e), e
        cycles[0] += 1
finally:
    stop.set()
    for t in threads:
        t.join()
print("cycles", cycles[0], "problems", sorted(set(problems)))
"""


@pytest.mark.slow
@pytest.mark.parametrize("native", ["1", "0"], ids=["cpp-kernel", "python-kernels"])
@pytest.mark.parametrize("fp8", [False, True], ids=["softmax", "fp8"])
def test_torch_autocast_threads_survive_regions_and_release_in_another_thread(native, fp8):
    """Two threads run plain torch.autocast while the main thread enters an edited region and
    calls release_kernels(), for 2 s (before: Python kernels segfaulted or failed an internal
    assert in SafePyObject.cpp within 3 s in 4 runs of 4; removing C++ kernels tripped
    KernelFunction.cpp's fallthrough assert; a Python kernel calling PyTorch's deadlocked
    against a region's exit clearing the cast cache, 2 runs of 3 with the cache on)."""
    env = {**os.environ, "MIXPREC_NATIVE_KERNELS": native}
    try:
        out = subprocess.run([sys.executable, "-c", textwrap.dedent(_STRESS.format(fp8=fp8, seconds=2))],
                             capture_output=True, text=True, env=env, timeout=120)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"hung: {e}")
    assert out.returncode == 0, f"exit {out.returncode}: {out.stderr[-2000:]}"
    last = out.stdout.strip().splitlines()[-1]
    assert last.endswith("problems []") and int(last.split()[1]) > 0, last


_UNSEEN_WORKER = """
import _thread, sys, time, torch, mixprec
sys.setswitchinterval(1e-6)
policy = mixprec.Policy().with_ops(fp32=["softmax"])
xb = torch.randn(4, 4).bfloat16()
with mixprec.autocast("cpu", policy=policy):  # softmax gets its kernel
    torch.softmax(xb, -1)
stop, calls, problems = [False], [0], []
done = _thread.allocate_lock()
done.acquire()

def worker():  # started with _thread: threading.enumerate() does not list it
    try:
        with mixprec.autocast("cpu"):  # a region without edits: PyTorch's casts
            while not stop[0]:
                if torch.softmax(xb, -1).dtype != torch.bfloat16:
                    problems.append("torch's cast changed")
                calls[0] += 1
    except Exception as e:
        problems.append(f"worker: {e}"[:300])
    finally:
        done.release()

_thread.start_new_thread(worker, ())
while calls[0] == 0:
    time.sleep(0.001)
refused, end = 0, time.monotonic() + 2
try:
    while time.monotonic() < end:
        with mixprec.autocast("cpu", policy=policy):
            torch.softmax(xb, -1)
        try:
            mixprec.release_kernels()
        except RuntimeError as e:
            assert "other threads are alive" in str(e) or "inside mixprec kernels" in str(e), e
            refused += 1
finally:
    stop[0] = True
    done.acquire()
print("refused", refused, "problems", sorted(set(problems)))
"""


def _run_script(script: str, native: str) -> str:
    env = {**os.environ, "MIXPREC_NATIVE_KERNELS": native}
    try:
        out = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                             env=env, timeout=120)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"hung: {e}")
    assert out.returncode == 0, f"exit {out.returncode}: {out.stderr[-2000:]}"
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.slow
@pytest.mark.parametrize("native", ["1", "0"], ids=["cpp-kernel", "python-kernels"])
def test_release_refuses_while_a_thread_started_with__thread_dispatches(native):
    """A worker started with ``_thread.start_new_thread`` (invisible to ``threading``) runs
    softmax in a region while the main thread calls release_kernels() for 2 s: every call is
    refused and the worker's ops keep PyTorch's casts (before: the kernels were removed under it,
    KernelFunction.cpp's fallthrough assert with the C++ kernel, a segfault with Python ones)."""
    last = _run_script(_UNSEEN_WORKER, native)
    assert last.startswith("refused ") and int(last.split()[1]) > 0 and last.endswith("problems []"), last


_INSIDE_A_KERNEL = """
import threading, torch, mixprec
from torch.utils._python_dispatch import TorchDispatchMode

class Block(TorchDispatchMode):  # holds the worker inside softmax, below our autocast kernel
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._softmax.default:
            entered.set()
            leave.wait(10)
        return func(*args, **(kwargs or {}))

xb = torch.randn(4, 4).bfloat16()
with mixprec.autocast("cpu", policy=mixprec.Policy().with_ops(fp32=["softmax"])):
    torch.softmax(xb, -1)
entered, leave = threading.Event(), threading.Event()

def worker():
    with torch.autocast("cpu"), Block():
        torch.softmax(xb, -1)

t = threading.Thread(target=worker)
t.start()
assert entered.wait(10)
try:
    mixprec.release_kernels()
    message = "released"
except RuntimeError as e:
    message = str(e)
leave.set()
t.join(10)
print(message.replace("\\n", " "))
"""


@pytest.mark.slow
@pytest.mark.parametrize("native", ["1", "0"], ids=["cpp-kernel", "python-kernels"])
def test_release_counts_calls_inside_the_kernels(native):
    """A call in flight inside our autocast kernel (C++ or Python) is counted, whichever thread
    makes it: release_kernels() names it (before: only threads were counted, so a native thread
    inside a kernel went unseen)."""
    last = _run_script(_INSIDE_A_KERNEL, native)
    assert "1 op call(s) are inside mixprec kernels" in last, last


@pytest.mark.parametrize("policy", [None, Policy().with_ops(fp32=["mm"]), Policy().keep(names="^never$")],
                         ids=["default", "edited", "module rules"])
def test_one_instance_entered_by_two_threads_at_once(policy):
    """As torch.autocast: one region object entered in two threads, its exits interleaved (thread A
    exits while B is inside), leaves each thread in its own state; before 2026-12-07 A popped B's
    entry, both raised StopIteration and autocast stayed on."""
    region, a = mixprec.autocast("cpu", policy=policy), torch.randn(4, 4)
    expected = torch.float32 if policy is not None and policy.edits("cpu") else torch.bfloat16
    a_inside, b_inside, a_left = threading.Event(), threading.Event(), threading.Event()
    out: dict[str, object] = {}

    def thread_a() -> None:
        with region:
            a_inside.set()
            assert b_inside.wait(10)
            out["A mm"] = torch.mm(a, a).dtype
        out["A after"] = torch.is_autocast_enabled("cpu")
        a_left.set()

    def thread_b() -> None:
        assert a_inside.wait(10)
        with region:
            b_inside.set()
            assert a_left.wait(10)
            out["B mm"] = torch.mm(a, a).dtype
        out["B after"] = torch.is_autocast_enabled("cpu")

    threads = [threading.Thread(target=f) for f in (thread_a, thread_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert out == {"A mm": expected, "A after": False, "B mm": expected, "B after": False}
    assert region._open == {}
