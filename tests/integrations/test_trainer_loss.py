"""The Trainer's loss path: looked up once per model, without keeping models alive."""

from __future__ import annotations

import gc
import weakref

import pytest
from torch import nn

pytest.importorskip("timm")
pytest.importorskip("transformers")

from hf_triaccel.integrations.trainer import TriAccelTrainer  # noqa: E402
from hf_triaccel.integrations.trainer_loss import LossRoutes  # noqa: E402
from tests.integrations.tiny import ImageSet, make_args, tiny_timm  # noqa: E402


def _unwraps(tmp_path, steps: int) -> int:
    """How many times a training run of ``steps`` steps unwraps its model."""
    args = make_args(tmp_path / str(steps), max_steps=steps, optim="adamw_torch")
    trainer = TriAccelTrainer(model=tiny_timm(), args=args, train_dataset=ImageSet())
    unwrap, calls = trainer.accelerator.unwrap_model, []

    def counted(model, *a, **kw):
        calls.append(model)
        return unwrap(model, *a, **kw)

    trainer.accelerator.unwrap_model = counted
    trainer.train()
    assert trainer.state.global_step == steps
    return len(calls)


def test_the_steps_do_not_unwrap_the_model(tmp_path):
    # the set-up unwraps (the collator's columns, the optimizer, the wrapping), and the
    # loss path once: not once a step
    assert _unwraps(tmp_path, 2) == _unwraps(tmp_path, 6)


def test_a_model_looked_up_is_not_kept_alive():
    routes = LossRoutes(unwrap=lambda m: m)
    model = nn.Linear(3, 4)
    assert routes.lookup(model, ["input"]) == (True, ({"input"}, False))
    held = weakref.ref(model)
    del model
    gc.collect()
    assert held() is None
    other = nn.Bilinear(2, 2, 2)  # forward(input1, input2): another signature
    assert routes.lookup(other, ["input1", "input2", "labels"])[1] == ({"input1", "input2"}, False)
