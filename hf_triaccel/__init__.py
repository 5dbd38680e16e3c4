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
from hf_triaccel.memory import ElasticBatchController, checkpoint_largest_blocks
from hf_triaccel.optim.adafisher import AdaFisher, AdaFisherW
from hf_triaccel.optim.functional import adafisher
from hf_triaccel.optim.steering import StepSizeSteering
from hf_triaccel.precision import PrecisionController, PrecisionPolicy, PrecisionRule

__version__ = "0.2.0"

# With timm installed, importing the package registers its CIFAR / Tiny ImageNet models
# with timm, so that a published model loads with `timm.create_model` after
# `import hf_triaccel`; without timm the rest of the package works as usual.
try:
    import timm  # noqa: F401
except ImportError:
    pass
else:
    importlib.import_module("hf_triaccel.integrations.timm_models")

# The integrations import transformers / accelerate: load them on first use so that
# `import hf_triaccel` needs neither.
_LAZY = {
    "AdaFisherFactory": "hf_triaccel.integrations.optimizers",
    "AdaFisherWFactory": "hf_triaccel.integrations.optimizers",
    "CrashConsistentCheckpoints": "hf_triaccel.integrations.checkpoints",
    "EXIT_PREEMPTED": "hf_triaccel.integrations.preemption",
    "PreemptionHandler": "hf_triaccel.integrations.preemption",
    "TriAccelArgumentParser": "hf_triaccel.integrations.trainer_args",
    "TriAccelArguments": "hf_triaccel.integrations.trainer_args",
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
    "AdaFisherFactory",
    "AdaFisherW",
    "AdaFisherWFactory",
    "CrashConsistentCheckpoints",
    "ElasticBatchController",
    "FactorLayout",
    "FisherCollector",
    "FisherRule",
    "PreemptionHandler",
    "PrecisionController",
    "PrecisionPolicy",
    "PrecisionRule",
    "SignalTracker",
    "StepSizeSteering",
    "TriAccelArgumentParser",
    "TriAccelArguments",
    "TriAccelMixin",
    "TriAccelPlugin",
    "TriAccelTrainer",
    "adafisher",
    "checkpoint_largest_blocks",
    "last_complete_checkpoint",
    "prepare_triaccel",
    "register_fisher_rule",
    "register_timm_optimizers",
    "trainer_optimizer",
]
