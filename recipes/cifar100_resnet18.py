"""CIFAR-100 (50,000 training / 10,000 test images, 32x32, the 100 fine labels) with
timm's ResNet-18 on a CIFAR stem (``resnet18_cifar``).

Trains with AdaFisher (lr 3e-3, weight decay 5e-4), batch 512, bf16 on CUDA, a
one-cycle-like schedule (30% linear warm-up, cosine decay), label smoothing 0.1, for 30
epochs, evaluating after every epoch; writes the model, reports, plots and a model card
to ``outputs/cifar100_resnet18`` (recipes/README.md lists the outputs and flags).

Usage:
    accelerate launch recipes/cifar100_resnet18.py
    accelerate launch recipes/cifar100_resnet18.py --baseline   # and the AdamW baseline
    python recipes/cifar100_resnet18.py --max_steps 20 --output_dir /tmp/run
    python recipes/cifar100_resnet18.py --help   # every flag
"""

import sys

from hf_triaccel.integrations.recipes import Recipe, main

RECIPE = Recipe(
    name="cifar100_resnet18",
    dataset="uoft-cs/cifar100",
    title="CIFAR-100",
    model="resnet18_cifar",
)

if __name__ == "__main__":
    sys.exit(main(RECIPE))
