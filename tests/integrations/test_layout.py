"""channels_last by default for convolutional models and their batches, and saves that
write contiguous weights (CPU)."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch
from torch import nn

timm = pytest.importorskip("timm")
transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

from hf_triaccel.data.images import ImageTensors  # noqa: E402
from hf_triaccel.integrations.layout import channels_last_batch, to_channels_last  # noqa: E402
from hf_triaccel.integrations.plugin import TriAccelPlugin, prepare_triaccel  # noqa: E402
from hf_triaccel.integrations.timm_models import save_model as save_timm_model  # noqa: E402
from hf_triaccel.integrations.trainer import TriAccelTrainer  # noqa: E402
from tests.integrations.tiny import (  # noqa: E402
    MLP,
    ImageSet,
    VectorSet,
    make_args,
    tiny_timm,
)

CL = torch.channels_last


def conv_weights(model: nn.Module) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.dim() == 4]


def is_channels_last(t: torch.Tensor) -> bool:
    # (a 4-D tensor with 1x1 spatial size, or one channel, is contiguous in both formats)
    return t.is_contiguous(memory_format=CL)


class LayoutProbe(nn.Module):
    """A timm-style conv net that records the memory format of each batch it sees."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Linear(8, 10)
        self.seen: list[bool] = []

    def forward(self, x):
        self.seen.append(is_channels_last(x))
        return self.head(self.conv(x).mean(dim=(2, 3)))


def test_trainer_puts_a_conv_model_and_its_batches_in_channels_last(tmp_path):
    model = LayoutProbe()
    args = make_args(tmp_path, max_steps=2, per_device_train_batch_size=4)
    trainer = TriAccelTrainer(
        model=model, args=args, train_dataset=ImageSet(), eval_dataset=ImageSet(8, seed=1)
    )
    assert trainer.channels_last
    assert all(is_channels_last(w) for w in conv_weights(model))
    trainer.train()
    trainer.evaluate()
    assert len(model.seen) >= 3 and all(model.seen)
    # the optimizer updated the channels-last weights in place: still channels-last
    assert all(is_channels_last(w) for w in conv_weights(model))


def test_the_switch_keeps_the_given_layout(tmp_path):
    model = LayoutProbe()
    args = make_args(
        tmp_path, max_steps=2, per_device_train_batch_size=4, triaccel_channels_last=False
    )
    trainer = TriAccelTrainer(model=model, args=args, train_dataset=ImageSet())
    trainer.train()
    assert not trainer.channels_last
    assert model.seen and not any(model.seen)
    assert all(w.is_contiguous() for w in conv_weights(model))


def test_adamw_runs_keep_the_stock_layout(tmp_path):
    model = LayoutProbe()
    args = make_args(tmp_path, max_steps=1, per_device_train_batch_size=4, optim="adamw_torch")
    trainer = TriAccelTrainer(model=model, args=args, train_dataset=ImageSet())
    trainer.train()
    assert not trainer.channels_last and model.seen and not any(model.seen)
    assert all(w.is_contiguous() for w in conv_weights(model))
    # asked for, it applies to any optimizer
    args = make_args(tmp_path, optim="adamw_torch", triaccel_channels_last=True)
    assert TriAccelTrainer(model=LayoutProbe(), args=args, train_dataset=ImageSet()).channels_last


def test_a_model_without_2d_convolutions_is_left_as_it_is(tmp_path):
    model = MLP()
    strides = [p.stride() for p in model.parameters()]
    trainer = TriAccelTrainer(
        model=model, args=make_args(tmp_path, max_steps=1), train_dataset=VectorSet()
    )
    trainer.train()
    assert not trainer.channels_last
    assert [p.stride() for p in model.parameters()] == strides


def test_model_init_models_are_converted_too(tmp_path):
    trainer = TriAccelTrainer(
        model_init=LayoutProbe,
        args=make_args(tmp_path, max_steps=1, per_device_train_batch_size=4),
        train_dataset=ImageSet(),
    )
    trainer.train()
    assert trainer.channels_last and all(trainer.model.seen)
    assert all(is_channels_last(w) for w in conv_weights(trainer.model))


def test_the_device_image_loader_gives_channels_last_batches(tmp_path):
    gen = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (16, 3, 8, 8), dtype=torch.uint8, generator=gen)
    data = ImageTensors(images, torch.arange(16) % 10, [str(i) for i in range(10)])
    model = LayoutProbe()
    trainer = TriAccelTrainer(
        model=model,
        args=make_args(tmp_path, max_steps=2, per_device_train_batch_size=8),
        train_dataset=data,
    )
    batch = next(iter(trainer.get_train_dataloader()))
    assert is_channels_last(batch["pixel_values"])
    trainer.train()
    assert model.seen and all(model.seen)


def test_channels_last_batch_converts_images_only():
    images, mask = torch.rand(2, 3, 4, 4), torch.ones(2, 1, 4, 4, dtype=torch.bool)
    batch = {"pixel_values": images, "labels": torch.tensor([1, 0]), "mask": mask}
    out = channels_last_batch(batch)
    assert is_channels_last(out["pixel_values"]) and torch.equal(out["pixel_values"], images)
    assert out["labels"] is batch["labels"] and out["mask"] is mask
    ready = channels_last_batch(out)
    assert ready is out  # nothing left to convert: the same batch, no copy
    uint8 = torch.zeros(2, 3, 4, 4, dtype=torch.uint8)
    assert is_channels_last(channels_last_batch([uint8, 3])[0])
    assert channels_last_batch(torch.zeros(2, 3, 4)).is_contiguous()  # not 4-D


def test_only_4d_tensors_change_in_a_model_with_3d_convolutions():
    model = nn.Sequential(nn.Conv3d(1, 2, 3), nn.Flatten(0, 1), nn.Conv2d(2, 4, 3))
    assert to_channels_last(model)
    assert model[0].weight.is_contiguous() and is_channels_last(model[2].weight)


# -- saving -----------------------------------------------------------------------------


def _loaded_equal(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    own = model.state_dict()
    assert set(state) == set(own)
    for name, tensor in own.items():
        assert torch.equal(state[name], tensor), name


def test_trainer_checkpoints_and_save_model_write_contiguous_weights(tmp_path):
    """A channels-last model (converted by the trainer, or given so) saves: checkpoints
    and save_model write safetensors that load back equal, the model keeps its layout."""
    model = tiny_timm().to(memory_format=CL)
    args = make_args(tmp_path, max_steps=2, save_strategy="steps", save_steps=2)
    trainer = TriAccelTrainer(model=model, args=args, train_dataset=ImageSet())
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    for folder in (tmp_path / "checkpoint-2", tmp_path / "final"):
        _loaded_equal(model, safetensors.torch.load_file(folder / "model.safetensors"))
    assert all(is_channels_last(w) for w in conv_weights(model))


def test_resume_from_a_channels_last_checkpoint_is_exact(tmp_path):
    common = dict(max_steps=4, save_strategy="steps", save_steps=2, per_device_train_batch_size=8)
    straight = tiny_timm()
    TriAccelTrainer(
        model=straight, args=make_args(tmp_path / "a", **common), train_dataset=ImageSet()
    ).train()
    resumed = tiny_timm()
    trainer = TriAccelTrainer(
        model=resumed, args=make_args(tmp_path / "b", **common), train_dataset=ImageSet()
    )
    trainer.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))
    assert trainer.channels_last
    assert all(is_channels_last(w) for w in conv_weights(resumed))
    for (n, p1), p2 in zip(straight.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p1, p2), n


def _tiny_hf_resnet():
    torch.manual_seed(0)
    config = transformers.ResNetConfig(
        num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=10
    )
    return transformers.ResNetForImageClassification(config)


def test_pretrained_model_saves_through_save_pretrained_and_loads_equal(tmp_path):
    model = _tiny_hf_resnet()
    trainer = TriAccelTrainer(
        model=model,
        args=make_args(tmp_path, max_steps=2, per_device_train_batch_size=4),
        train_dataset=ImageSet(),
    )
    assert trainer.channels_last
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    loaded = transformers.ResNetForImageClassification.from_pretrained(tmp_path / "final")
    _loaded_equal(model, loaded.state_dict())


def test_timm_save_for_hf_of_a_channels_last_model_loads_equal(tmp_path):
    model = tiny_timm()
    assert to_channels_last(model)
    save_timm_model(model, tmp_path)
    assert all(is_channels_last(w) for w in conv_weights(model))
    _loaded_equal(model, safetensors.torch.load_file(tmp_path / "model.safetensors"))


# -- the Accelerate helper --------------------------------------------------------------


def test_prepare_triaccel_puts_a_conv_model_in_channels_last():
    model = LayoutProbe()
    run = prepare_triaccel(accelerate.Accelerator(cpu=True), model, TriAccelPlugin())
    assert run.channels_last and all(is_channels_last(w) for w in conv_weights(model))
    batch = run.batch({"pixel_values": torch.randn(2, 3, 8, 8), "labels": torch.tensor([0, 1])})
    run.model(batch["pixel_values"])
    assert model.seen == [True]
    off = prepare_triaccel(
        accelerate.Accelerator(cpu=True), LayoutProbe(), TriAccelPlugin(channels_last=False)
    )
    assert not off.channels_last and all(w.is_contiguous() for w in conv_weights(off.model))
    assert off.batch(torch.randn(2, 3, 8, 8)).is_contiguous()


# -- FSDP2 ------------------------------------------------------------------------------


class PatchNet(nn.Module):
    """A ViT-style patch embedding (a strided 2-D convolution) and a Linear head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.patch = nn.Conv2d(3, 8, 4, stride=4)
        self.head = nn.Linear(8 * 16, 3)

    def forward(self, x):
        return self.head(self.patch(x).flatten(1))


def _layout_batches():
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 3, 16, 16, generator=gen), torch.arange(4) % 3) for _ in range(3)]


def _train(model: nn.Module, channels_last: bool) -> None:
    from hf_triaccel import AdaFisherW

    # the layouts' float32 roundings differ; the step size scales what they leave
    opt = AdaFisherW.from_model(model, lr=1e-3, update_every=1)
    for x, y in _layout_batches():
        x = channels_last_batch(x) if channels_last else x
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def _fsdp2_runs(rank: int, world: int) -> dict:
    """The default conversion (the run's environment says FSDP2) then ``fully_shard``, in
    each arrangement; and a conversion of a model already sharded."""
    from torch.distributed.fsdp import fully_shard

    from hf_triaccel.integrations.layout import fsdp2_layout, shards_with_fsdp2

    out = {"detected": shards_with_fsdp2(), "default": fsdp2_layout()}
    for layout in ("inputs", "weights"):
        model = PatchNet()
        assert to_channels_last(model, layout=layout)  # before sharding, as prepare_triaccel
        fully_shard(model)
        seen: list[tuple[int, ...]] = []
        model.patch.register_forward_pre_hook(
            lambda m, args, seen=seen: seen.append(m.weight.stride())
        )
        _train(model, channels_last=True)
        out[layout] = {
            "params": [p.full_tensor() for p in model.parameters()],
            "weight_seen": seen[0],
            "contiguous": model.patch.weight.to_local().is_contiguous(),
        }
    late = fully_shard(PatchNet())
    assert to_channels_last(late)  # after sharding: the DTensors are FSDP2's
    out["late_contiguous"] = late.patch.weight.to_local().is_contiguous()
    return out


@pytest.mark.timeout(120)
def test_fsdp2_shards_a_model_under_the_channels_last_default(tmp_path, monkeypatch):
    """``fully_shard`` refuses non-contiguous parameters: under FSDP2 the default keeps them
    contiguous and trains as the unsharded model in the default layout, in either
    arrangement; ``"weights"`` hands the convolution a channels-last copy of its weight."""
    from hf_triaccel.testing import run_distributed

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # as accelerate launch sets them
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.delenv("HF_TRIACCEL_FSDP2_CHANNELS_LAST", raising=False)
    (run,) = run_distributed(_fsdp2_runs, 1, tmp_path)
    assert run["detected"] and run["default"] == "weights"
    plain = PatchNet()
    _train(plain, channels_last=False)
    for layout in ("inputs", "weights"):
        assert run[layout]["contiguous"]
        for p, q in zip(run[layout]["params"], plain.parameters(), strict=True):
            torch.testing.assert_close(p, q.detach(), rtol=1e-5, atol=1e-6)
    assert run["inputs"]["weight_seen"] == (48, 16, 4, 1)  # the gathered, contiguous weight
    assert run["weights"]["weight_seen"] == (48, 1, 12, 3)  # its channels-last copy
    assert run["late_contiguous"]


def test_fsdp2_layout_is_chosen_by_its_variable(monkeypatch):
    from hf_triaccel.integrations.layout import fsdp2_layout

    monkeypatch.setenv("HF_TRIACCEL_FSDP2_CHANNELS_LAST", "weights")
    assert fsdp2_layout() == "weights"
    monkeypatch.setenv("HF_TRIACCEL_FSDP2_CHANNELS_LAST", "sideways")
    with pytest.raises(ValueError, match="HF_TRIACCEL_FSDP2_CHANNELS_LAST='sideways'"):
        fsdp2_layout()
    with pytest.raises(ValueError, match="layout='sideways'"):
        to_channels_last(PatchNet(), fsdp2=True, layout="sideways")
