"""Every model the stock Trainer trains trains with TriAccelTrainer, with the same loss;
the loss path looked up once per model, without keeping models alive."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

transformers = pytest.importorskip("transformers")

from hf_triaccel.integrations.trainer import TriAccelTrainer  # noqa: E402
from hf_triaccel.integrations.trainer_loss import LossRoutes  # noqa: E402
from tests.integrations.tiny import ImageSet, TokenSet, make_args, tiny_gpt2, tiny_timm  # noqa: E402


class Pixels(nn.Module):
    """forward(pixel_values, labels) in the Hugging Face convention, returning ``kind``."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 10))

    def forward(self, pixel_values, labels=None):
        logits = self.head(pixel_values)
        loss = None if labels is None else F.cross_entropy(logits, labels)
        if self.kind == "tuple":
            return (loss, logits) if loss is not None else (logits,)
        if self.kind == "model_output":
            return transformers.modeling_outputs.SequenceClassifierOutput(loss=loss, logits=logits)
        if self.kind == "logits_only":
            return {"logits": logits}
        return {"loss": loss, "logits": logits}


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(6, 3), nn.Linear(4, 3)

    def forward(self, first, second, labels=None):
        logits = self.a(first) + self.b(second)
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


class PairSet(Dataset):
    def __init__(self, n: int = 16) -> None:
        gen = torch.Generator().manual_seed(0)
        self.a, self.b = torch.randn(n, 6, generator=gen), torch.randn(n, 4, generator=gen)
        self.y = torch.randint(0, 3, (n,), generator=gen)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i):
        return {"first": self.a[i], "second": self.b[i], "labels": self.y[i]}


class OwnLabelName(nn.Module):
    """Labels under another name, given with ``label_names``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(6, 3)

    def forward(self, x, target=None):
        logits = self.lin(x)
        return {"loss": F.cross_entropy(logits, target), "logits": logits}


class TargetSet(PairSet):
    def __getitem__(self, i):
        return {"x": self.a[i], "target": self.y[i]}


class PeftShaped(nn.Module):
    """A wrapper around a PreTrainedModel that forwards keyword arguments, as PEFT's
    PeftModel does."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.base_model = base

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        return self.base_model(
            input_ids=input_ids, attention_mask=attention_mask, labels=labels, **kwargs
        )


class Sentences(Dataset):
    """Tokenized sentences of different lengths, to be padded by DataCollatorWithPadding."""

    def __init__(self, tokenizer, n: int = 8) -> None:
        words = ["a b c", "b c", "c a b a", "a", "b b c c a", "c", "a c", "b a c a b"]
        self.items = [dict(tokenizer(words[i % len(words)]), label=i % 2) for i in range(n)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def _bert(tmp_path):
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "b", "c"]))
    tokenizer = transformers.BertTokenizerFast(vocab_file=str(vocab))
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=8,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        num_labels=2,
    )
    model = transformers.BertForSequenceClassification(config)
    collator = transformers.DataCollatorWithPadding(tokenizer)
    return model, Sentences(tokenizer), {"data_collator": collator}


class Regression(nn.Module):
    """transformers' own test model: a plain module taking ``**kwargs`` that returns a
    tuple with the loss first."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Parameter(torch.tensor(0.5)), nn.Parameter(torch.tensor(0.0))

    def forward(self, input_x, labels=None, **kwargs):
        y = input_x * self.a + self.b
        return (y,) if labels is None else (F.mse_loss(y, labels), y)


def _regression_dataset(tmp):
    """A ``datasets.Dataset`` with a ``label`` column (the collator renames it) and a
    column the model does not take (the Trainer drops it)."""
    datasets = pytest.importorskip("datasets")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, generator=gen)
    data = datasets.Dataset.from_dict(
        {"input_x": x.tolist(), "label": (2 * x + 3).tolist(), "extra": x.tolist()}
    )
    return Regression(), data, {}


def _ce(outputs, labels, num_items_in_batch=None):
    return F.cross_entropy(outputs["logits"], labels)


CASES = {
    "dict": lambda tmp: (Pixels("dict"), ImageSet(16), {}),
    "tuple": lambda tmp: (Pixels("tuple"), ImageSet(16), {}),
    "model_output": lambda tmp: (Pixels("model_output"), ImageSet(16), {}),
    "compute_loss_func": lambda tmp: (
        Pixels("logits_only"),
        ImageSet(16),
        {"compute_loss_func": _ce},
    ),
    "two_inputs": lambda tmp: (TwoInputs(), PairSet(), {}),
    "label_names": lambda tmp: (OwnLabelName(), TargetSet(), {"label_names": ["target"]}),
    "peft_shaped": lambda tmp: (PeftShaped(tiny_gpt2()), TokenSet(), {}),
    "gpt2": lambda tmp: (tiny_gpt2(), TokenSet(), {}),
    "bert_padding": _bert,
    "datasets_tuple": _regression_dataset,
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_stock_trainer_models_train_with_the_same_loss(tmp_path, case):
    model, data, extra = CASES[case](tmp_path)
    label_names = extra.pop("label_names", None)
    common = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        max_steps=2,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        label_names=label_names,
    )
    stock = transformers.Trainer(
        model=model, args=transformers.TrainingArguments(**common), train_dataset=data, **extra
    )
    ours = TriAccelTrainer(
        model=model,
        args=make_args(tmp_path / "out", **{**common, "learning_rate": 1e-3}),
        train_dataset=data,
        **extra,
    )
    batch = next(iter(stock.get_train_dataloader()))
    assert sorted(next(iter(ours.get_train_dataloader()))) == sorted(batch)
    model.eval()  # no dropout: both losses from one forward each
    with torch.no_grad():
        expected = stock.compute_loss(model, dict(batch))
        got = ours.compute_loss(model, dict(batch))
    assert torch.equal(got, expected)
    before = [p.detach().clone() for p in model.parameters()]
    ours.train()
    assert torch.isfinite(torch.tensor(ours.state.log_history[-1]["train_loss"]))
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))


def test_timm_model_gets_cross_entropy_on_its_logits(tmp_path):
    """forward(x) -> logits, no loss: the one case the fallback loss applies, with the
    arguments' label smoothing; every dataset column is kept."""
    model = tiny_timm()
    args = make_args(tmp_path, max_steps=1, label_smoothing_factor=0.1)
    trainer = TriAccelTrainer(model=model, args=args, train_dataset=ImageSet())
    batch = next(iter(trainer.get_train_dataloader()))
    assert sorted(batch) == ["labels", "pixel_values"]
    with torch.no_grad():
        loss = trainer.compute_loss(model, batch)
        logits = model(batch["pixel_values"])
    expected = F.cross_entropy(logits, batch["labels"], label_smoothing=0.1)
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)
    trainer.train()
    assert args.label_smoothing_factor == 0.1 and trainer.args is args
    metrics = trainer.evaluate(ImageSet(8, seed=1))
    assert metrics["eval_loss"] > 0


def test_peft_lora_model_trains_with_the_same_loss(tmp_path):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(
        tiny_gpt2(), peft.LoraConfig(r=4, target_modules=["c_attn"], task_type="CAUSAL_LM")
    )
    common = dict(
        per_device_train_batch_size=4,
        max_steps=2,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    stock = transformers.Trainer(
        model=model,
        args=transformers.TrainingArguments(output_dir=str(tmp_path), **common),
        train_dataset=TokenSet(),
    )
    ours = TriAccelTrainer(
        model=model, args=make_args(tmp_path, **common), train_dataset=TokenSet()
    )
    batch = next(iter(stock.get_train_dataloader()))
    model.eval()
    with torch.no_grad():
        assert torch.equal(ours.compute_loss(model, dict(batch)), stock.compute_loss(model, batch))
    ours.train()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert sorted(ours.collector.layers) and all("lora_" in n for n in ours.collector.layers)


# -- the loss path, looked up once per model ----------------------------------------------


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
