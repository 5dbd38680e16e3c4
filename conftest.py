"""Test-wide set-up that must happen before the package is first imported."""

from __future__ import annotations

import os

import torch

# Without a GPU, Triton kernels run under Triton's CPU interpreter. The variable must be
# set before Triton is first imported: before the package is.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist each worker is a process of its own: its torch threads share the
# cores with the other workers', so each takes its share rather than all of them.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))
