"""AdaFisher in the stock ``transformers.Trainer`` and TRL's ``SFTTrainer`` through their
extension points: ``TriAccelCallback`` and the optimizer factory it hands the Trainer.
Offline: a tiny GPT-2 built from a config and a tokenizer built in the test."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_triaccel import AdaFisherW, TriAccelCallback  # noqa: E402
from hf_triaccel.integrations.precision_report import SIGNALS_NAME  # noqa: E402
from tests.integrations.tiny import TokenSet, tiny_gpt2, word_tokenizer  # noqa: E402

TEXTS = ["the cat sat on a mat", "a dog ran to the park", "the dog sat on the mat"] * 4


def _stock_args(tmp_path, **kw) -> transformers.TrainingArguments:
    defaults = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=4,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        dataloader_pin_memory=False,
        lr_scheduler_type="constant",
        seed=0,
    )
    return transformers.TrainingArguments(**{**defaults, **kw})


class AttachedAtEachStep(transformers.TrainerCallback):
    """Whether the Fisher hooks were on the model at each step."""

    def __init__(self, triaccel: TriAccelCallback) -> None:
        self.triaccel, self.seen = triaccel, []

    def on_step_end(self, args, state, control, **kwargs):
        self.seen.append(self.triaccel.optimizer.collector.attached)


def test_the_stock_trainer_trains_with_adafisher_its_hooks_and_the_precision_report(tmp_path):
    model = tiny_gpt2()
    triaccel = TriAccelCallback(
        lr=2e-3, weight_decay=0.01, update_every=2, precision=True, signals_every=2,
        report_dir=str(tmp_path / "report"),
    )  # fmt: skip
    attached = AttachedAtEachStep(triaccel)
    trainer = transformers.Trainer(
        model=model,
        args=_stock_args(tmp_path),
        train_dataset=TokenSet(vocab=64),
        callbacks=[triaccel, attached],
        optimizer_cls_and_kwargs=triaccel.optimizer_cls_and_kwargs,
    )
    trainer.train()
    optimizer = triaccel.optimizer
    assert trainer.optimizer.optimizer is optimizer and isinstance(optimizer, AdaFisherW)
    assert [g["lr"] for g in optimizer.param_groups] == [2e-3, 2e-3]
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.01, 0.0]
    assert optimizer.fisher_steps == 4 and optimizer.collector.layers
    assert attached.seen == [True] * 4 and not optimizer.collector.attached
    assert triaccel.parts.precision.decisions and triaccel.parts.signals.steps == 4
    signals = json.loads((tmp_path / "report" / SIGNALS_NAME).read_text())
    assert signals == json.loads(json.dumps(triaccel.parts.signals.as_dict()))
    # the controllers' hooks are off the model too
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_the_callback_route_steps_as_the_optimizer_built_by_hand(tmp_path):
    """The factory is the one builder: the same model, data and hyperparameters train to
    the same weights as with ``AdaFisherW.from_model`` handed to the Trainer."""
    hyperparameters = dict(lr=3e-3, weight_decay=0.05, update_every=2)
    trained = []
    for route in ("callback", "by hand"):
        model = tiny_gpt2()
        if route == "callback":
            triaccel = TriAccelCallback(**hyperparameters)
            extra = dict(
                callbacks=[triaccel], optimizer_cls_and_kwargs=triaccel.optimizer_cls_and_kwargs
            )
        else:
            extra = dict(optimizers=(AdaFisherW.from_model(model, **hyperparameters), None))
        trainer = transformers.Trainer(
            model=model, args=_stock_args(tmp_path), train_dataset=TokenSet(vocab=64), **extra
        )
        trainer.train()
        trained.append(model.state_dict())
    for key, value in trained[0].items():
        torch.testing.assert_close(value, trained[1][key], rtol=0, atol=0, msg=key)


def test_a_second_train_attaches_the_hooks_again(tmp_path):
    triaccel = TriAccelCallback(update_every=1)
    attached = AttachedAtEachStep(triaccel)
    trainer = transformers.Trainer(
        model=tiny_gpt2(),
        args=_stock_args(tmp_path, max_steps=2),
        train_dataset=TokenSet(vocab=64),
        callbacks=[triaccel, attached],
        optimizer_cls_and_kwargs=triaccel.optimizer_cls_and_kwargs,
    )
    trainer.train()
    trainer.train()
    assert attached.seen == [True] * 4 and not triaccel.optimizer.collector.attached


def test_the_callback_refuses_an_optimizer_it_did_not_build(tmp_path):
    trainer = transformers.Trainer(
        model=tiny_gpt2(),
        args=_stock_args(tmp_path, max_steps=1),
        train_dataset=TokenSet(vocab=64),
        callbacks=[TriAccelCallback()],
    )
    with pytest.raises(ValueError, match="optimizer_cls_and_kwargs=callback.optimizer_cls"):
        trainer.train()


def test_the_fp16_loss_scaler_reaches_the_collector():
    """Accelerate's prepared optimizer carries the run's scaler; the callback hands it to
    the collector, which unscales the statistics with it."""
    triaccel = TriAccelCallback()
    factory, kwargs = triaccel.optimizer_cls_and_kwargs
    optimizer = factory()(torch.nn.Linear(4, 2), **kwargs)
    scaler = torch.amp.GradScaler("cpu")
    prepared = SimpleNamespace(optimizer=optimizer, scaler=scaler)
    state = transformers.TrainerState()
    triaccel.on_train_begin(None, state, None, optimizer=prepared)
    assert optimizer.collector.grad_scaler is scaler
    triaccel.detach()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"lr": -1.0}, "TriAccelCallback.lr=-1.0"),
        ({"optimizer": "adam"}, "TriAccelCallback.optimizer='adam'"),
        ({"signals_every": 0}, "TriAccelCallback.signals_every=0"),
    ],
)
def test_bad_settings_fail_when_the_callback_is_built(kwargs, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("(", r"\(")):
        TriAccelCallback(**kwargs)


def test_sft_trainer_trains_with_adafisher_through_the_callback(tmp_path):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    tokenizer = word_tokenizer()
    model = tiny_gpt2(vocab_size=len(tokenizer), bos_token_id=2, eos_token_id=2)
    triaccel = TriAccelCallback(lr=2e-3, update_every=2)
    attached = AttachedAtEachStep(triaccel)
    args = trl.SFTConfig(
        output_dir=str(tmp_path),
        max_steps=3,
        per_device_train_batch_size=4,
        max_length=16,
        report_to=[],
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=None,  # TRL's True is a deprecated name in transformers 5.25
        lr_scheduler_type="constant",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_pin_memory=False,
    )
    trainer = trl.SFTTrainer(
        model=model,
        args=args,
        train_dataset=datasets.Dataset.from_dict({"text": TEXTS}),
        processing_class=tokenizer,
        callbacks=[triaccel, attached],
        optimizer_cls_and_kwargs=triaccel.optimizer_cls_and_kwargs,
    )
    before = model.transformer.wte.weight.detach().clone()
    trainer.train()
    optimizer = triaccel.optimizer
    assert trainer.optimizer.optimizer is optimizer and optimizer.fisher_steps == 3
    assert {g["lr"] for g in optimizer.param_groups} == {2e-3}  # not SFTConfig's 2e-5
    assert attached.seen == [True] * 3 and not optimizer.collector.attached
    assert not torch.equal(before, model.transformer.wte.weight)


def test_sft_trainer_with_the_mixin_gets_the_elastic_batch(tmp_path):
    """The elastic batch re-runs a step in pieces inside training_step, which no callback
    reaches: TRL's trainer takes it with TriAccelMixin and a config of both classes."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from hf_triaccel import TriAccelArguments, TriAccelMixin

    @dataclasses.dataclass
    class Config(TriAccelArguments, trl.SFTConfig):
        pass

    class TriAccelSFTTrainer(TriAccelMixin, trl.SFTTrainer):
        pass

    tokenizer = word_tokenizer()
    args = Config(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=4,
        max_length=16,
        report_to=[],
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=None,
        save_strategy="no",
        disable_tqdm=True,
        elastic_batch=True,
        adafisher_update_every=1,
    )
    trainer = TriAccelSFTTrainer(
        model=tiny_gpt2(vocab_size=len(tokenizer), bos_token_id=2, eos_token_id=2),
        args=args,
        train_dataset=datasets.Dataset.from_dict({"text": TEXTS}),
        processing_class=tokenizer,
    )
    trainer.train()
    assert trainer.elastic is not None and trainer.elastic.controller.micro_batch == 4
    assert trainer.optimizer.optimizer is trainer.triaccel.optimizer
    assert trainer.triaccel.optimizer.fisher_steps == 2
    assert not trainer.triaccel.optimizer.collector.attached
