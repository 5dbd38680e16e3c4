"""CIFAR-10 (50,000 training / 10,000 test images, 32x32, 10 classes) with timm's
ResNet-18 on a CIFAR stem (``resnet18_cifar``: 3x3 stride-1 ``conv1``, no max-pool).

Trains with AdaFisher (lr 3e-3, weight decay 5e-4), batch 512, bf16 on CUDA, a
one-cycle-like schedule (30% linear warm-up, cosine decay), label smoothing 0.1, for 30
epochs, evaluating after every epoch; writes the model, reports, plots and a model card
to ``outputs/cifar10_resnet18`` (recipes/README.md lists the outputs and flags).

Usage:
    accelerate launch recipes/cifar10_resnet18.py
    accelerate launch recipes/cifar10_resnet18.py --baseline   # and the AdamW baseline
    python recipes/cifar10_resnet18.py --dataset /path/to/cifar10 --baseline   # local parquet copy
    python recipes/cifar10_resnet18.py --max_steps 20 --output_dir /tmp/run
    python recipes/cifar10_resnet18.py --help   # every flag
"""

import sys

from hf_triaccel.integrations.recipes import Recipe, main

RECIPE = Recipe(
    name="cifar10_resnet18",
    dataset="uoft-cs/cifar10",
    title="CIFAR-10",
    model="resnet18_cifar",
)

if __name__ == "__main__":
    sys.exit(main(RECIPE))
