"""Device-resident image batches for the Trainer: sharding, epochs, resume."""

from __future__ import annotations

import pytest
import torch

timm = pytest.importorskip("timm")

from hf_triaccel.data.images import ImageTensors  # noqa: E402
from hf_triaccel.integrations.trainer import TriAccelArguments, TriAccelTrainer  # noqa: E402
from hf_triaccel.integrations.trainer_data import DeviceImageDataLoader  # noqa: E402


def tiny_images(n: int = 40, classes: int = 10) -> ImageTensors:
    """Random images; with ``classes == n`` each label is its sample's id."""
    gen = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (n, 3, 8, 8), dtype=torch.uint8, generator=gen)
    return ImageTensors(images, torch.arange(n) % classes, [str(i) for i in range(classes)])


def sample_ids(loader) -> list[int]:
    return [int(i) for batch in loader for i in batch["labels"]]


def test_ranks_see_disjoint_shards_covering_the_epoch():
    data = tiny_images(classes=40)
    shards = []
    for rank in range(3):
        loader = DeviceImageDataLoader(data, 4, rank=rank, world=3, seed=1)
        loader.set_epoch(2)
        shards.append(sample_ids(loader))
    assert all(len(s) == 13 for s in shards)  # 40 // 3 per rank, ranks in step
    flat = [i for s in shards for i in s]
    assert len(set(flat)) == len(flat) == 39


def test_epochs_reshuffle_and_repeat_with_the_seed():
    data = tiny_images(classes=40)
    loader = DeviceImageDataLoader(data, 8, seed=3)
    loader.set_epoch(0)
    first = sample_ids(loader)
    loader.set_epoch(1)
    second = sample_ids(loader)
    again = DeviceImageDataLoader(data, 8, seed=3)
    again.set_epoch(1)
    assert sorted(first) == sorted(second) == list(range(40))
    assert first != second and sample_ids(again) == second


def test_trainer_on_device_images_resumes_exactly(tmp_path):
    def run(out, resume=None):
        torch.manual_seed(0)
        model = timm.create_model("test_resnet", num_classes=10)
        args = TriAccelArguments(
            output_dir=str(out),
            max_steps=6,
            per_device_train_batch_size=8,
            report_to=[],
            use_cpu=True,
            save_strategy="steps",
            save_steps=3,
            disable_tqdm=True,
            seed=0,
            adafisher_update_every=2,
            learning_rate=1e-3,
        )
        trainer = TriAccelTrainer(model=model, args=args, train_dataset=tiny_images())
        trainer.train(resume_from_checkpoint=resume)
        return model

    straight = run(tmp_path / "a")
    resumed = run(tmp_path / "b", resume=str(tmp_path / "a" / "checkpoint-3"))
    for p1, p2 in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p1, p2)
