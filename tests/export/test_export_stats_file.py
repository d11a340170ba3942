"""A ``--stats`` file that is not statistics (empty, not a torch file, or a dict whose fields have the
wrong types) is a ValueError naming the field from :func:`mixprec.export.load_stats`, and one
``mixprec export: error:`` line with exit status 1 from the command: never a traceback."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from mixprec.export import Recorder, load_stats

_ONE = torch.zeros(1, 1)

#: (case id, what the file holds: bytes written as they are, anything else torch.save'd, what the error names)
HOSTILE: tuple[tuple[str, Any, str], ...] = (
    ("empty", b"", "the file is empty"),
    ("text", b"not statistics", "torch.load: "),
    ("truncated", "truncated", "torch.load: "),
    ("a_list", [1, 2, 3], "must be what mixprec.export.Recorder.save wrote"),
    ("no_history", {"names": ["a"]}, "no 'history'"),
    ("names_int", {"names": 5, "history": _ONE}, "'names' must be a list"),
    ("names_of_ints", {"names": [1], "history": _ONE}, "'names' must be a list"),
    ("history_list", {"names": ["a"], "history": [[0.0]]}, "'history' must be"),
    ("history_1d", {"names": ["a"], "history": torch.zeros(1)}, "'history' must be"),
    ("history_ints", {"names": ["a"], "history": torch.zeros(1, 1, dtype=torch.int64)}, "'history' must be"),
    ("history_width", {"names": ["a", "b"], "history": _ONE}, "'history' must be"),
    ("history_negative", {"names": ["a", "b"], "history": torch.tensor([[1.0, -2.0]])}, "negative amax"),
    ("fp8_layers_int", {"names": ["a"], "history": _ONE, "fp8_layers": 5}, "'fp8_layers' must be a list"),
    ("fp8_layers_str", {"names": ["a"], "history": _ONE, "fp8_layers": "a"}, "'fp8_layers' must be a list"),
    ("fallback_list", {"names": ["a"], "history": _ONE, "fallback": ["a"]}, "'fallback' must be a dict"),
    ("kv_sites_int", {"names": ["a"], "history": _ONE, "kv_sites": 3}, "'kv_sites' must be a dict"),
    ("recipes_list", {"names": ["a"], "history": _ONE, "recipes": [1]}, "'recipes' must be a dict"),
    ("recipe_int", {"names": ["a"], "history": _ONE, "recipes": {"a": 1}}, "'recipes'['a'] is not a recorded recipe"),
    ("recipe_fields", {"names": ["a"], "history": _ONE, "recipes": {"a": {"bogus": 1}}},
     "'recipes'['a'] is not a recorded recipe"),
    ("recipe_cast", {"names": ["a"], "history": _ONE, "recipes": {"a": {"input": {"format": 3}}}},
     "'recipes'['a'] is not a recorded recipe"),
)


def _write(path: Path, content: Any) -> Path:
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content == "truncated":
        torch.save({"names": ["a"], "history": _ONE}, path)
        path.write_bytes(path.read_bytes()[:40])
    else:
        torch.save(content, path)
    return path


@pytest.mark.parametrize(("content", "names"), [c[1:] for c in HOSTILE], ids=[c[0] for c in HOSTILE])
def test_load_stats_refuses_a_hostile_file_naming_what_is_wrong(tmp_path: Path, content: Any, names: str) -> None:
    path = _write(tmp_path / "stats.pt", content)
    with pytest.raises(ValueError) as info:
        load_stats(path)
    message = str(info.value)
    assert f"{path} is not a statistics file written by mixprec.export.Recorder.save" in message
    assert names in message and "rec.save(path)" in message, message  # what is wrong, and what to do
    assert "\n" not in message


def test_cli_answers_each_hostile_file_with_one_line_and_exit_status_1(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers", reason="transformers is not installed")
    from mixprec.cli import main

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    for case, content, names in HOSTILE:
        path = _write(tmp_path / f"{case}.pt", content)
        assert main(["export", str(tmp_path / "model"), str(tmp_path / "out"), "--stats", str(path)]) == 1, case
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and "Traceback" not in err, (case, err)
        assert lines[0].startswith(f"mixprec export: error: {path} is not a statistics file"), (case, err)
        assert names in lines[0], (case, err)
    assert not (tmp_path / "out").exists()


def test_what_a_recorder_saved_loads_back(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    with Recorder(model) as rec:
        model(torch.randn(2, 8))
        rec.step()
    rec.save(tmp_path / "stats.pt")
    loaded = load_stats(tmp_path / "stats.pt")
    assert loaded.names == rec.names and torch.equal(loaded.history, rec.history.cpu())
    assert set(loaded.series()) == set(rec.series())
