"""Image data: loading through ``datasets``, column detection, and the device-side batch loader."""

from __future__ import annotations

import io
import json
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from hf_triaccel.data import GPUBatchLoader, ImageTensors, is_hub_dataset_id, load_image_dataset
from hf_triaccel.data.loading import ClassCountError

CIFAR10_NAMES = [
    "airplane",
    "automobile",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
]


@pytest.fixture(scope="module")
def embedded_train() -> ImageTensors:
    return load_image_dataset("embedded", "train", progress=False)


def _png(pixels: np.ndarray) -> bytes:
    """Lossless encoding; the mode (L, RGB, RGBA) follows the array's shape."""
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def _write_hub_parquet(path, images, labels, *, columns=("img", "label"), names=None) -> None:
    """A parquet file in the Hub's layout: image structs of encoded bytes plus labels."""
    image_col, label_col = columns
    table = pa.table(
        {
            image_col: [{"bytes": b, "path": None} for b in images],
            label_col: pa.array(labels, type=pa.int64()),
        }
    )
    if names is not None:
        features = {
            image_col: {"_type": "Image"},
            label_col: {"names": names, "_type": "ClassLabel"},
        }
        meta = {b"huggingface": json.dumps({"info": {"features": features}}).encode()}
        table = table.replace_schema_metadata(meta)
    pq.write_table(table, path, compression="zstd")


@pytest.fixture
def tiny_pixels() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, (6, 5, 3), dtype=np.uint8) for _ in range(4)]


def test_embedded_splits(embedded_train):
    test = load_image_dataset("embedded", "test", progress=False)
    for data, n in ((embedded_train, 5000), (test, 1000)):
        assert data.images.shape == (n, 3, 32, 32)
        assert data.images.dtype == torch.uint8
        assert data.labels.shape == (n,)
        assert data.labels.dtype == torch.int64
        assert sorted(data.labels.unique().tolist()) == list(range(10))
        assert data.class_names == CIFAR10_NAMES
    # a real photo data set, not a constant: statistics near CIFAR-10's
    mean, std = embedded_train.channel_stats()
    assert mean == pytest.approx((0.49, 0.48, 0.45), abs=0.02)
    assert std == pytest.approx((0.25, 0.24, 0.26), abs=0.02)


def test_embedded_split_must_exist():
    with pytest.raises(ValueError, match="splits"):
        load_image_dataset("embedded", "validation")


def test_hub_schema_round_trip(tmp_path, tiny_pixels):
    gray = tiny_pixels[0][:, :, 0]
    rgba = np.dstack([tiny_pixels[1], np.full((6, 5), 255, np.uint8)])
    images = [_png(tiny_pixels[2]), _png(gray), _png(rgba)]
    _write_hub_parquet(tmp_path / "train.parquet", images, [2, 0, 1], names=["a", "b", "c"])

    for source in (str(tmp_path), str(tmp_path / "train.parquet")):
        data = load_image_dataset(source, "train", progress=False)
        assert data.images.shape == (3, 3, 6, 5)
        assert data.labels.tolist() == [2, 0, 1]
        assert data.class_names == ["a", "b", "c"]
        # PNG is lossless: pixels come back exactly, grayscale and RGBA as RGB
        assert torch.equal(data.images[0], torch.from_numpy(tiny_pixels[2]).permute(2, 0, 1))
        assert torch.equal(data.images[1], torch.from_numpy(gray).expand(3, 6, 5))
        assert torch.equal(data.images[2], torch.from_numpy(tiny_pixels[1]).permute(2, 0, 1))


def test_hub_shards_and_other_schemas(tmp_path, tiny_pixels):
    # uoft-cs/cifar100: img + fine_label; Hub shards in a subfolder; no metadata
    shard_dir = tmp_path / "plain_text"
    shard_dir.mkdir()
    images = [_png(p) for p in tiny_pixels]
    _write_hub_parquet(
        shard_dir / "test-00000-of-00002.parquet", images[:2], [4, 1], columns=("img", "fine_label")
    )
    _write_hub_parquet(
        shard_dir / "test-00001-of-00002.parquet", images[2:], [0, 3], columns=("img", "fine_label")
    )
    data = load_image_dataset(str(tmp_path), "test", progress=False)
    assert data.labels.tolist() == [4, 1, 0, 3]
    assert data.class_names == ["0", "1", "2", "3", "4"]

    # zh-plus/tiny-imagenet: image + label
    _write_hub_parquet(tmp_path / "x.parquet", images[:1], [7], columns=("image", "label"))
    assert load_image_dataset(str(tmp_path / "x.parquet"), progress=False).labels.tolist() == [7]


def test_missing_label_column_is_named(tmp_path, tiny_pixels):
    table = pa.table({"img": [{"bytes": _png(tiny_pixels[0]), "path": None}]})
    pq.write_table(table, tmp_path / "train.parquet")
    with pytest.raises(ValueError, match=r"no label column.*--label_column.*present: \['img'\]"):
        load_image_dataset(str(tmp_path), "train")
    with pytest.raises(ValueError, match="label column 'target' not found"):
        load_image_dataset(str(tmp_path), "train", label_column="target")


def test_local_path_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no test.parquet"):
        load_image_dataset(str(tmp_path), "test")
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_image_dataset(str(tmp_path / "missing.parquet"))


def test_images_of_different_sizes_are_refused(tmp_path, tiny_pixels):
    images = [_png(tiny_pixels[0]), _png(np.zeros((7, 5, 3), np.uint8))]
    _write_hub_parquet(tmp_path / "train.parquet", images, [0, 1])
    with pytest.raises(ValueError, match="image 1 is 5x7 but image 0 is 5x6"):
        load_image_dataset(str(tmp_path), "train", progress=False)


def test_loading_without_datasets_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match="needs the `datasets` package"):
        load_image_dataset("embedded", "train")


def test_parquet_files_are_read_by_datasets(tmp_path, tiny_pixels, monkeypatch):
    datasets = pytest.importorskip("datasets")
    calls = []
    load_dataset = datasets.load_dataset

    def recording_load_dataset(path, *args, **kwargs):
        calls.append((path, kwargs.get("data_files")))
        return load_dataset(path, *args, **kwargs)

    monkeypatch.setattr(datasets, "load_dataset", recording_load_dataset)
    _write_hub_parquet(tmp_path / "train.parquet", [_png(tiny_pixels[0])], [0], names=["a"])
    load_image_dataset(str(tmp_path), "train", progress=False)
    assert calls == [("parquet", [str(tmp_path / "train.parquet")])]


def test_class_count_is_checked_before_decoding(monkeypatch):
    datasets = pytest.importorskip("datasets")

    def no_decoding(*args, **kwargs):
        raise AssertionError("images decoded before the class check")

    monkeypatch.setattr(datasets.Dataset, "map", no_decoding)
    with pytest.raises(
        ClassCountError, match=r"has 10 classes \(airplane, automobile.*not the 100"
    ):
        load_image_dataset("embedded", "train", num_classes=100, progress=False)


@pytest.mark.parametrize("name", ["cifar10_local", "data/cifar10/extra", "../cifar10"])
def test_a_name_that_is_neither_a_path_nor_a_hub_id_fails_at_once(name, monkeypatch):
    datasets = pytest.importorskip("datasets")

    def no_hub(*args, **kwargs):
        raise AssertionError("asked the Hub")

    monkeypatch.setattr(datasets, "load_dataset", no_hub)
    with pytest.raises(FileNotFoundError, match=r"no such file or folder.*owner/name"):
        load_image_dataset(name, "train")


def test_hub_dataset_ids():
    assert is_hub_dataset_id("uoft-cs/cifar10") and is_hub_dataset_id("zh-plus/tiny-imagenet")
    assert not is_hub_dataset_id("cifar10") and not is_hub_dataset_id("a/b/c")
    assert not is_hub_dataset_id("../x") and not is_hub_dataset_id("/abs/path")


def test_hub_dataset_is_read_from_its_arrow_table(monkeypatch, tiny_pixels):
    datasets = pytest.importorskip("datasets")
    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=["x", "y"])}
    )
    rows = {"image": [{"bytes": _png(p), "path": None} for p in tiny_pixels], "label": [1, 0, 1, 1]}
    dataset = datasets.Dataset.from_dict(rows, features=features)
    calls = []

    def fake_load_dataset(name, split):
        calls.append((name, split))
        return dataset

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    data = load_image_dataset("zh-plus/tiny-imagenet", "valid", progress=False)
    assert calls == [("zh-plus/tiny-imagenet", "valid")]
    assert data.class_names == ["x", "y"]
    assert data.labels.tolist() == [1, 0, 1, 1]
    assert torch.equal(data.images[3], torch.from_numpy(tiny_pixels[3]).permute(2, 0, 1))


def test_unreachable_hub_gives_a_clear_error(monkeypatch):
    datasets = pytest.importorskip("datasets")

    def offline(name, split):
        raise ConnectionError("Couldn't reach huggingface.co")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(RuntimeError, match="could not load 'uoft-cs/cifar10'.*network"):
        load_image_dataset("uoft-cs/cifar10", "train")


def _indexed(n: int, size: int = 8) -> ImageTensors:
    """``n`` random images whose label is their index, to track every sample."""
    gen = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, generator=gen)
    return ImageTensors(images, torch.arange(n), [str(i) for i in range(n)])


@pytest.mark.parametrize("shuffle", [False, True])
def test_every_sample_once_per_epoch(shuffle):
    loader = GPUBatchLoader(_indexed(103), 10, shuffle=shuffle, augment=True)
    assert len(loader) == 11
    orders = []
    for _ in range(2):
        seen = torch.cat([labels for _, labels in loader])
        assert sorted(seen.tolist()) == list(range(103))
        orders.append(seen)
    assert torch.equal(orders[0], orders[1]) != shuffle

    dropping = GPUBatchLoader(_indexed(103), 10, shuffle=True, drop_last=True)
    assert len(dropping) == 10
    batches = [labels for _, labels in dropping]
    assert [len(b) for b in batches] == [10] * 10
    assert len(set(torch.cat(batches).tolist())) == 100


def _epochs(loader: GPUBatchLoader, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [batch for _ in range(n) for batch in loader]


def test_seeded_loader_is_reproducible():
    data = _indexed(50)
    first, second, other = (
        _epochs(GPUBatchLoader(data, 16, shuffle=True, augment=True, seed=s), 2) for s in (3, 3, 4)
    )
    for (xa, ya), (xb, yb) in zip(first, second, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not all(torch.equal(ya, yc) for (_, ya), (_, yc) in zip(first, other, strict=True))


def test_state_dict_resumes_with_the_same_batches():
    data = _indexed(50)
    reference = GPUBatchLoader(data, 16, shuffle=True, augment=True, seed=1)
    full = _epochs(reference, 3)

    interrupted = GPUBatchLoader(data, 16, shuffle=True, augment=True, seed=1)
    _epochs(interrupted, 1)
    batches = iter(interrupted)
    next(batches), next(batches)
    state = interrupted.state_dict()
    assert state == {"epoch": 1, "position": 2, "seed": 1}

    resumed = GPUBatchLoader(data, 16, shuffle=True, augment=True, seed=99)
    resumed.load_state_dict(state)
    rest = list(resumed) + list(resumed)
    assert len(rest) == len(full) - len(reference) - 2
    for (xa, ya), (xb, yb) in zip(full[len(reference) + 2 :], rest, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_augmentation_is_a_padded_crop_and_flip(embedded_train):
    data = ImageTensors(embedded_train.images[:64], embedded_train.labels[:64], CIFAR10_NAMES)
    identity = dict(mean=(0.0, 0.0, 0.0), std=(1 / 255,) * 3)  # batches in raw pixel values
    loader = GPUBatchLoader(data, 64, augment=True, seed=5, **identity)
    images, _ = next(iter(loader))
    assert images.shape == (64, 3, 32, 32) and images.dtype == torch.float32
    plain, _ = next(iter(GPUBatchLoader(data, 64, **identity)))
    assert not torch.equal(images, plain)

    plan = loader.epoch_plan(0)
    order, offsets, flips = plan.order, plan.offsets, plan.flips
    assert torch.equal(order, torch.arange(64))
    assert 0 < flips.sum() < 64 and offsets.min() == 0 and offsets.max() == 8
    for i in range(64):
        padded = F.pad(data.images[i].float(), (4, 4, 4, 4))
        top, left = offsets[i].tolist()
        crop = padded[:, top : top + 32, left : left + 32]
        expected = crop.flip(2) if flips[i] else crop
        assert torch.equal(images[i], expected)


def test_normalisation_dtype_and_memory_format(embedded_train):
    loader = GPUBatchLoader(embedded_train, 5000)
    images, _ = next(iter(loader))
    assert images.mean(dim=(0, 2, 3)).abs().max() < 1e-3
    assert (images.std(dim=(0, 2, 3)) - 1).abs().max() < 1e-3

    fast = GPUBatchLoader(
        embedded_train, 32, augment=True, dtype=torch.bfloat16, channels_last=True
    )
    images, labels = next(iter(fast))
    assert images.dtype == torch.bfloat16 and labels.dtype == torch.int64
    assert images.is_contiguous(memory_format=torch.channels_last)
    plain, _ = next(iter(GPUBatchLoader(embedded_train, 32, augment=True)))
    assert plain.is_contiguous()
