"""Memory: live device probes, OOM classification, elastic micro-batching and
activation checkpointing.

Modules: ``probe`` (device memory, error classes), ``sizing`` (which micro-batch fits),
``retry`` (re-running a step after an OOM), ``distributed`` (ranks agreeing),
``batches`` (slicing a batch into pieces), ``rollback`` (BatchNorm statistics restored
on a re-run or a recompute), ``elastic`` (the controller that uses them) and
``checkpointing``; ``ledger`` counts a run's bytes per parameter by kind.

Example:
    >>> from torch import nn
    >>> from hf_triaccel.memory import ElasticBatchController
    >>> controller = ElasticBatchController(effective_batch=64, min_micro_batch=4)
    >>> controller.metrics()
    {'micro_batch': 64, 'accumulation': 1}
"""

from hf_triaccel.memory.batches import batch_size, slice_batch
from hf_triaccel.memory.checkpointing import (
    CheckpointedBlocks,
    checkpoint_largest_blocks,
    enable_activation_checkpointing,
    find_blocks,
)
from hf_triaccel.memory.elastic import ElasticBatchController, ElasticEvent
from hf_triaccel.memory.ledger import MemoryLedger, count_ledger, measure_step
from hf_triaccel.memory.probe import (
    CudaMemoryProbe,
    MemoryProbe,
    MemorySnapshot,
    NullProbe,
    default_probe,
    is_fatal_cuda_error,
    is_oom,
)
from hf_triaccel.memory.retry import ElasticBatchError
from hf_triaccel.memory.rollback import RunningStatsRollback, StepRollback
from hf_triaccel.memory.sizing import SizingPolicy

__all__ = [
    "CheckpointedBlocks",
    "CudaMemoryProbe",
    "ElasticBatchController",
    "ElasticBatchError",
    "ElasticEvent",
    "MemoryLedger",
    "MemoryProbe",
    "MemorySnapshot",
    "NullProbe",
    "RunningStatsRollback",
    "SizingPolicy",
    "StepRollback",
    "batch_size",
    "checkpoint_largest_blocks",
    "count_ledger",
    "default_probe",
    "enable_activation_checkpointing",
    "find_blocks",
    "is_fatal_cuda_error",
    "is_oom",
    "measure_step",
    "slice_batch",
]
