"""The recipes' modules on the import path, and tiny stand-ins for their Hub data sets:
parquet folders with the Hub's columns."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import numpy as np
import pytest

RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"
# the recipe scripts import each other by file name, as when run from their folder
if str(RECIPES_DIR) not in sys.path:
    sys.path.insert(0, str(RECIPES_DIR))


def _jpeg(rng: np.random.Generator, size: int) -> dict[str, bytes | None]:
    from PIL import Image

    buffer = io.BytesIO()
    pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=75)
    return {"bytes": buffer.getvalue(), "path": None}


def write_split(
    path: Path,
    n: int,
    size: int,
    classes: int,
    image_column: str,
    label_columns: tuple[str, ...],
    seed: int = 0,
) -> None:
    """``n`` random JPEG images as the Hub stores them (``datasets.Image`` bytes) with
    ``ClassLabel`` label columns, so the class names travel in the parquet metadata."""
    datasets = pytest.importorskip("datasets")
    rng = np.random.default_rng(seed)
    features = {image_column: datasets.Image()}
    columns = {image_column: [_jpeg(rng, size) for _ in range(n)]}
    for name in label_columns:
        features[name] = datasets.ClassLabel(names=[f"class_{i}" for i in range(classes)])
        columns[name] = [i % classes for i in range(n)]
    path.parent.mkdir(parents=True, exist_ok=True)
    datasets.Dataset.from_dict(columns, features=datasets.Features(features)).to_parquet(path)


@pytest.fixture(scope="session")
def hub_folders(tmp_path_factory) -> dict[str, Path]:
    """Recipe name -> a local folder laid out like its Hub data set (tiny sizes)."""
    root = tmp_path_factory.mktemp("hub")
    cifar10, cifar100, tiny = root / "cifar10", root / "cifar100", root / "tiny-imagenet"
    for split, seed in (("train", 0), ("test", 1)):
        write_split(cifar10 / f"{split}.parquet", 16, 32, 10, "img", ("label",), seed)
        write_split(
            cifar100 / f"{split}.parquet", 16, 32, 100, "img", ("fine_label", "coarse_label"), seed
        )
    # Tiny-ImageNet as the Hub stores it: shards in a subfolder, splits train / valid
    for split, seed in (("train", 0), ("valid", 1)):
        write_split(
            tiny / "data" / f"{split}-00000-of-00001.parquet",
            16,
            64,
            200,
            "image",
            ("label",),
            seed,
        )
    return {
        "cifar10_resnet18": cifar10,
        "cifar10_efficientnet_b0": cifar10,
        "cifar100_resnet18": cifar100,
        "tiny_imagenet_resnet18": tiny,
    }
