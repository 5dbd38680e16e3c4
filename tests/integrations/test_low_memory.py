"""``triaccel_low_memory=True`` in the Trainer: the optimizer's settings, what blocks
gradient release said at the start, exact resume, the ledger in the report and the card."""

from __future__ import annotations

import json
import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_triaccel.integrations.model_card import build_card  # noqa: E402
from hf_triaccel.integrations.telemetry import REPORT_NAME  # noqa: E402
from hf_triaccel.integrations.trainer import TriAccelTrainer  # noqa: E402
from tests.integrations.tiny import TokenSet, make_args, tiny_gpt2  # noqa: E402


def _bf16_gpt2():
    return tiny_gpt2().to(torch.bfloat16)


def test_low_memory_releases_and_reports_bytes_per_parameter(tmp_path):
    model = _bf16_gpt2()
    args = make_args(tmp_path, max_steps=4, triaccel_low_memory=True, max_grad_norm=0.0)
    trainer = TriAccelTrainer(model=model, args=args, train_dataset=TokenSet())
    trainer.train()
    opt = trainer.optimizer.optimizer
    assert opt.config.state_dtype == "bfloat16" and opt.config.weight_rounding == "kahan"
    # update_every=2: steps 1 and 3 released every parameter with a gradient
    assert opt.release is not None and opt.release.total > 0
    entry = opt.state[model.transformer.h[0].mlp.c_fc.weight]
    assert entry["momentum"].dtype == torch.bfloat16
    assert entry["compensation"].dtype == torch.bfloat16
    trainer.save_model()
    report = json.loads((tmp_path / REPORT_NAME).read_text())
    # bf16 weight, momentum and compensation (6 B) and every gradient (2 B) or the
    # largest one alone, plus a float32 step count per tensor and the Fisher factors
    params = list(dict.fromkeys(model.parameters()))  # the tied embedding once
    n = sum(p.numel() for p in params)
    factors = {id(v): v for f in opt.collector.param_factors().values() for v in (f.g, f.a)}
    extra = 4 * len(params) + sum(4 * v.numel() for v in factors.values())
    largest = max(p.numel() for p in params)
    assert report["bytes_per_parameter_held"] == pytest.approx(8 + extra / n, abs=1e-3)
    want = 6 + (2 * largest + extra) / n
    assert report["bytes_per_parameter_released"] == pytest.approx(want, abs=1e-3)


def test_what_blocks_release_is_said_with_its_cost(tmp_path, caplog):
    model = _bf16_gpt2()
    args = make_args(tmp_path, max_steps=2, triaccel_low_memory=True, gradient_accumulation_steps=2)
    trainer = TriAccelTrainer(model=model, args=args, train_dataset=TokenSet())
    with caplog.at_level(logging.WARNING, logger="hf_triaccel.integrations.low_memory"):
        trainer.train()
    message = " ".join(r.getMessage() for r in caplog.records)
    assert "gradient release off" in message
    assert "max_grad_norm=1.0" in message and "gradient_accumulation_steps=2" in message
    assert "bytes per parameter" in message
    opt = trainer.optimizer.optimizer
    assert opt.release is None and opt.config.weight_rounding == "kahan"


def test_low_memory_needs_adafisher(tmp_path):
    with pytest.raises(ValueError, match="triaccel_low_memory"):
        make_args(tmp_path, optim="adamw_torch", triaccel_low_memory=True)


def test_low_memory_resume_is_exact(tmp_path):
    common = dict(
        max_steps=6,
        save_strategy="steps",
        save_steps=3,
        per_device_train_batch_size=4,
        logging_steps=1,
        triaccel_low_memory=True,
        max_grad_norm=0.0,
    )
    straight = _bf16_gpt2()
    first = TriAccelTrainer(
        model=straight, args=make_args(tmp_path / "a", **common), train_dataset=TokenSet()
    )
    first.train()
    resumed = _bf16_gpt2()
    trainer = TriAccelTrainer(
        model=resumed, args=make_args(tmp_path / "b", **common), train_dataset=TokenSet()
    )
    trainer.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-3"))
    a, b = first.optimizer.optimizer, trainer.optimizer.optimizer
    assert b.release.total > 0
    for p1, p2 in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p1, p2)
        for key in ("momentum", "compensation"):
            assert torch.equal(a.state[p1][key], b.state[p2][key])


def test_the_card_reports_bytes_per_parameter():
    from tests.recipes.test_model_card import sample_results

    results = sample_results()
    results.update(bytes_per_parameter_held=8.012, bytes_per_parameter_released=6.004)
    text = str(build_card(results, repo_id="me/x"))
    assert "8.01 bytes on a step that holds the gradients, 6.00 on a step that releases" in text
    results.update(bytes_per_parameter_held=None, bytes_per_parameter_released=None)
    assert "memory per parameter" not in str(build_card(results, repo_id="me/x"))
