"""Image data for training: decoded once into a uint8 tensor, batched on the device.

:func:`load_image_dataset` (:mod:`hf_triaccel.data.loading`) loads a split with
``datasets`` and decodes it into an :class:`ImageTensors`; :class:`GPUBatchLoader`
(:mod:`hf_triaccel.data.images`) batches and augments it on the device.

The package ships a CIFAR-10 slice for demos and tests
(``load_image_dataset("embedded", "train" | "test")``): ``cifar10_train.parquet`` (the
first 5000 rows of the training set) and ``cifar10_test.parquet`` (the first 1000 of the
test set), in the Hugging Face parquet layout of ``uoft-cs/cifar10`` (``img`` struct of
JPEG bytes, ``label``). The source rows are shuffled, so each prefix is roughly
class-balanced. With ``SRC`` the folder of the offline CIFAR-10 copy (``train.parquet``,
``test.parquet``, rows shuffled with a fixed seed), the slices were cut, JPEG bytes and
schema metadata unchanged, from the repository root by::

    SRC=/path/to/cifar10 python -c "import os, pyarrow.parquet as pq
    for s, n in (('train', 5000), ('test', 1000)):
        t = pq.read_table(os.path.join(os.environ['SRC'], s + '.parquet')).slice(0, n)
        pq.write_table(t, f'hf_triaccel/data/cifar10_{s}.parquet', compression='zstd')"

Example:
    >>> from hf_triaccel.data import GPUBatchLoader, load_image_dataset
    >>> train = load_image_dataset()  # the embedded training slice
    >>> loader = GPUBatchLoader(train, 128, shuffle=True, augment=True)
"""

from hf_triaccel.data.images import GPUBatchLoader, ImageTensors
from hf_triaccel.data.loading import is_hub_dataset_id, load_image_dataset

__all__ = ["GPUBatchLoader", "ImageTensors", "is_hub_dataset_id", "load_image_dataset"]
