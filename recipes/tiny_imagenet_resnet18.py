"""Tiny-ImageNet with timm's ``resnet18_tiny`` (``configs/tiny_imagenet_resnet18.yaml``).

The full run; the quick form, sized for a CPU
(the data from the Hub); every flag with this recipe's defaults::

    accelerate launch recipes/tiny_imagenet_resnet18.py
    python recipes/tiny_imagenet_resnet18.py --quick
    python recipes/tiny_imagenet_resnet18.py --help

Every flag of ``train.py`` works here; this file sets ``--recipe``.
"""

import sys

from train import main

if __name__ == "__main__":
    sys.exit(main(recipe="tiny_imagenet_resnet18"))
