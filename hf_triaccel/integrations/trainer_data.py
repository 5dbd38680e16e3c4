"""Feeding the Trainer from images held on the device.

The stock Trainer path (a DataLoader over decoded samples, collated on the CPU) runs
several times slower than a device-resident loop on small images (BENCHMARKS.md). Given an
:class:`~hf_triaccel.data.images.ImageTensors`, :class:`TriAccelTrainer` builds the
loader below instead: batches are gathered and augmented on the device by
:class:`~hf_triaccel.data.images.GPUBatchLoader`. It is a real ``DataLoader`` (no
workers), so the Trainer's epoch handling and its skipping of already-seen batches on
resume work unchanged. Its batches are channels-last when the trainer put the model in
that layout (``triaccel_channels_last``).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from hf_triaccel.data.images import EpochPlan, GPUBatchLoader, ImageTensors
from hf_triaccel.integrations import trainer_compat
from hf_triaccel.integrations.trainer_args import setting


class _EpochState:
    """The current epoch's plan, shared by the batch sampler and the dataset."""

    def __init__(self, loader: GPUBatchLoader) -> None:
        self.loader = loader
        self.epoch = -1
        self.plan: EpochPlan | None = None

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.plan = epoch, self.loader.epoch_plan(epoch)


class _PlannedImages(Dataset):
    """Positions of the epoch's order -> a ``{"pixel_values", "labels"}`` batch."""

    def __init__(self, state: _EpochState) -> None:
        self.state = state

    def __len__(self) -> int:
        return len(self.state.loader.data)

    def __getitem__(self, slot: int):
        return self.__getitems__([slot])

    def __getitems__(self, slots: range | list[int]) -> dict[str, torch.Tensor]:
        if self.state.plan is None:
            self.state.set_epoch(0)
        if isinstance(slots, range):
            # views of the epoch's plan: no index tensor to build and no gather of the
            # plan at every batch (a Python list copied from pageable host memory would
            # also make the host wait for the GPU)
            index = slice(slots.start, slots.stop, slots.step)
        else:
            index = torch.as_tensor(slots, device=self.state.loader.data.device)
        images, labels = self.state.loader.gather(self.state.plan, index)
        return {"pixel_values": images, "labels": labels}


class _ShardedBatches(Sampler[range]):
    """This process's batches of epoch positions: rank r takes every world-th position,
    the tail that does not divide evenly is dropped so that ranks stay in step."""

    def __init__(self, state: _EpochState, batch_size: int, rank: int, world: int) -> None:
        self.state, self.batch_size, self.rank, self.world = state, batch_size, rank, world
        self.per_rank = len(state.loader.data) // world

    def set_epoch(self, epoch: int) -> None:
        self.state.set_epoch(epoch)

    def __len__(self) -> int:
        if self.state.loader.drop_last:
            return self.per_rank // self.batch_size
        return -(-self.per_rank // self.batch_size)

    def __iter__(self) -> Iterator[range]:
        slots = range(self.rank, self.per_rank * self.world, self.world)
        for b in range(len(self)):
            yield slots[b * self.batch_size : (b + 1) * self.batch_size]


class DeviceImageDataLoader(DataLoader):
    """A ``DataLoader`` whose batches are built on the device from an ``ImageTensors``.

    Args:
        data: decoded images and labels (moved to ``device`` once).
        batch_size: per-process batch size.
        rank: this process's index, world: the number of processes (DDP sharding).
        device: where the images live and batches are built.
        **loader_kwargs: passed to :class:`GPUBatchLoader` (``augment``, ``seed``,
            ``dtype``, ``mean``, ``std``, ``channels_last``, ``drop_last``...).

    Example:
        >>> from hf_triaccel.data import load_image_dataset
        >>> loader = DeviceImageDataLoader(load_image_dataset(), 64, augment=True)
        >>> batch = next(iter(loader))
        >>> batch["pixel_values"].shape, batch["labels"].shape
        (torch.Size([64, 3, 32, 32]), torch.Size([64]))
    """

    def __init__(
        self,
        data: ImageTensors,
        batch_size: int,
        *,
        rank: int = 0,
        world: int = 1,
        device: torch.device | str | None = None,
        **loader_kwargs,
    ) -> None:
        loader_kwargs.setdefault("shuffle", True)
        batches = GPUBatchLoader(data, batch_size, device=device, **loader_kwargs)
        state = _EpochState(batches)
        super().__init__(
            _PlannedImages(state),
            batch_sampler=_ShardedBatches(state, batch_size, rank, world),
            collate_fn=_identity,
            num_workers=0,
        )

    def set_epoch(self, epoch: int) -> None:
        """Selects the epoch's order and augmentation (called by the Trainer)."""
        self.batch_sampler.set_epoch(epoch)


def _identity(batch):
    """The dataset already returns whole batches."""
    return batch


class DeviceImagesMixin:
    """Trainer mixin: an :class:`~hf_triaccel.data.images.ImageTensors` train or eval
    dataset is fed by a :class:`DeviceImageDataLoader` (batch, shards and seed from the
    arguments, normalised with the training set's statistics, channels-last when the
    trainer's ``channels_last`` is set); other datasets by the Trainer's own loaders."""

    def get_train_dataloader(self):
        if not isinstance(self.train_dataset, ImageTensors):
            return super().get_train_dataloader()
        return self._device_loader(
            self.train_dataset,
            trainer_compat.train_batch_size(self),
            shuffle=True,
            augment=setting(self.args, "device_data_augment"),
            drop_last=self.args.dataloader_drop_last,
        )

    def get_eval_dataloader(self, eval_dataset=None):
        dataset = self.eval_dataset if eval_dataset is None else eval_dataset
        if not isinstance(dataset, ImageTensors):
            return super().get_eval_dataloader(eval_dataset)
        return self._device_loader(
            dataset, self.args.eval_batch_size, shuffle=False, augment=False, drop_last=False
        )

    def _device_loader(self, data: ImageTensors, batch_size: int, **kwargs):
        """Batches built on the device, normalised with the training set's statistics."""
        stats = self.train_dataset if isinstance(self.train_dataset, ImageTensors) else data
        # computed once: each evaluation builds a new loader, and the statistics take a
        # pass over every training image
        cached = getattr(self, "_pixel_stats", None)
        if cached is None or cached[0] is not stats:
            self._pixel_stats = cached = (stats, stats.channel_stats())
        mean, std = cached[1]
        return DeviceImageDataLoader(
            data,
            batch_size,
            rank=self.args.process_index,
            world=self.args.world_size,
            device=self.args.device,
            seed=self.args.seed,
            mean=mean,
            std=std,
            channels_last=getattr(self, "channels_last", False),
            **kwargs,
        )
