"""The tests import the installed hf_triaccel, never the checkout's folder of that name.

``python3 -m pytest`` puts the current folder first on ``sys.path``, and pytest puts the
checkout's root there to import the ``tests`` package; either way the checkout's
``hf_triaccel/`` would shadow the installed package. The two differ: the Triton kernels
live in the checkout's ``kernels/`` and install as ``hf_triaccel.kernels`` (see the
package-dir mapping in pyproject.toml), and a wheel holds only what is packaged. This file,
the first conftest pytest loads, imports the package with the checkout's root off
``sys.path``, so that every later ``import hf_triaccel...`` finds the installed copy (an
editable install maps the names back onto the checkout, kernels included).
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent

# Without a GPU, Triton kernels run under Triton's CPU interpreter. The variable must be
# set before Triton is first imported: before the package is.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _import_installed(name: str) -> None:
    """Imports ``name`` as installed, with the checkout's root off ``sys.path``."""
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != ROOT]
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as err:
        raise pytest.UsageError(
            f"{name} is not installed; install it first: "
            f'python3 -m pip install -e ".[test]"  ({err})'
        ) from err
    finally:
        sys.path[:] = saved


_import_installed("hf_triaccel")
_import_installed("hf_triaccel.kernels")
