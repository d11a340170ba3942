"""The cross-ISA subset in the default run: the tests marked ``cross_isa`` (their results follow
the CPU's bf16 rounding: controller decisions, losses) run again under the lowest instruction-set
cap this CPU allows (``scripts/cross_isa.py``), so a test that holds only on this CPU fails here
and not on CI's next machine. The whole suite under every cap: ``scripts/cross_isa.py``."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("cross_isa", ROOT / "scripts" / "cross_isa.py")
cross_isa = sys.modules["cross_isa"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cross_isa)


def test_the_caps_follow_the_cpu_flags() -> None:
    names = lambda flags: [c.name for c in cross_isa.available(flags)]  # noqa: E731
    assert names(set()) == ["native"]
    assert names({"avx2", "fma"}) == ["avx2", "native"]
    avx512 = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq"}
    assert names(avx512) == ["avx2", "avx512", "native"]
    assert names(avx512 | {"avx512_bf16"}) == ["avx2", "avx512", "avx512-bf16", "native"]
    assert names(avx512 | {"avx512_bf16", "amx_bf16", "amx_tile"}) == ["avx2", "avx512", "avx512-bf16", "amx", "native"]
    avx2 = cross_isa.available({"avx2", "fma"})[0].env()
    assert avx2["ONEDNN_MAX_CPU_ISA"] == "AVX2" and avx2["ATEN_CPU_CAPABILITY"] == "avx2"


@pytest.mark.slow
def test_every_cross_isa_test_is_collected() -> None:
    """The subset is not empty: a marker renamed or dropped would make the run below vacuous."""
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
                          "-m", "cross_isa"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    collected = [line for line in out.stdout.splitlines() if "::" in line]
    assert len(collected) >= 8, out.stdout[-2000:]


@pytest.mark.slow
def test_the_cross_isa_subset_passes_under_the_lowest_cap() -> None:
    if cross_isa.available()[0].name == "native":
        pytest.skip("this CPU offers no instruction-set cap to lower to (not x86 with AVX2)")
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "cross_isa.py"), "--subset", "--caps", "lowest",
                          "--", "-x"], cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]


def test_each_cap_below_native_has_its_own_inductor_cache(monkeypatch) -> None:
    """Inductor's cache does not key on ``ATEN_CPU_CAPABILITY``: a kernel a native run generated
    for AVX-512, reloaded under the AVX2 cap, computes all-NaN outputs (no AVX2 machine does)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/inductor-here")
    caps = {c.name: c.env().get("TORCHINDUCTOR_CACHE_DIR") for c in cross_isa.CAPS}
    assert caps["native"] == "/tmp/inductor-here"
    assert caps["avx2"] == "/tmp/inductor-here-avx2"
    assert len(set(caps.values())) == len(caps)
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    assert cross_isa.CAPS[0].env()["TORCHINDUCTOR_CACHE_DIR"] == default_cache_dir() + "-avx2"
    assert "TORCHINDUCTOR_CACHE_DIR" not in cross_isa.CAPS[-1].env()
