"""Test set-up shared by every test module.

Without a GPU, Triton kernels run under Triton's CPU interpreter. The variable must be
set before Triton is first imported, which is why it is set here, at collection time.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture
def device() -> torch.device:
    """The device tests marked ``gpu`` run on; CPU elsewhere."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A run that collected no test is a failure, not a success (pytest's exit code 5)."""
    if exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
