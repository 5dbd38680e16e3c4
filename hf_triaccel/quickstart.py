"""A short, real training run: a CIFAR ResNet-18 from timm trained with AdaFisherW.

Run it as::

    python -m hf_triaccel.quickstart                          # embedded CIFAR-10 slice
    python -m hf_triaccel.quickstart --data uoft-cs/cifar10   # full data set from the Hub
    python -m hf_triaccel.quickstart --data ./cifar10 --epochs 10 --optimizer adamw

The images are decoded once into a uint8 tensor on the device and batched, augmented and
normalised there (:class:`~hf_triaccel.data.images.GPUBatchLoader`); the learning rate
follows a one-cycle schedule. It prints the training loss and accuracy of every epoch, the
test accuracy and the total time.

On a CPU the default run is shortened to :data:`CPU_DEFAULT_STEPS` optimizer steps
(``--max_steps`` overrides that): on two otherwise idle cores it took about 2.5 minutes and
reached about 26% test accuracy on the embedded slice (chance is 10%).
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from hf_triaccel.curvature.signals import SignalTracker
from hf_triaccel.data.images import GPUBatchLoader, ImageTensors, load_image_dataset
from hf_triaccel.integrations.plugin import TriAccelPlugin
from hf_triaccel.integrations.timm_models import create_cifar_model
from hf_triaccel.optim.adafisher import AdaFisher, AdaFisherW
from hf_triaccel.precision import PrecisionController

OPTIMIZERS = ("adafisherw", "adafisher", "adamw")
# (learning rate, weight decay) per optimizer, measured on CIFAR-10 with a ResNet-18,
# batch 512, 30 epochs, one-cycle (BENCHMARKS.md): the published AdaFisher lr of 1e-3
# underfits there
DEFAULT_HYPERPARAMETERS = {
    "adafisherw": (1e-2, 5e-4),
    "adafisher": (3e-3, 5e-4),
    "adamw": (3e-3, 5e-2),
}
CPU_DEFAULT_STEPS = 50
# compute precision of a training run: bf16 autocast, plain float32, or bf16 autocast with
# per-module precision chosen by the PrecisionController (see precision_autocast)
PRECISION_MODES = ("bf16", "fp32", "adaptive")


def build_optimizer(
    name: str, model: nn.Module, lr: float, weight_decay: float, impl: str | None = None
) -> torch.optim.Optimizer:
    """The optimizer ``name`` (one of :data:`OPTIMIZERS`) for every parameter of ``model``.

    Example:
        >>> opt = build_optimizer("adafisherw", nn.Linear(4, 2), lr=1e-3, weight_decay=5e-4)
    """
    if name == "adafisherw":
        return AdaFisherW.from_model(model, lr=lr, weight_decay=weight_decay, impl=impl)
    if name == "adafisher":
        return AdaFisher.from_model(model, lr=lr, weight_decay=weight_decay, impl=impl)
    if name == "adamw":
        fused = next(model.parameters()).is_cuda
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, fused=fused)
    raise ValueError(f"unknown optimizer {name!r}; choose one of {OPTIMIZERS}")


def _check_precision(precision: str) -> None:
    if precision not in PRECISION_MODES:
        raise ValueError(f"unknown precision {precision!r}; choose one of {PRECISION_MODES}")


def precision_autocast(device: torch.device, precision: str) -> torch.autocast:
    """The autocast region that training and evaluation steps run in under ``precision``.

    ``"bf16"`` and ``"adaptive"`` run the model under bf16 autocast: the adaptive
    controller's hooks open each decided module's own region inside it, and modules
    without a decision follow it. ``"fp32"`` runs without autocast (TF32 stays as torch's
    flags set it).

    Example:
        >>> with precision_autocast(torch.device("cpu"), "bf16"):
        ...     (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
        torch.bfloat16
    """
    _check_precision(precision)
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision != "fp32")


def build_precision(
    precision: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    signals_every: int | None = None,
) -> tuple[SignalTracker, PrecisionController] | None:
    """For ``"adaptive"``, the signal tracker and precision controller of ``model``, built
    the way ``TriAccelTrainer`` builds them (:meth:`TriAccelPlugin.build_precision` under
    bf16 mixed precision: no fp16 modules); ``None`` for the static precisions.

    Args:
        precision: one of :data:`PRECISION_MODES`.
        model: the model the optimizer's Fisher collector was built on.
        optimizer: AdaFisher or AdaFisherW.
        signals_every: optimizer steps between two rankings (default: the plugin's).

    Raises:
        ValueError: ``"adaptive"`` with an optimizer other than AdaFisher / AdaFisherW,
            whose Fisher factors the per-module signals are read from.

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
        >>> optimizer = build_optimizer("adafisherw", model, lr=1e-3, weight_decay=0.0)
        >>> signals, controller = build_precision("adaptive", model, optimizer)
        >>> controller.decisions
        {'1': 'fp32'}
    """
    _check_precision(precision)
    if precision != "adaptive":
        return None
    if not isinstance(optimizer, AdaFisher):
        raise ValueError(
            "adaptive precision needs optimizer adafisher or adafisherw: its per-module "
            f"signals come from their Fisher factors, got {type(optimizer).__name__}"
        )
    plugin = TriAccelPlugin(precision=True, signals_every=signals_every)
    return plugin.build_precision(model, optimizer, fp16=False)


@torch.no_grad()
def evaluate(model: nn.Module, loader: GPUBatchLoader, precision: str) -> float:
    """Top-1 accuracy of ``model`` over one pass of ``loader``, computed in ``precision``
    (one of :data:`PRECISION_MODES`, as in training; adaptive precision's hooks stay on).

    Example:
        >>> accuracy = evaluate(model, test_loader, "fp32")  # doctest: +SKIP
    """
    model.eval()
    correct = torch.zeros((), dtype=torch.long, device=loader.data.device)
    for images, labels in loader:
        with precision_autocast(images.device, precision):
            correct += (model(images).argmax(dim=1) == labels).sum()
    model.train()
    return correct.item() / len(loader.data)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command-line flags (see ``python -m hf_triaccel.quickstart --help``)."""
    parser = argparse.ArgumentParser(
        prog="python -m hf_triaccel.quickstart",
        description="Train a CIFAR ResNet-18 (timm) with AdaFisherW for a few minutes.",
    )
    parser.add_argument(
        "--data",
        default="embedded",
        help="'embedded' (CIFAR-10 slice in the package), a folder of {split}.parquet files, "
        "a .parquet file or a Hub dataset id such as uoft-cs/cifar10",
    )
    parser.add_argument("--test_split", default="test", help="split to report accuracy on")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument(
        "--max_steps",
        type=int,
        default=None,
        help=f"stop after this many optimizer steps (CPU default: {CPU_DEFAULT_STEPS})",
    )
    parser.add_argument("--batch_size", type=int, default=128)
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adafisherw")
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate")
    parser.add_argument("--weight_decay", type=float, default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--bf16",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="bf16 autocast (default: on for CUDA)",
    )
    args = parser.parse_args(argv)
    default_lr, default_wd = DEFAULT_HYPERPARAMETERS[args.optimizer]
    args.lr = default_lr if args.lr is None else args.lr
    args.weight_decay = default_wd if args.weight_decay is None else args.weight_decay
    args.device = torch.device(args.device)
    args.bf16 = args.device.type == "cuda" if args.bf16 is None else args.bf16
    if args.max_steps is None and args.device.type == "cpu":
        args.max_steps = CPU_DEFAULT_STEPS
    return args


def train_loop(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: GPUBatchLoader,
    *,
    total_steps: int,
    lr: float,
    precision: str,
    label_smoothing: float = 0.0,
    log: Callable[[str], None] | None = None,
) -> tuple[int, list[dict[str, float]]]:
    """Trains ``total_steps`` steps under a one-cycle schedule peaking at ``lr``, computing
    in ``precision`` (one of :data:`PRECISION_MODES`; for ``"adaptive"``,
    :func:`build_precision` has hooked the model and the optimizer).

    Loss and accuracy sums stay on the device; the one read-back per epoch also makes
    each epoch's ``seconds`` cover all of its device work.

    Returns:
        The steps taken and, per epoch, ``train_loss``, ``train_accuracy``, ``samples``
        and ``seconds``.
    """
    # AdaFisher has no Adam-style betas to cycle; keep momentum fixed for every optimizer
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=lr, total_steps=total_steps, cycle_momentum=False
    )
    device = loader.data.device
    log = log or tqdm.write
    epochs: list[dict[str, float]] = []
    step = 0
    progress = tqdm(total=total_steps, desc="training", unit="step")
    for epoch in range(math.ceil(total_steps / len(loader))):
        start = time.perf_counter()
        loss_sum = torch.zeros((), device=device)
        correct = torch.zeros((), dtype=torch.long, device=device)
        seen = 0
        for images, labels in loader:
            with precision_autocast(device, precision):
                logits = model(images)
                loss = F.cross_entropy(logits, labels, label_smoothing=label_smoothing)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            loss_sum += loss.detach() * len(labels)
            correct += (logits.argmax(dim=1) == labels).sum()
            seen += len(labels)
            step += 1
            progress.update()
            if step == total_steps:
                break
        epochs.append(
            {
                "epoch": epoch + 1,
                "train_loss": loss_sum.item() / seen,
                "train_accuracy": correct.item() / seen,
                "samples": seen,
                "seconds": time.perf_counter() - start,
            }
        )
        log(
            f"epoch {epoch + 1}: train loss {epochs[-1]['train_loss']:.4f}, "
            f"train accuracy {100 * epochs[-1]['train_accuracy']:.2f}%, "
            f"{epochs[-1]['seconds']:.1f} s"
        )
    progress.close()
    return step, epochs


def train(
    args: argparse.Namespace, train_data: ImageTensors, test_data: ImageTensors
) -> dict[str, Any]:
    """Trains a fresh ``resnet18_cifar`` as ``args`` says; returns the run's figures."""
    torch.manual_seed(args.seed)
    device = args.device
    model = create_cifar_model("resnet18_cifar", num_classes=train_data.num_classes).to(device)
    optimizer = build_optimizer(args.optimizer, model, args.lr, args.weight_decay)
    mean, std = train_data.channel_stats()
    train_loader = GPUBatchLoader(
        train_data,
        args.batch_size,
        shuffle=True,
        augment=True,
        drop_last=True,
        seed=args.seed,
        device=device,
        mean=mean,
        std=std,
    )
    test_loader = GPUBatchLoader(test_data, 2 * args.batch_size, device=device, mean=mean, std=std)
    steps_per_epoch = len(train_loader)
    if steps_per_epoch == 0:
        raise ValueError(f"batch size {args.batch_size} exceeds the {len(train_data)} samples")
    total_steps = args.epochs * steps_per_epoch
    if args.max_steps is not None:
        total_steps = min(total_steps, args.max_steps)
    print(
        f"resnet18_cifar, {args.optimizer} (lr {args.lr:g}, weight decay {args.weight_decay:g}), "
        f"{len(train_data)} training images, batch {args.batch_size}, {total_steps} steps, "
        f"{device}{', bf16' if args.bf16 else ''}"
    )
    precision = "bf16" if args.bf16 else "fp32"
    step, epochs = train_loop(
        model, optimizer, train_loader, total_steps=total_steps, lr=args.lr, precision=precision
    )
    return {
        "steps": step,
        "epochs": epochs,
        "test_accuracy": evaluate(model, test_loader, precision),
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs the quickstart; returns its figures (also printed).

    Example:
        >>> results = main(["--max_steps", "20", "--device", "cpu"])  # doctest: +SKIP
        >>> results["test_accuracy"]  # doctest: +SKIP
    """
    start = time.perf_counter()
    args = parse_args(argv)
    train_data = load_image_dataset(args.data, "train")
    test_data = load_image_dataset(args.data, args.test_split)
    results = train(args, train_data, test_data)
    results["seconds"] = time.perf_counter() - start
    print(f"test accuracy: {100 * results['test_accuracy']:.2f}% ({len(test_data)} images)")
    print(f"total time: {results['seconds']:.1f} s")
    return results


if __name__ == "__main__":
    main()
