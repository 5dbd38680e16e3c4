"""Image classification data held as one uint8 tensor, and a loader that batches it on the device.

Images are loaded and decoded by ``datasets`` (``load_dataset``, the ``Image`` feature,
``map``), once, into a ``(N, 3, H, W)`` uint8 tensor that lives on the training device;
:class:`GPUBatchLoader` shuffles, crops, flips and normalises whole batches there. At
32x32 the per-sample Python work of a ``DataLoader``, not the GPU, would set the pace.

Example:
    >>> train = load_image_dataset("embedded", "train")
    >>> loader = GPUBatchLoader(train, batch_size=256, shuffle=True, augment=True, seed=0)
    >>> images, labels = next(iter(loader))
    >>> images.shape, images.dtype, labels.dtype
    (torch.Size([256, 3, 32, 32]), torch.float32, torch.int64)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

# importable from here too, where the benchmarks and earlier code import it
from hf_triaccel.data.loading import load_image_dataset

__all__ = ["EpochPlan", "GPUBatchLoader", "ImageTensors", "load_image_dataset"]


@dataclass
class ImageTensors:
    """A decoded image classification split.

    Attributes:
        images: uint8 tensor of shape ``(N, 3, H, W)``.
        labels: int64 tensor of shape ``(N,)``.
        class_names: one name per class index.

    Example:
        >>> data = ImageTensors(torch.zeros(4, 3, 8, 8, dtype=torch.uint8),
        ...                     torch.tensor([0, 1, 1, 0]), ["cat", "dog"])
        >>> len(data), data.num_classes
        (4, 2)
    """

    images: torch.Tensor
    labels: torch.Tensor
    class_names: list[str]

    def __post_init__(self) -> None:
        if self.images.dtype != torch.uint8 or self.images.dim() != 4 or self.images.shape[1] != 3:
            raise ValueError(
                "images must be a uint8 tensor of shape (N, 3, H, W), got "
                f"{self.images.dtype} {tuple(self.images.shape)}"
            )
        if self.labels.shape != (self.images.shape[0],):
            raise ValueError(
                f"labels must have shape ({self.images.shape[0]},), got {tuple(self.labels.shape)}"
            )

    def __len__(self) -> int:
        return self.images.shape[0]

    @property
    def num_classes(self) -> int:
        """The number of classes (from the class names)."""
        return len(self.class_names)

    @property
    def device(self) -> torch.device:
        """Where the images live."""
        return self.images.device

    def to(self, device: torch.device | str) -> ImageTensors:
        """A copy on ``device`` (``self`` when already there).

        Example:
            >>> gpu_data = data.to("cuda")  # doctest: +SKIP
        """
        device = torch.device(device)
        if self.images.device == device and self.labels.device == device:
            return self
        return ImageTensors(self.images.to(device), self.labels.to(device), self.class_names)

    def channel_stats(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """Per-channel mean and standard deviation of the pixels, scaled to [0, 1].

        Computed in float64 chunks, so a large uint8 tensor is never copied whole to float.

        Example:
            >>> mean, std = ImageTensors(torch.full((2, 3, 4, 4), 255, dtype=torch.uint8),
            ...                          torch.zeros(2, dtype=torch.long), ["a"]).channel_stats()
            >>> mean, std
            ((1.0, 1.0, 1.0), (0.0, 0.0, 0.0))
        """
        total = torch.zeros(3, dtype=torch.float64, device=self.images.device)
        total_sq = torch.zeros_like(total)
        for chunk in self.images.split(4096):
            x = chunk.to(torch.float64)
            total += x.sum(dim=(0, 2, 3))
            total_sq += x.square().sum(dim=(0, 2, 3))
        count = self.images.numel() / 3
        mean = total / count
        std = (total_sq / count - mean.square()).clamp_min(0).sqrt()
        return tuple((mean / 255).tolist()), tuple((std / 255).tolist())


@dataclass(frozen=True)
class EpochPlan:
    """One epoch's sample order and per-position augmentation (crop offsets, flips)."""

    order: torch.Tensor
    offsets: torch.Tensor | None
    flips: torch.Tensor | None


class GPUBatchLoader:
    """Batches an :class:`ImageTensors` on its device, with batched augmentation.

    Each epoch visits every sample exactly once, in an order drawn from a generator seeded
    with ``(seed, epoch)``; the augmentation of every sample is drawn at the same time. An
    epoch therefore depends on nothing but the seed and its number, which is what makes
    :meth:`state_dict` / :meth:`load_state_dict` resume exactly, batch for batch.

    Augmentation (``augment=True``) is a random crop of the image zero-padded by
    ``padding`` pixels, then a random horizontal flip, done as one gather for the whole
    batch. Batches come out normalised with ``mean`` / ``std`` (default: the statistics of
    ``data`` itself; pass the training set's to a test loader).

    The attributes ``epoch`` and ``position`` (batches of that epoch already given out)
    say where iteration stands. A new ``iter()`` continues from there, so a loop that
    breaks off mid-epoch picks up at the next batch; once an epoch is exhausted, the next
    ``iter()`` starts the following epoch.

    Args:
        data: the split; moved to ``device`` once if given.
        batch_size: samples per batch.
        shuffle: new sample order every epoch.
        augment: random crop and horizontal flip.
        drop_last: skip the last batch when it is smaller than ``batch_size``.
        seed: seed of the order and the augmentation.
        device: where to keep the data and build batches (default: where ``data`` is).
        dtype: floating dtype of the image batches.
        mean: per-channel mean in [0, 1] units.
        std: per-channel standard deviation in [0, 1] units.
        padding: zero padding of the random crop, in pixels.
        channels_last: return image batches in channels-last memory format.

    Example:
        >>> train = load_image_dataset("embedded", "train", progress=False)
        >>> device = "cuda" if torch.cuda.is_available() else "cpu"
        >>> loader = GPUBatchLoader(train, 128, shuffle=True, augment=True, device=device)
        >>> for epoch in range(2):  # doctest: +SKIP
        ...     for images, labels in loader:
        ...         ...
        >>> state = loader.state_dict()  # {"epoch": ..., "position": ..., "seed": ...}
    """

    def __init__(
        self,
        data: ImageTensors,
        batch_size: int,
        *,
        shuffle: bool = False,
        augment: bool = False,
        drop_last: bool = False,
        seed: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        padding: int = 4,
        channels_last: bool = False,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if padding < 0:
            raise ValueError(f"padding must be >= 0, got {padding}")
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating type, got {dtype}")
        self.data = data if device is None else data.to(device)
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.augment = augment
        self.drop_last = drop_last
        self.seed = seed
        self.dtype = dtype
        self.padding = padding
        self.channels_last = channels_last
        if mean is None or std is None:
            data_mean, data_std = self.data.channel_stats()
            mean = data_mean if mean is None else mean
            std = data_std if std is None else std
        dev = self.data.device
        std_t = torch.tensor(std, dtype=torch.float32, device=dev).view(1, 3, 1, 1)
        mean_t = torch.tensor(mean, dtype=torch.float32, device=dev).view(1, 3, 1, 1)
        # (x / 255 - mean) / std as one multiply-add on the uint8 values
        self._scale = 1.0 / (255.0 * std_t)
        self._shift = -mean_t / std_t
        self.epoch = 0
        self.position = 0

    def __len__(self) -> int:
        n = len(self.data)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def state_dict(self) -> dict[str, int]:
        """Epoch, batches already given out in it, and seed.

        Example:
            >>> loader.state_dict()  # doctest: +SKIP
            {'epoch': 3, 'position': 17, 'seed': 0}
        """
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continues from a :meth:`state_dict`: the next batch is the one that followed it."""
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self.seed = int(state["seed"])

    def epoch_plan(self, epoch: int) -> EpochPlan:
        """Sample order, crop offsets and flips of ``epoch``, drawn on the CPU, then moved.

        A CPU generator seeded with ``(seed, epoch)`` gives the same epochs on every
        device and torch build.
        """
        n = len(self.data)
        gen = torch.Generator().manual_seed((self.seed * 0x9E3779B1 + epoch) % (1 << 63))
        order = torch.randperm(n, generator=gen) if self.shuffle else torch.arange(n)
        offsets = flips = None
        if self.augment:
            offsets = torch.randint(0, 2 * self.padding + 1, (n, 2), generator=gen)
            flips = torch.rand(n, generator=gen) < 0.5
        dev = self.data.device
        return EpochPlan(
            order.to(dev),
            None if offsets is None else offsets.to(dev),
            None if flips is None else flips.to(dev),
        )

    def gather(
        self, plan: EpochPlan, slots: torch.Tensor | slice
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The normalised, augmented batch at positions ``slots`` of the epoch's order."""
        index = plan.order[slots]
        if plan.offsets is None:
            images = self.data.images[index]
        else:
            images = self._crop_flip(index, plan.offsets[slots], plan.flips[slots])
        return self._normalise(images), self.data.labels[index]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self.position >= len(self):
            self.epoch += 1
            self.position = 0
        plan = self.epoch_plan(self.epoch)
        for batch in range(self.position, len(self)):
            start = batch * self.batch_size
            self.position = batch + 1
            yield self.gather(plan, slice(start, start + self.batch_size))

    def _crop_flip(
        self, index: torch.Tensor, offsets: torch.Tensor, flips: torch.Tensor
    ) -> torch.Tensor:
        """Random crop of the zero-padded images plus horizontal flip, as one gather.

        Returns uint8 ``(B, 3, H, W)`` with channels-last strides.
        """
        _, _, height, width = self.data.images.shape
        dev = index.device
        # source row / column of every output pixel; out of range means padding (zero)
        rows = offsets[:, :1] - self.padding + torch.arange(height, device=dev)
        cols = offsets[:, 1:] - self.padding + torch.arange(width, device=dev)
        cols = torch.where(flips[:, None], cols.flip(1), cols)
        row_inside = (rows >= 0) & (rows < height)
        col_inside = (cols >= 0) & (cols < width)
        inside = row_inside[:, :, None] & col_inside[:, None, :]
        rows = rows.clamp(0, height - 1)
        cols = cols.clamp(0, width - 1)
        # the advanced indices around the channel slice put the channel last: (B, H, W, 3)
        pixels = self.data.images[index[:, None, None], :, rows[:, :, None], cols[:, None, :]]
        pixels = pixels * inside[..., None]
        return pixels.permute(0, 3, 1, 2)

    def _normalise(self, images: torch.Tensor) -> torch.Tensor:
        memory_format = torch.channels_last if self.channels_last else torch.contiguous_format
        # in place, so that the memory format chosen here is the one returned
        x = (
            images.to(torch.float32, memory_format=memory_format)
            .mul_(self._scale)
            .add_(self._shift)
        )
        return x if self.dtype == torch.float32 else x.to(self.dtype)
