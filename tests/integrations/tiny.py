"""Tiny models and datasets for the Trainer integration tests (CPU, a second or two each)."""

from __future__ import annotations

import torch
import transformers
from torch import nn
from torch.utils.data import Dataset


class Logs(transformers.TrainerCallback):
    """The logs as the reporting callbacks receive them (telemetry included)."""

    def __init__(self) -> None:
        self.entries: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.entries.append(dict(logs))


class ImageSet(Dataset):
    """Random ``size`` x ``size`` images with fixed labels, in the Trainer's dict-of-tensors
    form."""

    def __init__(self, n: int = 32, seed: int = 0, size: int = 16) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 3, size, size, generator=gen)
        self.y = torch.randint(0, 10, (n,), generator=gen)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"pixel_values": self.x[i], "labels": self.y[i]}


class TokenSet(Dataset):
    """Token sequences whose labels are the inputs (causal LM); with ``masked``, about half
    of the first four labels of each sequence are -100, so sequences count unequal tokens."""

    def __init__(self, n: int = 16, seq: int = 12, vocab: int = 64, masked: bool = False) -> None:
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, seq), generator=gen)
        self.labels = self.ids.clone()
        if masked:
            self.labels[:, :4][torch.rand(n, 4, generator=gen) < 0.5] = -100

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


class VectorSet(Dataset):
    """Vectors ``x`` with class labels."""

    def __init__(self, n: int = 32, key: str = "x") -> None:
        gen = torch.Generator().manual_seed(0)
        self.key = key
        self.x = torch.randn(n, 6, generator=gen)
        self.y = torch.randint(0, 3, (n,), generator=gen)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {self.key: self.x[i], "labels": self.y[i]}


class MLP(nn.Module):
    """``forward(x) -> logits``, timm's convention: no loss, no keyword inputs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up, self.norm, self.down = nn.Linear(6, 12), nn.LayerNorm(12), nn.Linear(12, 3)

    def forward(self, x):
        return self.down(torch.tanh(self.norm(self.up(x))))


def tiny_timm():
    import timm

    torch.manual_seed(0)
    return timm.create_model("test_resnet", num_classes=10)


def tiny_gpt2(**config):
    """A one-block GPT-2 (``config`` overrides its settings)."""
    torch.manual_seed(0)
    settings = dict(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**settings, **config}))


def make_args(tmp_path, **kw):
    from hf_triaccel.integrations.trainer_args import TriAccelArguments

    defaults = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_steps=2,
        seed=0,
        adafisher_update_every=2,
        disable_tqdm=True,
    )
    defaults.update(kw)
    return TriAccelArguments(**defaults)


WORDS = ["the", "a", "cat", "dog", "sat", "ran", "on", "to", "mat", "park", "and"]


def word_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A tokenizer built here, without the Hub: one id per word of :data:`WORDS`, after
    ``[PAD]``, ``[UNK]`` and ``[EOS]``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[PAD]": 0, "[UNK]": 1, "[EOS]": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]"
    )
