"""``python -m benchmarks cifar`` with ``--precision``: short smoke runs (a narrow model of the
same structure, random images, CPU).

They check the record fields and the precision map, not accuracy or speed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import cifar

# resnet18_cifar: 20 BatchNorm layers (fp32 from the start), 20 convolutions and the head
NORMS, RANKED = 20, 21


@pytest.fixture
def train_cifar():
    """The one-training measurement's module, on one thread."""
    # tiny batches on a shared CPU: one thread is faster than waking a pool
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield cifar
    torch.set_num_threads(threads)


def run(module, tmp_path: Path, *flags: str) -> dict:
    out = tmp_path / "record.json"
    argv = ["--smoke", "--batch_size", "8", "--out", str(out), *flags]
    assert module.run(module.parse_args(argv)) == 0
    return json.loads(out.read_text())


def test_adaptive_run_records_the_precision_map(train_cifar, tmp_path):
    png = tmp_path / "maps" / "precision.png"
    # gradient noise needs two samples (steps 0 and 4): the ranking at step 6 is the first,
    # and step 7 trains with it
    flags = ("--max_steps", "7", "--signals_every", "6", "--precision_map", str(png))
    record = run(train_cifar, tmp_path, "--precision", "adaptive", *flags)
    assert record["precision"] == "adaptive" and record["steps"] == 7
    assert 0.0 <= record["test_accuracy"] <= 1.0
    adaptive = record["adaptive_precision"]
    counts = adaptive["counts"]
    assert set(counts) == {"fp32", "bf16", "fp16"}
    assert sum(counts.values()) == NORMS + RANKED == len(adaptive["decisions"])
    assert counts["fp16"] == 0  # bf16 autocast around the model: no loss scaler, no fp16
    # fp32 modules are a prefix of the sensitivity ranking whose compute up to the last
    # one's middle is under fp32_fraction, so they hold under twice that share (none when
    # the first alone is larger): the count of ranked fp32 modules may be zero
    shares = adaptive["compute_shares"]
    fraction = adaptive["policy"]["fp32_fraction"]
    assert NORMS <= counts["fp32"] < NORMS + RANKED
    assert shares.get("fp32", 0.0) < 2 * fraction and sum(shares.values()) == pytest.approx(1.0)
    assert adaptive["changes"] == NORMS + RANKED
    assert adaptive["changes_by_reason"] == {"norm": NORMS, "initial": RANKED}
    assert adaptive["rankings"] == 1
    assert adaptive["policy"]["signals_every"] == 6
    assert adaptive["map"] == str(png)
    assert png.read_bytes().startswith(b"\x89PNG")
    assert isinstance(record["tf32_matmul"], bool) and isinstance(record["tf32_cudnn"], bool)


def test_fp32_run_records_the_tf32_flags(train_cifar, tmp_path):
    record = run(train_cifar, tmp_path, "--precision", "fp32", "--max_steps", "2")
    assert record["precision"] == "fp32" and record["steps"] == 2
    assert record["adaptive_precision"] is None
    assert record["tf32_matmul"] == torch.backends.cuda.matmul.allow_tf32
    assert record["tf32_cudnn"] == torch.backends.cudnn.allow_tf32
    assert 0.0 <= record["test_accuracy"] <= 1.0


def test_bf16_is_the_default_and_the_map_needs_adaptive(train_cifar):
    assert train_cifar.parse_args([]).precision == "bf16"
    with pytest.raises(SystemExit):
        train_cifar.parse_args(["--precision_map", "map.png"])


def test_lr_steering_records_the_final_scales(train_cifar, tmp_path):
    flags = ("--lr_steering", "--max_steps", "7", "--signals_every", "6")
    record = run(train_cifar, tmp_path, "--optimizer", "adafisher", *flags)
    scales = record["lr_steering_scales"]
    # every module with Fisher factors but the 3 of each of the 8 residual branches: their
    # last norm layer starts at zero (timm's zero_init_last), so at the one refresh so far
    # (step 0) their output gradients were zero, their factors are still at the zero
    # seed and their curvature is 0: they keep scale 1
    assert len(scales) == NORMS + RANKED - 3 * 8
    assert all(0.5 <= s <= 2.0 for s in scales.values()) and len(set(scales.values())) > 1
    assert record["adaptive_precision"] is None
    with pytest.raises(SystemExit):
        train_cifar.parse_args(["--optimizer", "adamw", "--lr_steering"])
