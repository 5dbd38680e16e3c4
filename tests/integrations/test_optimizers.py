"""One configuration, one default learning rate and one parameter-group rule in every entry
point; AdaFisher for the stock Trainer (factory) and for timm (registry)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")
timm = pytest.importorskip("timm")

from hf_triaccel.integrations.optimizers import (  # noqa: E402
    AdaFisherWFactory,
    trainer_optimizer,
)
from hf_triaccel.integrations.plugin import TriAccelPlugin, prepare_triaccel  # noqa: E402
from hf_triaccel.integrations.timm_optim import register_timm_optimizers  # noqa: E402
from hf_triaccel.integrations.trainer import TriAccelArguments, TriAccelTrainer  # noqa: E402
from hf_triaccel.optim.adafisher import AdaFisherW  # noqa: E402
from hf_triaccel.optim.config import DEFAULT_LR  # noqa: E402
from tests.integrations.tiny import MLP, VectorSet, make_args  # noqa: E402

STOCK_LR = 5e-5  # TrainingArguments.learning_rate's default


def _group_names(model: nn.Module, optimizer) -> list[tuple[float, list[str]]]:
    """Each param group's weight decay and the names of its parameters."""
    names = {p: n for n, p in model.named_parameters()}
    return [
        (g["weight_decay"], sorted(names[p] for p in g["params"])) for g in optimizer.param_groups
    ]


NO_DECAY = ["down.bias", "norm.bias", "norm.weight", "up.bias"]
DECAY = ["down.weight", "up.weight"]


def _trained_optimizer(tmp_path, **kw):
    trainer = TriAccelTrainer(
        model=MLP(), args=make_args(tmp_path, max_steps=1, **kw), train_dataset=VectorSet()
    )
    trainer.train()
    return trainer.model, trainer.optimizer.optimizer


# -- one default learning rate per optimizer ------------------------------------------


def test_every_entry_point_has_adafishers_default_learning_rate():
    assert TriAccelPlugin().lr == DEFAULT_LR
    assert AdaFisherWFactory()(nn.Linear(2, 2)).defaults["lr"] == DEFAULT_LR
    register_timm_optimizers()
    opt = timm.optim.create_optimizer_v2(nn.Linear(2, 2), "adafisherw")
    assert opt.defaults["lr"] == DEFAULT_LR


# -- one parameter-group rule ---------------------------------------------------------


@pytest.mark.parametrize("optim", ["adafisherw", "adamw_torch"])
def test_trainer_groups_leave_biases_and_norms_undecayed(tmp_path, optim):
    model, opt = _trained_optimizer(tmp_path, optim=optim, weight_decay=0.1)
    assert _group_names(model, opt) == [(0.1, DECAY), (0.0, NO_DECAY)]


def test_accelerate_groups_leave_biases_and_norms_undecayed():
    model = MLP()
    run = prepare_triaccel(
        accelerate.Accelerator(cpu=True), model, TriAccelPlugin(weight_decay=0.1)
    )
    assert _group_names(model, run.optimizer.optimizer) == [(0.1, DECAY), (0.0, NO_DECAY)]


def test_stock_trainer_factory_groups_and_hyperparameters(tmp_path):
    model = MLP()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=2,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        per_device_train_batch_size=8,
        remove_unused_columns=False,
        lr_scheduler_type="constant",
    )

    class Loss(transformers.Trainer):  # the stock Trainer needs a loss for a logits model
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return nn.functional.cross_entropy(model(inputs["x"]), inputs["labels"])

    trainer = Loss(
        model=model,
        args=args,
        train_dataset=VectorSet(),
        optimizer_cls_and_kwargs=trainer_optimizer(lr=2e-3, weight_decay=0.1, update_every=1),
    )
    before = [p.detach().clone() for p in model.parameters()]
    trainer.train()
    opt = trainer.optimizer.optimizer
    assert isinstance(opt, AdaFisherW) and opt.update_every == 1
    assert {g["lr"] for g in opt.param_groups} == {2e-3}
    assert _group_names(model, opt) == [(0.1, DECAY), (0.0, NO_DECAY)]
    assert sorted(opt.collector.layers) == ["down", "norm", "up"]
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))


# -- timm -----------------------------------------------------------------------------


def test_timm_create_optimizer_v2_builds_adafisher_bound_to_the_model():
    assert register_timm_optimizers() == ["adafisher", "adafisherw"]
    model = MLP()
    opt = timm.optim.create_optimizer_v2(
        model, "adafisherw", lr=1e-3, weight_decay=0.1, update_every=1
    )
    assert isinstance(opt, AdaFisherW) and opt.collector is None  # bound at the first forward
    assert _group_names(model, opt) == [(0.0, NO_DECAY), (0.1, DECAY)]  # timm's group order
    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    losses = []
    for _ in range(3):
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert sorted(opt.collector.layers) == ["down", "norm", "up"]
    assert opt.fisher_steps == 3 and losses[-1] < losses[0]
    # the binding hook is gone: another model's forward does not rebind
    collector = opt.collector
    MLP()(x)
    assert opt.collector is collector
    collector.remove()


def test_timm_skips_wrappers_when_binding():
    model = MLP()
    wrapper = nn.Sequential(model)  # one child, no parameters of its own
    opt = timm.optim.create_optimizer_v2(wrapper, "adafisher", lr=1e-3)
    wrapper(torch.randn(2, 6))
    assert sorted(opt.collector.layers) == ["down", "norm", "up"]
    opt.collector.remove()


# -- one configuration: validation and no environment fallback -------------------------


@pytest.mark.parametrize(
    "build, field",
    [
        (
            lambda: TriAccelArguments(output_dir="o", optim="adamw_torch", learning_rate=-1.0),
            "TriAccelArguments.learning_rate",
        ),
        (
            lambda: TriAccelArguments(output_dir="o", learning_rate=-1.0),
            "TriAccelArguments.learning_rate",
        ),
        (lambda: TriAccelPlugin(lr=-1.0), "TriAccelPlugin.lr"),
        (lambda: trainer_optimizer(lr=-1.0), "trainer_optimizer.lr"),
        (lambda: TriAccelPlugin(optimizer="adam"), "TriAccelPlugin.optimizer"),
        (lambda: TriAccelPlugin(update_every=0), "TriAccelPlugin.update_every"),
    ],
)
def test_invalid_values_fail_at_construction_naming_the_field(build, field):
    with pytest.raises(ValueError, match=field):
        build()


def test_timm_path_validates_too():
    register_timm_optimizers()
    with pytest.raises(ValueError, match="beta"):
        timm.optim.create_optimizer_v2(MLP(), "adafisherw", beta=1.5)


def test_no_environment_fallback_but_the_implementation(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_TRIACCEL_UPDATE_EVERY", "7")
    monkeypatch.setenv("HF_TRIACCEL_LR", "0.5")
    monkeypatch.setenv("HF_TRIACCEL_OPTIMIZER", "adafisher")
    plugin = TriAccelPlugin()
    assert (plugin.update_every, plugin.lr, plugin.optimizer) == (None, DEFAULT_LR, "adafisherw")
    _, opt = _trained_optimizer(tmp_path)
    assert opt.update_every == 2  # make_args' adafisher_update_every, not the environment
