"""Memory: live device probes, OOM classification, elastic micro-batching and
activation checkpointing of the largest blocks.

Example:
    >>> from torch import nn
    >>> from hf_triaccel.memory import ElasticBatchController
    >>> controller = ElasticBatchController(effective_batch=64, min_micro_batch=4)
    >>> controller.metrics()
    {'micro_batch': 64, 'accumulation': 1}
"""

from hf_triaccel.memory.checkpointing import (
    CheckpointedBlocks,
    checkpoint_largest_blocks,
    find_blocks,
)
from hf_triaccel.memory.elastic import (
    ElasticBatchController,
    ElasticBatchError,
    ElasticEvent,
    RunningStatsRollback,
    StepRollback,
    batch_size,
    slice_batch,
)
from hf_triaccel.memory.probe import (
    CudaMemoryProbe,
    MemoryProbe,
    MemorySnapshot,
    NullProbe,
    default_probe,
    is_fatal_cuda_error,
    is_oom,
)

__all__ = [
    "CheckpointedBlocks",
    "CudaMemoryProbe",
    "ElasticBatchController",
    "ElasticBatchError",
    "ElasticEvent",
    "MemoryProbe",
    "MemorySnapshot",
    "NullProbe",
    "RunningStatsRollback",
    "StepRollback",
    "batch_size",
    "checkpoint_largest_blocks",
    "default_probe",
    "find_blocks",
    "is_fatal_cuda_error",
    "is_oom",
    "slice_batch",
]
