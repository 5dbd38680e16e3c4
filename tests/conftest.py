"""Test set-up shared by every test module (the root conftest.py has already imported the
installed package and set up Triton's CPU interpreter where there is no GPU)."""

import pytest
import torch


@pytest.fixture
def device() -> torch.device:
    """The device tests marked ``gpu`` run on; CPU elsewhere."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A run that collected no test is a failure, not a success (pytest's exit code 5)."""
    if exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
