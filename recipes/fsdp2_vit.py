"""Train a ViT-B/16 (or another timm model: --model) with AdaFisherW under FSDP2.

The parameters are sharded by rows over the processes (``torch.distributed.fsdp.fully_shard``
through Accelerate, ``fsdp_version: 2``): each process keeps its rows and their momentum,
and steps them where they live with the slice of the (full, replicated) Fisher factors
they read. Usage::

    accelerate launch --config_file recipes/fsdp2_config.yaml recipes/fsdp2_vit.py
    accelerate launch --config_file recipes/fsdp2_config.yaml --num_processes 1 \\
        recipes/fsdp2_vit.py --smoke                     # a few steps and a checkpoint check
    accelerate launch --config_file recipes/fsdp2_config.yaml recipes/fsdp2_vit.py --trainer
    python recipes/fsdp2_vit.py --smoke --cpu            # the same loop, one CPU process

Two ways to run the same training: a hand-written Accelerate loop with
:func:`~hf_triaccel.prepare_triaccel` (the default), or ``TriAccelTrainer`` with the
Trainer's ``fsdp`` arguments (``--trainer``). The images (CIFAR-10 by default: ``embedded``,
the slice shipped in the package, or a Hub id / local parquet folder with ``--dataset``) are
decoded once, kept on the device and resized to the model's input size on the device.

``--smoke`` trains 6 steps with a refresh every 2, saves the run at step 3 (Accelerate's
``save_state``, or a Trainer checkpoint), and checks that loading it restores AdaFisher's
state: the refresh schedule and the Fisher factors. It prints one ``OK`` line per check.

Layout: the Accelerate loop puts the model and its batches in channels_last (the helper's
default). Under FSDP2 the parameters stay contiguous (``fully_shard`` refuses others) and
the ``HF_TRIACCEL_FSDP2_CHANNELS_LAST`` environment variable picks the arrangement
(``inputs`` or ``weights``: :mod:`hf_triaccel.integrations.layout`); ``--nchw`` keeps the
default layout throughout. The loop prints its mean step time after ``WARMUP_STEPS``, for
timing the arrangements against each other and against a run without FSDP (``bash
recipes/fsdp2_gpu_check.sh --timing`` runs them all, for a ViT and a ResNet)::

    HF_TRIACCEL_FSDP2_CHANNELS_LAST=weights accelerate launch --config_file \\
        recipes/fsdp2_config.yaml --num_processes 1 recipes/fsdp2_vit.py --max_steps 60
"""

from __future__ import annotations

import argparse
import math
import os
import time

import timm
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn

from hf_triaccel import TriAccelArguments, TriAccelPlugin, TriAccelTrainer, prepare_triaccel
from hf_triaccel.data import GPUBatchLoader, ImageTensors, load_image_dataset
from hf_triaccel.integrations.layout import fsdp2_layout, shards_with_fsdp2

# Steps left out of the reported step time: the first forwards' kernel selection and the
# first Fisher refresh.
WARMUP_STEPS = 5


class Resized(nn.Module):
    """A classifier that resizes its input images to ``size`` first (CIFAR's 32 px to the
    ViT's 224), on the device."""

    def __init__(self, model: nn.Module, size: int) -> None:
        super().__init__()
        self.model = model
        self.size = size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.size:
            x = F.interpolate(x, size=(self.size, self.size), mode="bilinear", antialias=False)
        return self.model(x)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--model", default="vit_base_patch16_224", help="timm model name")
    parser.add_argument("--img_size", type=int, default=224, help="model input size (px)")
    parser.add_argument("--patch_size", type=int, default=None, help="default: the model's")
    parser.add_argument("--dataset", default="embedded", help="embedded, Hub id or folder")
    parser.add_argument("--epochs", type=float, default=10.0)
    parser.add_argument("--max_steps", type=int, default=None, help="overrides --epochs")
    parser.add_argument("--batch_size", type=int, default=64, help="per process")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--weight_decay", type=float, default=0.05)
    parser.add_argument("--update_every", type=int, default=50, help="Fisher refreshes")
    parser.add_argument("--warmup", type=float, default=0.1, help="share of the steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output_dir", default="outputs/fsdp2_vit")
    parser.add_argument("--trainer", action="store_true", help="TriAccelTrainer's loop")
    parser.add_argument("--smoke", action="store_true", help="6 steps and checkpoint checks")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU")
    parser.add_argument("--nchw", action="store_true", help="no channels_last (Accelerate loop)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.max_steps, args.update_every = 6, 2
        if args.cpu:  # a ViT of the same family, small enough for a CPU test
            args.model, args.img_size, args.patch_size, args.batch_size = (
                "vit_tiny_patch16_224", 32, 8, 8
            )  # fmt: skip
    return args


def build_model(args: argparse.Namespace, num_classes: int) -> nn.Module:
    """The timm model (a ViT sized by ``--img_size`` and ``--patch_size``; a convolutional
    net, which takes any input size, as it is) behind :class:`Resized`."""
    torch.manual_seed(args.seed)
    extra = {} if args.patch_size is None else {"patch_size": args.patch_size}
    if "vit" in args.model:
        extra["img_size"] = args.img_size
    model = timm.create_model(args.model, pretrained=False, num_classes=num_classes, **extra)
    return Resized(model, args.img_size)


def schedule(step: int, total: int, warmup: float) -> float:
    """Linear warm-up over ``warmup`` of the steps, then cosine decay to 0."""
    ramp = max(1, round(total * warmup))
    if step < ramp:
        return (step + 1) / ramp
    return 0.5 * (1.0 + math.cos(math.pi * (step - ramp) / max(1, total - ramp)))


def accelerate_loop(args: argparse.Namespace, train: ImageTensors, test: ImageTensors) -> None:
    accelerator = Accelerator(cpu=args.cpu)
    rank, world = accelerator.process_index, accelerator.num_processes
    plugin = TriAccelPlugin(
        lr=args.lr,
        weight_decay=args.weight_decay,
        update_every=args.update_every,
        channels_last=not args.nchw,
    )
    run = prepare_triaccel(accelerator, build_model(args, train.num_classes), plugin)
    optimizer = run.optimizer.optimizer  # AdaFisherW, inside Accelerate's wrapper
    accelerator.print(f"distributed: {accelerator.distributed_type.value}, {world} process(es)")
    layout = "nchw" if not run.channels_last else "channels_last"
    if run.channels_last and shards_with_fsdp2():
        layout += f" (FSDP2 arrangement: {fsdp2_layout()})"
    accelerator.print(f"layout: {layout}")

    # every process draws the same global batch and takes its share
    loader = GPUBatchLoader(
        train, args.batch_size * world, shuffle=True, augment=True, drop_last=True,
        seed=args.seed, device=accelerator.device,
    )  # fmt: skip
    total = args.max_steps or int(args.epochs * len(loader))
    step, start = 0, time.perf_counter()
    saved = timed = None
    while step < total:
        for images, labels in loader:
            share = slice(rank * args.batch_size, (rank + 1) * args.batch_size)
            for group in optimizer.param_groups:
                group["lr"] = args.lr * schedule(step, total, args.warmup)
            logits = run.model(run.batch(images[share]))
            loss = F.cross_entropy(logits, labels[share], label_smoothing=0.1)
            accelerator.backward(loss)
            run.optimizer.step()
            run.optimizer.zero_grad()
            step += 1
            if step == WARMUP_STEPS:
                timed = _now(accelerator)
            if step % 20 == 0 or step == total:
                rate = step * args.batch_size * world / (time.perf_counter() - start)
                accelerator.print(f"step {step}/{total} loss {loss.item():.4f} {rate:.0f} img/s")
            if args.smoke and step == 3:
                accelerator.save_state(os.path.join(args.output_dir, "state"))
                saved = (optimizer.fisher_steps, _factors(run.collector))
            if step == total:
                break
    if timed is not None and total > WARMUP_STEPS:
        ms = 1000 * (_now(accelerator) - timed) / (total - WARMUP_STEPS)
        accelerator.print(f"step time: {ms:.1f} ms (steps {WARMUP_STEPS + 1}-{total}), {layout}")
    accelerator.print(f"test accuracy {evaluate(accelerator, run.model, train, test):.4f}")
    if torch.cuda.is_available() and not args.cpu:
        peak = torch.cuda.max_memory_allocated() / 2**30
        accelerator.print(f"peak memory of process 0: {peak:.2f} GiB")
    if args.smoke:
        accelerator.load_state(os.path.join(args.output_dir, "state"))
        restored = (optimizer.fisher_steps, _factors(run.collector))
        assert restored[0] == saved[0] == 3, (restored[0], saved[0])
        assert all(map(torch.equal, restored[1], saved[1])), "factors not restored"
        accelerator.print("OK: Accelerate save_state/load_state restores AdaFisher's state")
        accelerator.print(f"OK: prepare_triaccel trained {step} steps under {_mode(accelerator)}")
    accelerator.end_training()


def _now(accelerator: Accelerator) -> float:
    """The time once the device has finished the work queued so far."""
    if accelerator.device.type == "cuda":
        torch.cuda.synchronize(accelerator.device)
    return time.perf_counter()


def _factors(collector) -> list[torch.Tensor]:
    return [t.clone() for ly in collector.layers.values() for t in (ly.a_ema, ly.g_ema)]


def _mode(accelerator: Accelerator) -> str:
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    version = getattr(plugin, "fsdp_version", None)
    return f"{accelerator.distributed_type.value}" + (f" (version {version})" if version else "")


@torch.no_grad()
def evaluate(
    accelerator: Accelerator, model: nn.Module, train: ImageTensors, test: ImageTensors
) -> float:
    """Top-1 accuracy on ``test``, each process scoring its share (every process runs the
    same number of forwards: FSDP gathers parameters in each)."""
    model.eval()
    rank, world = accelerator.process_index, accelerator.num_processes
    mean, std = train.channel_stats()
    loader = GPUBatchLoader(test, 256, device=accelerator.device, mean=mean, std=std)
    correct = torch.zeros((), device=accelerator.device)
    for images, labels in loader:
        mine = torch.arange(len(labels), device=labels.device) % world == rank
        correct += (model(images).argmax(-1) == labels)[mine].sum()
    model.train()
    return accelerator.reduce(correct, "sum").item() / len(test)


def trainer_loop(args: argparse.Namespace, train: ImageTensors, test: ImageTensors) -> None:
    fsdp = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    common = dict(
        optim="adafisherw", learning_rate=args.lr, weight_decay=args.weight_decay,
        adafisher_update_every=args.update_every, per_device_train_batch_size=args.batch_size,
        num_train_epochs=args.epochs, max_steps=args.max_steps or -1, warmup_steps=args.warmup,
        lr_scheduler_type="cosine", label_smoothing_factor=0.1, seed=args.seed,
        bf16=torch.cuda.is_available() and not args.cpu, use_cpu=args.cpu, report_to=[],
        logging_steps=20, eval_strategy="no", disable_tqdm=True,
        # the Trainer's FSDP2, as the launcher's config asks: the ViT's blocks are the units
        fsdp="full_shard" if fsdp else "",
        fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["Block"]} if fsdp else None,
        save_strategy="steps" if args.smoke else "no", save_steps=3,
    )  # fmt: skip
    targs = TriAccelArguments(output_dir=args.output_dir, **common)
    trainer = TriAccelTrainer(
        model=build_model(args, train.num_classes), args=targs, train_dataset=train
    )
    trainer.train()
    mode = trainer.accelerator.distributed_type.value
    if trainer.is_world_process_zero():
        print(f"train loss {trainer.state.log_history[-1].get('train_loss')}")
    if not args.smoke:
        trainer.save_model()
        return
    resumed = TriAccelTrainer(
        model=build_model(args, train.num_classes), args=targs, train_dataset=train
    )
    resumed.train(resume_from_checkpoint=os.path.join(args.output_dir, "checkpoint-3"))
    optimizer = resumed.optimizer.optimizer
    assert optimizer.fisher_steps == args.max_steps, optimizer.fisher_steps
    assert any("fisher_a" in s for s in optimizer.state.values()), "no factors in the state"
    if trainer.is_world_process_zero():
        print("OK: TriAccelTrainer resumed AdaFisher from its checkpoint")
        print(f"OK: TriAccelTrainer trained {args.max_steps} steps under {mode}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    quiet = int(os.environ.get("RANK", "0")) != 0
    train = load_image_dataset(args.dataset, "train", progress=not quiet)
    test = load_image_dataset(args.dataset, "test", progress=not quiet)
    if args.smoke:
        test = ImageTensors(test.images[:256], test.labels[:256], test.class_names)
    (trainer_loop if args.trainer else accelerate_loop)(args, train, test)


if __name__ == "__main__":
    main()
