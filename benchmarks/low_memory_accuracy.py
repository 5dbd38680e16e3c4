"""Accuracy of AdaFisherW's low-memory mode on the CPU, beside fp32 mixed precision.

Each run appends one JSON line to ``benchmarks/results/low_memory.jsonl``. The variants
(every one AdaFisherW, bf16 autocast, the same seed's initial weights and batches):

- ``fp32_mixed``: float32 weights, float32 momentum, gradients held to ``step()``;
- ``low_memory``: bfloat16 weights and momentum, Kahan-compensated updates, gradient release;
- ``bf16_plain``: bfloat16 weights and momentum, updates rounded to nearest, release;
- ``bf16_stochastic``: bfloat16 weights and momentum, stochastic rounding, release.

Tasks: ``cifar`` is the main job's CPU run (``hf_triaccel.quickstart``: the embedded
CIFAR-10 slice, the narrow ResNet-10, its AdaFisherW learning rate and step count);
``gpt2`` a 2-layer, 64-wide GPT-2 on ``--wikitext`` (word-level vocabulary), evaluated on
the first validation blocks. ``--lr_scale`` runs at a fraction of the task's learning rate
(a smaller step is where rounding to nearest loses updates).

Usage::

    python -m benchmarks low-memory-accuracy --task cifar --variant low_memory --seed 0
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from hf_triaccel.optim.adafisher import AdaFisherW

NAME = "low-memory-accuracy"
HELP = "accuracy of the low-memory mode beside fp32 mixed precision and bf16 rounding (CPU)"

VARIANTS = {
    "fp32_mixed": dict(weights=torch.float32, state_dtype=None, rounding="nearest", release=False),
    "low_memory": dict(
        weights=torch.bfloat16, state_dtype="bfloat16", rounding="kahan", release=True
    ),
    "bf16_plain": dict(
        weights=torch.bfloat16, state_dtype="bfloat16", rounding="nearest", release=True
    ),
    "bf16_stochastic": dict(
        weights=torch.bfloat16, state_dtype="bfloat16", rounding="stochastic", release=True
    ),
}
RESULTS = Path(__file__).resolve().parent / "results" / "low_memory.jsonl"


def optimizer_for(model, variant: dict, lr: float, weight_decay: float, **extra) -> AdaFisherW:
    return AdaFisherW.from_model(
        model,
        lr=lr,
        weight_decay=weight_decay,
        state_dtype=variant["state_dtype"],
        weight_rounding=variant["rounding"],
        release_grads=variant["release"],
        **extra,
    )


def run_cifar(variant: dict, seed: int, lr_scale: float) -> dict:
    from hf_triaccel.data import GPUBatchLoader, load_image_dataset
    from hf_triaccel.integrations.timm_models import create_cifar_model
    from hf_triaccel.quickstart import CPU_MODEL_ARGS, CPU_PLAN, evaluate, train_loop

    train_data = load_image_dataset("embedded", "train")
    test_data = load_image_dataset("embedded", "test")
    torch.manual_seed(seed)
    model = create_cifar_model(
        "resnet18_cifar", num_classes=train_data.num_classes, **CPU_MODEL_ARGS
    )
    model = model.to(variant["weights"])
    lr, weight_decay = CPU_PLAN.hyperparameters["adafisherw"]
    lr *= lr_scale
    optimizer = optimizer_for(model, variant, lr, weight_decay)
    mean, std = train_data.channel_stats()
    loader = GPUBatchLoader(
        train_data,
        CPU_PLAN.batch_size,
        shuffle=True,
        augment=True,
        drop_last=True,
        seed=seed,
        device=torch.device("cpu"),
        mean=mean,
        std=std,
    )
    steps = min(CPU_PLAN.epochs * len(loader), CPU_PLAN.max_steps)
    model.train()
    epochs = train_loop(
        model,
        optimizer,
        loader,
        total_steps=steps,
        lr=lr,
        bf16=True,
        log=lambda line: None,
        progress=False,
    )
    test_loader = GPUBatchLoader(test_data, 1024, device=torch.device("cpu"), mean=mean, std=std)
    accuracy = evaluate(model, test_loader, bf16=True)
    released = 0 if optimizer.release is None else optimizer.release.total
    return {
        "steps": steps,
        "lr": lr,
        "test_accuracy": accuracy,
        "train_loss_last_epoch": epochs[-1]["train_loss"],
        "released_param_steps": released,
        "test_samples": len(test_data),
    }


def run_gpt2(
    variant: dict, seed: int, lr_scale: float, wikitext: str, steps: int, batch: int
) -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel

    from hf_triaccel.data.text import load_text_split, pack_blocks, token_ids, word_level_tokenizer

    block, eval_blocks = 64, 64
    lines = {s: load_text_split(wikitext, s) for s in ("train", "validation")}
    words = word_level_tokenizer(lines["train"])
    train = pack_blocks(token_ids(lines["train"], words), block)
    valid = pack_blocks(token_ids(lines["validation"], words), block)[:eval_blocks]
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=words.get_vocab_size(),
        n_positions=block,
        n_embd=64,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = GPT2LMHeadModel(config).to(variant["weights"])
    lr = 3e-3 * lr_scale
    optimizer = optimizer_for(model, variant, lr, 0.01, update_every=10)
    warmup = max(1, steps // 20)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: (
            min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
        ),
    )
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed))
    model.train()
    losses = []
    for step in range(steps):
        idx = order[(step * batch) % len(order) :][:batch]
        if len(idx) < batch:
            idx = order[:batch]
        ids = train[idx].long()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        total = 0.0
        for i in range(0, len(valid), batch):
            ids = valid[i : i + batch].long()
            total += model(input_ids=ids, labels=ids).loss.float().item() * len(ids)
    eval_loss = total / len(valid)
    released = 0 if optimizer.release is None else optimizer.release.total
    return {
        "steps": steps,
        "lr": lr,
        "eval_loss": eval_loss,
        "eval_perplexity": math.exp(eval_loss),
        "batch": batch,
        "train_loss_last_20": sum(losses[-20:]) / 20,
        "released_param_steps": released,
        "eval_tokens": eval_blocks * block,
        "vocab": words.get_vocab_size(),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The measurement's options."""
    parser.add_argument("--task", choices=("cifar", "gpt2"), required=True)
    parser.add_argument("--variant", choices=sorted(VARIANTS), required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr_scale", type=float, default=1.0)
    parser.add_argument("--gpt2_steps", type=int, default=200)
    parser.add_argument("--gpt2_batch", type=int, default=16)
    parser.add_argument("--wikitext", default=".data/wikitext2", help="WikiText-2 parquet folder")
    parser.add_argument("--out", default=str(RESULTS))


def run(args: argparse.Namespace) -> None:
    """One run of one variant, appended to ``--out``."""
    torch.set_num_threads(1)
    variant = VARIANTS[args.variant]
    start = time.perf_counter()
    if args.task == "cifar":
        figures = run_cifar(variant, args.seed, args.lr_scale)
    else:
        figures = run_gpt2(
            variant, args.seed, args.lr_scale, args.wikitext, args.gpt2_steps, args.gpt2_batch
        )
    record = {
        "task": args.task,
        "variant": args.variant,
        "seed": args.seed,
        "lr_scale": args.lr_scale,
        **figures,
        "seconds": round(time.perf_counter() - start, 1),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as f:
        f.write(json.dumps(record) + "\n")
    print(json.dumps(record))
