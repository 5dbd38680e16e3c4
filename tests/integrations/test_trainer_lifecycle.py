"""The Trainer integration on transformers' extension points: a mixin for any Trainer,
the Trainer's optimizer selection, arguments left as given, hooks only while training,
optional dependencies checked at the start, checkpoints of hf_triaccel 0.1.0."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

import hf_triaccel  # noqa: E402
from hf_triaccel.integrations.trainer import (  # noqa: E402
    TriAccelArguments,
    TriAccelMixin,
    TriAccelTrainer,
)
from hf_triaccel.optim.adafisher import AdaFisherW  # noqa: E402
from hf_triaccel.optim.config import DEFAULT_LR  # noqa: E402
from tests.integrations.tiny import MLP, VectorSet, make_args  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
LEGACY = Path(__file__).resolve().parent / "data" / "checkpoint-v0.1.0"


def _hooks(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


# -- a mixin for any Trainer subclass ---------------------------------------------------


@dataclasses.dataclass
class SFTLikeConfig(transformers.TrainingArguments):
    """A TRL-style config: TrainingArguments with fields of its own."""

    max_length: int = 8


class SFTLikeTrainer(transformers.Trainer):
    """A TRL-style Trainer subclass with its own constructor."""

    def __init__(self, model, args: SFTLikeConfig, train_dataset, processing_class=None):
        self.max_length = args.max_length
        super().__init__(model=model, args=args, train_dataset=train_dataset)


class TriAccelSFT(TriAccelMixin, SFTLikeTrainer):
    pass


@dataclasses.dataclass
class TriAccelSFTConfig(TriAccelArguments, SFTLikeConfig):
    pass


def test_mixin_brings_adafisher_to_a_trainer_subclass(tmp_path):
    args = TriAccelSFTConfig(
        output_dir=str(tmp_path),
        max_length=4,
        max_steps=2,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        per_device_train_batch_size=8,
        adafisher_update_every=1,
    )
    trainer = TriAccelSFT(MLP(), args, VectorSet())
    trainer.train()
    assert trainer.max_length == 4
    assert isinstance(trainer.optimizer.optimizer, AdaFisherW)
    assert trainer.optimizer.optimizer.fisher_steps == 2


def test_mixin_with_the_subclass_own_config_keeps_its_optimizer(tmp_path):
    args = SFTLikeConfig(
        output_dir=str(tmp_path),
        max_steps=1,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        per_device_train_batch_size=8,
        optim="sgd",
        learning_rate=0.1,
    )
    trainer = TriAccelSFT(MLP(), args, VectorSet())  # a timm-style model: the fallback loss
    trainer.train()
    assert type(trainer.optimizer.optimizer) is torch.optim.SGD


# -- the Trainer's optimizer selection ---------------------------------------------------


def test_optimizer_comes_through_the_callback_and_its_factory(tmp_path):
    """The mixin hands the Trainer a TriAccelCallback and its optimizer_cls_and_kwargs:
    the optimizer the Trainer steps is the one the callback built."""
    args = make_args(tmp_path, max_steps=1, learning_rate=None, lr_scheduler_type="constant")
    trainer = TriAccelTrainer(model=MLP(), args=args, train_dataset=VectorSet())
    assert trainer.triaccel in trainer.callback_handler.callbacks
    assert trainer.optimizer_cls_and_kwargs == trainer.triaccel.optimizer_cls_and_kwargs
    trainer.train()
    assert trainer.optimizer.optimizer is trainer.triaccel.optimizer
    assert {g["lr"] for g in trainer.triaccel.optimizer.param_groups} == {DEFAULT_LR}


def test_stock_optimizers_get_no_callback(tmp_path):
    trainer = TriAccelTrainer(
        model=MLP(), args=make_args(tmp_path, optim="adamw_torch"), train_dataset=VectorSet()
    )
    assert trainer.triaccel is None and trainer.optimizer_cls_and_kwargs is None


def test_users_optimizer_cls_and_kwargs_wins(tmp_path):
    trainer = TriAccelTrainer(
        model=MLP(),
        args=make_args(tmp_path, max_steps=1),
        train_dataset=VectorSet(),
        optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": 0.1}),
    )
    trainer.train()
    assert type(trainer.optimizer.optimizer) is torch.optim.SGD


# -- arguments left as given -----------------------------------------------------------


# -- model_init, hooks only while training -----------------------------------------------


def test_model_init_trains_again_from_scratch(tmp_path):
    """hyperparameter_search's way: model_init, then train() once per trial."""
    trainer = TriAccelTrainer(
        args=make_args(tmp_path, max_steps=2), train_dataset=VectorSet(), model_init=MLP
    )
    trainer.train()
    first = [p.detach().clone() for p in trainer.model.parameters()]
    first_model = trainer.model
    trainer.train()
    assert trainer.model is not first_model and _hooks(first_model) == 0
    for p, q in zip(first, trainer.model.parameters(), strict=True):
        assert torch.equal(p, q)  # same seed, fresh model and optimizer: the same run
    assert trainer.optimizer.optimizer.fisher_steps == 2


class HookCount(transformers.TrainerCallback):
    def __init__(self, model) -> None:
        self.model, self.counts = model, []

    def on_step_end(self, args, state, control, **kwargs):
        self.counts.append(_hooks(self.model))


def test_hooks_are_attached_for_training_and_removed_after(tmp_path):
    model = MLP()
    counter = HookCount(model)
    args = make_args(tmp_path, max_steps=2, triaccel_precision=True, triaccel_signals_every=1)
    trainer = TriAccelTrainer(
        model=model, args=args, train_dataset=VectorSet(), callbacks=[counter]
    )
    trainer.train()
    assert min(counter.counts) > 0 and _hooks(model) == 0
    assert trainer.optimizer.optimizer.fisher_steps == 2
    # a second train() hooks the model again and carries the optimizer state over
    args.max_steps = 4  # (the test's own object: the trainer never writes to it)
    trainer.train()
    assert counter.counts[-1] > 0 and _hooks(model) == 0
    assert trainer.optimizer.optimizer.fisher_steps == 6


# -- optional dependencies --------------------------------------------------------------


class RaiseAtStep(transformers.TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        raise RuntimeError("a failure in the middle of training")


def test_hooks_come_off_when_training_raises(tmp_path):
    """on_train_end does not run then: train's cleanup takes the hooks off."""
    model = MLP()
    args = make_args(tmp_path, max_steps=2, triaccel_precision=True, triaccel_signals_every=1)
    trainer = TriAccelTrainer(
        model=model, args=args, train_dataset=VectorSet(), callbacks=[RaiseAtStep()]
    )
    with pytest.raises(RuntimeError, match="middle of training"):
        trainer.train()
    assert _hooks(model) == 0 and not trainer.collector.attached


# -- version, changelog, checkpoints of 0.1.0 -------------------------------------------


def test_breaking_release_is_versioned_with_a_changelog():
    assert hf_triaccel.__version__ == "0.2.0"
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert "## 0.2.0" in changelog and "HF_TRIACCEL_" in changelog
    assert 'version = "0.2.0"' in (ROOT / "pyproject.toml").read_text()


class LegacyMLP(nn.Module):
    """The model the 0.1.0 checkpoint was written for."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = nn.Linear(6, 12), nn.Linear(12, 3)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


def test_a_checkpoint_of_version_0_1_0_resumes(tmp_path):
    """Written by hf_triaccel 0.1.0 (TriAccelTrainer, adafisherw, elastic batch at a
    micro-batch of 4 after an out-of-memory error, step 2 of 4)."""
    checkpoint = tmp_path / "out" / "checkpoint-2"
    shutil.copytree(LEGACY, checkpoint)
    args = make_args(
        tmp_path / "out",
        max_steps=4,
        save_strategy="no",
        learning_rate=1e-2,
        adafisher_update_every=1,
        elastic_batch=True,
        logging_steps=1,
    )
    trainer = TriAccelTrainer(model=LegacyMLP(), args=args, train_dataset=VectorSet())
    trainer.train(resume_from_checkpoint=str(checkpoint))
    assert trainer.state.global_step == 4
    assert trainer.optimizer.optimizer.fisher_steps == 4
    assert trainer.elastic.controller.micro_batch == 4  # from the checkpoint
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
