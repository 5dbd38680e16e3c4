"""Loading an image classification split with ``datasets`` and decoding it once.

``datasets`` reads the parquet files (a local folder, one file, the slice shipped in the
package) or the Hub data set, takes the class names from the ``ClassLabel`` feature (for
parquet files, from the schema metadata ``datasets`` wrote there) and decodes the images
(the ``Image`` feature, converted to RGB) in ``map`` workers into one ``Array3D`` column,
read back as a single uint8 array.

Example:
    >>> train = load_image_dataset("embedded", "train", progress=False)
    >>> train.images.shape, train.num_classes
    (torch.Size([5000, 3, 32, 32]), 10)
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from hf_triaccel.data.images import ImageTensors

IMAGE_COLUMNS = ("img", "image")
LABEL_COLUMNS = ("label", "fine_label", "labels")
EMBEDDED_SPLITS = ("train", "test")
# the Hub data set the embedded slice copies (its images, JPEG-encoded; see the package doc)
EMBEDDED_ORIGIN = "uoft-cs/cifar10"
# the package's own folder: the embedded slice ships beside this module
EMBEDDED_DIR = Path(__file__).resolve().parent


class ClassCountError(ValueError):
    """The data has another number of classes than the one asked for."""


def load_image_dataset(
    source: str = "embedded",
    split: str = "train",
    *,
    image_column: str | None = None,
    label_column: str | None = None,
    num_classes: int | None = None,
    num_proc: int | None = None,
    progress: bool = True,
) -> ImageTensors:
    """Loads an image classification split with ``datasets`` and decodes every image once.

    Args:
        source: where the data comes from:

            - ``"embedded"``: the CIFAR-10 slice shipped with the package
              (5000 train / 1000 test images, splits ``"train"`` and ``"test"``);
            - a local folder holding ``{split}.parquet`` (or the Hub's
              ``{split}-00000-of-000NN.parquet`` shards, in any subfolder);
            - a path to one ``.parquet`` file (``split`` is then ignored);
            - a Hugging Face Hub dataset id ``owner/name`` such as ``"uoft-cs/cifar10"``,
              ``"uoft-cs/cifar100"`` or ``"zh-plus/tiny-imagenet"`` (needs the network).
        split: the split to load.
        image_column: the image column; found automatically among ``img`` and ``image``.
        label_column: the label column; found automatically among ``label``,
            ``fine_label`` and ``labels``.
        num_classes: the number of classes the data must have (checked before any image
            is decoded); ``None`` accepts any.
        num_proc: decoding processes (default: one per 10,000 images, at most one per CPU,
            one below 20,000 images).
        progress: show progress bars.

    Returns:
        The decoded split on the CPU, images as uint8 ``(N, 3, H, W)`` in RGB.

    Raises:
        FileNotFoundError: a local path that does not exist, a folder without the split,
            or a name that is neither a path nor a Hub id.
        ClassCountError: not ``num_classes`` classes (a ``ValueError``).
        ValueError: a missing column, or images of different sizes.
        ImportError: without the ``datasets`` package.
        RuntimeError: a Hub dataset that could not be loaded (no network, unknown id).

    Example:
        >>> test = load_image_dataset("embedded", "test", progress=False)
        >>> test.images.shape, test.class_names[:2]
        (torch.Size([1000, 3, 32, 32]), ['airplane', 'automobile'])
        >>> cifar100 = load_image_dataset("uoft-cs/cifar100", "test")  # doctest: +SKIP
    """
    # at call time: images.py imports this module for its own namespace
    from hf_triaccel.data.images import ImageTensors

    try:
        import datasets
    except ImportError as exc:
        raise ImportError(
            "loading images needs the `datasets` package: pip install datasets "
            "(or the package's [hf] extra)"
        ) from exc
    was_disabled = datasets.are_progress_bars_disabled()
    if not progress:
        datasets.disable_progress_bars()
    try:
        dataset = _open_split(datasets, source, split)
        image_column, label_column = _pick_columns(dataset.column_names, image_column, label_column)
        dataset = dataset.select_columns([image_column, label_column])
        labels = torch.from_numpy(
            dataset.select_columns([label_column]).with_format("numpy")[:][label_column]
        ).to(torch.int64)
        names = _class_names(dataset.features[label_column], labels)
        if num_classes is not None and len(names) != num_classes:
            raise ClassCountError(
                f"{source!r} (split {split!r}) has {len(names)} classes "
                f"({_preview(names)}), not the {num_classes} expected"
            )
        images = _decode(datasets, dataset, image_column, num_proc)
    finally:
        if not progress and not was_disabled:
            datasets.enable_progress_bars()
    return ImageTensors(images, labels, names)


def _open_split(datasets: Any, source: str, split: str) -> Any:
    """The ``datasets.Dataset`` of ``split`` from ``source``, images not yet decoded."""
    if source == "embedded":
        if split not in EMBEDDED_SPLITS:
            raise ValueError(f"the embedded data has splits {EMBEDDED_SPLITS}, not {split!r}")
        return _from_parquet(datasets, [EMBEDDED_DIR / f"cifar10_{split}.parquet"])
    local = Path(source).expanduser()
    if local.is_dir():
        return _from_parquet(datasets, split_files(local, split))
    if local.is_file():
        return _from_parquet(datasets, [local])
    if not is_hub_dataset_id(source):
        raise FileNotFoundError(
            f"no such file or folder: {path_in_message(source)}; nor is it a Hub "
            "dataset id, which has the form owner/name (e.g. uoft-cs/cifar10)"
        )
    try:
        return datasets.load_dataset(source, split=split)
    except ValueError:
        # an unknown split: datasets' own message lists the splits that exist
        raise
    except Exception as exc:
        raise RuntimeError(
            f"could not load {source!r} (split {split!r}) from the Hugging Face Hub: "
            f"{type(exc).__name__}: {exc}. Check the dataset id and the network, or pass a "
            "local folder of parquet files instead"
        ) from exc


def path_in_message(path: str | Path) -> str:
    """A path as an error names it: an absolute one as it is, a relative one with the
    folder it is relative to.

    Example:
        >>> path_in_message("/data/x")
        "'/data/x'"
        >>> path_in_message("x").startswith("'x' (relative to ")
        True
    """
    if Path(path).expanduser().is_absolute():
        return repr(str(path))
    return f"{str(path)!r} (relative to {Path.cwd()})"


def is_hub_dataset_id(name: str) -> bool:
    """Whether ``name`` has the form of a Hub dataset id, ``owner/name``.

    Example:
        >>> is_hub_dataset_id("uoft-cs/cifar10"), is_hub_dataset_id("cifar10_local")
        (True, False)
    """
    return re.fullmatch(r"[\w.-]+/[\w.-]+", name) is not None and ".." not in name


def _from_parquet(datasets: Any, files: Sequence[Path]) -> Any:
    # in memory: no Arrow copy of the files in the datasets cache folder
    return datasets.load_dataset(
        "parquet", data_files=[str(f) for f in files], split="train", keep_in_memory=True
    )


def split_files(folder: str | Path, split: str) -> list[Path]:
    """The parquet files of ``split`` in a local folder laid out like a Hub data set:
    ``{split}.parquet``, or the Hub's ``{split}-00000-of-000NN.parquet`` shards in any
    subfolder.

    Raises:
        FileNotFoundError: the folder does not exist, or holds no file of the split (the
            message lists the parquet files it holds).

    Example:
        >>> import tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> (folder / "train.parquet").touch()
        >>> [p.name for p in split_files(folder, "train")]
        ['train.parquet']
        >>> split_files(folder, "test")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        FileNotFoundError: no test.parquet (or test-*.parquet shards) in ...: train.parquet
    """
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(f"no such folder: {path_in_message(folder)}")
    single = folder / f"{split}.parquet"
    if single.is_file():
        return [single]
    shards = sorted(folder.rglob(f"{split}-*.parquet"))
    if shards:
        return shards
    present = sorted(str(p.relative_to(folder)) for p in folder.rglob("*.parquet"))
    raise FileNotFoundError(
        f"no {split}.parquet (or {split}-*.parquet shards) in {folder}; parquet files "
        f"there: {', '.join(present) or 'none'}"
    )


def _pick_columns(
    columns: Sequence[str], image_column: str | None, label_column: str | None
) -> tuple[str, str]:
    """Finds the image and label columns among the known schemas, or names what is missing."""
    picked = []
    for given, known, role in (
        (image_column, IMAGE_COLUMNS, "image"),
        (label_column, LABEL_COLUMNS, "label"),
    ):
        if given is not None:
            if given not in columns:
                raise ValueError(
                    f"{role} column {given!r} not found; columns present: {list(columns)}"
                )
            picked.append(given)
            continue
        found = next((c for c in known if c in columns), None)
        if found is None:
            raise ValueError(
                f"no {role} column: expected one of {list(known)} (or name it: "
                f"{role}_column=..., --{role}_column on the command line); "
                f"columns present: {list(columns)}"
            )
        picked.append(found)
    return picked[0], picked[1]


def _class_names(feature: Any, labels: torch.Tensor) -> list[str]:
    """A ``ClassLabel``'s names (``datasets`` reads them from the parquet schema metadata),
    else the label values as names."""
    names = getattr(feature, "names", None)
    if names:
        return list(names)
    return [str(i) for i in range(int(labels.max()) + 1 if len(labels) else 0)]


def _preview(names: Sequence[str], shown: int = 5) -> str:
    more = f", ... {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _decode(datasets: Any, dataset: Any, column: str, num_proc: int | None) -> torch.Tensor:
    """Decodes the image column (``datasets.Image``, converted to RGB) into uint8
    ``(N, 3, H, W)``, every image checked against the size of the first."""
    if len(dataset) == 0:
        raise ValueError("the split holds no images")
    dataset = dataset.cast_column(column, datasets.Image(mode="RGB"))
    height, width = np.asarray(dataset[0][column]).shape[:2]

    def to_pixels(batch: dict[str, list], indices: list[int]) -> dict[str, np.ndarray]:
        pixels = [np.asarray(image) for image in batch[column]]
        for index, array in zip(indices, pixels, strict=True):
            if array.shape[:2] != (height, width):
                raise ValueError(
                    f"image {index} is {array.shape[1]}x{array.shape[0]} but image 0 is "
                    f"{width}x{height}: resize the data set to one size first"
                )
        return {"pixels": np.stack(pixels)}

    if num_proc is None:
        # Worker processes pay their start and the transfer of their shard back: below
        # ~20,000 small images that costs more than it saves (the 5,000-image slice
        # decoded in 0.7 s in one process, 1.6 s in two, on two cores).
        num_proc = min(os.cpu_count() or 1, len(dataset) // 10_000) if len(dataset) >= 20_000 else 1
    features = datasets.Features({"pixels": datasets.Array3D((height, width, 3), "uint8")})
    decoded = dataset.map(
        to_pixels,
        batched=True,
        with_indices=True,
        remove_columns=dataset.column_names,
        features=features,
        num_proc=num_proc if num_proc > 1 else None,
        keep_in_memory=True,
        desc="decoding images",
    )
    pixels = decoded.with_format("numpy", dtype=np.uint8)[:]["pixels"]
    return torch.from_numpy(pixels).permute(0, 3, 1, 2).contiguous()
