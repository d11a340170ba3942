"""The build's first line says what to expect on this machine (issue 42: it promised "about 30 s
on 2 idle cores" and took 120 s at load 4-7): the latest build here and its load, else a range
from the load now; the load now always."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from mixprec import _native


def test_without_an_earlier_build_a_range_from_the_load_now(tmp_path: Path) -> None:
    assert _native._expected(tmp_path, 0.0, 2) == "about 30 s (load now 0 on 2 core(s))"
    assert _native._expected(tmp_path, 5.0, 2) == "30 to 105 s or more (load now 5 on 2 core(s))"
    assert _native._expected(tmp_path, 0.4, 1) == "about 60 s (load now 0.4 on 1 core(s))"  # 1 core: twice 2's
    assert "load now unknown" in _native._expected(tmp_path, None, 2)


def test_the_latest_earlier_build_here_and_its_load(tmp_path: Path) -> None:
    for name, when, seconds, load in [("a", 1.0, 40.0, 0.3), ("b", 2.0, 169.5, 5.1), ("c", 0.5, 20.0, None)]:
        (tmp_path / f"mixprec_native_{name}").mkdir()
        (tmp_path / f"mixprec_native_{name}" / "built.json").write_text(
            json.dumps({"time": when, "seconds": seconds, "load": load}))
    (tmp_path / "mixprec_native_d").mkdir()
    (tmp_path / "mixprec_native_d" / "built.json").write_text("not json")  # skipped
    assert _native._expected(tmp_path, 6.25, 2) == "the last build here took 170 s at load 5.1; load now 6.25 on 2 core(s)"


def test_a_build_announces_the_estimate_and_records_its_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(_native, "_state", {})
    monkeypatch.setattr(_native, "_compile", lambda d: (d / f"{d.name}.so").write_bytes(b""))
    monkeypatch.setattr(_native, "_load_library", lambda d: None)
    monkeypatch.setattr(_native, "_load_now", lambda: 3.0)
    caplog.set_level(logging.WARNING, logger="mixprec")
    built = _native.build()
    first = [r.getMessage() for r in caplog.records if r.name == "mixprec"][0]
    assert "idle cores" not in first and "(load now 3 on " in first and first.endswith("; once per environment")
    record = json.loads((built.directory / "built.json").read_text())
    assert record["load"] == 3.0
    monkeypatch.setenv("CXX", "/no/such/compiler/differs")  # another environment: the estimate uses this one
    monkeypatch.setattr(_native, "_check_tools", lambda env: None)
    _native.build()
    second = [r.getMessage() for r in caplog.records if r.name == "mixprec"][2]
    assert "the last build here took 0 s at load 3; load now 3 on" in second
