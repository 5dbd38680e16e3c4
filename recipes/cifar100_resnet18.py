"""CIFAR-100 with timm's ``resnet18_cifar`` (``configs/cifar100_resnet18.yaml``).

The full run; the quick form, sized for a CPU
(the data from the Hub); every flag with this recipe's defaults::

    accelerate launch recipes/cifar100_resnet18.py
    python recipes/cifar100_resnet18.py --quick
    python recipes/cifar100_resnet18.py --help

Every flag of ``train.py`` works here; this file sets ``--recipe``.
"""

import sys

from train import main

if __name__ == "__main__":
    sys.exit(main(recipe="cifar100_resnet18"))
