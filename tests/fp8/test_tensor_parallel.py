"""fp8/fp4 under tensor and sequence parallelism (2 gloo ranks): a Linear -> (Linear, ReLU,
Linear) -> Linear model whose block is sharded with torch's ColwiseParallel and RowwiseParallel
trains 3 SGD steps in bf16 with every recipe, on the policy route and after ``fp8.convert``, and
computes what one process computes (``_tp_cases.py``; each rank runs the one-process reference
itself):

* the forward casts of step 0 take the one-process scales: the window amax of each layer's input
  and weight, MAX over the ranks, is bitwise the one process's, and a tensor scale's amax is the
  global one on every rank (a scale per shard would give each rank its own);
* step 0's output differs from the one process's by no more than twice what the same runs
  without fp8 differ by (only the rowwise layer's reduce order differs); the gradients of step 0
  and the trained parameters differ from the one process's by less than the recipe's own error
  (one process, fp8 against no fp8): the backward's casts see that reduce order's last bits.

Before the fix the fp8 statistics raised ``aten.maximum.default got mixed torch.Tensor and
DTensor`` (NVFP4: in ``aten.add_``)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist

from _distributed import gloo_group, spawn
from _tp_cases import features

pytestmark = [pytest.mark.distributed,
              pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")]

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8", "blockwise", "mxfp4", "nvfp4",
           "nvfp4+hadamard", "nvfp4+sr")
FORWARD = (0, 1)  # the window rows of the input and the weight
AMAX, PREVIOUS = 0, 4  # the window columns of the amax and the previous cast's amax


def _worker(rank: int, port: int, out_dir: str, names: tuple[str, ...], route: str, sequence: bool) -> None:
    from _tp_cases import compare_case

    with gloo_group(rank, port):
        torch.set_num_threads(1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            results = {name: compare_case(name, route, sequence) for name in ("fp32", "fp32-128", *names)}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def _run(tmp_path, names: tuple[str, ...], route: str = "policy", sequence: bool = False) -> list[dict]:
    spawn(_worker, str(tmp_path), names, route, sequence, timeout=300)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def _check(ranks: list[dict], names: tuple[str, ...]) -> None:
    for name in names:
        base = ranks[0]["fp32" if features(name) == 32 else "fp32-128"]
        tolerance = 2 * _max_diff(base["single"]["outputs"][0], base["tp"]["outputs"][0])
        single, tps = ranks[0][name]["single"], [r[name]["tp"] for r in ranks]
        for layer, window in single["windows"][0].items():
            merged = torch.stack([tp["windows"][0][layer] for tp in tps]).amax(0)
            for row in FORWARD:
                assert torch.equal(merged[row, [AMAX, PREVIOUS]], window[row, [AMAX, PREVIOUS]]), (name, layer, row)
            if name == "tensorwise":  # one scale: the global amax on every rank
                for tp in tps:
                    assert torch.equal(tp["windows"][0][layer][FORWARD, AMAX], window[FORWARD, AMAX]), (name, layer)
        for tp in tps:
            assert _max_diff(tp["outputs"][0], single["outputs"][0]) <= tolerance, name
            for param, grad in single["grads"][0].items():  # within the recipe's own error (vs no fp8)
                assert _max_diff(tp["grads"][0][param], grad) <= _max_diff(grad, base["single"]["grads"][0][param]), \
                    (name, param)
            for param, value in single["params"].items():
                assert _max_diff(tp["params"][param], value) <= _max_diff(value, base["single"]["params"][param]), \
                    (name, param)
        assert all(torch.equal(a, b) for a, b in zip(tps[0]["outputs"], tps[1]["outputs"])), name


@pytest.mark.slow
def test_every_recipe_under_tensor_parallelism_matches_one_process(tmp_path) -> None:
    _check(_run(tmp_path, RECIPES), RECIPES)


@pytest.mark.slow
def test_every_recipe_after_convert_under_tensor_parallelism_matches_one_process(tmp_path) -> None:
    _check(_run(tmp_path, RECIPES, "convert"), RECIPES)


@pytest.mark.slow
@pytest.mark.parametrize("gather", ["torch", "fp8"])
def test_sequence_parallel_block_matches_one_process(tmp_path, gather: str) -> None:
    """Sequence parallelism: torch's ColwiseParallel(input_layouts=Shard(1)) gathers the sequence
    in bf16; ``fp8.colwise_sequence_parallel()`` leaves it to the layer, which gathers it in fp8
    (one byte an element, uint8 on the wire) where the recipe reuses that cast (tensorwise), else
    in bf16."""
    names = ("tensorwise", "rowwise", "mxfp8", "nvfp4")
    ranks = _run(tmp_path, names, sequence=True if gather == "torch" else "fp8")
    _check(ranks, names)
    if gather == "fp8":
        for r in ranks:
            assert r["tensorwise"]["gathered"] == [torch.uint8] * 3  # the layer's forward, 3 steps
            assert r["rowwise"]["gathered"] == [torch.bfloat16] * 3
            assert r["fp32"]["gathered"] == []  # no fp8: DTensor's F.linear gathers


def _export_worker(rank: int, port: int, out_dir: str) -> None:
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    import mixprec
    from mixprec import Policy
    from _tp_cases import model_for, tp_plan

    with gloo_group(rank, port):
        torch.set_num_threads(1)
        warnings.simplefilter("ignore")
        single = model_for(32)
        sharded = copy.deepcopy(single)
        parallelize_module(sharded, init_device_mesh("cpu", (2,)), tp_plan())
        for label, model in (("single", single), ("tp", sharded)):
            rec = mixprec.export.Recorder(model)
            for step in range(2):  # forwards only: the weights stay the same
                x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(step))
                with mixprec.autocast("cpu", policy=Policy.parse("compute=bf16").fp8("tensorwise")):
                    model(x)
            rec.step()
            mixprec.export(model, os.path.join(out_dir, f"{label}{rank}"), stats=rec)


@pytest.mark.slow
def test_export_of_a_sharded_model_writes_what_one_process_writes(tmp_path) -> None:
    spawn(_export_worker, str(tmp_path), timeout=300)
    for rank in range(2):
        single, tp = tmp_path / f"single{rank}", tmp_path / f"tp{rank}"
        files = sorted(p.name for p in single.iterdir())
        assert files == sorted(p.name for p in tp.iterdir()) and "model.safetensors" in files
        for name in files:
            assert (single / name).read_bytes() == (tp / name).read_bytes(), name


def _rounding_worker(rank: int, port: int, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from mixprec import fp8

    with gloo_group(rank, port):
        torch.set_num_threads(1)
        mesh = init_device_mesh("cpu", (2,))
        g = torch.Generator().manual_seed(0)
        x, w, go = torch.randn(24, 32, generator=g), torch.randn(64, 32, generator=g), torch.randn(24, 64, generator=g)
        go[:, 40] *= 50  # an outlier column in rank 1's shard: the NVFP4 tensor scale is global
        results = {}
        for hadamard in (False, True):
            recipe = fp8.Float8Recipe.nvfp4(stochastic_rounding=True, hadamard=hadamard)
            for label in ("single", "tp"):
                xx, ww, gy = x, w, go
                if label == "tp":
                    xx, ww = distribute_tensor(x, mesh, [Replicate()]), distribute_tensor(w, mesh, [Shard(0)])
                    gy = distribute_tensor(go, mesh, [Shard(1)])
                xx, ww = xx.detach().requires_grad_(), ww.detach().requires_grad_()
                y = fp8.linear(xx, ww, recipe=recipe, backend="emulate_fp32")
                y.backward(gy)
                full = [t.full_tensor() if isinstance(t, DTensor) else t for t in (y, ww.grad, xx.grad)]
                results[hadamard, label] = [t.detach() for t in full]
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.slow
def test_stochastic_rounding_draws_what_one_process_draws(tmp_path) -> None:
    """A colwise NVFP4 layer with stochastic rounding (and the Hadamard transform): each shard of
    grad_output takes the one process's draws at its positions, so the weight gradient (whose
    rows the shards compute whole) is the one process's up to float32 sum order, and so are the
    output and the input gradient (the GEMMs in float32: ``emulate_fp32``). Other draws would
    round other values (errors of a whole fp4 step)."""
    spawn(_rounding_worker, str(tmp_path), timeout=120)
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        for hadamard in (False, True):
            single, tp = results[hadamard, "single"], results[hadamard, "tp"]
            for what, a, b in zip(("output", "grad_weight", "grad_input"), single, tp):
                assert _max_diff(a, b) <= 1e-5 * float(a.abs().max()), (hadamard, what, _max_diff(a, b))


GATHER_ROWS = ("rowwise", "rowwise_with_gw_hp", "mxfp8", "blockwise")


def _gather_worker(rank: int, port: int, out_dir: str) -> None:
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    import mixprec
    from mixprec import Policy
    from mixprec.formats import _tensor_parallel
    from mixprec.formats._quant import cast_to_fp8
    from _tp_cases import model_for, recipe_of, tp_plan

    with gloo_group(rank, port):
        torch.set_num_threads(1)
        warnings.simplefilter("ignore")
        results, original = {}, _tensor_parallel._GatherSequence.apply
        for name in GATHER_ROWS:
            recipe, d = recipe_of(name), features(name)
            single = model_for(d)
            sharded = copy.deepcopy(single)
            parallelize_module(sharded, init_device_mesh("cpu", (2,)), tp_plan("fp8"))
            seen: dict[str, list] = {"single": [], "tp": []}
            single[1].up.register_forward_pre_hook(lambda m, args: seen["single"].append(args[0].detach()))
            policy = Policy.parse("compute=bf16").fp8(recipe)
            x = torch.randn(2, 8, d, generator=torch.Generator().manual_seed(3))
            x[0, 5, 1] *= 100  # a token outlier in rank 0's half of the sequence
            out = {}
            for grad in (False, True):  # inference, then a training forward (its weights need gradients)
                for label, model in (("single", single), ("tp", sharded)):
                    moved = []
                    _tensor_parallel._GatherSequence.apply = \
                        lambda *a: seen["tp"].append(original(*a)) or seen["tp"][-1]
                    gather = dist.all_gather_into_tensor
                    dist.all_gather_into_tensor = lambda o, t, *a, **k: moved.append((t.dtype, t.numel() * t.element_size())) \
                        or gather(o, t, *a, **k)
                    try:
                        with torch.set_grad_enabled(grad), mixprec.autocast("cpu", policy=policy):
                            y = model(x)
                    finally:
                        _tensor_parallel._GatherSequence.apply = original
                        dist.all_gather_into_tensor = gather
                    out[label, grad] = (y.detach().float(), moved)
            # the one process's cast of the whole input, and what the layer gathered (inference)
            full = seen["single"][0]
            q, scale, _ = cast_to_fp8(full, recipe.input, -1, recipe.pow2_scales)
            gathered = seen["tp"][0]
            results[name] = {"cast": (q.view(torch.uint8), scale.reshape(-1, scale.shape[-1])),
                             "gathered": (gathered._data.view(torch.uint8), gathered._scale.reshape(-1, scale.shape[-1]),
                                          type(gathered).__name__, type(seen["tp"][1]).__name__),
                             "out": out}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.slow
@pytest.mark.parametrize("run", range(3))
def test_sequence_gather_in_fp8_for_row_and_block_scales(tmp_path, run: int) -> None:
    """``fp8.colwise_sequence_parallel()`` with a recipe whose input scales run along each token's
    features (``rowwise``, ``rowwise_with_gw_hp``: one per token; ``mxfp8``, ``blockwise``: per
    block of 32, 128): without a weight gradient (inference) each shard casts its tokens with
    their own scales and the layer gathers the fp8 bytes plus the scales, bitwise the one
    process's cast of the whole input (a token outlier in rank 0's half: a global scale would
    differ), 1 byte an element plus the scales against bf16's 2; a training forward gathers in
    bf16 (the weight-gradient GEMM casts the input again, over the tokens). The outputs are the
    one process's within the rowwise layer's reduce order."""
    spawn(_gather_worker, str(tmp_path), timeout=300)
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        for name in GATHER_ROWS:
            r = results[name]
            (q, scale), (got_q, got_scale, kind, training) = r["cast"], r["gathered"]
            assert kind == "GatheredFloat8Weight" and training == "Tensor", (name, kind, training)
            assert torch.equal(got_q, q) and torch.equal(got_scale, scale), name
            inference, train = r["out"]["tp", False][1], r["out"]["tp", True][1]
            assert sorted(str(dtype) for dtype, _ in inference) == ["torch.float32", "torch.uint8"], (name, inference)
            assert [dtype for dtype, _ in train] == [torch.bfloat16], (name, train)
            assert sum(n for _, n in inference) < 0.6 * train[0][1], (name, inference, train)
            for grad in (False, True):
                single, tp = r["out"]["single", grad][0], r["out"]["tp", grad][0]
                assert _max_diff(tp, single) <= 2 ** -6 * float(single.abs().max()), (name, grad, _max_diff(tp, single))


#: ``(route, recipe, sequence)``: what runs compiled against eager
COMPILED = (("convert", "tensorwise", "fp8"), ("convert", "tensorwise", False), ("convert", "rowwise", False),
            ("convert", "mxfp8", False), ("policy", "tensorwise", False))


def _compile_worker(rank: int, port: int, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    import mixprec
    from mixprec import Policy, fp8
    from _tp_cases import TP_LAYERS, model_for, recipe_of, tp_plan

    with gloo_group(rank, port):
        torch.set_num_threads(1)
        warnings.simplefilter("ignore")
        results = []
        for route, name, sequence in COMPILED:
            recipe = recipe_of(name)
            model = model_for(32)
            if route == "convert":
                fp8.convert(model, recipe, filter_fn=lambda m, fqn: fqn in TP_LAYERS)
            parallelize_module(model, init_device_mesh("cpu", (2,)), tp_plan(sequence))
            policy = Policy.parse("compute=bf16")
            policy = policy.fp8(recipe) if route == "policy" else policy
            x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(5))
            x[..., 3] *= 30
            runs = []
            # the converted model compiles whole (fullgraph: the amax all-reduces are in the graph);
            # the policy route's region hooks run eagerly between its graphs (docs/autocast.md)
            for run in (model, torch.compile(model, backend="aot_eager", fullgraph=route == "convert")):
                with mixprec.autocast("cpu", policy=policy):
                    y = run(x)
                y.float().square().mean().backward()
                grads = [getattr(p.grad, "full_tensor", p.grad.detach)() for p in model.parameters()]
                states = [fp8.layer_state(model.get_submodule(n)) for n in TP_LAYERS]
                runs.append((y.detach(), grads, [st.window.clone() for st in states]))
                model.zero_grad(set_to_none=True)
                for st in states:
                    st.reset()
            results.append(runs)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.slow
@pytest.mark.parametrize("run", range(3))
def test_compiled_tensor_parallel_layers_compute_what_eager_does(tmp_path, run: int) -> None:
    """``torch.compile`` (aot_eager) of a model whose fp8 layers are ColwiseParallel and
    RowwiseParallel: after ``fp8.convert`` one graph (``fullgraph=True``: the amax all-reduces
    are traced), on the policy route between the region's eager hooks; output, every gradient
    and the layers' windows bitwise eager's. ``fp8.colwise_sequence_parallel()`` compiled gathers
    the sequence in the input's dtype (the same casts: same output and gradients; the window then
    holds the whole input's statistics, not the shard's)."""
    spawn(_compile_worker, str(tmp_path), timeout=400)
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        for case, ((y, grads, windows), (cy, cgrads, cwindows)) in zip(COMPILED, results):
            assert torch.equal(cy, y), case
            assert len(grads) == len(cgrads) and all(torch.equal(a, b) for a, b in zip(grads, cgrads)), case
            if not case[2]:
                assert all(torch.equal(a, b) for a, b in zip(windows, cwindows)), case
