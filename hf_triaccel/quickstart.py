"""The main job: AdaFisher beside AdamW on the same model, data, batches and schedule.

Run it as::

    python -m hf_triaccel.quickstart                           # embedded CIFAR-10 slice
    python -m hf_triaccel.quickstart --dataset uoft-cs/cifar10 # full data set from the Hub
    python -m hf_triaccel.quickstart --dataset ./cifar10 --epochs 10

Each optimizer trains a fresh copy of the same model (same seed, so the same initial
weights) on the same batches and augmentations, under a one-cycle learning-rate schedule
with its own measured peak learning rate and weight decay (each plan's own: the GPU's
from the accuracy grid of the full CIFAR-10, the CPU's from a grid of this very run). The
images are decoded once into a uint8 tensor on the device and batched, augmented and
normalised there (:class:`~hf_triaccel.data.images.GPUBatchLoader`). It prints each
run's test accuracy, training time and time per step side by side. On CUDA each optimizer
first runs :data:`CUDA_WARMUP_STEPS` steps on a throwaway model: kernel compilation and
cuDNN's algorithm search stay out of the timed run.

- On a GPU it trains the CIFAR recipes' model, timm ``resnet18_cifar``, for
  :data:`GPU_PLAN` epochs in bf16.
- On a CPU it trains a narrow ResNet-10 built by the same entry point (one block per
  stage, a quarter of the channels: :data:`CPU_MODEL_ARGS`) for :data:`CPU_PLAN` steps in
  fp32, so that both runs finish in about a minute on two cores.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from hf_triaccel.data import GPUBatchLoader, ImageTensors, load_image_dataset
from hf_triaccel.integrations.timm_models import create_cifar_model
from hf_triaccel.optim.adafisher import build_adafisher
from hf_triaccel.optim.config import AdaFisherConfig

OPTIMIZERS = ("adafisher", "adamw", "adafisherw")
COMPARED = ("adafisher", "adamw")
# the loss of the measured CIFAR-10 runs (BENCHMARKS.md)
LABEL_SMOOTHING = 0.1
CPU_MODEL_ARGS: dict[str, Any] = {
    "layers": (1, 1, 1, 1),
    "channels": (16, 32, 64, 128),
    "stem_width": 16,
}


@dataclass(frozen=True)
class Plan:
    """How long each optimizer trains (``epochs`` over the data, capped at ``max_steps``)
    and at what (peak learning rate, weight decay)."""

    batch_size: int
    epochs: int
    max_steps: int | None = None
    hyperparameters: Mapping[str, tuple[float, float]] = field(default_factory=dict)


# The GPU plan is the 15-epoch, batch-512 comparison of the time-to-accuracy grid on the
# full CIFAR-10 (benchmarks/results/chosen.json): AdaFisher's and AdamW's are its chosen
# values. AdaFisherW's is not from a grid: at 1e-2, batch 256, this run ended at chance.
GPU_PLAN = Plan(
    batch_size=512,
    epochs=15,
    hyperparameters={
        "adafisher": (1.2e-2, 5e-4),
        "adamw": (2.4e-2, 0.1),
        "adafisherw": (3e-3, 5e-4),
    },
)
# The CPU plan: the best of its own grid on the embedded slice (docs/benchmarks_history.md)
CPU_PLAN = Plan(
    batch_size=64,
    epochs=2,
    max_steps=100,
    hyperparameters={"adafisher": (3e-3, 5e-4), "adamw": (3e-2, 5e-2), "adafisherw": (3e-3, 5e-4)},
)
CUDA_WARMUP_STEPS = 5


def build_optimizer(
    name: str, model: nn.Module, lr: float, weight_decay: float
) -> torch.optim.Optimizer:
    """The optimizer ``name`` (one of :data:`OPTIMIZERS`) for every parameter of ``model``
    (AdaFisher and AdaFisherW from the package's builder).

    Example:
        >>> opt = build_optimizer("adafisherw", nn.Linear(4, 2), lr=1e-3, weight_decay=5e-4)
    """
    if name in ("adafisher", "adafisherw"):
        return build_adafisher(model, AdaFisherConfig(lr=lr, weight_decay=weight_decay), name)
    if name == "adamw":
        fused = next(model.parameters()).is_cuda
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, fused=fused)
    raise ValueError(f"unknown optimizer {name!r}; choose one of {OPTIMIZERS}")


def autocast(device: torch.device, bf16: bool) -> torch.autocast:
    """The region training and evaluation steps run in: bf16 autocast, or plain fp32.

    Example:
        >>> with autocast(torch.device("cpu"), bf16=True):
        ...     (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
        torch.bfloat16
    """
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)


@torch.no_grad()
def evaluate(model: nn.Module, loader: GPUBatchLoader, bf16: bool) -> float:
    """Top-1 accuracy of ``model`` over one pass of ``loader``.

    Example:
        >>> accuracy = evaluate(model, test_loader, bf16=False)  # doctest: +SKIP
    """
    model.eval()
    correct = torch.zeros((), dtype=torch.long, device=loader.data.device)
    for images, labels in loader:
        with autocast(images.device, bf16):
            correct += (model(images).argmax(dim=1) == labels).sum()
    model.train()
    return correct.item() / len(loader.data)


def train_loop(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: GPUBatchLoader,
    *,
    total_steps: int,
    lr: float,
    bf16: bool,
    label_smoothing: float = LABEL_SMOOTHING,
    max_grad_norm: float | None = None,
    log: Callable[[str], None] = tqdm.write,
    desc: str = "training",
    progress: bool = True,
) -> list[dict[str, float]]:
    """Trains ``total_steps`` steps under a one-cycle schedule peaking at ``lr``, with
    cross-entropy and ``label_smoothing``, the gradients' norm clipped to ``max_grad_norm``
    if given (as the Trainer clips); ``log`` gets a line per epoch, ``progress`` a bar.

    Loss and accuracy sums stay on the device: the one read-back per epoch makes each
    epoch's ``seconds`` cover all of its device work.

    Returns:
        Per epoch: ``train_loss``, ``train_accuracy``, ``samples`` and ``seconds``.
    """
    # AdaFisher has no Adam-style betas to cycle; keep momentum fixed for every optimizer
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=lr, total_steps=total_steps, cycle_momentum=False
    )
    device = loader.data.device
    epochs: list[dict[str, float]] = []
    step = 0
    bar = tqdm(total=total_steps, desc=desc, unit="step", leave=False, disable=not progress)
    for epoch in range(math.ceil(total_steps / len(loader))):
        start = time.perf_counter()
        loss_sum = torch.zeros((), device=device)
        correct = torch.zeros((), dtype=torch.long, device=device)
        seen = 0
        for images, labels in loader:
            with autocast(device, bf16):
                logits = model(images)
                loss = F.cross_entropy(logits, labels, label_smoothing=label_smoothing)
            loss.backward()
            if max_grad_norm is not None:
                nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            loss_sum += loss.detach() * len(labels)
            correct += (logits.argmax(dim=1) == labels).sum()
            seen += len(labels)
            step += 1
            bar.update()
            if step == total_steps:
                break
        epochs.append(
            {
                "train_loss": loss_sum.item() / seen,
                "train_accuracy": correct.item() / seen,
                "samples": seen,
                "seconds": time.perf_counter() - start,
            }
        )
        log(
            f"  {desc}, epoch {epoch + 1}: train loss {epochs[-1]['train_loss']:.3f}, "
            f"train accuracy {100 * epochs[-1]['train_accuracy']:.1f}%"
        )
    bar.close()
    return epochs


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command-line flags (see ``python -m hf_triaccel.quickstart --help``)."""
    trains = " and with ".join(COMPARED)
    parser = argparse.ArgumentParser(prog="python -m hf_triaccel.quickstart", allow_abbrev=False)
    parser.description = f"Train the same model with {trains} (--optimizers), on the same data "
    parser.description += "and batches, and print their accuracy and time side by side."
    parser.add_argument(
        "--dataset",
        "--data",
        default="embedded",
        help="'embedded' (the CIFAR-10 slice in the package), a folder of {split}.parquet "
        "files, a .parquet file or a Hub dataset id such as uoft-cs/cifar10",
    )
    parser.add_argument("--test_split", default="test", help="split to report accuracy on")
    parser.add_argument("--image_column", default=None, help="image column (default: found)")
    parser.add_argument("--label_column", default=None, help="label column (default: found)")
    parser.add_argument(
        "--optimizers",
        default=",".join(COMPARED),
        help=f"comma-separated, trained in this order; from {', '.join(OPTIMIZERS)}",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--epochs",
        type=int,
        default=None,
        help=f"epochs per optimizer (GPU: {GPU_PLAN.epochs}; CPU: {CPU_PLAN.epochs}, "
        f"capped at {CPU_PLAN.max_steps} steps)",
    )
    parser.add_argument("--max_steps", type=int, default=None, help="cap on optimizer steps")
    parser.add_argument(
        "--batch_size",
        type=int,
        default=None,
        help=f"GPU: {GPU_PLAN.batch_size}; CPU: {CPU_PLAN.batch_size}",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--bf16",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="bf16 autocast (default: on for CUDA)",
    )
    args = parser.parse_args(argv)
    args.optimizers = [name.strip() for name in args.optimizers.split(",") if name.strip()]
    unknown = [name for name in args.optimizers if name not in OPTIMIZERS]
    if unknown or not args.optimizers:
        parser.error(f"--optimizers {unknown or 'empty'}: choose from {', '.join(OPTIMIZERS)}")
    args.device = torch.device(args.device)
    gpu = args.device.type == "cuda"
    plan = GPU_PLAN if gpu else CPU_PLAN
    explicit_length = args.epochs is not None or args.max_steps is not None
    args.plan = Plan(
        batch_size=plan.batch_size if args.batch_size is None else args.batch_size,
        epochs=plan.epochs if args.epochs is None else args.epochs,
        max_steps=args.max_steps if explicit_length else plan.max_steps,
        hyperparameters=plan.hyperparameters,
    )
    args.model_args = {} if gpu else dict(CPU_MODEL_ARGS)
    args.bf16 = gpu if args.bf16 is None else args.bf16
    return args


def synchronize(device: torch.device) -> None:
    """Waits for the device's queued work, so that a wall-clock time covers it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _build(
    name: str, args: argparse.Namespace, train_data: ImageTensors
) -> tuple[nn.Module, torch.optim.Optimizer, GPUBatchLoader]:
    """A fresh model (from the seed's initial weights), its optimizer and the training
    loader (the seed's batches and augmentations)."""
    torch.manual_seed(args.seed)
    model = create_cifar_model(
        "resnet18_cifar", num_classes=train_data.num_classes, **args.model_args
    ).to(args.device)
    optimizer = build_optimizer(name, model, *args.plan.hyperparameters[name])
    mean, std = train_data.channel_stats()
    loader = GPUBatchLoader(
        train_data,
        args.plan.batch_size,
        shuffle=True,
        augment=True,
        drop_last=True,
        seed=args.seed,
        device=args.device,
        mean=mean,
        std=std,
    )
    if len(loader) == 0:
        raise ValueError(
            f"--batch_size {args.plan.batch_size} exceeds the {len(train_data)} training images"
        )
    return model, optimizer, loader


def train_one(
    name: str, args: argparse.Namespace, train_data: ImageTensors, test_data: ImageTensors
) -> dict[str, Any]:
    """Trains a fresh model with optimizer ``name``; returns its figures."""
    device = args.device
    lr, weight_decay = args.plan.hyperparameters[name]
    if device.type == "cuda":
        # CUDA kernels compile and cuDNN picks its algorithms in the first steps: a
        # throwaway model pays for that, outside the timed run
        model, optimizer, loader = _build(name, args, train_data)
        train_loop(
            model,
            optimizer,
            loader,
            total_steps=CUDA_WARMUP_STEPS,
            lr=lr,
            bf16=args.bf16,
            log=lambda line: None,
            desc=f"{name} warm-up",
        )
    model, optimizer, train_loader = _build(name, args, train_data)
    mean, std = train_data.channel_stats()
    test_loader = GPUBatchLoader(test_data, 1024, device=device, mean=mean, std=std)
    total_steps = args.plan.epochs * len(train_loader)
    if args.plan.max_steps is not None:
        total_steps = min(total_steps, args.plan.max_steps)
    synchronize(device)
    start = time.perf_counter()
    epochs = train_loop(
        model, optimizer, train_loader, total_steps=total_steps, lr=lr, bf16=args.bf16, desc=name
    )
    synchronize(device)
    seconds = time.perf_counter() - start
    return {
        "optimizer": name,
        "learning_rate": lr,
        "weight_decay": weight_decay,
        "steps": total_steps,
        "epochs": epochs,
        "train_seconds": seconds,
        "step_ms": 1e3 * seconds / total_steps,
        "test_accuracy": evaluate(model, test_loader, args.bf16),
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def describe(args: argparse.Namespace, train_data: ImageTensors, runs: list[dict]) -> str:
    """The setting the runs share, in one line."""
    first = runs[0] if runs else {}
    model = "resnet18_cifar" + (" (narrow ResNet-10 for the CPU)" if args.model_args else "")
    steps = first.get("steps", 0)
    epochs = steps * args.plan.batch_size / max(len(train_data), 1)
    return (
        f"{model}, {first.get('parameters', 0) / 1e6:.2f}M parameters, on {args.device}, "
        f"{'bf16' if args.bf16 else 'fp32'}; {len(train_data)} training images, "
        f"{steps} steps of {args.plan.batch_size} ({epochs:.1f} epochs)"
    )


def table(runs: list[dict[str, Any]], test_images: int) -> str:
    """The runs side by side."""
    lines = [
        f"{'optimizer':<12} {'test accuracy':>14} {'training time':>14} {'per step':>10}",
        *(
            f"{run['optimizer']:<12} {100 * run['test_accuracy']:>13.2f}% "
            f"{run['train_seconds']:>12.1f} s {run['step_ms']:>7.0f} ms"
            for run in runs
        ),
        f"(accuracy on {test_images} test images; training time without data loading "
        "and evaluation)",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs the comparison; returns its figures (also printed).

    Example:
        >>> results = main(["--max_steps", "20", "--device", "cpu"])  # doctest: +SKIP
        >>> [run["test_accuracy"] for run in results["runs"]]  # doctest: +SKIP
    """
    start = time.perf_counter()
    args = parse_args(argv)
    columns = {"image_column": args.image_column, "label_column": args.label_column}
    train_data = load_image_dataset(args.dataset, "train", **columns)
    test_data = load_image_dataset(args.dataset, args.test_split, **columns)
    runs = []
    for name in args.optimizers:
        print(f"training with {name} ...", flush=True)
        runs.append(train_one(name, args, train_data, test_data))
    training = sum(run["train_seconds"] for run in runs)
    total = time.perf_counter() - start
    print(f"\n{describe(args, train_data, runs)}\n{table(runs, len(test_data))}")
    print(f"training {training:.1f} s in all; {total:.1f} s with data loading and evaluation")
    return {"runs": runs, "train_seconds": training, "seconds": total}


if __name__ == "__main__":
    main()
