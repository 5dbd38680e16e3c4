"""TriAccelTrainer and TriAccelArguments on tiny timm and transformers models (CPU)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch.utils.data import Dataset

timm = pytest.importorskip("timm")
transformers = pytest.importorskip("transformers")

from hf_triaccel.integrations.telemetry import REPORT_NAME  # noqa: E402
from hf_triaccel.integrations.trainer import TriAccelArguments, TriAccelTrainer  # noqa: E402


class ImageSet(Dataset):
    """Random 16x16 images with fixed labels, in the Trainer's dict-of-tensors form."""

    def __init__(self, n: int = 32, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 3, 16, 16, generator=gen)
        self.y = torch.randint(0, 10, (n,), generator=gen)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"pixel_values": self.x[i], "labels": self.y[i]}


class TokenSet(Dataset):
    def __init__(self, n: int = 16, seq: int = 12, vocab: int = 64) -> None:
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, seq), generator=gen)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_timm():
    torch.manual_seed(0)
    return timm.create_model("test_resnet", num_classes=10)


def tiny_gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    return transformers.GPT2LMHeadModel(config)


def make_args(tmp_path, **kw) -> TriAccelArguments:
    defaults = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_steps=2,
        seed=0,
        adafisher_update_every=2,
        disable_tqdm=True,
    )
    defaults.update(kw)
    return TriAccelArguments(**defaults)


def test_timm_model_trains_and_reports(tmp_path):
    model = tiny_timm()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = TriAccelTrainer(
        model=model,
        args=make_args(tmp_path, max_steps=4),
        train_dataset=ImageSet(),
        eval_dataset=ImageSet(16, seed=1),
    )
    trainer.train()
    opt = trainer.optimizer.optimizer
    assert type(opt).__name__ == "AdaFisherW"
    assert opt.fisher_steps == 4
    # the Trainer's weight-decay grouping is kept: biases and norms in a no-decay group
    assert [g["weight_decay"] for g in opt.param_groups] == [0.0, 0.0]
    assert len(trainer.collector.layers) > 0
    for n, p in model.named_parameters():
        assert torch.isfinite(p).all() and not torch.equal(before[n], p), n
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert logs and all("step_time_ms" in e and e["samples_per_second"] > 0 for e in logs)
    report = json.loads((tmp_path / REPORT_NAME).read_text())
    assert report["optimizer_steps"] == 4 and report["samples"] == 32
    assert (
        report["versions"]["torch"] == torch.__version__.split("+")[0]
        or report["versions"]["torch"]
    )
    metrics = trainer.evaluate()
    assert metrics["eval_loss"] > 0


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
    """A run resumed from its step-3 checkpoint ends where the uninterrupted run ends."""
    common = dict(max_steps=6, save_strategy="steps", save_steps=3, per_device_train_batch_size=4)
    straight = tiny_timm()
    TriAccelTrainer(
        model=straight, args=make_args(tmp_path / "a", **common), train_dataset=ImageSet()
    ).train()
    resumed = tiny_timm()
    trainer = TriAccelTrainer(
        model=resumed, args=make_args(tmp_path / "b", **common), train_dataset=ImageSet()
    )
    trainer.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-3"))
    assert trainer.optimizer.optimizer.fisher_steps == 6
    for (n, p1), p2 in zip(straight.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p1, p2), n


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"adafisher_beta": 1.5}, "adafisher_beta"),
        ({"adafisher_damping": 0.0}, "adafisher_damping"),
        ({"adafisher_gamma": 0.0}, "adafisher_gamma"),
        ({"adafisher_update_every": 0}, "adafisher_update_every"),
        ({"adafisher_ema": "fast"}, "adafisher_ema"),
        ({"triaccel_impl": "cuda"}, "triaccel_impl"),
        ({"weight_decay": -1.0}, "weight_decay"),
    ],
)
def test_bad_arguments_name_the_field(tmp_path, kwargs, field):
    with pytest.raises(ValueError, match=field):
        TriAccelArguments(output_dir=str(tmp_path), **kwargs)


def test_unknown_optimizer_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="not_an_optimizer"):
        TriAccelArguments(output_dir=str(tmp_path), optim="not_an_optimizer")


def test_plain_trainer_arguments_are_rejected(tmp_path):
    with pytest.raises(TypeError, match="TriAccelArguments"):
        TriAccelTrainer(
            model=tiny_gpt2(),
            args=transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True),
        )


def test_arguments_parse_from_the_command_line(tmp_path):
    parser = transformers.HfArgumentParser(TriAccelArguments)
    (args,) = parser.parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--optim", "adafisher", "--adafisher_update_every", "50"]
    )
    plugin = args.to_plugin()
    assert (plugin.optimizer, plugin.update_every) == ("adafisher", 50)
    assert os.fspath(args.output_dir) == str(tmp_path)


def test_adaptive_precision_through_the_trainer(tmp_path):
    args = make_args(
        tmp_path, max_steps=4, triaccel_precision=True, triaccel_signals_every=2, logging_steps=4
    )
    trainer = TriAccelTrainer(model=tiny_timm(), args=args, train_dataset=ImageSet())
    trainer.train()
    assert trainer.precision is not None and trainer.signals.steps == 4
    assert set(trainer.precision.decisions.values()) <= {"fp32", "bf16"}  # no fp16 without --fp16
    log = next(e for e in trainer.state.log_history if "loss" in e)
    assert log["precision_fp32"] + log["precision_bf16"] == len(trainer.precision.decisions)
    assert (tmp_path / "precision_map.png").stat().st_size > 0
    assert json.loads((tmp_path / "signals.json").read_text())
    saved = trainer.optimizer.state_dict()["triaccel_precision"]
    assert saved["precision"] == trainer.precision.state_dict()


@pytest.mark.parametrize("field", ["triaccel_precision", "triaccel_lr_steering"])
def test_signal_features_need_adafisher(tmp_path, field):
    with pytest.raises(ValueError, match=field):
        TriAccelArguments(output_dir=str(tmp_path), optim="adamw_torch", **{field: True})


def test_step_size_steering_through_the_trainer(tmp_path):
    args = make_args(
        tmp_path, max_steps=4, triaccel_lr_steering=True, triaccel_signals_every=2, logging_steps=4
    )
    trainer = TriAccelTrainer(model=tiny_timm(), args=args, train_dataset=ImageSet())
    trainer.train()
    assert trainer.precision is None and trainer.signals is trainer.steering.tracker
    assert trainer.signals.steps == 4 and trainer.steering.scales
    log = next(e for e in trainer.state.log_history if "loss" in e)
    assert log["lr_scale_min"] == min(trainer.steering.scales.values())
    assert log["lr_scale_max"] == max(trainer.steering.scales.values())
    saved = trainer.optimizer.state_dict()["triaccel_steering"]
    assert saved["steering"] == trainer.steering.state_dict()
    assert saved["signals"]["steps"] == 4


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
