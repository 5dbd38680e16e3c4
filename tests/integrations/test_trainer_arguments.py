"""TriAccelArguments: fields, checks, the command line, the one table from the Trainer's
names to the configuration's, and stock defaults kept for stock optimizers."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

timm = pytest.importorskip("timm")
transformers = pytest.importorskip("transformers")

from hf_triaccel.integrations.low_memory import LOW_MEMORY_STATE, low_memory_settings  # noqa: E402
from hf_triaccel.integrations.plugin import TriAccelPlugin  # noqa: E402
from hf_triaccel.integrations.trainer import TriAccelArguments, TriAccelTrainer  # noqa: E402
from hf_triaccel.integrations.trainer_args import (  # noqa: E402
    ARGUMENT_SETTINGS,
    accelerator_available,
)
from hf_triaccel.optim.config import DEFAULT_LR, AdaFisherConfig  # noqa: E402
from tests.integrations.tiny import MLP, ImageSet, VectorSet, make_args, tiny_timm  # noqa: E402

STOCK_LR = 5e-5


def test_one_table_maps_every_hyperparameter_to_its_argument():
    """Each AdaFisherConfig field (and each controller setting) has one argument, which
    takes the plugin's default and help; the low-memory fields have one together,
    ``triaccel_low_memory``."""
    settings = set(ARGUMENT_SETTINGS.values())
    low_memory = set(LOW_MEMORY_STATE) | {"release_grads"}
    assert {f.name for f in dataclasses.fields(AdaFisherConfig)} - low_memory <= settings
    on = TriAccelArguments(output_dir="out", triaccel_low_memory=True, max_grad_norm=0.0)
    assert set(low_memory_settings(on)) == low_memory
    assert on.to_plugin().state_dtype == "bfloat16" and on.to_plugin().release_grads
    assert len(settings) == len(ARGUMENT_SETTINGS)  # no field renamed twice
    plugin = {f.name: f for f in dataclasses.fields(TriAccelPlugin)}
    arguments = {f.name: f for f in dataclasses.fields(TriAccelArguments)}
    for argument, name in ARGUMENT_SETTINGS.items():
        assert plugin[name].metadata["help"] in arguments[argument].metadata["help"], argument
        if argument not in ("learning_rate", "triaccel_channels_last"):  # None: by optim
            assert arguments[argument].default == plugin[name].default, argument
    args = TriAccelArguments(output_dir="out", adafisher_gamma=0.5, triaccel_signals_every=7)
    assert (args.to_plugin().gamma, args.to_plugin().signals_every) == (0.5, 7)


def test_stock_defaults_change_only_with_adafisher():
    stock = TriAccelArguments(output_dir="out", optim="adamw_torch")
    plain = transformers.TrainingArguments(output_dir="out")
    for name in ("learning_rate", "logging_nan_inf_filter", "dataloader_pin_memory"):
        assert getattr(stock, name) == getattr(plain, name), name
    ours = TriAccelArguments(output_dir="out")
    assert ours.learning_rate is None and ours.logging_nan_inf_filter is False
    assert ours.dataloader_pin_memory == accelerator_available()
    for name in ("logging_nan_inf_filter", "dataloader_pin_memory", "triaccel_channels_last"):
        help_text = TriAccelArguments.__dataclass_fields__[name].metadata["help"]
        assert "adafisher(w)" in help_text, name


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"adafisher_beta": 1.5}, "adafisher_beta"),
        ({"adafisher_damping": 0.0}, "adafisher_damping"),
        ({"adafisher_gamma": 0.0}, "adafisher_gamma"),
        ({"adafisher_update_every": 0}, "adafisher_update_every"),
        ({"adafisher_ema": "fast"}, "adafisher_ema"),
        ({"adafisher_normalise": "scaled"}, "adafisher_normalise"),
        ({"triaccel_impl": "cuda"}, "triaccel_impl"),
        ({"weight_decay": -1.0}, "weight_decay"),
    ],
)
def test_bad_arguments_name_the_field(tmp_path, kwargs, field):
    with pytest.raises(ValueError, match=field):
        TriAccelArguments(output_dir=str(tmp_path), **kwargs)


def test_unknown_optimizer_is_rejected_with_the_choices(tmp_path):
    """One short line: the closest name, ours, and where transformers' are listed."""
    with pytest.raises(ValueError, match="optim='adamw_toch'") as err:
        TriAccelArguments(output_dir=str(tmp_path), optim="adamw_toch")
    message = str(err.value)
    assert "did you mean 'adamw_torch'" in message and "adafisherw" in message
    assert "OptimizerNames" in message and len(message) < 300


def test_plain_trainer_arguments_train_as_the_stock_trainer(tmp_path):
    """Arguments of another class keep every stock default: AdamW, the stock layout."""
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        max_steps=1,
        per_device_train_batch_size=8,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        dataloader_pin_memory=False,
    )
    model = tiny_timm()
    trainer = TriAccelTrainer(model=model, args=args, train_dataset=ImageSet())
    trainer.train()
    assert type(trainer.optimizer.optimizer) is torch.optim.AdamW and trainer.triaccel is None
    assert not trainer.channels_last
    assert all(p.is_contiguous() for p in model.parameters())


def test_arguments_parse_from_the_command_line(tmp_path):
    parser = transformers.HfArgumentParser(TriAccelArguments)
    (args,) = parser.parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--optim", "adafisher", "--adafisher_update_every", "50"]
    )
    plugin = args.to_plugin()
    assert (plugin.optimizer, plugin.update_every) == ("adafisher", 50)
    assert os.fspath(args.output_dir) == str(tmp_path)


def test_normalise_argument_reaches_the_optimizer(tmp_path):
    parser = transformers.HfArgumentParser(TriAccelArguments)
    (args,) = parser.parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--use_cpu", "--adafisher_normalise", "relative"]
    )
    assert args.to_plugin().normalise == "relative"
    trainer = TriAccelTrainer(model=tiny_timm(), args=args, train_dataset=ImageSet())
    optimizer = trainer.create_optimizer()
    assert optimizer.normalise == "relative"
    default = TriAccelTrainer(
        model=tiny_timm(), args=make_args(tmp_path / "default"), train_dataset=ImageSet()
    )
    assert default.create_optimizer().normalise == "absolute"


@pytest.mark.parametrize("field", ["triaccel_precision", "triaccel_lr_steering"])
def test_signal_features_need_adafisher(tmp_path, field):
    with pytest.raises(ValueError, match=field):
        TriAccelArguments(output_dir=str(tmp_path), optim="adamw_torch", **{field: True})


def test_arguments_are_never_changed(tmp_path):
    args = make_args(
        tmp_path,
        max_steps=2,
        auto_find_batch_size=True,
        remove_unused_columns=True,
        label_smoothing_factor=0.1,
        learning_rate=None,
    )
    before = args.to_dict()
    trainer = TriAccelTrainer(model=tiny_timm(), args=args, train_dataset=ImageSet())
    trainer.train()
    assert trainer.args is args
    assert args.to_dict() == before
    assert trainer.triaccel_settings["learning_rate"] == DEFAULT_LR
    assert trainer.elastic is not None  # auto_find_batch_size turns it on, on the trainer


@pytest.mark.parametrize(
    "optim, given, expected",
    [
        ("adafisherw", None, DEFAULT_LR),
        ("adafisher", None, DEFAULT_LR),
        ("adamw_torch", None, STOCK_LR),
        ("adafisherw", 3e-2, 3e-2),
        ("adamw_torch", 3e-2, 3e-2),
    ],
)
def test_learning_rate_is_the_optimizers_default_unless_set(tmp_path, optim, given, expected):
    args = make_args(tmp_path, optim=optim, learning_rate=given, lr_scheduler_type="constant")
    trainer = TriAccelTrainer(model=MLP(), args=args, train_dataset=VectorSet())
    trainer.create_optimizer()
    assert {g["lr"] for g in trainer.optimizer.param_groups} == {expected}
    assert trainer.triaccel_settings["learning_rate"] == expected
    # AdaFisher's default is reported, not written back; a stock optimizer's arguments
    # hold transformers' default, as TrainingArguments would
    assert args.learning_rate == (given if optim.startswith("adafisher") else expected)
