"""FSDP2 fp8 all-gather (``fp8.convert(..., fsdp_fp8_all_gather=True)``), 2 gloo processes:
bitwise torchao's ``enable_fsdp_float8_all_gather`` (outputs, input and parameter gradients,
updated weights; SGD and AdamW; fp32 and bf16 ``MixedPrecisionPolicy``), bitwise mixprec without
the option where the math says so (fp32 parameters: the amax all-reduced over the shards is the
amax of the whole weight), the bytes FSDP2 all-gathers, an uneven shard on 3 ranks, and the
errors and warnings of configurations that cannot take effect; ``precompute_fsdp_scales`` bitwise
the same as without it, also after a foreach or fused optimizer step and a weight written after
it (``torch.distributed.checkpoint.load``, ``.data.copy_``), none of which moves the DTensor
parameter's ``_version``."""

from __future__ import annotations

import collections
import dataclasses
import os
import warnings
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

from mixprec import fp8
from mixprec.formats._fsdp import Float8AllGatherWeight, GatheredFloat8Weight
from mixprec.formats._quant import cast_to_fp8
from mixprec.formats._recipe import Cast

from _distributed import gloo_group, spawn
from _models import mlp

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
slow, distributed = pytest.mark.slow, pytest.mark.distributed

STEPS, BATCH = 3, 8
LAYERS = {"0": (32, 64), "2": (64, 32), "4": (32, 16)}  # fqn: (in, out), all with a bias, all fp8
CASES = {"fp32_sgd": (None, "sgd"), "fp32_adamw": (None, "adamw"), "bf16_adamw": (torch.bfloat16, "adamw")}
RUNS = ("torchao", "gathered", "plain")  # torchao's all-gather, mixprec's, mixprec without it
OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),  # (on CPU torch steps DTensors one by one)
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    # what torch picks for DTensor parameters on CUDA: one op over every parameter
    "sgd_foreach": lambda ps: torch.optim.SGD(ps, lr=0.1, foreach=True),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
}
IN_ONE_OP = ("sgd_foreach", "adamw_foreach", "adamw_fused")


def _model(bf16_values: bool = False) -> nn.Sequential:
    model = mlp(32, 64, 32, 16, act=nn.Tanh)
    if bf16_values:  # fp32 master weights that are bf16 values: FSDP2's cast to bf16 is exact
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.bfloat16().float())
    return model


def _build(run: str, model: nn.Module) -> nn.Module:
    if run == "torchao":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=True)
        return convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: True)
    return fp8.convert(model, filter_fn=lambda m, fqn: True, fsdp_fp8_all_gather=run == "gathered")


def _shard(model: nn.Module, param_dtype: torch.dtype | None) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else None
    kwargs = {"mp_policy": mp} if mp else {}
    for layer in model:
        if isinstance(layer, (nn.Linear, fp8.Float8Conv1D)):
            fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)


class _Comm:
    """Counts what goes through ``dist.all_gather_single`` (FSDP2's all-gather) and
    ``dist.all_reduce`` while active: per call, the bytes of this rank's input."""

    def __init__(self) -> None:
        self.gathers: list[int] = []
        self.reduces: list[int] = []

    def __enter__(self) -> _Comm:
        self._saved = dist.all_gather_single, dist.all_reduce

        def gather(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.gathers.append(input.numel() * input.element_size())
            return self._saved[0](output, input, *args, **kwargs)

        def reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.reduces.append(tensor.numel() * tensor.element_size())
            return self._saved[1](tensor, *args, **kwargs)

        dist.all_gather_single, dist.all_reduce = gather, reduce
        return self

    def __exit__(self, *exc: Any) -> None:
        dist.all_gather_single, dist.all_reduce = self._saved


def _train(run: str, param_dtype: torch.dtype | None, optim: str, rank: int, bf16_values: bool = False,
           precompute: bool = False) -> dict[str, Any]:
    """STEPS steps; ``precompute``: ``fp8.precompute_fsdp_scales`` before the first step and after
    the first update, none after the second (the third step's scales are stale: reduced again)."""
    model = _build(run, _model(bf16_values))
    _shard(model, param_dtype)
    opt = OPTIMIZERS[optim](model.parameters())
    out: dict[str, Any] = {"outputs": [], "input_grads": [], "grads": [], "precomputed": []}
    if precompute:
        out["precomputed"].append(fp8.precompute_fsdp_scales(model))
    comm = _Comm()
    for step in range(STEPS):
        x = torch.randn(BATCH, 32, generator=torch.Generator().manual_seed(10 * step + rank)).requires_grad_()
        with comm:
            y = model(x)
            y.float().square().mean().backward()
        out["outputs"].append(y.detach())
        out["input_grads"].append(x.grad)
        out["grads"].append({n: p.grad.full_tensor() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        if precompute and step == 0:
            out["precomputed"].append(fp8.precompute_fsdp_scales(model))
    out["params"] = {n: p.full_tensor().detach() for n, p in model.named_parameters()}
    out["gathers"], out["reduces"] = comm.gathers, comm.reduces
    if run != "torchao":
        out["stats"] = {n: fp8.layer_state(model.get_submodule(n)).stats.clone() for n in LAYERS}
    return out


def _bias_free(rank: int) -> dict[str, Any]:
    """A bias-free fp8 layer sharded on its own: the all-gather holds fp8 bytes only."""
    from torch.distributed.fsdp import fully_shard

    res: dict[str, Any] = {}
    for run in RUNS:
        torch.manual_seed(0)
        model = _build(run, nn.Sequential(nn.Linear(32, 32, bias=False)))
        fully_shard(model)
        x = torch.randn(BATCH, 32, generator=torch.Generator().manual_seed(rank))
        try:
            y = model(x)
        except RuntimeError as exc:
            res[run] = str(exc)
            continue
        y.square().mean().backward()
        res[run] = (y.detach(), model[0].weight.grad.full_tensor())
    return res


def _conv1d(rank: int) -> dict[str, Any]:
    """transformers' Conv1D (weight stored ``(in, out)``: FSDP2 shards the input features)."""
    from torch.distributed.fsdp import fully_shard
    from transformers.pytorch_utils import Conv1D

    res = {}
    for run in ("gathered", "plain"):
        torch.manual_seed(0)
        model = _build(run, nn.Sequential(Conv1D(64, 32), nn.Tanh(), Conv1D(16, 64)))
        assert isinstance(model[0], fp8.Float8Conv1D)
        _shard(model, None)
        seen = []
        model[0].register_forward_pre_hook(lambda m, args: seen.append(type(m.weight).__name__))
        x = torch.randn(BATCH, 32, generator=torch.Generator().manual_seed(rank))
        y = model(x)
        y.square().mean().backward()
        res[run] = (y.detach(), [p.grad.full_tensor() for p in model.parameters()])
        res[run + "_weight"] = seen
    return res


def _written_after_precompute(rank: int, checkpoint: str) -> dict[str, Any]:
    """``precompute_fsdp_scales``, then the weights written in place before the next forward:
    ``torch.distributed.checkpoint.load`` into the model's state dict (FSDP2's resume), or
    ``.data.copy_``; against the model they were written from (4x larger weights), no precompute."""
    import torch.distributed.checkpoint as dcp

    def build(seed: int, scale: float) -> nn.Module:
        torch.manual_seed(seed)
        model = _model()
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(scale)
        model = _build("gathered", model)
        _shard(model, None)
        return model

    def step(model: nn.Module) -> tuple[torch.Tensor, ...]:
        x = torch.randn(BATCH, 32, generator=torch.Generator().manual_seed(rank)).requires_grad_()
        y = model(x)
        y.float().square().mean().backward()
        return y.detach(), x.grad, *(p.grad.full_tensor() for p in model.parameters())

    source = build(0, 4.0)
    dcp.save(source.state_dict(), checkpoint_id=checkpoint)
    res: dict[str, Any] = {"source": step(source)}
    loaded = build(1, 1.0)
    res["precomputed"] = fp8.precompute_fsdp_scales(loaded)
    dcp.load(loaded.state_dict(), checkpoint_id=checkpoint)
    res["dcp_load"] = step(loaded)
    copied = build(1, 1.0)
    fp8.precompute_fsdp_scales(copied)
    with torch.no_grad():
        for p, q in zip(copied.parameters(), source.parameters()):
            p.data.copy_(q.data)
    res["data_copy"] = step(copied)
    return res


def _worker(rank: int, port: int, out_dir: str) -> None:
    with gloo_group(rank, port):
        torch.set_num_threads(1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            results: dict[str, Any] = {case: {run: _train(run, dt, opt, rank) for run in RUNS}
                                       for case, (dt, opt) in CASES.items()}
            results["bf16_values"] = {run: _train(run, torch.bfloat16, "sgd", rank, bf16_values=True)
                                      for run in ("gathered", "plain")}
            results["bias_free"] = _bias_free(rank)
            results["conv1d"] = _conv1d(rank)
            results["precomputed"] = {case: _train("gathered", CASES[case][0], "adamw", rank, precompute=True)
                                      for case in ("fp32_adamw", "bf16_adamw")}
            results["in_one_op"] = {optim: {"precomputed": _train("gathered", None, optim, rank, precompute=True),
                                            "dynamic": _train("gathered", None, optim, rank)}
                                    for optim in IN_ONE_OP}
            results["written"] = _written_after_precompute(rank, os.path.join(out_dir, "checkpoint"))
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def _uneven_worker(rank: int, port: int, out_dir: str) -> None:
    """3 ranks, 16 output rows: torch.chunk gives shards of 6, 6 and 4 rows (the last one padded)."""
    with gloo_group(rank, port, world_size=3):
        torch.set_num_threads(1)
        res = {}
        for run in ("gathered", "plain"):
            torch.manual_seed(0)
            model = _build(run, nn.Sequential(nn.Linear(32, 16)))
            _shard(model, None)
            x = torch.randn(BATCH, 32, generator=torch.Generator().manual_seed(rank))
            y = model(x)
            y.square().mean().backward()
            res[run] = (y.detach(), model[0].weight.grad.full_tensor())
        torch.save(res, os.path.join(out_dir, f"uneven{rank}.pt"))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("fsdp_fp8_ag")
    spawn(_worker, str(out), timeout=240)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))


KEYS = ("outputs", "input_grads", "grads", "params")


@slow
@distributed
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("rank", [0, 1])
def test_bitwise_torchao_fsdp_float8_all_gather(ranks: list[dict[str, Any]], case: str, rank: int) -> None:
    res = ranks[rank][case]
    for key in KEYS:
        assert _equal(res["gathered"][key], res["torchao"][key]), (case, key)
    assert res["gathered"]["gathers"] == res["torchao"]["gathers"]  # the same bytes on the wire


@slow
@distributed
@pytest.mark.parametrize("case", ["fp32_sgd", "fp32_adamw"])
def test_fp32_parameters_bitwise_mixprec_without_the_all_gather(ranks: list[dict[str, Any]], case: str) -> None:
    """fp32 parameters: max over the shards of the shard amax is the amax of the weight, so the
    scale and the fp8 bytes are those of casting the unsharded weight: every step bitwise."""
    for res in (r[case] for r in ranks):
        for key in KEYS:
            assert _equal(res["gathered"][key], res["plain"][key]), (case, key)
        for name in LAYERS:  # input and grad_output statistics, and the weight's amax, the same
            g, p = res["gathered"]["stats"][name], res["plain"]["stats"][name]
            assert torch.equal(g[[0, 2]], p[[0, 2]]) and g[1, 0] == p[1, 0], name


@slow
@distributed
def test_bf16_mixed_precision_casts_the_fp32_master_weight_once(ranks: list[dict[str, Any]]) -> None:
    """``MixedPrecisionPolicy(param_dtype=bf16)``: without the option FSDP2 gathers bf16 and the
    layer casts that (fp32 -> bf16 -> fp8, the amax of the bf16 values); with it the fp32 shard
    is cast to fp8 directly (torchao does the same). The results differ, unless the fp32 weights
    are bf16 values: then the first forward is bitwise the same (later updates leave bf16)."""
    for r in ranks:
        res = r["bf16_adamw"]
        assert not _equal(res["gathered"]["outputs"][0], res["plain"]["outputs"][0])
        diff = (res["gathered"]["params"]["0.weight"] - res["plain"]["params"]["0.weight"]).abs().max()
        assert 0 < diff < 0.05, diff  # AdamW lr 1e-2, 3 steps: moves up to 3e-2
        exact = r["bf16_values"]
        assert _equal(exact["gathered"]["outputs"][0], exact["plain"]["outputs"][0])
        assert _equal(exact["gathered"]["input_grads"][0], exact["plain"]["input_grads"][0])
        assert _equal(exact["gathered"]["grads"][0], exact["plain"]["grads"][0])
        assert not _equal(exact["gathered"]["outputs"][-1], exact["plain"]["outputs"][-1])


def _wire(dtype_bytes: int, weight_bytes: int) -> collections.Counter:
    """One all-gather per layer and pass (forward, and again in backward: reshard after
    forward), this rank's half of the weight and of the bias."""
    per_layer = [i * o // 2 * weight_bytes + o // 2 * dtype_bytes for i, o in LAYERS.values()]
    return collections.Counter(per_layer * 2 * STEPS)


@slow
@distributed
@pytest.mark.parametrize("case, hp_bytes", [("fp32_sgd", 4), ("bf16_adamw", 2)])
def test_all_gather_bytes(ranks: list[dict[str, Any]], case: str, hp_bytes: int) -> None:
    res = ranks[0][case]
    assert collections.Counter(res["plain"]["gathers"]) == _wire(hp_bytes, hp_bytes)
    assert collections.Counter(res["gathered"]["gathers"]) == _wire(hp_bytes, 1)
    weights = sum(i * o for i, o in LAYERS.values()) // 2 * 2 * STEPS
    saved = sum(res["plain"]["gathers"]) - sum(res["gathered"]["gathers"])
    assert saved == weights * (hp_bytes - 1)  # the weights move in 1/4 (fp32) or 1/2 (bf16) of their bytes
    # and one all-reduce of the shard's amax (fp32: the master weight's) per all-gathered weight
    assert res["gathered"]["reduces"] == [4] * len(LAYERS) * 2 * STEPS and res["plain"]["reduces"] == []


@slow
@distributed
@pytest.mark.parametrize("case", ["fp32_adamw", "bf16_adamw"])
def test_precomputed_scales_are_bitwise_the_same_with_one_all_reduce(ranks: list[dict[str, Any]], case: str) -> None:
    for r in ranks:
        pre, dynamic = r["precomputed"][case], r[case]["gathered"]
        for key in KEYS:
            assert _equal(pre[key], dynamic[key]), (case, key)
        assert pre["precomputed"] == [len(LAYERS)] * 2
        # steps 1 and 2 used the precomputed amaxes; step 3's were stale (AdamW updated the weights)
        assert pre["reduces"] == [4] * len(LAYERS) * 2


@slow
@distributed
@pytest.mark.parametrize("optim", IN_ONE_OP)
def test_precomputed_scales_after_a_foreach_or_fused_step(ranks: list[dict[str, Any]], optim: str) -> None:
    """A foreach or fused step (torch's default for DTensor parameters on CUDA) writes every
    weight in one op and leaves the DTensor parameters' ``_version`` as it was: the amaxes
    precomputed before it are stale all the same (step 3 reduces its own, bitwise)."""
    for r in ranks:
        pre, dynamic = r["in_one_op"][optim]["precomputed"], r["in_one_op"][optim]["dynamic"]
        for key in KEYS:
            assert _equal(pre[key], dynamic[key]), (optim, key)
        assert pre["precomputed"] == [len(LAYERS)] * 2
        assert pre["reduces"] == [4] * len(LAYERS) * 2  # steps 1 and 2: none; step 3: its own


@slow
@distributed
@pytest.mark.parametrize("write", ["dcp_load", "data_copy"])
def test_precomputed_scales_of_weights_written_after(ranks: list[dict[str, Any]], write: str) -> None:
    """A checkpoint loaded with ``torch.distributed.checkpoint.load`` into the model's state
    dict (a write through a view of each shard), or ``.data.copy_``, after
    ``precompute_fsdp_scales``: the next all-gather reduces the amax of the weights loaded."""
    for r in ranks:
        res = r["written"]
        assert res["precomputed"] == len(LAYERS)
        assert _equal(res[write], res["source"]), write


@slow
@distributed
def test_a_lone_fp8_weight_all_gathers_as_uint8_on_gloo(ranks: list[dict[str, Any]]) -> None:
    """A bias-free fp8 layer sharded alone: FSDP2 all-gathers in the inputs' dtype, which gloo
    does not have for float8 (torchao fails: 'Invalid scalar type'); mixprec sends uint8, bitwise
    mixprec without the option."""
    for r in ranks:
        res = r["bias_free"]
        assert "Invalid scalar type" in res["torchao"]
        assert _equal(res["gathered"], res["plain"])


@slow
@distributed
def test_transformers_conv1d_bitwise_mixprec_without_the_all_gather(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert _equal(r["conv1d"]["gathered"], r["conv1d"]["plain"])
        assert r["conv1d"]["gathered_weight"] == ["GatheredFloat8Weight"]  # FSDP2 gave it the fp8 bytes
        assert r["conv1d"]["plain_weight"] == ["Parameter"]


@slow
@distributed
def test_uneven_shards_on_three_ranks(tmp_path: Any) -> None:
    spawn(_uneven_worker, str(tmp_path), nprocs=3, timeout=120)
    for r in range(3):
        res = torch.load(tmp_path / f"uneven{r}.pt", weights_only=True)
        assert _equal(res["gathered"], res["plain"]), r


# Single process: configurations that cannot take effect, and the gathered weight in fp8.linear.

def _seq() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_with_gw_hp", "mxfp8", "blockwise",
                                    dataclasses.replace(fp8.Float8Recipe.tensorwise(), weight_for_grad_input=Cast("e5m2"),
                                                        save_fp8=False)])
def test_a_recipe_without_a_tensorwise_weight_raises(recipe: Any) -> None:
    model = _seq()
    with pytest.raises(ValueError, match="fsdp_fp8_all_gather needs a recipe whose weight is cast to fp8 with one scale"):
        fp8.convert(model, recipe, filter_fn=lambda m, fqn: True, fsdp_fp8_all_gather=True)
    assert all(type(m) is nn.Linear for m in model)  # nothing changed


def test_a_non_bool_option_raises() -> None:
    with pytest.raises(ValueError, match="fsdp_fp8_all_gather must be True or False"):
        fp8.convert(_seq(), filter_fn=lambda m, fqn: True, fsdp_fp8_all_gather="yes")


def test_without_fully_shard_it_warns_and_is_bitwise_the_plain_layer() -> None:
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))
    results = []
    for option in (True, False):
        model = fp8.convert(_seq(), filter_fn=lambda m, fqn: True, fsdp_fp8_all_gather=option)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            y = model(x)
            model(x)
        messages = [str(w.message) for w in caught if "fsdp_fp8_all_gather" in str(w.message)]
        assert len(messages) == (1 if option else 0)  # once, for all the layers
        assert not option or "layer(s) '0', '1' reached the forward without FSDP2's all-gather" in messages[0]
        y.square().mean().backward()
        results.append((y, [p.grad for p in model.parameters()]))
    assert _equal(results[0], results[1])
    assert [type(m.weight) for m in fp8.unconvert(model)] == [nn.Parameter, nn.Parameter]


def test_unconvert_gives_plain_parameters_on_the_same_storage() -> None:
    model = fp8.convert(_seq(), filter_fn=lambda m, fqn: True, fsdp_fp8_all_gather=True)
    ptr = model[0].weight._tensor.data_ptr()
    plain = fp8.unconvert(model)
    assert type(plain[0]) is nn.Linear and type(plain[0].weight) is nn.Parameter
    assert plain[0].weight.data_ptr() == ptr


def _gathered(w: torch.Tensor) -> GatheredFloat8Weight:
    q, scale, amax = cast_to_fp8(w.detach(), Cast("e4m3fn"), 0, False)
    return GatheredFloat8Weight(q, scale, amax, w.dtype, Cast("e4m3fn"))


def test_linear_reads_the_gathered_bytes_bitwise() -> None:
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(2), requires_grad=True)
    w = torch.randn(16, 32, generator=torch.Generator().manual_seed(3), requires_grad=True)
    g = nn.Parameter(_gathered(w))
    y_ref = fp8.linear(x, w)
    gx_ref, gw_ref = torch.autograd.grad(y_ref.sum(), (x, w))
    for recipe in (fp8.Float8Recipe.tensorwise(), dataclasses.replace(fp8.Float8Recipe.tensorwise(), save_fp8=False)):
        y = fp8.linear(x, g, recipe=recipe)
        gx, gw = torch.autograd.grad(y.sum(), (x, g))
        assert _equal((y, gx, gw), (y_ref, gx_ref, gw_ref))


def test_another_recipe_casts_the_dequantized_gathered_weight_and_a_fallback_warns() -> None:
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(4), requires_grad=True)
    g = nn.Parameter(_gathered(torch.randn(32, 32, generator=torch.Generator().manual_seed(5))))
    w = g.dequantize().detach().requires_grad_()  # the weight the gathered bytes stand for
    for recipe in ("rowwise", "mxfp8"):
        state, ref_state = fp8.LayerState(), fp8.LayerState()
        state.recipe = ref_state.recipe = fp8.as_recipe(recipe)  # a controller's rung
        y = fp8.linear(x, g, state=state)
        y_ref = fp8.linear(x, w, state=ref_state)
        grads = torch.autograd.grad(y.sum(), (x, g))
        assert _equal((y, grads), (y_ref, torch.autograd.grad(y_ref.sum(), (x, w))))
        assert torch.equal(state.stats, ref_state.stats) and state.stats[1, 0] > 0  # the weight is measured
    state = fp8.LayerState()
    state.recipe, state.fallback = None, True
    with pytest.warns(UserWarning, match="dequantized fp8 weight"):
        y = fp8.linear(x, g, state=state)
    assert torch.equal(y, x @ g.dequantize().t())


def test_a_checkpoint_loads_with_weights_only_into_plain_and_converted_models(tmp_path: Any) -> None:
    model = fp8.convert(_seq(), filter_fn=lambda m, fqn: True, fsdp_fp8_all_gather=True)
    torch.save(model.state_dict(), tmp_path / "ckpt.pt")
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    plain, converted = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32)), fp8.convert(
        nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32)), filter_fn=lambda m, fqn: True, fsdp_fp8_all_gather=True)
    plain.load_state_dict(state)
    converted.load_state_dict(state)
    for name, p in model.named_parameters():
        ref = getattr(p, "_tensor", p)
        assert torch.equal(plain.get_parameter(name), ref) and torch.equal(converted.get_parameter(name), ref), name
    assert type(plain[0].weight) is nn.Parameter and type(converted[0].weight._tensor) is torch.Tensor


class _Tied(nn.Module):
    """An embedding tied to the LM head (``head.weight is emb.weight``), a body between."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.body = nn.Embedding(32, 16), nn.Linear(16, 16)
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(self.emb(x))))


def test_a_tied_weight_stays_one_parameter_stepped_once() -> None:
    tokens = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(6))
    runs = []
    for option in (True, False):
        torch.manual_seed(7)
        model = fp8.convert(_Tied(), filter_fn=lambda m, fqn: fqn in ("body", "head"), fsdp_fp8_all_gather=option)
        assert model.head.weight is model.emb.weight and len(list(model.parameters())) == 3
        assert isinstance(model.emb.weight, Float8AllGatherWeight) == option
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # without fully_shard: the all-gather's warning
            for _ in range(5):
                opt.zero_grad()
                nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
                opt.step()
        assert len(opt.state) == 3
        runs.append([getattr(p, "_tensor", p).detach().clone() for p in model.parameters()])
        plain = fp8.unconvert(model)
        assert plain.head.weight is plain.emb.weight and type(plain.emb.weight) is nn.Parameter
    assert _equal(runs[0], runs[1])
