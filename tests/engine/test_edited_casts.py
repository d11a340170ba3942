"""The casts of an op a policy edits (mixprec's own kernel, C++ or Python: the Python one in
``test_python_kernels_pass_the_edited_cast_tests`` below): its weight-cast cache, the
promote, set-dtype and append-dtype kinds, with PyTorch's kernels of the same kinds as the oracle
where CPU has them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec import Policy

from _count_casts import CountCasts

LOWER_MUL = Policy().with_ops(lower=["mul"])  # mul: no autocast kind of PyTorch's, lowered by our kernel
PROMOTE_MUL = Policy().with_ops(promote=["mul"])
NUMERICS = Policy.preset("fp32-numerics")  # CUDA's float32 list on the CPU: set-dtype and append-dtype ops


def _region(policy: Policy = LOWER_MUL, **kwargs):
    return mixprec.autocast("cpu", dtype=torch.bfloat16, policy=policy, **kwargs)


# ------------------------------------------------------------------ the weight-cast cache
def test_a_weight_is_cast_once_per_region():
    w, x = nn.Parameter(torch.randn(4)), torch.randn(4)
    with CountCasts() as c, _region():
        assert torch.mul(x, w).dtype == torch.bfloat16
        first = c.casts
        torch.mul(x, w)
        again = c.casts - first
        with _region():
            torch.mul(x, w)
        nested = c.casts - first - again
    assert (first, again, nested) == (2, 1, 1)  # the weight's cast is kept until the outermost exit
    with CountCasts() as c, _region(cache_enabled=False):
        torch.mul(x, w), torch.mul(x, w)
    assert c.casts == 4


def test_the_next_region_casts_the_updated_weight():
    """The cache ends with the outermost region: an optimizer's in-place update between two
    regions is seen by the second."""
    w, x = nn.Parameter(torch.randn(4)), torch.randn(4)
    for step in range(2):
        with _region():
            y = torch.mul(x, w)
        assert torch.equal(y, x.bfloat16() * w.detach().bfloat16()), step
        with torch.no_grad():
            w.add_(1.0)


@pytest.mark.parametrize("first", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
def test_a_cast_made_without_grad_first_still_carries_the_gradient(first):
    """A weight first cast under no_grad (cached with a grad_fn) or inference mode (not cached)
    gets its gradient from a later grad-enabled use in the region."""
    w, x = nn.Parameter(torch.randn(4)), torch.randn(4)
    with _region():
        with first():
            torch.mul(x, w)
        y = torch.mul(x, w)
    assert not y.is_inference()
    y.float().sum().backward()
    assert torch.equal(w.grad, x.bfloat16().float())


def test_a_tensor_without_grad_is_cast_again_after_it_changes():
    a, w = torch.randn(4), nn.Parameter(torch.randn(4))
    with _region():
        torch.mul(a, w)
        a.add_(1.0)
        y = torch.mul(a, w)
    assert torch.equal(y, a.bfloat16() * w.detach().bfloat16())


def test_a_leaf_view_is_cast_again_after_its_base_changes():
    base, w = torch.randn(6), nn.Parameter(torch.randn(4))
    view = base[:4].requires_grad_()  # a leaf that requires grad, and a view
    assert view.is_leaf and view._is_view()
    with _region():
        torch.mul(view, w)
        with torch.no_grad():
            base.add_(1.0)
        y = torch.mul(view, w)
    assert torch.equal(y, view.detach().bfloat16() * w.detach().bfloat16())


def test_a_python_number_operand_of_an_edited_op():
    """``x * 2`` passes 2 as a wrapped number: the edited op (and, later, the same op outside
    any region) computes what PyTorch computes with it."""
    x, ints = torch.randn(4), torch.arange(4)
    with _region():
        assert torch.equal(x * 0.1, x.bfloat16() * 0.1)
        assert torch.equal(ints * 2.5, torch.arange(4) * 2.5) and (ints * 2.5).dtype == torch.float32
        assert torch.equal(x * True, x.bfloat16())
    assert torch.equal(x * 3, x + x + x) and (ints * 3).dtype == torch.int64
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert (x * 2).dtype == torch.float32


# ------------------------------------------------------------------ promote
PAIRS = [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
         (torch.float64, torch.bfloat16), (torch.bfloat16, torch.float64), (torch.float32, torch.float64),
         (torch.float16, torch.bfloat16), (torch.float32, torch.float16)]


_CAT_ORACLE = """
import torch
for names in {pairs!r}:
    a, b = (torch.randn(4).to(getattr(torch, n)) for n in names)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            print(str(torch.cat([a, b]).dtype))
    except RuntimeError as e:
        print("error:" + str(e).splitlines()[0])
"""


@pytest.fixture(scope="module")
def cat_oracle() -> dict:
    """PyTorch's own promote kernel (``cat``) on ``PAIRS``, in a process mixprec never ran in
    (here, a policy may have given ``cat`` a kernel of ours)."""
    names = [tuple(str(d).removeprefix("torch.") for d in pair) for pair in PAIRS]
    run = subprocess.run([sys.executable, "-c", _CAT_ORACLE.format(pairs=names)], capture_output=True,
                         text=True, check=True, timeout=300)
    return dict(zip(PAIRS, run.stdout.split("\n")))


@pytest.mark.parametrize("dtypes", PAIRS, ids=lambda d: f"{d[0]}-{d[1]}".replace("torch.", ""))
def test_promote_takes_the_widest_input_as_pytorchs_promote_kernel(dtypes, cat_oracle):
    """``mul`` edited to promote gives the dtype (or the error) PyTorch's own promote kernel
    (``cat``, promote on the CPU) gives the same inputs: float32 wins, float64 is left alone,
    another half dtype than the region's is refused."""
    a, b = (torch.randn(4).to(d) for d in dtypes)
    expected = cat_oracle[dtypes]
    if expected.startswith("error:"):
        assert "Unexpected floating ScalarType" in expected
        with pytest.raises(RuntimeError, match="Unexpected floating ScalarType"):
            with _region(PROMOTE_MUL):
                torch.mul(a, b)
        return
    with _region(PROMOTE_MUL):
        assert str(torch.mul(a, b).dtype) == expected


BILINEAR_PROMOTE = Policy().with_ops(promote=["bilinear"])


@pytest.mark.parametrize("bias", [torch.float32, torch.bfloat16, None], ids=str)
def test_promote_weighs_no_optional_argument(bias):
    """As ATen's ``promote_type``: Tensor and Tensor[] arguments are weighed, an optional
    ``Tensor?`` (bilinear's bias) is not, and is cast to the dtype the others chose."""
    a, b, w = torch.randn(2, 3).bfloat16(), torch.randn(2, 4).bfloat16(), torch.randn(5, 3, 4).bfloat16()
    bias_t = None if bias is None else torch.randn(5).to(bias)
    cast_bias = None if bias is None else bias_t.bfloat16()
    with _region(BILINEAR_PROMOTE):
        positional, keyword = torch.bilinear(a, b, w, bias_t), F.bilinear(a, b, w, bias=bias_t)
        widened = torch.bilinear(a.float(), b, w, bias_t)  # a weighed float32 input widens all
    for out in (positional, keyword):
        assert out.dtype == torch.bfloat16 and torch.equal(out, torch.bilinear(a, b, w, cast_bias))
    expected = torch.bilinear(a.float(), b.float(), w.float(), None if bias is None else bias_t.float())
    assert widened.dtype == torch.float32 and torch.equal(widened, expected)


# ------------------------------------------------------------------ set-dtype, append-dtype
def test_set_dtype_ops_compute_in_float32_unless_the_caller_named_a_dtype():
    x = torch.randn(3, 5).bfloat16()
    with _region(NUMERICS):
        assert F.softmax(x, -1).dtype == torch.float32
        assert F.softmax(x, -1, dtype=torch.float64).dtype == torch.float64
        assert torch.sum(x).dtype == torch.float32
        assert torch.sum(x, dtype=torch.bfloat16).dtype == torch.bfloat16
        assert torch.cumsum(torch.arange(5), 0).dtype == torch.int64  # not a floating input: no dtype set
        assert F.softmax(x.double(), -1).dtype == torch.float64  # float64: autocast leaves it
    torch.testing.assert_close(F.softmax(x, -1, dtype=torch.float64), F.softmax(x.double(), -1), rtol=0, atol=0)


def test_append_dtype_ops_compute_in_float32():
    """``aten::norm``'s overloads go to their ``dtype=`` forms in float32 (a float64 input keeps
    its dtype), with the arguments a call leaves at their defaults (``p=2``)."""
    x = torch.randn(3, 5).bfloat16()
    norm = torch.ops.aten.norm
    calls = [lambda t: norm(t), lambda t: norm(t, 3), lambda t: norm(t, 2, [1]), lambda t: norm(t, 1, [0], True),
             lambda t: norm.Scalar(t, p=3), lambda t: norm.ScalarOpt_dim(t, 2, dim=[1], keepdim=True)]
    with _region(NUMERICS):
        got = [call(x) for call in calls]
        assert all(call(x.double()).dtype == torch.float64 for call in calls)
    for g, call in zip(got, calls):
        assert g.dtype == torch.float32 and torch.equal(g, call(x.float()))


# ------------------------------------------------------------------ the Python kernel
@pytest.mark.slow
def test_python_kernels_pass_the_edited_cast_tests():
    """Where no C++ build serves (``MIXPREC_NATIVE_KERNELS=0``), the Python kernels run every
    edited op: this file's tests and the policy-edit tests of the engine pass there too."""
    here = Path(__file__).parent
    files = [here / "test_edited_casts.py", here / "test_autocast_engine.py", here / "test_autocast_gaps.py",
             here / "test_module_rules.py"]
    env = {**os.environ, "MIXPREC_NATIVE_KERNELS": "0", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow",
                          "-o", "faulthandler_timeout=240", *map(str, files)],
                         capture_output=True, text=True, env=env, timeout=900, cwd=here.parent.parent)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
