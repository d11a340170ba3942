"""Missing C++ kernels: a skip on a developer's machine, a failure with the build log's tail in CI
(``_native_required``; ``.ci/run`` sets ``MIXPREC_REQUIRE_NATIVE=1``)."""

from __future__ import annotations

from pathlib import Path

import pytest

import _native_required
from _native_required import kernels_missing, required
from mixprec import _native

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def build_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An environment whose build failed: a 50-line build.log, a failed.json."""
    for name in ("CI", "MIXPREC_REQUIRE_NATIVE", "MIXPREC_NATIVE_KERNELS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(_native, "build_directory", lambda env=None: tmp_path)
    (tmp_path / "build.log").write_text("".join(f"log line {i}\n" for i in range(50)))
    (tmp_path / "failed.json").write_text('{"cause": "c++: error: no such file"}\n')
    return tmp_path


@pytest.mark.parametrize("env,expected", [
    ({}, False), ({"CI": "true"}, True), ({"CI": "1"}, True), ({"CI": "false"}, False),
    ({"MIXPREC_REQUIRE_NATIVE": "1"}, True), ({"MIXPREC_REQUIRE_NATIVE": "true"}, True),
    ({"MIXPREC_REQUIRE_NATIVE": "0", "CI": "true"}, False),  # a CI runner without a compiler, on purpose
])
def test_ci_requires_the_kernels(monkeypatch: pytest.MonkeyPatch, env: dict[str, str], expected: bool) -> None:
    for name in ("CI", "MIXPREC_REQUIRE_NATIVE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert required() is expected


def test_without_ci_a_missing_kernel_skips(build_dir: Path) -> None:
    with pytest.raises(pytest.skip.Exception, match="could not be built"):
        kernels_missing("could not be built")


def test_in_ci_a_missing_kernel_fails_with_the_build_log_tail(build_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MIXPREC_REQUIRE_NATIVE", "1")
    with pytest.raises(pytest.fail.Exception) as info:
        kernels_missing("could not be built")
    message = str(info.value)
    assert message.startswith("could not be built; the C++ kernels are required here")
    assert "c++: error: no such file" in message  # failed.json's cause
    assert "log line 49" in message and "log line 20" in message and "log line 19" not in message  # last 30
    assert f"{build_dir / 'build.log'} (last 30 of 50 lines)" in message


def test_in_ci_kernels_turned_off_on_purpose_skip(build_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    monkeypatch.setenv("MIXPREC_NATIVE_KERNELS", "0")
    with pytest.raises(pytest.skip.Exception, match="MIXPREC_NATIVE_KERNELS=0"):
        kernels_missing("could not be built")


def test_a_build_without_a_log_says_so(build_dir: Path) -> None:
    for name in ("build.log", "failed.json"):
        (build_dir / name).unlink()
    assert _native_required.build_log_tail() == f"(no build.log or failed.json in {build_dir})"


def test_ci_and_the_test_script_require_the_kernels() -> None:
    """.ci/run sets the variable; scripts/test.sh fails on a failed build when it is set."""
    assert "export MIXPREC_REQUIRE_NATIVE=1" in (ROOT / ".ci" / "run").read_text()
    script = (ROOT / "scripts" / "test.sh").read_text()
    assert 'require="${MIXPREC_REQUIRE_NATIVE:-${CI:-}}"' in script and "exit 1" in script
