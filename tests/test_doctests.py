"""The docstring examples of every module of the installed package, run as doctests.

Examples that need a GPU say so with ``# doctest: +SKIP``. The kernels' examples run on
CPU tensors, that is under Triton's interpreter (set up by the root conftest.py where
there is no GPU); on a GPU machine they are left to the kernel tests.
"""

from __future__ import annotations

import doctest
import importlib

import pytest

from hf_triaccel.dispatch import triton_interpreted
from tests.test_contracts import PACKAGE, modules

MODULES = sorted(modules())


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    if name.startswith(f"{PACKAGE}.kernels.") and not triton_interpreted():
        pytest.skip("kernel examples use CPU tensors: they need TRITON_INTERPRET=1")
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    report: list[str] = []
    for test in finder.find(module, name):
        runner.run(test, out=report.append)
    results = runner.summarize(verbose=False)
    assert results.failed == 0, "".join(report)


def test_every_module_is_checked():
    """The list above is the package as installed: kernels included."""
    assert f"{PACKAGE}.kernels.launch" in MODULES
    assert f"{PACKAGE}.curvature.collection.hooks" in MODULES
