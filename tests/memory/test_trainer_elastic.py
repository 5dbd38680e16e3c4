"""TrainerElasticBatch wired into TriAccelTrainer the documented way (CPU): the same
parameters as an uninterrupted run at the same batch, checkpoint state (Trainer callback
state), telemetry, out-of-memory errors in evaluation and in the optimizer step; and
FisherStatisticsRollback keeping AdaFisher exact in a hand-written loop."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

transformers = pytest.importorskip("transformers")

from hf_triaccel import AdaFisherW  # noqa: E402
from hf_triaccel.integrations.elastic import (  # noqa: E402
    LEGACY_STATE_NAME,
    FisherStatisticsRollback,
)
from hf_triaccel.integrations.trainer import TriAccelArguments, TriAccelTrainer  # noqa: E402
from hf_triaccel.memory.elastic import ElasticBatchController  # noqa: E402
from hf_triaccel.testing import CountingProbe, OOMInBackward, oom  # noqa: E402
from tests.integrations import tiny  # noqa: E402
from tests.integrations.tiny import Logs, TokenSet, tiny_gpt2  # noqa: E402


class ElasticTrainer(TriAccelTrainer):
    """TriAccelTrainer with elastic batching and the controller's arguments (fake probes)."""

    def __init__(self, *args, elastic: dict | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.enable_elastic_batch(**(elastic or {}))


def tokens() -> TokenSet:
    return TokenSet(n=32, seq=8, masked=True)  # uneven token counts


def gpt2(limit: int | None = None, armed: list[bool] | None = None):
    """GPT-2 without dropout (pieces draw different masks than the whole batch), with an
    OOM for more than ``limit`` sequences and an OOM in the backward while ``armed``."""
    model = tiny_gpt2(n_embd=16, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    if limit is not None:

        def too_big(module, args, kwargs):
            if kwargs["input_ids"].shape[0] > limit:
                raise oom()

        model.register_forward_pre_hook(too_big, with_kwargs=True)
    if armed is not None:

        def fail_in_backward(module, args, output):
            hidden = output[0] if isinstance(output, tuple) else output
            hidden = OOMInBackward.apply(hidden, armed)
            return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

        model.transformer.h[0].register_forward_hook(fail_in_backward)
    return model


def make_args(tmp_path, **kw) -> TriAccelArguments:
    """Three steps, each logged and each a Fisher refresh."""
    return tiny.make_args(
        tmp_path, **{"logging_steps": 1, "adafisher_update_every": 1, "max_steps": 3, **kw}
    )


class VectorSet(Dataset):
    def __init__(self, n: int = 32) -> None:
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 6, generator=gen)
        self.y = torch.randint(0, 3, (n,), generator=gen)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


class FaultyMLP(nn.Module):
    """A plain MLP with an OOM for more than ``limit`` samples and one in the backward,
    between the two layers, while ``armed``."""

    def __init__(self, limit: int | None = None, armed: list[bool] | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = nn.Linear(6, 12), nn.Linear(12, 3)
        self.limit, self.armed = limit, armed or [False]

    def forward(self, x):
        if self.limit is not None and x.shape[0] > self.limit:
            raise oom()
        return self.down(OOMInBackward.apply(torch.tanh(self.up(x)), self.armed))


CASES = {
    # GPT-2's loss is normalised by the Trainer's token count: pieces are added as they are.
    # (AdaFisher is left out here: the statistic of its position embedding, broadcast over
    # the batch, depends on the micro-batch size.)
    "gpt2-adamw": (gpt2, tokens, "adamw_torch"),
    # a plain module's mean loss: pieces are weighted by their share of the batch
    "mlp-adafisherw": (FaultyMLP, VectorSet, "adafisherw"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_trainer_matches_an_uninterrupted_run(tmp_path, case):
    make_model, make_data, optim = CASES[case]
    reference = make_model()
    plain = TriAccelTrainer(
        model=reference, args=make_args(tmp_path / "ref", optim=optim), train_dataset=make_data()
    )
    plain.train()

    armed = [True]  # the first backward fails once, after the top layers' gradients
    model = make_model(limit=2, armed=armed)
    reported = Logs()
    trainer = ElasticTrainer(
        model=model,
        args=make_args(tmp_path / "elastic", optim=optim),
        train_dataset=make_data(),
        callbacks=[reported],
    )
    trainer.train()
    controller = trainer.elastic.controller
    assert [(e.step, e.old, e.new, e.reason) for e in controller.events] == [
        (0, 8, 4, "oom"),
        (0, 4, 2, "oom"),
        (0, 2, 1, "oom"),  # the backward OOM
    ]
    assert not armed[0] and controller.steps == 3
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=2e-5, atol=2e-6, msg=name)
    logs = [e for e in trainer.state.log_history if "loss" in e]
    ref_logs = [e for e in plain.state.log_history if "loss" in e]
    assert [e["loss"] for e in logs] == pytest.approx([e["loss"] for e in ref_logs], rel=1e-5)
    assert reported.entries[-2]["micro_batch"] == 1 and reported.entries[-2]["accumulation"] == 8


def _saved_state(checkpoint) -> dict:
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    return state["stateful_callbacks"]["ElasticBatchState"]["attributes"]["saved"]


@pytest.mark.parametrize("restore_callbacks", [False, True])
def test_checkpoint_keeps_the_micro_batch(tmp_path, restore_callbacks):
    common = dict(
        max_steps=4,
        save_strategy="steps",
        save_steps=2,
        optim="adamw_torch",
        restore_callback_states_from_checkpoint=restore_callbacks,
    )
    first = ElasticTrainer(
        model=FaultyMLP(limit=3), args=make_args(tmp_path, **common), train_dataset=VectorSet()
    )
    first.train()
    state = _saved_state(tmp_path / "checkpoint-2")
    assert state["micro_batch"] == 2 and state["steps"] == 2
    assert [e["reason"] for e in state["events"]] == ["oom", "oom"]
    assert not (tmp_path / "checkpoint-2" / LEGACY_STATE_NAME).exists()

    resumed = ElasticTrainer(
        model=FaultyMLP(),
        args=make_args(tmp_path, **common, output_dir=str(tmp_path / "b")),
        train_dataset=VectorSet(),
    )
    assert resumed.elastic.controller.micro_batch == 8
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert resumed.elastic.controller.micro_batch == 2
    assert resumed.elastic.controller.steps == 4
    # the state exported at the next checkpoint is the live controller's
    assert _saved_state(tmp_path / "b" / "checkpoint-4")["steps"] == 4


def test_auto_find_batch_size_turns_on_elastic_and_keeps_the_arguments(tmp_path):
    args = make_args(tmp_path, auto_find_batch_size=True)
    trainer = TriAccelTrainer(model=gpt2(), args=args, train_dataset=tokens())
    assert trainer.elastic is not None and trainer.eval_pieces is not None
    assert args.auto_find_batch_size and not args.elastic_batch  # as given
    with pytest.warns(UserWarning, match="gradient_accumulation_steps=2"):
        ElasticTrainer(
            model=gpt2(),
            args=make_args(tmp_path, gradient_accumulation_steps=2),
            train_dataset=tokens(),
        )


class EvalLimitMLP(FaultyMLP):
    """Out of memory in evaluation above ``limit`` samples; training never is."""

    def forward(self, x):
        if not self.training and x.shape[0] > self.limit:
            raise oom()
        return self.down(torch.tanh(self.up(x)))


def test_evaluation_oom_splits_the_evaluation_batch_only(tmp_path):
    args = make_args(tmp_path, optim="adamw_torch", per_device_eval_batch_size=8)
    reference = TriAccelTrainer(
        model=FaultyMLP(), args=args, train_dataset=VectorSet(), eval_dataset=VectorSet(16)
    ).evaluate()
    model = EvalLimitMLP(limit=3)
    trainer = ElasticTrainer(
        model=model,
        args=args,
        train_dataset=VectorSet(),
        eval_dataset=VectorSet(16),
        elastic={"probe": CountingProbe()},
    )
    metrics = trainer.evaluate()
    assert trainer.eval_pieces.micro_batch == 2  # 8 -> 4 -> 2
    assert trainer.elastic.controller.micro_batch == 8  # the training batch is untouched
    assert trainer.elastic.probe.releases == 2
    # a batch's loss is the size-weighted mean of its pieces' mean losses: the same
    # number up to float32 rounding of a sum of at most 8 terms (8 * 2**-24 relative)
    assert metrics["eval_loss"] == pytest.approx(reference["eval_loss"], rel=8 * 2**-24)
    trainer.train()
    assert trainer.elastic.controller.events == []


class OOMBeforeOptimizerStep(transformers.TrainerCallback):
    """An out-of-memory error in the optimizer step while the batch is ``limit`` or more
    (the Trainer calls this callback right before ``optimizer.step()``)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if state.train_batch_size >= self.limit:
            raise oom()


def test_optimizer_step_oom_restarts_with_a_smaller_batch(tmp_path):
    """With auto_find_batch_size, an OOM outside forward and backward goes to transformers'
    own search, which restarts the loop with a 10% smaller batch (16 -> 14)."""
    args = make_args(
        tmp_path,
        optim="adamw_torch",
        per_device_train_batch_size=16,
        auto_find_batch_size=True,
        save_strategy="steps",
        save_steps=1,
    )
    trainer = TriAccelTrainer(
        model=FaultyMLP(),
        args=args,
        train_dataset=VectorSet(64),
        callbacks=[OOMBeforeOptimizerStep(16)],
    )
    trainer.train()
    assert trainer.state.train_batch_size == 14 and trainer.state.global_step == 3
    assert args.per_device_train_batch_size == 16
    # resumed, the run takes the batch the search found back from the checkpoint
    resumed = TriAccelTrainer(model=FaultyMLP(), args=args, train_dataset=VectorSet(64))
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.train_batch_size == 14


def test_activation_checkpointing_fallback_uses_the_models_own_switch(tmp_path):
    trainer = ElasticTrainer(
        model=gpt2(),
        args=make_args(tmp_path),
        train_dataset=tokens(),
        elastic={"checkpoint_blocks": 1, "min_micro_batch": 4},
    )
    trainer.elastic.controller.enable_activation_checkpointing()
    # transformers' own switch (named gradient_checkpointing_enable before 5.18) knows the
    # model's layers and their arguments: it is used before any block is wrapped by hand
    checkpointed = trainer.elastic.checkpointed
    assert checkpointed.method in (
        "activation_checkpointing_enable",
        "gradient_checkpointing_enable",
    )
    model = trainer.accelerator.unwrap_model(trainer.model)
    name = "is_" + checkpointed.method.removesuffix("_enable")
    assert getattr(model, name)
    checkpointed.remove()
    assert not getattr(model, name)


# -- AdaFisher in a hand-written loop --------------------------------------------------


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))


def _data():
    gen = torch.Generator().manual_seed(2)
    return [
        (torch.randn(16, 6, generator=gen), torch.randint(0, 3, (16,), generator=gen))
        for _ in range(3)
    ]


def _adafisher_run(elastic: bool, rollback: bool = True):
    model = _mlp()
    opt = AdaFisherW.from_model(model, lr=1e-2, update_every=1, impl="reference")
    armed = [False]
    controller = ElasticBatchController(16, probe=CountingProbe())
    rollbacks = [FisherStatisticsRollback(opt.collector)] if rollback else []

    def loss_fn(piece):
        x, y = piece
        if len(x) > 8:
            raise oom()
        h = OOMInBackward.apply(model[1](model[0](x)), armed)
        return F.cross_entropy(model[2](h), y)

    for step, (x, y) in enumerate(_data()):
        if elastic:
            armed[0] = step == 1
            controller.run_step((x, y), loss_fn, model=model, rollbacks=rollbacks)
        else:
            F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_fisher_rollback_keeps_adafisher_exact():
    full, full_opt = _adafisher_run(elastic=False)
    elastic, elastic_opt = _adafisher_run(elastic=True)
    for p, q in zip(elastic.parameters(), full.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    for name, layer in full_opt.collector.state_dict().items():
        got = elastic_opt.collector.state_dict()[name]
        torch.testing.assert_close(got["a"], layer["a"], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(got["g"], layer["g"], rtol=1e-5, atol=1e-9)

    # without the rollback, the failed attempt's statistics are counted too
    unguarded, unguarded_opt = _adafisher_run(elastic=True, rollback=False)
    g_full = full_opt.collector.state_dict()["2"]["g"]
    assert not torch.allclose(unguarded_opt.collector.state_dict()["2"]["g"], g_full, rtol=1e-5)


def test_fallback_leaves_transformers_checkpointing_alone(tmp_path):
    model = gpt2()
    # transformers 5.24's name, or the older one (5.17)
    enable = getattr(model, "activation_checkpointing_enable", None)
    (enable or model.gradient_checkpointing_enable)()
    trainer = ElasticTrainer(model=model, args=make_args(tmp_path), train_dataset=tokens())
    trainer.elastic.enable_activation_checkpointing()
    assert trainer.elastic.checkpointed is None
