"""A recipe's configuration (``configs/<name>.yaml``) and the command line of ``train.py``.

A configuration names the data set, its class count, the timm model, the splits and the
recipe's quick form (``--quick``: the model and run sized for a CPU). The flags are
:class:`RecipeArguments` plus every ``TrainingArguments`` / ``TriAccelArguments`` field,
with the defaults of :func:`recipe_defaults` (and :func:`quick_defaults` under
``--quick``); they are checked here, before any data is read, and a flag that cannot work
ends the command with one line that names it.

Example:
    >>> config = RecipeConfig.load("cifar10_resnet18")
    >>> config.dataset, config.num_classes, config.model
    ('uoft-cs/cifar10', 10, 'resnet18_cifar')
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import socket
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
import yaml
from transformers.hf_argparser import string_to_bool

from hf_triaccel import TriAccelArguments
from hf_triaccel.data import is_hub_dataset_id
from hf_triaccel.data.loading import path_in_message
from hf_triaccel.integrations.checkpoints import RESUME_OR_START
from hf_triaccel.integrations.trainer_args import TriAccelArgumentParser

CONFIGS_DIR = Path(__file__).resolve().parent / "configs"
EMBEDDED = "embedded"
BASELINE_OPTIM = "adamw_torch_fused"
# the environment variables that make huggingface_hub and datasets read their caches only
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")


class UsageError(ValueError):
    """Input a recipe cannot train on (data of another class count, a data set that cannot
    be reached), found before any training: the script prints it in one line and exits
    with status 2, as for a bad flag."""


def hub_unreachable(timeout: float = 5.0) -> str | None:
    """Why the Hugging Face Hub cannot be reached from here, or ``None``.

    One TCP connection to the Hub's host (``HF_ENDPOINT``'s, else huggingface.co) answers
    in milliseconds where there is no network, where ``datasets`` would retry for half a
    minute before it fails. ``None`` too when the caches are asked for
    (``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE``: loading reads them) or a proxy is
    set (the direct connection says nothing about it).

    """
    if any(os.environ.get(name, "").strip() not in ("", "0") for name in OFFLINE_VARIABLES):
        return None
    if any(os.environ.get(name) for name in PROXY_VARIABLES):
        return None
    endpoint = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = endpoint.hostname or "huggingface.co", endpoint.port or 443
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as exc:
        return f"{host}: {exc.strerror or exc}"
    return None


def first_line(error: BaseException, limit: int = 160) -> str:
    """An error's type and the first line of its message, cut at ``limit`` characters.

    Example:
        >>> first_line(ConnectionError("Couldn't reach 'a/b' on the Hub\\nmore"))
        "ConnectionError: Couldn't reach 'a/b' on the Hub"
    """
    lines = str(error).strip().splitlines() or [""]
    text = f"{type(error).__name__}: {lines[0]}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def dataset_tag(dataset: str) -> str:
    """The part of a default output folder's name that names the data: ``embedded``, a
    Hub id with ``--`` for its slash, or a local folder's name with a short hash of its
    absolute path (two folders of one name get two output folders). The same data gives
    the same tag on every run, so that a resumed or requeued run finds its folder again.

    Example:
        >>> dataset_tag("embedded"), dataset_tag("uoft-cs/cifar100")
        ('embedded', 'uoft-cs--cifar100')
        >>> dataset_tag("/data/cifar10") == dataset_tag("/data/../data/cifar10")
        True
    """
    if dataset == EMBEDDED:
        return EMBEDDED
    local = Path(dataset).expanduser()
    if local.exists() or not is_hub_dataset_id(dataset):
        resolved = str(local.resolve())
        return f"{local.resolve().name}-{hashlib.sha1(resolved.encode()).hexdigest()[:6]}"
    return dataset.replace("/", "--")


def output_folder(name: str, dataset: str, default_dataset: str, quick: bool) -> str:
    """The default output folder: ``outputs/NAME`` (``NAME-quick`` under ``--quick``),
    with :func:`dataset_tag` appended for data other than the recipe's own.

    Example:
        >>> output_folder("cifar10_resnet18", "uoft-cs/cifar10", "uoft-cs/cifar10", False)
        'outputs/cifar10_resnet18'
        >>> output_folder("cifar10_resnet18", "embedded", "uoft-cs/cifar10", True)
        'outputs/cifar10_resnet18-quick-embedded'
    """
    base = f"{name}-quick" if quick else name
    if dataset != default_dataset:
        base = f"{base}-{dataset_tag(dataset)}"
    return os.path.join("outputs", base)


# flags that are other names of a field
FLAG_ALIASES = {"lr": "learning_rate", "epochs": "num_train_epochs"}


def given_flags(argv: Sequence[str]) -> frozenset[str]:
    """The settings a command line sets, as field names (no prefix of a flag is
    accepted, so every flag names its field).

    Example:
        >>> sorted(given_flags(["--eval-steps", "5", "--lr=0.1", "x", "--epochs", "2"]))
        ['eval_steps', 'learning_rate', 'num_train_epochs']
    """
    names = (a[2:].split("=")[0].replace("-", "_") for a in argv if a.startswith("--"))
    return frozenset(FLAG_ALIASES.get(name, name) for name in names)


@dataclass(frozen=True)
class RecipeConfig:
    """What a recipe trains: a data set, its splits and class count, and a timm model.

    Attributes:
        name: the recipe's name (its config file's stem; default output ``outputs/{name}``).
        title: the data set's display name, for the model card.
        dataset: the Hub data set (``--dataset`` can name a local copy instead).
        num_classes: classes the data must have: other data is refused.
        model: the timm model name (``--model`` overrides it).
        train_split: the training split.
        eval_split: the split evaluated during training and reported.
        quick_model: under ``--quick``, the timm model trained instead of ``model``, for a
            model that no argument makes small (``None``: ``model``).
        quick_model_args: under ``--quick``, the timm arguments that make the model small
            enough for a CPU (empty: the model as it is).
        quick_steps: optimizer steps under ``--quick``.

    Example:
        >>> RecipeConfig("c100", "CIFAR-100", "uoft-cs/cifar100", 100, "resnet18_cifar").eval_split
        'test'
    """

    name: str
    title: str
    dataset: str
    num_classes: int
    model: str
    train_split: str = "train"
    eval_split: str = "test"
    quick_model: str | None = None
    quick_model_args: dict[str, Any] = field(default_factory=dict)
    quick_steps: int = 300

    @classmethod
    def load(cls, recipe: str) -> RecipeConfig:
        """The configuration ``configs/{recipe}.yaml``, or the YAML file at path ``recipe``.

        Raises:
            ValueError: no such recipe (the message lists them), or a field missing or unknown.
        """
        path = Path(recipe)
        if path.suffix not in (".yaml", ".yml"):
            path = CONFIGS_DIR / f"{recipe}.yaml"
        if not path.is_file():
            raise ValueError(f"--recipe {recipe!r}: no such recipe; choose one of {available()}")
        entries = yaml.safe_load(path.read_text()) or {}
        names = {f.name for f in dataclasses.fields(cls)} - {"name"}
        required = {
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        }
        unknown, missing = set(entries) - names, required - {"name"} - set(entries)
        if unknown or missing:
            raise ValueError(
                f"recipe config {path}: unknown fields {sorted(unknown)}, missing "
                f"{sorted(missing)}; its fields are {sorted(names)}"
            )
        return cls(name=path.stem, **entries)


def available() -> list[str]:
    """The recipes in ``configs/``.

    Example:
        >>> "cifar100_resnet18" in available()
        True
    """
    return sorted(p.stem for p in CONFIGS_DIR.glob("*.yaml"))


@dataclass
class ReportArguments:
    """The flags of what a recipe run writes besides the model, shared by every recipe."""

    plot: bool = field(
        default=True, metadata={"help": "Write the PNG plots (--no_plot to skip them)."}
    )
    carbon_intensity: float = field(
        default=475.0,
        metadata={
            "help": "Grid carbon intensity in g CO2eq per kWh, to turn the measured GPU "
            "energy into emissions (default: an assumed world-average grid mix)."
        },
    )
    geographical_location: str | None = field(
        default=None, metadata={"help": "Where the run trained, for the model card."}
    )


@dataclass
class RecipeArguments(ReportArguments):
    """The recipe's own flags; every ``TriAccelArguments`` field is a flag too.

    Example:
        >>> RecipeArguments(recipe="cifar10_resnet18", baseline=True).baseline_learning_rate
        0.024
    """

    recipe: str | None = field(
        default=None,
        metadata={
            "help": f"A recipe name ({', '.join(available())}) or a YAML config path; "
            "recipes/<name>.py sets it."
        },
    )
    quick: bool = field(
        default=False,
        metadata={
            "help": "The recipe's quick form, sized for a CPU: its model made small, batches "
            "of 64, a few hundred steps, outputs in outputs/<recipe>-quick. Any flag still wins."
        },
    )
    dataset: str | None = field(
        default=None,
        metadata={
            "help": "Hub data set id (owner/name), or a local folder of {split}.parquet files "
            "(or Hub shards) with the Hub's columns, or 'embedded' (the CIFAR-10 slice in "
            "the package). Default: the recipe's Hub data set."
        },
    )
    hub_dataset_id: str | None = field(
        default=None,
        metadata={
            "help": "The Hub data set a local --dataset folder is a copy of, named in the "
            "model card; without it the card names the folder."
        },
    )
    image_column: str | None = field(
        default=None, metadata={"help": "Image column (default: img or image)."}
    )
    label_column: str | None = field(
        default=None, metadata={"help": "Label column (default: label, fine_label or labels)."}
    )
    model: str | None = field(default=None, metadata={"help": "timm model name."})
    baseline: bool = field(
        default=False,
        metadata={
            "help": f"Also train the plain baseline ({BASELINE_OPTIM}, same schedule, batch "
            "and precision) first, into OUTPUT_DIR/baseline, and compare with it."
        },
    )
    # the baseline's values: AdamW's best of the CIFAR-10 / CIFAR-100 accuracy grid
    # (benchmarks/results/chosen.json)
    baseline_learning_rate: float = field(
        default=2.4e-2, metadata={"help": "Learning rate of the --baseline run."}
    )
    baseline_weight_decay: float = field(
        default=0.1, metadata={"help": "Weight decay of the --baseline run."}
    )
    compare_to: str | None = field(
        default=None,
        metadata={
            "help": "A baseline run's results.json (or its folder) to compare with, instead "
            "of training the baseline again."
        },
    )


def recipe_defaults(config: RecipeConfig) -> dict[str, Any]:
    """The defaults a recipe gives its flags; any flag given on the command line wins.

    The optimizer settings are those the CIFAR-10 / CIFAR-100 accuracy grid with a
    ResNet-18 at batch 512 chose (``benchmarks/results/chosen.json``, BENCHMARKS.md). bf16
    is on where CUDA is (``--bf16 false`` for a GPU without bf16).

    Example:
        >>> defaults = recipe_defaults(RecipeConfig.load("cifar10_resnet18"))
        >>> defaults["optim"], defaults["learning_rate"], defaults["per_device_train_batch_size"]
        ('adafisher', 0.012, 512)
    """
    return {
        "dataset": config.dataset,
        "model": config.model,
        "optim": "adafisher",
        "learning_rate": 1.2e-2,
        "weight_decay": 5e-4,
        "per_device_train_batch_size": 512,
        # whole batches only: under --torch_compile a batch of another size compiles (and
        # with CUDA graphs records) the step again; 1000 divides the 10,000 test images
        "per_device_eval_batch_size": 1000,
        "dataloader_drop_last": True,
        "num_train_epochs": 30.0,
        # one-cycle-like: linear warm-up over the first 30% of the steps, then cosine decay
        "lr_scheduler_type": "cosine",
        "warmup_steps": 0.3,
        "label_smoothing_factor": 0.1,
        "bf16": torch.cuda.is_available(),
        "eval_strategy": "epoch",
        "logging_steps": 20,
        # a checkpoint every epoch would add its write time to the measured training time
        "save_strategy": "no",
        # The loss is a per-process mean: DDP's gradient averaging then makes it the global
        # mean. With batch-wide counting across processes, the Trainer would expect a
        # per-process loss scaled by the process count, which the plain-model loss is not.
        "average_tokens_across_devices": False,
        # every parameter of these models gets a gradient: skip DDP's per-step graph search
        "ddp_find_unused_parameters": False,
    }


def quick_defaults(config: RecipeConfig) -> dict[str, Any]:
    """The defaults ``--quick`` gives on top of :func:`recipe_defaults`: the quick form's
    model (made small by :func:`model_args`), batches of 64 for ``config.quick_steps``
    steps (into ``outputs/{name}-quick...``: :func:`output_folder`).

    Example:
        >>> quick = quick_defaults(RecipeConfig.load("cifar10_resnet18"))
        >>> quick["model"], quick["per_device_train_batch_size"], quick["max_steps"]
        ('resnet18_cifar', 64, 300)
    """
    return {
        "model": config.quick_model or config.model,
        "per_device_train_batch_size": 64,
        "per_device_eval_batch_size": 500,
        "max_steps": config.quick_steps,
    }


def model_args(config: RecipeConfig, recipe_args: RecipeArguments) -> dict[str, Any]:
    """The timm arguments the model is built with: the quick form's, under ``--quick`` for
    the quick form's model (they would not fit another ``--model``), else none.

    Example:
        >>> config = RecipeConfig.load("cifar10_resnet18")
        >>> model_args(config, RecipeArguments(quick=True, model=config.model))["layers"]
        [1, 1, 1, 1]
    """
    own_model = recipe_args.model == (config.quick_model or config.model)
    return dict(config.quick_model_args) if recipe_args.quick and own_model else {}


def parse_args(
    argv: Sequence[str] | None = None, recipe: str | None = None
) -> tuple[RecipeConfig, RecipeArguments, TriAccelArguments]:
    """Parses the flags (``sys.argv[1:]`` by default) over the recipe's defaults and checks
    them; ``--epochs`` is another name for ``--num_train_epochs``.

    Args:
        argv: the command line's flags.
        recipe: the recipe, for the ``recipes/<name>.py`` scripts; without it ``--recipe``
            names it.

    Raises:
        SystemExit: a flag that cannot work, said in one line that names it (an unknown
            recipe, a ``--dataset`` that is neither ``embedded``, an existing path nor a
            Hub id, a value out of range, flags that contradict each other).

    Example:
        >>> config, recipe_args, args = parse_args(
        ...     ["--recipe", "cifar100_resnet18", "--epochs", "5", "--baseline"])
        >>> config.num_classes, recipe_args.baseline, args.num_train_epochs, args.optim
        (100, True, 5.0, 'adafisher')
        >>> args = parse_args(["--quick"], recipe="cifar10_resnet18")[2]
        >>> args.per_device_train_batch_size, args.max_steps
        (64, 300)
    """
    # the recipe and --quick first: they give the other flags their defaults
    # no flag is taken for a longer one it begins (argparse's prefix matching): an unknown
    # flag gets the closest one suggested instead
    head = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    head.add_argument("--recipe", default=recipe)
    head.add_argument("--quick", nargs="?", const=True, default=False, type=string_to_bool)
    head.add_argument("--dataset")
    known = head.parse_known_args(argv)[0]
    parser = TriAccelArgumentParser(
        (RecipeArguments, TriAccelArguments),
        description="Train a timm image classifier.",
        allow_abbrev=False,
    )
    try:
        config = RecipeConfig.load(known.recipe) if known.recipe else None
    except ValueError as exc:
        parser.error(str(exc))
    parser.add_argument(
        "--epochs", dest="num_train_epochs", type=float, help="Same as --num_train_epochs."
    )
    if config is None:
        parser.description += " --recipe NAME --help lists a recipe's defaults."
    else:
        defaults = recipe_defaults(config) | (quick_defaults(config) if known.quick else {})
        dataset = known.dataset or config.dataset
        defaults["output_dir"] = output_folder(config.name, dataset, config.dataset, known.quick)
        parser.set_defaults(recipe=known.recipe, **defaults)
        length = (
            f"{defaults['max_steps']} steps"
            if known.quick
            else f"{defaults['num_train_epochs']:g} epochs"
        )
        parser.description = (
            f"Train {config.model} on {config.title} with hf_triaccel. The defaults below are "
            f"this recipe's{' quick form' if known.quick else ''}: batch "
            f"{defaults['per_device_train_batch_size']}, {length}, {defaults['optim']} at "
            f"learning rate {defaults['learning_rate']:g}, weight decay "
            f"{defaults['weight_decay']:g}."
        )
    # preemptible by default: a signal stops with a checkpoint, the same command resumes
    parser.set_defaults(preemption_signals="SIGTERM", resume_from_checkpoint=RESUME_OR_START)
    recipe_args, args = parser.parse_args_into_dataclasses(args=argv)
    if config is None:
        parser.error(f"--recipe: give one of {available()}, or the path of a YAML config")
    try:
        check_arguments(recipe_args, args)
    except ValueError as exc:
        parser.error(str(exc))
    return config, recipe_args, args


def check_arguments(recipe_args: RecipeArguments, args: TriAccelArguments) -> None:
    """Refuses what cannot work before any data is read; warns once about settings that
    run but do not do what they say on this machine."""
    dataset = recipe_args.dataset
    if not (
        dataset == EMBEDDED or Path(dataset).expanduser().exists() or is_hub_dataset_id(dataset)
    ):
        raise ValueError(
            f"--dataset {path_in_message(dataset)}: no such file or folder, and "
            "not a Hub data set id of the form owner/name (e.g. uoft-cs/cifar10); a local "
            f"folder needs its path, or '{EMBEDDED}' for the slice in the package"
        )
    if recipe_args.hub_dataset_id is not None and not is_hub_dataset_id(recipe_args.hub_dataset_id):
        raise ValueError(
            f"--hub_dataset_id {recipe_args.hub_dataset_id!r}: a Hub id has the form owner/name"
        )
    if recipe_args.baseline and recipe_args.compare_to:
        raise ValueError("--baseline and --compare_to both name a baseline: give one of them")
    if args.device.type != "cpu":
        return
    if args.fp16:
        warnings.warn(
            "--fp16 on a CPU: float16 autocast there runs slower than fp32 and without a "
            "loss scaler; use --bf16 true or leave both off",
            stacklevel=2,
        )
    if getattr(args, "elastic_batch", False) or args.auto_find_batch_size:
        warnings.warn(
            "--elastic_batch / --auto_find_batch_size without a GPU: there is no device "
            "memory to follow, so the micro-batch stays per_device_train_batch_size",
            stacklevel=2,
        )
