"""mixprec.integrations.accelerate against Accelerate's and the HF Trainer's own mixed precision,
with a tiny GPT-2 built from a config (no download) on CPU."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

import mixprec

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402
from accelerate.utils import GradScalerKwargs  # noqa: E402

from mixprec.integrations.accelerate import prepare  # noqa: E402

VOCAB, SEQ = 32, 8


@pytest.fixture(autouse=True)
def fresh_accelerator_state() -> Iterator[None]:
    # AcceleratorState is a process-wide singleton holding the mixed precision: reset it per run
    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


def gpt2() -> Any:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=1, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    model.out_dtypes = {}
    for name in ("transformer.h.0.mlp.c_fc", "lm_head"):
        model.get_submodule(name).register_forward_hook(
            lambda m, a, out, name=name: model.out_dtypes.__setitem__(name, out.dtype))
    return model


def batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (4, SEQ), generator=g) for _ in range(n)]


def accelerate_run(policy: Any = None, apply: bool = True, steps: int = 3, **kwargs: Any) -> tuple[Any, list[float]]:
    accelerator = Accelerator(cpu=True, **kwargs)
    if apply:
        prepare(accelerator, policy=policy)
    model = gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    losses = []
    for ids in batches(steps):
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return accelerator.unwrap_model(model), losses


def test_accelerate_bf16_is_bitwise_accelerates_own() -> None:
    model, losses = accelerate_run(mixed_precision="bf16")
    AcceleratorState._reset_state(True)
    ref_model, ref_losses = accelerate_run(apply=False, mixed_precision="bf16")
    assert losses == ref_losses
    for pa, pb in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(pa, pb)
    assert model.out_dtypes == {"transformer.h.0.mlp.c_fc": torch.bfloat16, "lm_head": torch.bfloat16}


# GPT-2's attention and MLP projections: keeping them in fp32 leaves lm_head (an nn.Linear) in bf16
KEEP_CONV1D = mixprec.Policy().keep(types=(transformers.pytorch_utils.Conv1D,))


def test_accelerate_policy_keeps_modules_in_fp32_and_autocast_follows_it() -> None:
    model, losses = accelerate_run(policy=KEEP_CONV1D, steps=1, mixed_precision="bf16")
    assert model.out_dtypes == {"transformer.h.0.mlp.c_fc": torch.float32, "lm_head": torch.bfloat16}
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    prepare(accelerator, policy=mixprec.Policy().with_ops(fp32=["matmul"]))
    a = torch.randn(4, 4)
    with accelerator.autocast():
        assert mixprec.is_autocast_enabled("cpu")
        assert (a @ a).dtype == torch.float32 and torch.nn.functional.linear(a, a).dtype == torch.bfloat16


KEEP_NAMES = r"^lm_head$|^transformer\.h\.0\.mlp\.c_fc$"


def test_name_rules_name_modules_from_the_prepared_model_as_in_a_plain_loop() -> None:
    policy = mixprec.Policy().keep(names=KEEP_NAMES)
    plain = gpt2().eval()  # no dropout: the losses compare bitwise
    ids = batches(1)[0]
    with mixprec.autocast("cpu", policy=policy):
        ref = plain(input_ids=ids, labels=ids).loss
    assert plain.out_dtypes == {"transformer.h.0.mlp.c_fc": torch.float32, "lm_head": torch.float32}
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    prepare(accelerator, policy=policy)
    model = accelerator.prepare(gpt2().eval())
    assert torch.equal(model(input_ids=ids, labels=ids).loss, ref)
    assert model.out_dtypes == plain.out_dtypes
    model.out_dtypes.clear()
    with accelerator.autocast():  # the wrapped forward's region nested in an equal one
        assert torch.equal(model(input_ids=ids, labels=ids).loss, ref)
        assert model.out_dtypes == plain.out_dtypes
        model.out_dtypes.clear()
        model(input_ids=ids, labels=ids)
    assert model.out_dtypes == plain.out_dtypes


def test_a_deepcopy_of_a_prepared_model_names_modules_from_itself() -> None:
    """An EMA or best-model copy (``copy.deepcopy`` of the prepared model) runs under the same rules:
    its forward is rebound to the copy and names modules from it (until 2026-12-07 from the
    original, under which the copy's modules have no name: the name rules silently did nothing)."""
    import copy

    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    prepare(accelerator, policy=mixprec.Policy().keep(names=KEEP_NAMES))
    model = accelerator.prepare(gpt2().eval())
    ids = batches(1)[0]
    reference = model(input_ids=ids, labels=ids).loss
    twin, seen = copy.deepcopy(model), {}
    for name in ("transformer.h.0.mlp.c_fc", "lm_head"):
        twin.get_submodule(name).register_forward_hook(
            lambda m, a, out, name=name: seen.__setitem__(name, out.dtype))
    assert torch.equal(twin(input_ids=ids, labels=ids).loss, reference)
    assert seen == {"transformer.h.0.mlp.c_fc": torch.float32, "lm_head": torch.float32}


def test_a_name_rule_that_matches_nothing_under_accelerate_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    from mixprec.engine import watch

    monkeypatch.setattr(watch, "_WARNED", set())  # warned once per process: as if fresh
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    prepare(accelerator, policy=mixprec.Policy().keep(names=r"^lm_haed$"))
    model = accelerator.prepare(gpt2())
    ids = batches(1)[0]
    with pytest.warns(UserWarning, match=r"keep\(names='\^lm_haed\$'.*relative to the model given as root=.*'lm_head'"):
        model(input_ids=ids, labels=ids)
    assert model.out_dtypes["lm_head"] == torch.bfloat16


def test_unwrap_model_strips_the_region_and_prepare_wraps_once() -> None:
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    prepare(accelerator)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4))
    seen: list[torch.dtype] = []
    net[0].register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    model = accelerator.prepare(net)
    assert model(torch.randn(2, 4)).dtype == torch.float32  # outputs converted, as Accelerate does
    plain = accelerator.unwrap_model(model, keep_fp32_wrapper=False)
    plain(torch.randn(2, 4))
    again = accelerator.prepare_model(plain)
    again(torch.randn(2, 4))
    assert seen == [torch.bfloat16, torch.float32, torch.bfloat16]


def test_accelerate_refusals_say_what_to_do() -> None:
    with pytest.raises(ValueError, match="mixed_precision='bf16' or 'fp16'"):
        prepare(Accelerator(cpu=True))
    AcceleratorState._reset_state(True)
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    with pytest.raises(ValueError, match="drop compute= from the policy"):
        prepare(accelerator, policy="compute=fp16")
    with pytest.raises(ValueError, match="uses no loss scaler"):
        prepare(accelerator, scaler=mixprec.GradScaler("cpu"))
    accelerator.prepare(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="before accelerator.prepare"):
        prepare(accelerator)


# what was prepared before prepare(accelerator): each captured Accelerate's scaler (None on CPU)
PREPARED_FIRST = {
    "a model": lambda m, o: (m,),
    "an optimizer": lambda m, o: (o,),  # the AcceleratedOptimizer steps with its own scaler: unscaled
    "a model and an optimizer": lambda m, o: (m, o),
}


@pytest.mark.parametrize("first", PREPARED_FIRST)
def test_prepare_after_an_object_was_prepared_is_refused(first: str) -> None:
    """Until 2026-12-07 only a prepared model was refused: after ``accelerator.prepare(optimizer)``
    fp16 scaled the loss with mixprec's scaler and the optimizer stepped on 65536x gradients."""
    accelerator = Accelerator(cpu=True, mixed_precision="fp16")
    model = torch.nn.Linear(2, 2)
    accelerator.prepare(*PREPARED_FIRST[first](model, torch.optim.SGD(model.parameters(), lr=0.1)))
    with pytest.raises(ValueError, match=f"before accelerator.prepare.*: {first} was already prepared"):
        prepare(accelerator)
    assert accelerator.scaler is None and getattr(accelerator, "_mixprec_policy", None) is None


def trainer_run(tmp_path: Path, cls: Any, steps: int = 3, bf16: bool = True, fp16: bool = False,
                save_strategy: str = "no", save_steps: int = 500, **kwargs: Any) -> tuple[Any, list[float]]:
    class Recorder(cls):  # the exact loss of every step (the Trainer's logs round to 4 digits)
        losses: list[float] = []

        def compute_loss(self, model: Any, inputs: Any, *args: Any, **kw: Any) -> Any:
            loss = super().compute_loss(model, inputs, *args, **kw)
            self.losses.append(loss.item())
            return loss

    Recorder.losses = []
    data = [{"input_ids": ids, "labels": ids} for ids in torch.cat(batches(steps))]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / cls.__name__), max_steps=steps, per_device_train_batch_size=4,
        learning_rate=1e-2, bf16=bf16, fp16=fp16, use_cpu=True, report_to=[], save_strategy=save_strategy,
        save_steps=save_steps, logging_steps=1,
        seed=0, dataloader_num_workers=0, disable_tqdm=True,
    )
    trainer = Recorder(model=gpt2(), args=args, train_dataset=data, **kwargs)
    trainer.train()
    return trainer.model, Recorder.losses


def test_trainer_default_policy_is_bitwise_the_trainers_bf16(tmp_path: Path) -> None:
    from mixprec.integrations.accelerate import MixprecTrainer

    model, losses = trainer_run(tmp_path, MixprecTrainer)
    AcceleratorState._reset_state(True)
    ref_model, ref_losses = trainer_run(tmp_path, transformers.Trainer)
    assert len(losses) == 3 and losses == ref_losses
    for (name, pa), pb in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(pa, pb), name
    assert model.out_dtypes["lm_head"] == torch.bfloat16


def test_trainer_trains_under_a_policy(tmp_path: Path) -> None:
    from mixprec.integrations.accelerate import MixprecTrainer

    model, losses = trainer_run(tmp_path, MixprecTrainer, policy=KEEP_CONV1D)
    assert model.out_dtypes == {"transformer.h.0.mlp.c_fc": torch.float32, "lm_head": torch.bfloat16}
    assert all(torch.isfinite(torch.tensor(losses))) and len(losses) == 3
    assert isinstance(MixprecTrainer.__mro__[1], type) and issubclass(MixprecTrainer, transformers.Trainer)


def test_trainer_without_mixed_precision_refuses_a_policy(tmp_path: Path) -> None:
    from mixprec.integrations.accelerate import MixprecTrainer

    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    with pytest.raises(ValueError, match=r"needs TrainingArguments\(bf16=True\)"):
        MixprecTrainer(model=gpt2(), args=args, policy=mixprec.Policy())


def test_accelerate_fp16_on_cpu_is_bitwise_a_torch_amp_loop() -> None:
    plain = Accelerator(cpu=True, mixed_precision="fp16")
    assert not plain.native_amp and plain.scaler is None  # Accelerate alone: fp32 training on CPU
    AcceleratorState._reset_state(True)
    scaler_kwargs = {"init_scale": 2.0**17, "growth_interval": 1}  # skips, backoffs and growth
    model, losses = accelerate_run(steps=4, mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(**scaler_kwargs)])
    assert model.out_dtypes == {"transformer.h.0.mlp.c_fc": torch.float16, "lm_head": torch.float16}

    ref = gpt2()
    optimizer = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", **scaler_kwargs)
    ref_losses, scales = [], []
    for ids in batches(4):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = ref(input_ids=ids, labels=ids).loss
        scaler.scale(loss.float()).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        ref_losses.append(loss.item())
        scales.append(scaler.get_scale())
    assert losses == ref_losses
    assert len(set(scales)) > 1
    for pa, pb in zip(model.parameters(), ref.parameters()):
        assert torch.equal(pa, pb)


def test_trainer_fp16_on_cpu_trains_with_mixprecs_scaler_and_checkpoints_it(tmp_path: Path) -> None:
    from mixprec.integrations.accelerate import MixprecTrainer

    model, losses = trainer_run(tmp_path, MixprecTrainer, bf16=False, fp16=True, save_strategy="steps", save_steps=3)
    assert model.out_dtypes["lm_head"] == torch.float16 and len(losses) == 3
    saved = torch.load(next(tmp_path.glob("*/checkpoint-3/scaler.pt")), weights_only=False)
    assert saved["scale"] in (2.0**16, 2.0**15, 2.0**14, 2.0**13)  # mixprec's state_dict, torch's keys
