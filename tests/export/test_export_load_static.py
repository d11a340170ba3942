"""load_static checks everything it reads before it changes the model: a damaged or mismatched export
folder gets a ValueError naming the file and the tensor, and the model stays bitwise as it was."""

from __future__ import annotations

import copy
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import mixprec
from mixprec import fp8
from mixprec.export import Recorder, StaticFloat8Linear, load_static

safetensors_torch = pytest.importorskip("safetensors.torch", reason="safetensors is not installed")

X = torch.randn(4, 32, generator=torch.Generator().manual_seed(7))
FP8 = "2"  # the export's one fp8 layer (the first and last linear are kept)


def _trained() -> nn.Module:
    """``Linear, ReLU, Linear, ReLU, Linear`` (32 wide) under ``fp8.convert``."""
    torch.manual_seed(0)
    return fp8.convert(nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32)))


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[nn.Module, Path]:
    """The trained model and its compressed-tensors export (one fp8 layer, ``2``)."""
    torch.set_num_threads(1)
    model = _trained()
    with Recorder(model) as rec:
        model(torch.randn(8, 32, generator=torch.Generator().manual_seed(1))).sum().backward()
        rec.step()
    folder = tmp_path_factory.mktemp("export") / "good"
    q = mixprec.export(model, folder, stats=rec)
    assert sorted(q.layers) == [FP8]
    return model, folder


def _edit(fn: Callable[[dict[str, torch.Tensor]], object]) -> Callable[[Path], None]:
    """A folder edit that rewrites ``model.safetensors`` with ``fn`` applied to its tensors."""
    def edit(folder: Path) -> None:
        tensors = safetensors_torch.load_file(str(folder / "model.safetensors"))
        fn(tensors)
        safetensors_torch.save_file(tensors, str(folder / "model.safetensors"))
    return edit


def _set(key: str, value: Callable[[torch.Tensor | None], torch.Tensor]) -> Callable[[Path], None]:
    """Tensor ``key`` replaced by ``value(the stored one)``."""
    return _edit(lambda t: t.__setitem__(key, value(t.get(key))))


def _drop(*keys: str) -> Callable[[Path], None]:
    return _edit(lambda t: [t.pop(k) for k in keys])


def _nan_byte(q: torch.Tensor) -> torch.Tensor:
    b = q.view(torch.uint8).clone()
    b[3, 5] = 0x7F  # e4m3fn's NaN
    return b.view(torch.float8_e4m3fn)


def _truncate(folder: Path) -> None:
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _move(src: str, dst: str) -> Callable[[Path], None]:
    """Layer ``src``'s fp8 tensors stored under layer ``dst``'s names."""
    def move(t: dict[str, torch.Tensor]) -> None:
        for n in ("weight", "weight_scale", "input_scale"):
            t[f"{dst}.{n}"] = t.pop(f"{src}.{n}")
    return _edit(move)


#: (case, the folder's edit, the file named, the words of the error: each names the tensor's key)
CORRUPT = [
    ("zero-input-scale", _set("2.input_scale", lambda s: torch.zeros(1)), "model.safetensors",
     r"'2\.input_scale' holds 0 \(a scale must be finite and > 0\)"),
    ("nan-weight-scale", _set("2.weight_scale", lambda s: torch.full((1,), float("nan"))), "model.safetensors",
     r"'2\.weight_scale' holds nan"),
    ("inf-weight-scale", _set("2.weight_scale", lambda s: torch.full((1,), float("inf"))), "model.safetensors",
     r"'2\.weight_scale' holds inf"),
    ("negative-weight-scale", _set("2.weight_scale", lambda s: -s), "model.safetensors",
     r"'2\.weight_scale' holds -\d.* \(a scale must be finite and > 0\)"),
    ("negative-input-scale", _set("2.input_scale", lambda s: -s), "model.safetensors",
     r"'2\.input_scale' holds -"),
    ("missing-weight-scale", _drop("2.weight_scale"), "model.safetensors",
     r"'2\.weight_scale' is missing \(an fp8 layer has '2\.weight', '2\.weight_scale', '2\.input_scale'\)"),
    ("missing-input-scale", _drop("2.input_scale"), "model.safetensors", r"'2\.input_scale' is missing"),
    ("missing-both-scales", _drop("2.weight_scale", "2.input_scale"), "model.safetensors",
     r"'2\.weight_scale' is missing"),  # an e4m3 weight alone is an fp8 layer too, not left out
    ("missing-weight", _drop("2.weight"), "model.safetensors", r"'2\.weight' is missing"),
    ("weight-of-another-shape", _set("2.weight", lambda q: q[:16]), "model.safetensors",
     r"'2\.weight' has shape \(16, 32\), but layer '2' of the model has a \(32, 32\) weight"),
    ("input-scale-of-another-shape", _set("2.input_scale", lambda s: torch.ones(5)), "model.safetensors",
     r"'2\.input_scale' has shape \(5,\), not one of"),
    ("weight-scale-per-input-column", _set("2.weight_scale", lambda s: s.expand(32).clone()), "model.safetensors",
     r"'2\.weight_scale' has shape \(32,\), not one of \[\(1,\), \(\), \(32, 1\)\]"),  # would broadcast: no error
    ("weight-of-another-dtype", _set("2.weight", lambda q: q.float()), "model.safetensors",
     r"'2\.weight' is torch\.float32, not torch\.float8_e4m3fn"),
    ("weight-holding-nan", _set("2.weight", _nan_byte), "model.safetensors", r"'2\.weight' holds NaN"),
    ("integer-scale", _set("2.input_scale", lambda s: torch.ones(1, dtype=torch.int64)), "model.safetensors",
     r"'2\.input_scale' is torch\.int64, not a float32 scale"),
    ("unknown-layer", _move("2", "9"), "model.safetensors",
     r"'9\.weight' is for layer '9', which the model does not have"),
    ("not-a-linear-layer", _move("2", "1"), "model.safetensors",
     r"'1\.weight' is for '1', a ReLU in the model, not a linear layer"),
    ("truncated-safetensors", _truncate, "model.safetensors", r"not a whole safetensors file"),
    ("config-not-json", lambda d: (d / "config.json").write_text("{not json"), "config.json", r"not JSON"),
]


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("edit,file,words", [c[1:] for c in CORRUPT], ids=[c[0] for c in CORRUPT])
def test_a_corrupt_folder_is_refused_naming_the_tensor_and_the_model_is_unchanged(tmp_path, exported, edit, file,
                                                                                  words):
    model, good = exported
    folder = tmp_path / "bad"
    shutil.copytree(good, folder)
    edit(folder)
    plain = fp8.unconvert(copy.deepcopy(model))
    before, kinds = _state(plain), [type(m) for m in plain.modules()]
    with torch.no_grad():
        y = plain(X)
    with pytest.raises(ValueError, match=words) as err:
        load_static(plain, folder)
    assert str(err.value).startswith(f"{folder / file}: ")
    if file == "model.safetensors":  # says what to do
        assert str(err.value).endswith("export the model again (mixprec.export), or load the folder into the model "
                                       "it was exported from")
    after = plain.state_dict()
    assert after.keys() == before.keys() and [type(m) for m in plain.modules()] == kinds
    assert all(torch.equal(v, after[k]) and v.dtype == after[k].dtype for k, v in before.items())
    with torch.no_grad():
        assert torch.equal(plain(X), y)


def test_a_scale_that_float16_cannot_hold_is_refused_for_scale_dtype_float16(tmp_path, exported):
    model, good = exported
    shutil.copytree(good, tmp_path / "f")
    _set("2.input_scale", lambda s: torch.full((1,), 1e-9))(tmp_path / "f")
    plain = fp8.unconvert(copy.deepcopy(model))
    before = _state(plain)
    with pytest.raises(ValueError, match=r"'2\.input_scale' holds 1e-09, which is 0 in torch\.float16, the "
                                         r"scale_dtype asked for: load with scale_dtype=torch\.bfloat16, or None"):
        load_static(plain, tmp_path / "f", scale_dtype=torch.float16)
    assert all(torch.equal(v, plain.state_dict()[k]) for k, v in before.items())
    load_static(plain, tmp_path / "f", scale_dtype=torch.bfloat16)  # a valid float32 scale: bf16 holds it


@pytest.mark.parametrize("strategy", ["tensor", "channel"])
def test_a_good_folder_loads_the_stored_tensors(tmp_path, strategy):
    """Per-tensor and per-channel (``(out, 1)``) weight scales, an all-zero weight (its tiny scale is 0
    in float16, harmless on zeros) with float16 scales: the layer holds the file's tensors bitwise."""
    model = _trained()
    with torch.no_grad():
        (model[2].weight if strategy == "tensor" else model[2].weight[5]).zero_()
    with Recorder(model) as rec:
        model(X)
        rec.step()
    mixprec.export(model, tmp_path, stats=rec, weight_strategy=strategy)
    stored = safetensors_torch.load_file(str(tmp_path / "model.safetensors"))
    for scale_dtype in (None, torch.float16):
        served = load_static(fp8.unconvert(copy.deepcopy(model)), tmp_path, scale_dtype=scale_dtype)
        layer = served[2]
        assert isinstance(layer, StaticFloat8Linear) and not isinstance(served[0], StaticFloat8Linear)
        assert torch.equal(layer.weight.view(torch.uint8), stored["2.weight"].view(torch.uint8))
        dtype = scale_dtype or torch.float32
        assert torch.equal(layer.weight_scale, stored["2.weight_scale"].to(dtype))
        assert torch.equal(layer.input_scale, stored["2.input_scale"].to(dtype))
        with torch.no_grad():
            assert torch.isfinite(served(X)).all()
