"""Tiny-ImageNet (100,000 training / 10,000 validation images, 64x64, 200 classes) with
timm's ResNet-18 on a 3x3 stride-1 stem followed by the max-pool (``resnet18_tiny``), so
its first block works on 32x32 maps as on CIFAR.

Trains with AdaFisher (lr 3e-3, weight decay 5e-4), batch 512, bf16 on CUDA, a
one-cycle-like schedule (30% linear warm-up, cosine decay), label smoothing 0.1, for 30
epochs, evaluating after every epoch; writes the model, reports, plots and a model card
to ``outputs/tiny_imagenet_resnet18`` (recipes/README.md lists the outputs and flags).

Usage:
    accelerate launch recipes/tiny_imagenet_resnet18.py
    accelerate launch recipes/tiny_imagenet_resnet18.py --baseline   # and the AdamW baseline
    python recipes/tiny_imagenet_resnet18.py --max_steps 20 --output_dir /tmp/run
    python recipes/tiny_imagenet_resnet18.py --help   # every flag
"""

import sys

from hf_triaccel.integrations.recipes import Recipe, main

RECIPE = Recipe(
    name="tiny_imagenet_resnet18",
    dataset="zh-plus/tiny-imagenet",
    title="Tiny-ImageNet",
    model="resnet18_tiny",
    eval_split="valid",
)

if __name__ == "__main__":
    sys.exit(main(RECIPE))
