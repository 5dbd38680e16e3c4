"""CIFAR-10 with timm's ``efficientnet_b0_cifar`` (``configs/cifar10_efficientnet_b0.yaml``).

The full run; the quick form, sized for a CPU
(the embedded CIFAR-10 slice, no network); every flag with this recipe's defaults::

    accelerate launch recipes/cifar10_efficientnet_b0.py
    python recipes/cifar10_efficientnet_b0.py --quick --dataset embedded
    python recipes/cifar10_efficientnet_b0.py --help

Every flag of ``train.py`` works here; this file sets ``--recipe``.
"""

import sys

from train import main

if __name__ == "__main__":
    sys.exit(main(recipe="cifar10_efficientnet_b0"))
