"""``TriAccelArguments``: ``TrainingArguments`` with hf_triaccel's settings.

Over 400 lines: HfArgumentParser reads one dataclass, so every setting of the optimizer
and the controllers is a field here, each with its help, beside the parser that reads them.

The fields that set a :class:`~hf_triaccel.integrations.plugin.TriAccelPlugin` field (an
:class:`~hf_triaccel.optim.config.AdaFisherConfig` field for the optimizer's own) are
declared with :func:`plugin_field`, which takes the default and help from the plugin and
records the plugin field's name: those declarations are the one table from the Trainer's
names to the configuration's (:data:`ARGUMENT_SETTINGS`), and :func:`plugin_from_args`
the one way arguments become a configuration.

Stock defaults change only where the arguments ask for hf_triaccel's optimizer (``optim``
``adafisher`` / ``adafisherw``, the default here): the learning rate left unset (``None``)
is AdaFisher's own, nan/inf filtering of the logged loss is off and memory is pinned only
where an accelerator exists. With any other ``optim`` these fields take transformers'
defaults. ``TrainingArguments`` cannot tell a learning rate left at its default (5e-5) from
one set to that value, so ``None`` is the one unambiguous "not set"; the resolved value is
reported by the trainer and never written back into the arguments.

:class:`TriAccelArgumentParser` reads them from a command line, with errors of one line
that name the flag.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch
from transformers import HfArgumentParser, TrainingArguments
from transformers.training_args import OptimizerNames

from hf_triaccel.integrations.low_memory import low_memory_settings
from hf_triaccel.integrations.plugin import TriAccelPlugin, check_fsdp_features
from hf_triaccel.optim.adafisher import OPTIMIZERS
from hf_triaccel.optim.config import DEFAULT_LR

_DECLARED: dict[dataclasses.Field, str] = {}  # a field of plugin_field -> the plugin field
_PLUGIN = {f.name: f for f in dataclasses.fields(TriAccelPlugin)}
_STOCK = {f.name: f.default for f in dataclasses.fields(TrainingArguments)}
_NEEDS_ADAFISHER = "Needs optim adafisher or adafisherw."
STOCK_DEFAULT_LR: float = _STOCK["learning_rate"]
"""transformers' default learning rate, the default of its own optimizers here too."""


def plugin_field(name: str, note: str = "", prefix: str = "", **default: Any) -> Any:
    """A field that sets ``TriAccelPlugin.<name>``: the plugin's default (or ``default=``)
    and help, with ``prefix`` and ``note`` around the help."""
    source = _PLUGIN[name]
    text = " ".join(filter(None, [prefix + source.metadata["help"], note]))
    declared = field(default=default.pop("default", source.default), metadata={"help": text})
    # kept beside the field: HfArgumentParser hands a field's metadata to argparse whole
    _DECLARED[declared] = name
    return declared


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """A suggestion for a misspelt ``word``: the closest of ``choices`` as a question, or
    ``""`` when none is close.

    Example:
        >>> did_you_mean("adamw_torch_fuse", ["adafisher", "adamw_torch_fused", "sgd"])
        " did you mean 'adamw_torch_fused'?"
        >>> did_you_mean("lion", ["adafisher", "adamw_torch_fused"])
        ''
    """
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" did you mean {close[0]!r}?" if close else ""


def accelerator_available() -> bool:
    """Whether torch finds an accelerator, the test the DataLoader's ``pin_memory`` makes."""
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
    return accelerator.is_available() if accelerator else torch.cuda.is_available()


def optim_name(args: TrainingArguments) -> str:
    """``args.optim`` as a plain lower-case string (transformers keeps an enum)."""
    return str(getattr(args.optim, "value", args.optim)).lower()


def uses_adafisher(args: TrainingArguments) -> bool:
    """Whether ``args.optim`` names one of hf_triaccel's optimizers."""
    return optim_name(args) in OPTIMIZERS


def resolve_learning_rate(args: TrainingArguments) -> float:
    """The learning rate training uses: ``args.learning_rate`` when set, else the chosen
    optimizer's default (AdaFisher's for ours, transformers' for the others).

    Example:
        >>> resolve_learning_rate(TriAccelArguments(output_dir="out"))
        0.012
        >>> resolve_learning_rate(TriAccelArguments(output_dir="out", optim="adamw_torch"))
        5e-05
    """
    if args.learning_rate is not None:
        return args.learning_rate
    return DEFAULT_LR if uses_adafisher(args) else STOCK_DEFAULT_LR


def setting(args: TrainingArguments, name: str) -> Any:
    """A TriAccelArguments setting of ``args``, or its default for arguments of another
    ``TrainingArguments`` class (a TRL config given to :class:`TriAccelMixin`)."""
    if hasattr(args, name):
        return getattr(args, name)
    return TriAccelArguments.__dataclass_fields__[name].default


@dataclass
class TriAccelArguments(TrainingArguments):
    """``TrainingArguments`` with hf_triaccel's settings (each a CLI flag through
    ``HfArgumentParser``).

    ``optim`` also accepts ``"adafisher"`` and ``"adafisherw"`` (the default). Only with
    those does a stock default change (``learning_rate``, ``logging_nan_inf_filter``,
    ``dataloader_pin_memory``, each field's help says how); ``weight_decay`` is the
    Trainer's own.

    Example:
        >>> args = TriAccelArguments(output_dir="out")
        >>> args.optim, args.learning_rate, resolve_learning_rate(args)
        ('adafisherw', None, 0.012)
        >>> stock = TriAccelArguments(output_dir="out", optim="adamw_torch")
        >>> stock.learning_rate, stock.logging_nan_inf_filter
        (5e-05, True)
        >>> TriAccelArguments(output_dir="out", optim="adamw_torch_fuse")
        Traceback (most recent call last):
        ...
        ValueError: TriAccelArguments.optim='adamw_torch_fuse' is not a known optimizer; did \
you mean 'adamw_torch_fused'? ...
    """

    optim: str = field(
        default="adafisherw",
        metadata={
            "help": "Optimizer: adafisher, adafisherw (Fisher-preconditioned, hf_triaccel; the "
            "default here) or any name transformers' `optim` accepts (e.g. adamw_torch_fused), "
            "with which every other field keeps transformers' default."
        },
    )
    dataloader_pin_memory: bool = field(
        default=True,
        metadata={
            "help": "Pin the batches' host memory for faster copies to the accelerator. With "
            "optim adafisher(w): off where torch finds no accelerator, as pinning there does "
            "nothing."
        },
    )
    logging_nan_inf_filter: bool | None = field(
        default=None,
        metadata={
            "help": "Leave nan/inf losses out of the logged loss. Default: off with optim "
            "adafisher(w) (the check reads the loss back at every step, a GPU sync that costs "
            "throughput on small models), transformers' default (on) otherwise."
        },
    )
    # -- the settings of the run's TriAccelPlugin: Trainer name -> plugin field ------------
    learning_rate: float | None = plugin_field(
        "lr",
        default=None,
        note=f"Default: the optimizer's own ({DEFAULT_LR} for adafisher / adafisherw, "
        f"transformers' {STOCK_DEFAULT_LR} for its optimizers).",
    )
    weight_decay: float = plugin_field(
        "weight_decay",
        note="With adafisher(w) it applies to every parameter but biases and normalisation "
        "weights; transformers' optimizers group the parameters by the Trainer's own rule.",
    )
    adafisher_beta: float = plugin_field("beta", prefix="AdaFisher: ")
    adafisher_damping: float = plugin_field("damping", prefix="AdaFisher: ")
    adafisher_gamma: float = plugin_field("gamma", prefix="AdaFisher: ")
    adafisher_update_every: int | None = plugin_field("update_every", prefix="AdaFisher: ")
    adafisher_ema: str = plugin_field("ema", prefix="AdaFisher: ")
    adafisher_normalise: str = plugin_field("normalise", prefix="AdaFisher: ")
    adafisher_factor_init: str = plugin_field("factor_init", prefix="AdaFisher: ")
    triaccel_impl: str | None = plugin_field("impl", prefix="AdaFisher: ")
    triaccel_precision: bool = plugin_field("precision", _NEEDS_ADAFISHER)
    triaccel_signals_every: int = plugin_field("signals_every")
    triaccel_fp32_fraction: float = plugin_field("fp32_fraction")
    triaccel_fp16_fraction: float | None = plugin_field("fp16_fraction")
    triaccel_lr_steering: bool = plugin_field("lr_steering", _NEEDS_ADAFISHER)
    triaccel_channels_last: bool | None = plugin_field(
        "channels_last",
        "Default: on with optim adafisher(w), off otherwise (the stock layout). The Trainer "
        "feeds such a model its 4-D image batches in channels_last; sharded models (fsdp, "
        "deepspeed) are left as they are. Saved weights stay contiguous.",
        default=None,
    )
    # -- the Trainer's own settings ---------------------------------------------------
    triaccel_report_dir: str | None = field(
        default=None,
        metadata={
            "help": "Folder that receives efficiency_report.json (and, with triaccel_precision, "
            "precision_map.png and signals.json) when training ends. Default: none during "
            "training (output_dir then holds exactly what transformers writes); "
            "trainer.save_model() writes them beside the model."
        },
    )
    elastic_batch: bool = field(
        default=False,
        metadata={
            "help": "Micro-batch that follows live GPU memory, with out-of-memory steps re-run "
            "in smaller pieces and out-of-memory evaluation batches split; the effective "
            "batch stays per_device_train_batch_size. --auto_find_batch_size turns it on too "
            "(transformers' search then still restarts the loop on an out-of-memory error "
            "raised outside forward and backward, such as in the optimizer step)."
        },
    )
    elastic_min_micro_batch: int = field(
        default=1, metadata={"help": "Elastic batch: smallest micro-batch before giving up."}
    )
    elastic_target_fraction: float = field(
        default=0.9,
        metadata={"help": "Elastic batch: peak memory target, as a share of what the GPU gives."},
    )
    # -- preemption (hf_triaccel.integrations.preemption) --------------------------------
    preemption_signals: str = field(
        default="",
        metadata={
            "help": "Signals that stop training at the next optimizer step's end with a "
            "complete checkpoint, then exit with status 3 (e.g. 'SIGTERM' or "
            "'SIGTERM,SIGUSR1'); empty: off. Pair with --resume_from_checkpoint auto, which "
            "resumes from the newest complete checkpoint and starts when there is none."
        },
    )
    # -------------------------------------------------------------------------------------
    device_data_augment: bool = field(
        default=True,
        metadata={
            "help": "For an ImageTensors train_dataset (images kept on the device): random "
            "crop with 4-pixel padding and horizontal flip, done per batch on the device."
        },
    )

    triaccel_low_memory: bool = field(
        default=False,
        metadata={
            "help": "AdaFisher(W) with bfloat16 momentum, Kahan-compensated updates of bfloat16 "
            "weights (load the model in bfloat16) and gradients released into the update on "
            "steps that do not refresh the Fisher factors, where the run allows it (not with "
            "max_grad_norm > 0, gradient accumulation, the elastic batch, fp16 or several "
            "processes: the log says which and what it costs). " + _NEEDS_ADAFISHER
        },
    )

    def __post_init__(self) -> None:
        name = str(getattr(self.optim, "value", self.optim))
        ours = name.lower() in OPTIMIZERS
        if ours:
            self.optim = name.lower()
        elif name not in {o.value for o in OptimizerNames}:
            choices = sorted(OPTIMIZERS) + sorted(o.value for o in OptimizerNames)
            # transformers has dozens of names: point to them rather than list them
            raise ValueError(
                f"TriAccelArguments.optim={name!r} is not a known optimizer;"
                f"{did_you_mean(name, choices)} hf_triaccel's are {', '.join(sorted(OPTIMIZERS))}, "
                "transformers' those of transformers.training_args.OptimizerNames"
            )
        self._check_fields(ours)
        if self.logging_nan_inf_filter is None:
            self.logging_nan_inf_filter = False if ours else _STOCK["logging_nan_inf_filter"]
        if not ours:
            if self.learning_rate is None:
                self.learning_rate = STOCK_DEFAULT_LR
            super().__post_init__()
            return
        # the DataLoader warns about pinned memory without an accelerator, where it does nothing
        self.dataloader_pin_memory = self.dataloader_pin_memory and accelerator_available()
        # the parent validates optim against its own names: give it one for the check
        chosen, self.optim = self.optim, OptimizerNames.ADAMW_TORCH.value
        try:
            super().__post_init__()
        finally:
            self.optim = chosen
        if self.deepspeed:
            raise ValueError(
                f"TriAccelArguments.optim={chosen!r} does not support deepspeed: use FSDP2 "
                "(fsdp with fsdp_config={'version': 2}), DDP or a single device"
            )
        fsdp_version = int((self.fsdp_config or {}).get("version", 2)) if self.fsdp else 2
        if fsdp_version != 2:
            raise ValueError(
                f"TriAccelArguments.optim={chosen!r} does not support FSDP version "
                f"{fsdp_version}: use FSDP2 (fsdp_config={{'version': 2}}), DDP or a single device"
            )
        if self.fsdp:
            check_fsdp_features(
                self.triaccel_precision, self.triaccel_lr_steering, "TriAccelArguments.triaccel_"
            )

    def _check_fields(self, ours: bool) -> None:
        plugin_from_args(self)  # the plugin's checks, naming this class's fields
        checks = [
            ("elastic_min_micro_batch", self.elastic_min_micro_batch >= 1, "needs >= 1"),
            (
                "elastic_target_fraction",
                0.0 < self.elastic_target_fraction <= 1.0,
                "must lie in (0, 1]",
            ),
            ("triaccel_precision", ours or not self.triaccel_precision, "needs adafisher(w)"),
            ("triaccel_lr_steering", ours or not self.triaccel_lr_steering, "needs adafisher(w)"),
            ("triaccel_low_memory", ours or not self.triaccel_low_memory, "needs adafisher(w)"),
            (
                "learning_rate",
                self.learning_rate is not None or not self.deepspeed,
                "set it with deepspeed, whose configuration is filled from it",
            ),
        ]
        for name, ok, why in checks:
            if not ok:
                if why == "needs adafisher(w)":
                    why = (
                        "needs optim adafisher or adafisherw (its signals come from the Fisher "
                        f"factors), got optim={self.optim!r}"
                    )
                raise ValueError(f"TriAccelArguments.{name}={getattr(self, name)!r}: {why}")

    @property
    def uses_adafisher(self) -> bool:
        """Whether ``optim`` names one of hf_triaccel's optimizers."""
        return uses_adafisher(self)

    @property
    def uses_elastic_batch(self) -> bool:
        """Whether the elastic micro-batch is on (``elastic_batch`` or
        ``auto_find_batch_size``)."""
        return bool(self.elastic_batch or self.auto_find_batch_size)

    def to_plugin(self) -> TriAccelPlugin:
        """The :class:`TriAccelPlugin` these arguments describe (learning rate resolved).

        Example:
            >>> TriAccelArguments(output_dir="out", adafisher_update_every=50).to_plugin()
            ... # doctest: +ELLIPSIS
            TriAccelPlugin(lr=0.012, beta=0.9, damping=0.001, gamma=0.8, update_every=50, ...)
        """
        if not self.uses_adafisher:
            raise ValueError(f"optim={self.optim!r} is not an hf_triaccel optimizer")
        return plugin_from_args(self)


ARGUMENT_SETTINGS: dict[str, str] = {
    f.name: _DECLARED[f] for f in dataclasses.fields(TriAccelArguments) if f in _DECLARED
}
"""TriAccelArguments field -> TriAccelPlugin field, read from the declarations above."""


def plugin_from_args(args: TrainingArguments) -> TriAccelPlugin:
    """The :class:`TriAccelPlugin` that ``args`` describe, learning rate resolved; the
    settings ``args`` lacks (a TRL config) take their defaults. Errors name the argument.

    Example:
        >>> plugin_from_args(TriAccelArguments(output_dir="out", weight_decay=0.1)).weight_decay
        0.1
    """
    values = {name: setting(args, argument) for argument, name in ARGUMENT_SETTINGS.items()}
    values["lr"] = resolve_learning_rate(args)
    if values["channels_last"] is None:  # unset: on with AdaFisher, as the plugin's default
        del values["channels_last"]
    values["optimizer"] = optim_name(args) if uses_adafisher(args) else "adafisherw"
    values.update(low_memory_settings(args))
    names = {name: argument for argument, name in ARGUMENT_SETTINGS.items()}
    return TriAccelPlugin.from_values(values, owner="TriAccelArguments", names=names)


# "TriAccelArguments.adafisher_gamma=2.0: ..." or "TrainingArguments.x=...": a field, its value
_FIELD_VALUE = re.compile(r"\b(?:TriAccel|Training)Arguments\.(\w+)=")


def flag_message(error: Exception) -> str:
    """An error raised while the arguments are built, as a command line reads it: on one
    line, each field named as its flag.

    Example:
        >>> flag_message(ValueError("TriAccelArguments.adafisher_gamma=2.0: needs 0 < gamma < 1"))
        '--adafisher_gamma 2.0: needs 0 < gamma < 1'
    """
    return " ".join(_FIELD_VALUE.sub(r"--\1 ", str(error)).split())


class TriAccelArgumentParser(HfArgumentParser):
    """``HfArgumentParser`` whose errors are one line naming the flag, with the closest
    flag suggested for an unknown one, and exit status 2 (argparse's usage error).

    A value that fails a check when the arguments are built (``--adafisher_gamma 2``), a
    value of the wrong type, an unknown or misspelt flag: each prints
    ``PROG: error: ...`` and exits, without argparse's usage text (every field of
    ``TrainingArguments`` is a flag: ``--help`` lists them) or a traceback.

    Example:
        >>> parser = TriAccelArgumentParser(TriAccelArguments, prog="train.py")
        >>> (args,) = parser.parse_args_into_dataclasses(["--output_dir", "out", "--optim", "sgd"])
        >>> optim_name(args)
        'sgd'
        >>> parser.parse_args_into_dataclasses(["--output_dir", "out", "--adafisher_gamma", "2"])
        Traceback (most recent call last):
        ...
        SystemExit: 2
    """

    def error(self, message: str) -> NoReturn:
        """Prints ``PROG: error: MESSAGE`` on one line and exits with status 2."""
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")

    def parse_args_into_dataclasses(
        self,
        args: Sequence[str] | None = None,
        return_remaining_strings: bool = False,
        **kwargs: Any,
    ) -> tuple[Any, ...]:
        """``HfArgumentParser.parse_args_into_dataclasses``, its errors one line each
        (see the class).

        Raises:
            SystemExit: a flag that is unknown, or whose value cannot work.
        """
        try:
            *outputs, remaining = super().parse_args_into_dataclasses(
                args, return_remaining_strings=True, **kwargs
            )
        except ValueError as err:
            self.error(flag_message(err))
        if return_remaining_strings:
            return (*outputs, remaining)
        if remaining:
            flags = [o for action in self._actions for o in action.option_strings]
            hints = "".join(did_you_mean(w, flags) for w in remaining if w.startswith("-"))
            self.error(f"unrecognised arguments: {' '.join(remaining)}" + (hints and f";{hints}"))
        return tuple(outputs)
