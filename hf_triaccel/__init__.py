"""hf_triaccel: faster, lighter training for the Hugging Face stack.

Example:
    >>> from torch import nn
    >>> from hf_triaccel import AdaFisherW
    >>> model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    >>> optimizer = AdaFisherW.from_model(model, lr=1e-3, weight_decay=1e-4)
"""

import importlib

from hf_triaccel.curvature.collector import FisherCollector
from hf_triaccel.curvature.rules import FactorLayout, FisherRule, register_fisher_rule
from hf_triaccel.curvature.signals import SignalTracker
from hf_triaccel.memory import (
    ElasticBatchController,
    MemoryLedger,
    checkpoint_largest_blocks,
    measure_step,
)
from hf_triaccel.optim.adafisher import AdaFisher, AdaFisherW, build_adafisher
from hf_triaccel.optim.config import AdaFisherConfig
from hf_triaccel.optim.functional import adafisher
from hf_triaccel.optim.steering import StepSizeSteering
from hf_triaccel.precision import PrecisionController, PrecisionPolicy, PrecisionRule

__version__ = "0.2.0"

# The integrations import transformers / accelerate / timm: load them on first use, so
# that `import hf_triaccel` needs none of them and changes nothing in them (timm's
# registries included: its CIFAR models are registered when
# `hf_triaccel.integrations.timm_models` is imported, its optimizers by
# `register_timm_optimizers()`).
_LAZY = {
    "AdaFisherFactory": "hf_triaccel.integrations.optimizers",
    "AdaFisherWFactory": "hf_triaccel.integrations.optimizers",
    "CrashConsistentCheckpoints": "hf_triaccel.integrations.checkpoints",
    "EXIT_PREEMPTED": "hf_triaccel.integrations.preemption",
    "PreemptionHandler": "hf_triaccel.integrations.preemption",
    "TriAccelArgumentParser": "hf_triaccel.integrations.trainer_args",
    "TriAccelArguments": "hf_triaccel.integrations.trainer_args",
    "TriAccelCallback": "hf_triaccel.integrations.callback",
    "TriAccelMixin": "hf_triaccel.integrations.trainer",
    "TriAccelPlugin": "hf_triaccel.integrations.plugin",
    "TriAccelTrainer": "hf_triaccel.integrations.trainer",
    "prepare_triaccel": "hf_triaccel.integrations.plugin",
    "register_timm_optimizers": "hf_triaccel.integrations.timm_optim",
    "last_complete_checkpoint": "hf_triaccel.integrations.checkpoints",
    "trainer_optimizer": "hf_triaccel.integrations.optimizers",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hf_triaccel' has no attribute {name!r}")


__all__ = [
    "EXIT_PREEMPTED",
    "AdaFisher",
    "AdaFisherConfig",
    "AdaFisherFactory",
    "AdaFisherW",
    "AdaFisherWFactory",
    "CrashConsistentCheckpoints",
    "ElasticBatchController",
    "FactorLayout",
    "FisherCollector",
    "FisherRule",
    "MemoryLedger",
    "PreemptionHandler",
    "PrecisionController",
    "PrecisionPolicy",
    "PrecisionRule",
    "SignalTracker",
    "StepSizeSteering",
    "TriAccelArgumentParser",
    "TriAccelArguments",
    "TriAccelCallback",
    "TriAccelMixin",
    "TriAccelPlugin",
    "TriAccelTrainer",
    "adafisher",
    "build_adafisher",
    "checkpoint_largest_blocks",
    "measure_step",
    "last_complete_checkpoint",
    "prepare_triaccel",
    "register_fisher_rule",
    "register_timm_optimizers",
    "trainer_optimizer",
]
