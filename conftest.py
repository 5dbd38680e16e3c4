"""Test-wide set-up that must happen before the package is first imported."""

from __future__ import annotations

import os

import torch

# Without a GPU, Triton kernels run under Triton's CPU interpreter. The variable must be
# set before Triton is first imported: before the package is.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
