"""The network, the data on the device and test-time augmentation of
``recipes/cifar10_speedrun.py``.

The net is of the airbench class: a frozen 2x2 whitening convolution whose filters come
from the eigen-decomposition of the training patches' covariance (with their negatives,
so that GELU keeps both signs), three blocks of conv -> max-pool -> BatchNorm -> GELU ->
conv -> BatchNorm -> GELU, a max-pool over the last 3x3 map and a bias-free linear head
whose output is scaled down. BatchNorm scales are frozen at one; its biases train.

Example:
    >>> net = SpeedrunNet(widths=(8, 16, 16))
    >>> net(torch.zeros(2, 3, 32, 32)).shape
    torch.Size([2, 10])
"""

from __future__ import annotations

import io
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)
WHITEN_KERNEL = 2
# BatchNorm: torch's momentum is the weight of the new batch's statistics
BN_MOMENTUM = 0.4
BN_EPS = 1e-12
_DECODE_CHUNK = 2500


def _decode_chunk(blobs: list[bytes]) -> np.ndarray:
    from PIL import Image

    return np.stack([np.asarray(Image.open(io.BytesIO(b)).convert("RGB")) for b in blobs])


def decode_split(path: Path, limit: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Decodes a Hub-layout parquet split (columns ``img`` {bytes} and ``label``).

    Args:
        path: the ``{split}.parquet`` file.
        limit: keep only the first ``limit`` rows (the Hub copies are shuffled).

    Returns:
        uint8 images of shape (N, 32, 32, 3) and int64 labels of shape (N,).
    """
    import pyarrow.parquet as pq

    table = pq.read_table(path, columns=["img", "label"])
    if limit is not None:
        table = table.slice(0, limit)
    blobs = table.column("img").combine_chunks().field("bytes").to_pylist()
    labels = table.column("label").to_numpy().astype(np.int64)
    chunks = [blobs[i : i + _DECODE_CHUNK] for i in range(0, len(blobs), _DECODE_CHUNK)]
    if len(chunks) == 1:
        return _decode_chunk(chunks[0]), labels
    with ProcessPoolExecutor(min(len(chunks), os.cpu_count() or 1)) as pool:
        return np.concatenate(list(pool.map(_decode_chunk, chunks))), labels


def normalise(images: np.ndarray, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """uint8 (N, H, W, 3) -> ``dtype`` (N, 3, H, W) on ``device``, per-channel standardised."""
    x = torch.from_numpy(images).to(device).permute(0, 3, 1, 2).float().div_(255)
    mean = torch.tensor(CIFAR_MEAN, device=device).view(1, 3, 1, 1)
    std = torch.tensor(CIFAR_STD, device=device).view(1, 3, 1, 1)
    return ((x - mean) / std).to(dtype).contiguous()


@dataclass
class DeviceData:
    """Training images reflect-padded by ``pad`` pixels, test images, labels, all on the device."""

    train: torch.Tensor
    train_labels: torch.Tensor
    test: torch.Tensor
    test_labels: torch.Tensor
    pad: int

    @classmethod
    def from_arrays(
        cls,
        train: tuple[np.ndarray, np.ndarray],
        test: tuple[np.ndarray, np.ndarray],
        device: torch.device,
        dtype: torch.dtype,
        pad: int,
    ) -> DeviceData:
        x = normalise(train[0], device, dtype)
        if pad:
            x = F.pad(x.float(), (pad,) * 4, mode="reflect").to(dtype)
        return cls(
            train=x,
            train_labels=torch.from_numpy(train[1]).to(device),
            test=normalise(test[0], device, dtype),
            test_labels=torch.from_numpy(test[1]).to(device),
            pad=pad,
        )

    def unpadded_train(self) -> torch.Tensor:
        p = self.pad
        return self.train[..., p : self.train.shape[-2] - p, p : self.train.shape[-1] - p]


def random_crop(padded: torch.Tensor, size: int, dy: torch.Tensor, dx: torch.Tensor):
    """Crops ``padded[n, :, dy[n]:dy[n]+size, dx[n]:dx[n]+size]`` for every n, with two
    gathers (no host synchronisation, unlike masks per offset).

    Example:
        >>> x = torch.arange(2 * 16.0).view(2, 1, 4, 4)
        >>> random_crop(x, 2, torch.tensor([0, 2]), torch.tensor([1, 0]))[:, 0]
        tensor([[[ 1.,  2.],
                 [ 5.,  6.]],
        <BLANKLINE>
                [[24., 25.],
                 [28., 29.]]])
    """
    n, c, h, w = padded.shape
    rows = dy.view(n, 1, 1, 1) + torch.arange(size, device=padded.device).view(1, 1, size, 1)
    x = torch.gather(padded, 2, rows.expand(n, c, size, w))
    cols = dx.view(n, 1, 1, 1) + torch.arange(size, device=padded.device).view(1, 1, 1, size)
    return torch.gather(x, 3, cols.expand(n, c, size, size))


class EpochAugmenter:
    """Alternating flips and random translation, drawn for the whole training set per epoch.

    Half of the images (drawn once) are mirrored in even epochs, the other half in odd
    ones, so every image is seen both ways in any two consecutive epochs. Translation
    takes a random crop of the reflect-padded image (up to ``pad`` pixels each way).

    Example:
        >>> aug = EpochAugmenter(torch.zeros(4, 3, 36, 36), pad=2, generator=torch.Generator())
        >>> aug.epoch(0).shape
        torch.Size([4, 3, 32, 32])
    """

    def __init__(self, padded: torch.Tensor, pad: int, generator: torch.Generator) -> None:
        self.padded = padded
        self.pad = pad
        self.generator = generator
        n = padded.shape[0]
        self.flip_even = torch.rand(n, generator=generator, device=generator.device) < 0.5
        self.flip_even = self.flip_even.to(padded.device)

    def flips(self, epoch: int) -> torch.Tensor:
        """Which images are mirrored in ``epoch`` (bool, one per image)."""
        return self.flip_even ^ bool(epoch % 2)

    def epoch(self, epoch: int) -> torch.Tensor:
        x = self.padded
        n, size = x.shape[0], x.shape[-1] - 2 * self.pad
        if self.pad:
            offsets = torch.randint(
                0, 2 * self.pad + 1, (2, n), generator=self.generator, device=self.generator.device
            ).to(x.device)
            x = random_crop(x, size, offsets[0], offsets[1])
        return torch.where(self.flips(epoch).view(n, 1, 1, 1), x.flip(-1), x)


def whitening_filters(images: torch.Tensor, eps: float = 5e-4) -> torch.Tensor:
    """Filters (2 * 3k^2, 3, k, k) that whiten the k x k patches of ``images`` (k = 2):
    rows of V^T / sqrt(lambda + eps) for the eigenpairs of the patches' uncentred
    covariance, followed by their negatives.

    Example:
        >>> whitening_filters(torch.randn(8, 3, 32, 32)).shape
        torch.Size([24, 3, 2, 2])
    """
    k = WHITEN_KERNEL
    c = images.shape[1]
    patches = images.float().unfold(2, k, 1).unfold(3, k, 1)  # (N, C, H', W', k, k)
    patches = patches.permute(0, 2, 3, 1, 4, 5).reshape(-1, c * k * k).double()
    covariance = patches.T @ patches / patches.shape[0]
    eigenvalues, eigenvectors = torch.linalg.eigh(covariance)
    filters = eigenvectors.T / (eigenvalues + eps).sqrt().unsqueeze(1)
    filters = filters.view(-1, c, k, k).float()
    return torch.cat([filters, -filters])


class ConvBlock(nn.Module):
    """conv -> max-pool 2 -> BatchNorm -> GELU -> conv -> BatchNorm -> GELU."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)
        self.pool = nn.MaxPool2d(2)
        self.norm1 = nn.BatchNorm2d(c_out, eps=BN_EPS, momentum=BN_MOMENTUM)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.norm2 = nn.BatchNorm2d(c_out, eps=BN_EPS, momentum=BN_MOMENTUM)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.norm1(self.pool(self.conv1(x))))
        return self.act(self.norm2(self.conv2(x)))


class SpeedrunNet(nn.Module):
    """The airbench-class CIFAR net (see the module docstring).

    Args:
        widths: output channels of the three blocks.
        num_classes: classes of the head.
        scale: factor applied to the head's output.
    """

    def __init__(
        self,
        widths: tuple[int, int, int] = (64, 256, 256),
        num_classes: int = 10,
        scale: float = 1 / 9,
    ) -> None:
        super().__init__()
        whiten_out = 2 * 3 * WHITEN_KERNEL**2
        self.whiten = nn.Conv2d(3, whiten_out, WHITEN_KERNEL, padding=0, bias=True)
        self.whiten.weight.requires_grad_(False)
        self.act = nn.GELU()
        self.block1 = ConvBlock(whiten_out, widths[0])
        self.block2 = ConvBlock(widths[0], widths[1])
        self.block3 = ConvBlock(widths[1], widths[2])
        self.pool = nn.AdaptiveMaxPool2d(1)
        self.head = nn.Linear(widths[2], num_classes, bias=False)
        self.scale = scale
        for module in self.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.weight.requires_grad_(False)

    def filters(self) -> list[nn.Parameter]:
        """The trained convolution filters (every block's two)."""
        return [
            m.weight for m in self.modules() if isinstance(m, nn.Conv2d) and m is not self.whiten
        ]

    @torch.no_grad()
    def reset(self, whitening: torch.Tensor) -> None:
        """Re-initialises every parameter and statistic in place (a compiled copy stays
        valid): default init, identity (Dirac) init of the first ``c_in`` filters of
        each conv, whitening filters from ``whitening``."""
        for module in self.modules():
            if isinstance(module, nn.Conv2d | nn.Linear | nn.BatchNorm2d):
                module.reset_parameters()
            if isinstance(module, nn.BatchNorm2d):
                module.reset_running_stats()
        for w in self.filters():
            nn.init.dirac_(w[: w.shape[1]])
        self.whiten.weight.copy_(whitening)
        self.whiten.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.whiten(x))
        x = self.block3(self.block2(self.block1(x)))
        return self.head(self.pool(x).flatten(1)) * self.scale


# Test-time augmentation: the image and its mirror, each weighted 1/4, and the mirrored
# pairs of the two one-pixel diagonal translations (reflect padding), each 1/8.
TTA_WEIGHTS = (0.25, 0.25, 0.125, 0.125, 0.125, 0.125)


def tta_views(x: torch.Tensor) -> torch.Tensor:
    """The six views of ``x`` that :data:`TTA_WEIGHTS` weights, stacked along the batch."""
    h, w = x.shape[-2:]
    padded = F.pad(x, (1, 1, 1, 1), mode="reflect")
    up_left, down_right = padded[..., :h, :w], padded[..., 2:, 2:]
    return torch.cat([v for s in (x, up_left, down_right) for v in (s, s.flip(-1))])


@torch.no_grad()
def count_correct(
    model: nn.Module, images: torch.Tensor, labels: torch.Tensor, batch: int, tta: bool
) -> torch.Tensor:
    """Correct predictions on ``images`` as a device tensor (no host synchronisation).

    Example:
        >>> net = SpeedrunNet(widths=(8, 8, 8)).eval()
        >>> int(count_correct(net, torch.zeros(4, 3, 32, 32), torch.zeros(4, dtype=torch.long),
        ...                   batch=2, tta=True)) in range(5)
        True
    """
    weights = torch.tensor(TTA_WEIGHTS, device=images.device).view(-1, 1, 1)
    correct = torch.zeros((), dtype=torch.long, device=images.device)
    for i in range(0, images.shape[0], batch):
        x, y = images[i : i + batch], labels[i : i + batch]
        if tta:
            logits = model(tta_views(x)).float().view(len(TTA_WEIGHTS), x.shape[0], -1)
            logits = (logits * weights).sum(0)
        else:
            logits = model(x)
        correct += (logits.argmax(1) == y).sum()
    return correct
