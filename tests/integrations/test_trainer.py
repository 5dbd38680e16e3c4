"""TriAccelTrainer and TriAccelArguments on tiny timm and transformers models (CPU)."""

from __future__ import annotations

import json
import os

import pytest
import torch

timm = pytest.importorskip("timm")
transformers = pytest.importorskip("transformers")

from hf_triaccel.integrations.telemetry import REPORT_NAME  # noqa: E402
from hf_triaccel.integrations.trainer import TriAccelTrainer  # noqa: E402
from tests.integrations.tiny import ImageSet, Logs, TokenSet, make_args, tiny_gpt2, tiny_timm  # noqa: E402

# what transformers' resume tests leave out when comparing a run's log history to its
# resumption's (TrainerIntegrationCommon.check_trainer_state_are_the_same)
TIMING_KEYS = ("train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss")


def test_timm_model_trains_and_reports(tmp_path):
    model = tiny_timm()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    logs = Logs()
    trainer = TriAccelTrainer(
        model=model,
        args=make_args(tmp_path, max_steps=4),
        train_dataset=ImageSet(),
        eval_dataset=ImageSet(16, seed=1),
        callbacks=[logs],
    )
    trainer.train()
    opt = trainer.optimizer.optimizer
    assert type(opt).__name__ == "AdaFisherW"
    assert opt.fisher_steps == 4
    # biases and norms in a no-decay group (weight_decay is 0 here for both)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.0, 0.0]
    assert len(trainer.collector.layers) > 0
    for n, p in model.named_parameters():
        assert torch.isfinite(p).all() and not torch.equal(before[n], p), n
    train_logs = [e for e in logs.entries if "loss" in e]
    assert train_logs and all(
        "step_time_ms" in e and e["samples_per_second"] > 0 for e in train_logs
    )
    trainer.save_model()
    report = json.loads((tmp_path / REPORT_NAME).read_text())
    assert report["optimizer_steps"] == 4 and report["samples"] == 32
    assert report["versions"]["torch"] == torch.__version__.split("+")[0]
    metrics = trainer.evaluate()
    assert metrics["eval_loss"] > 0


def test_output_dir_and_log_history_hold_what_transformers_writes(tmp_path):
    """Telemetry reaches the reporting callbacks but neither the log history (resumed runs
    compare it) nor output_dir (checkpoint listing counts it); the report goes to
    triaccel_report_dir."""
    logs = Logs()
    report_dir = tmp_path / "reports"
    args = make_args(
        tmp_path / "out",
        max_steps=4,
        save_strategy="steps",
        save_steps=2,
        logging_steps=1,
        triaccel_report_dir=str(report_dir),
    )
    trainer = TriAccelTrainer(
        model=tiny_timm(), args=args, train_dataset=ImageSet(), callbacks=[logs]
    )
    trainer.train()
    assert sorted(os.listdir(tmp_path / "out")) == ["checkpoint-2", "checkpoint-4"]
    assert all("step_time_ms" not in e for e in trainer.state.log_history)
    assert sum("step_time_ms" in e for e in logs.entries) == 4
    assert json.loads((report_dir / REPORT_NAME).read_text())["optimizer_steps"] == 4


def test_gpt2_trains_with_gradient_accumulation(tmp_path):
    model = tiny_gpt2()
    args = make_args(
        tmp_path,
        max_steps=3,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        optim="adafisher",
        weight_decay=0.01,
    )
    trainer = TriAccelTrainer(model=model, args=args, train_dataset=TokenSet())
    trainer.train()
    opt = trainer.optimizer.optimizer
    assert type(opt).__name__ == "AdaFisher"
    assert opt.fisher_steps == 3  # folded once per optimizer step, not per micro-batch
    assert {g["weight_decay"] for g in opt.param_groups} == {0.01, 0.0}


def test_other_optimizers_still_work(tmp_path):
    trainer = TriAccelTrainer(
        model=tiny_gpt2(),
        args=make_args(tmp_path, max_steps=1, optim="adamw_torch"),
        train_dataset=TokenSet(),
    )
    trainer.train()
    assert type(trainer.optimizer.optimizer).__name__ == "AdamW"
    assert trainer.collector is None


def test_resume_from_checkpoint_is_exact(tmp_path):
    """A run resumed from its step-3 checkpoint ends where the uninterrupted run ends, with
    the same log history (as transformers' resume tests compare it)."""
    common = dict(
        max_steps=6,
        save_strategy="steps",
        save_steps=3,
        per_device_train_batch_size=4,
        logging_steps=1,
    )
    straight = tiny_timm()
    first = TriAccelTrainer(
        model=straight, args=make_args(tmp_path / "a", **common), train_dataset=ImageSet()
    )
    first.train()
    resumed = tiny_timm()
    trainer = TriAccelTrainer(
        model=resumed, args=make_args(tmp_path / "b", **common), train_dataset=ImageSet()
    )
    trainer.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-3"))
    assert trainer.optimizer.optimizer.fisher_steps == 6
    for (n, p1), p2 in zip(straight.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p1, p2), n

    def comparable(history):
        return [{k: v for k, v in e.items() if k not in TIMING_KEYS} for e in history]

    assert comparable(trainer.state.log_history) == comparable(first.state.log_history)


def test_label_smoothing_with_a_plain_model(tmp_path):
    trainer = TriAccelTrainer(
        model=tiny_timm(),
        args=make_args(tmp_path, max_steps=1, label_smoothing_factor=0.1),
        train_dataset=ImageSet(),
    )
    batch = {"pixel_values": ImageSet().x[:4], "labels": ImageSet().y[:4]}
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch)
        logits = trainer.model(batch["pixel_values"])
    expected = torch.nn.functional.cross_entropy(logits, batch["labels"], label_smoothing=0.1)
    torch.testing.assert_close(loss, expected)
    trainer.train()
