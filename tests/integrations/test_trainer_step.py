"""The lean training step (trainer_step.LeanStepMixin, trainer_compat.KeptParameterClipping)
against the Trainer's own methods, on tiny models on the CPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from hf_triaccel.integrations.trainer import TriAccelMixin, TriAccelTrainer  # noqa: E402
from tests.integrations.test_trainer import TIMING_KEYS  # noqa: E402
from tests.integrations.tiny import MLP, Logs, TokenSet, VectorSet, make_args, tiny_gpt2  # noqa: E402


def spy(monkeypatch, obj, name: str) -> list:
    """The calls of ``obj.name`` (an instance attribute over the class's method) as
    ``(args, kwargs)``; the method still runs."""
    calls, original = [], getattr(obj, name)

    def recorded(*args, **kwargs):
        calls.append((args, kwargs))
        return original(*args, **kwargs)

    monkeypatch.setattr(obj, name, recorded)
    return calls


class TrainersOwnStep(TriAccelTrainer):
    """TriAccelTrainer with ``transformers.Trainer``'s step, clipping and flop count."""

    def _training_step(self, model, inputs, num_items_in_batch):
        return transformers.Trainer.training_step(self, model, inputs, num_items_in_batch)

    def _clip_grad_norm(self, model):
        return transformers.Trainer._clip_grad_norm(self, model)

    def floating_point_ops(self, inputs):
        return transformers.Trainer.floating_point_ops(self, inputs)


class ModesAtForward(transformers.TrainerCallback):
    """Whether every module of ``model`` was in training mode at each training forward,
    and a callback's switch of one module to eval mode after each step."""

    def __init__(self, model: nn.Module, switched: nn.Module) -> None:
        self.model, self.switched, self.training_forwards = model, switched, []
        self.in_training = False
        model.register_forward_pre_hook(self._record)

    def _record(self, module, args):
        if self.in_training:
            self.training_forwards.append(all(m.training for m in module.modules()))

    def on_step_begin(self, args, state, control, **kwargs):
        self.in_training = True

    def on_step_end(self, args, state, control, **kwargs):
        self.in_training = False
        self.switched.eval()


def _gpt2_run(tmp_path, trainer_class, steps=6):
    model = tiny_gpt2()  # dropout 0.1: a step in eval mode would give other losses
    logs = Logs()
    args = make_args(
        tmp_path,
        optim="adamw_torch",
        max_steps=steps,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_grad_norm=0.5,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=2,
        include_num_input_tokens_seen="all",
    )
    modes = ModesAtForward(model, model.transformer.h[0].mlp)
    trainer = trainer_class(
        model=model,
        args=args,
        train_dataset=TokenSet(32),
        eval_dataset=TokenSet(8),
        callbacks=[logs, modes],
    )
    trainer.train()
    timing = (*TIMING_KEYS, "runtime", "per_second")
    history = [
        {k: v for k, v in e.items() if not any(t in k for t in timing)}
        for e in trainer.state.log_history
    ]
    return model, history, modes, trainer.state.total_flos


def test_lean_step_trains_exactly_as_the_trainers_own_step(tmp_path):
    """Dropout, evaluation between steps, a callback switching a block to eval mode,
    gradient accumulation, clipping: parameters and logs are the same to the bit."""
    lean, lean_logs, lean_modes, lean_flos = _gpt2_run(tmp_path / "lean", TriAccelTrainer)
    own, own_logs, own_modes, own_flos = _gpt2_run(tmp_path / "own", TrainersOwnStep)
    assert lean_logs == own_logs and any("grad_norm" in e for e in lean_logs)
    assert lean_flos == own_flos > 0
    for (name, a), b in zip(lean.named_parameters(), own.parameters(), strict=True):
        assert torch.equal(a, b), name
    # every training forward saw every module in training mode, in both
    assert len(lean_modes.training_forwards) == 12 and all(lean_modes.training_forwards)
    assert own_modes.training_forwards == lean_modes.training_forwards


class CountedTrain(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.train_calls = 0

    def train(self, mode: bool = True):
        self.train_calls += 1
        return super().train(mode)


def _mlp_trainer(tmp_path, model, trainer_class=TriAccelTrainer, **kwargs):
    args = make_args(tmp_path, optim="adamw_torch", max_grad_norm=1.0, **kwargs)
    return trainer_class(model=model, args=args, train_dataset=VectorSet(64))


def test_train_is_called_only_when_it_changes_a_mode(tmp_path, monkeypatch):
    model = MLP()
    calls = spy(monkeypatch, model, "train")
    _mlp_trainer(tmp_path, model, max_steps=5).train()
    assert calls == []  # built in training mode: nothing to change at any step
    model.norm.eval()
    _mlp_trainer(tmp_path, model, max_steps=5).train()
    assert len(calls) == 1 and model.norm.training  # switched back once, as the Trainer does


def test_a_module_overriding_train_gets_the_call_at_every_step(tmp_path):
    model = CountedTrain()
    _mlp_trainer(tmp_path, model, max_steps=5).train()
    assert model.train_calls == 5


def test_the_clipping_walks_the_parameters_once_per_run(tmp_path, monkeypatch):
    """``model.parameters()`` per step: the Trainer's clipping walks them at every step;
    the kept list leaves only the Trainer's ``model.zero_grad()`` walk."""

    def walks_per_step(trainer_class) -> float:
        counts = []
        for steps in (2, 6):
            model = MLP()
            calls = spy(monkeypatch, model, "parameters")
            _mlp_trainer(tmp_path, model, trainer_class, max_steps=steps).train()
            counts.append(len(calls))
        return (counts[1] - counts[0]) / 4

    assert walks_per_step(TrainersOwnStep) == 2
    assert walks_per_step(TriAccelTrainer) == 1


def test_transformers_model_counts_its_parameters_once(tmp_path, monkeypatch):
    model = tiny_gpt2()
    count = model.num_parameters(exclude_embeddings=True)
    calls = spy(monkeypatch, model, "num_parameters")
    args = make_args(tmp_path, optim="adamw_torch", max_steps=4, per_device_train_batch_size=4)
    trainer = TriAccelTrainer(model=model, args=args, train_dataset=TokenSet(16))
    trainer.train()
    assert calls == [((), {"exclude_embeddings": True})]
    assert trainer.state.total_flos == 4 * 6 * 4 * 12 * count  # steps x 6 x tokens x count


class OwnStepTrainer(transformers.Trainer):
    """A Trainer subclass with its own step and clipping (as TRL's trainers have)."""

    steps = clips = 0

    def training_step(self, model, inputs, num_items_in_batch=None):
        OwnStepTrainer.steps += 1
        return super().training_step(model, inputs, num_items_in_batch)

    def _clip_grad_norm(self, model):
        OwnStepTrainer.clips += 1
        return super()._clip_grad_norm(model)


class TriAccelOwnStep(TriAccelMixin, OwnStepTrainer):
    pass


def test_a_subclass_step_between_the_mixin_and_the_trainer_is_kept(tmp_path):
    _mlp_trainer(tmp_path, MLP(), TriAccelOwnStep, max_steps=3).train()
    assert (OwnStepTrainer.steps, OwnStepTrainer.clips) == (3, 3)
