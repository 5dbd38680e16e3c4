"""The memory ledger of GPT-2 small and the CIFAR ResNet-18 under each optimizer
configuration, on a step that holds the gradients (AdaFisher's refresh step, its worst)
and on a releasing step, counted from the tensors after real steps on the CPU
(:func:`hf_triaccel.memory.ledger.measure_step`); beside them, what the arithmetic of
optimizers not installed here gives.

Writes ``benchmarks/results/low_memory_ledger.json`` and prints a Markdown table.

Usage::

    python -m benchmarks low-memory-ledger
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from hf_triaccel.memory.ledger import measure_step
from hf_triaccel.optim.adafisher import AdaFisherW

NAME = "low-memory-ledger"
HELP = "bytes per parameter of weights, gradients, state, compensation and factors (CPU)"

OUT = Path(__file__).resolve().parent / "results" / "low_memory_ledger.json"

# Bytes per parameter by the optimizers' arithmetic (not measured here): weight,
# gradient, state, compensation.
ARITHMETIC = {
    "optimi Adam, bf16 weights, Kahan (arithmetic)": (2, 2, 4, 2),
    "optimi Adam, bf16 weights, Kahan, gradient release (arithmetic)": (2, 0, 4, 2),
    # bitsandbytes' blockwise 8-bit states: 1 B each plus one float32 scale per 2048 values
    "8-bit AdamW, bf16 weights, no compensation (arithmetic)": (2, 2, 2 + 2 * 4 / 2048, 0),
}


def gpt2_small():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config())  # 124M parameters, embeddings tied
    ids = torch.randint(0, model.config.vocab_size, (1, 16))

    def loss():
        return model(input_ids=ids, labels=ids).loss

    return model, loss


def resnet18_cifar():
    from hf_triaccel.integrations.timm_models import create_cifar_model

    torch.manual_seed(0)
    model = create_cifar_model("resnet18_cifar", num_classes=10)
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([0, 1])

    def loss():
        return F.cross_entropy(model(x.to(next(model.parameters()).dtype)).float(), y)

    return model, loss


CONFIGS = {
    "mixed-precision AdamW (fp32 weights)": dict(weights=torch.float32, optimizer="adamw"),
    "AdaFisherW today (fp32 weights)": dict(weights=torch.float32, optimizer="adafisherw"),
    "AdaFisherW low memory (bf16 weights)": dict(
        weights=torch.bfloat16,
        optimizer="adafisherw",
        state_dtype="bfloat16",
        weight_rounding="kahan",
        release_grads=True,
    ),
}


def ledgers(build, config: dict) -> list[dict]:
    model, loss = build()
    model = model.to(config["weights"]).train()
    if config["optimizer"] == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    else:
        settings = {k: v for k, v in config.items() if k not in ("weights", "optimizer")}
        opt = AdaFisherW.from_model(model, lr=1e-4, update_every=2, **settings)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            value = loss()
        value.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    # step 0 refreshes the factors (holds every gradient); step 1 releases if it can
    return [measure_step(model, opt, step).as_dict() for _ in range(2)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The measurement's options."""
    parser.add_argument("--out", type=Path, default=OUT, help="where the ledgers are written")


def run(args: argparse.Namespace) -> None:
    """Counts the ledgers, writes them and prints their table."""
    torch.set_num_threads(1)
    records = []
    for name, build in (("GPT-2 small", gpt2_small), ("CIFAR ResNet-18", resnet18_cifar)):
        for label, config in CONFIGS.items():
            for ledger in ledgers(build, config):
                records.append({"model": name, "config": label, **ledger})
                print(json.dumps(records[-1]["per_parameter"]), label, ledger["step"], flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"measured": records, "arithmetic": ARITHMETIC}, indent=1))
    print("| model | configuration | step | weights | grads | state | comp. | factors | total |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in records:
        p = r["per_parameter"]
        cells = [p[k] for k in ("weights", "gradients", "optimizer_state", "compensation")]
        cells += [p["fisher_factors"], p["total"]]
        print(
            f"| {r['model']} | {r['config']} | {r['step']} | "
            + " | ".join(f"{c:.3f}" for c in cells)
            + " |"
        )
    for label, (w, g, s, c) in ARITHMETIC.items():
        print(f"| any | {label} | | {w} | {g} | {s:.3f} | {c} | 0 | {w + g + s + c:.3f} |")
