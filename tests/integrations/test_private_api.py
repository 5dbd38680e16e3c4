"""The private names of other libraries that the package uses: all listed, all present."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import hf_triaccel
from hf_triaccel.integrations.private_api import (
    PRIVATE_NAMES,
    PrivateName,
    missing_private_names,
)

PACKAGE = Path(hf_triaccel.__file__).resolve().parent
# a private member reached on another library's object or module: `super()._x`,
# `trainer._x`, `Trainer._x`, `model._orig_mod`, `from timm.optim._optim_factory import`
USE = re.compile(
    r"(?:super\(\)|\btrainer|\bTrainer|\bmodel)\.(_[a-z]\w*)|from (?:transformers|accelerate|timm)"
    r"[\w.]*\.(_\w+) import|\b(_internal_call)\b"
)


@pytest.mark.parametrize("entry", PRIVATE_NAMES, ids=lambda e: e.name)
def test_each_private_name_is_in_the_installed_release(entry):
    assert entry.problem() is None, entry.problem()


def test_a_missing_name_is_named():
    entries = (
        PrivateName("transformers", "Trainer._no_such_method", used_by="nothing"),
        PrivateName("transformers", "Trainer._clip_grad_norm", ("no_such_parameter",)),
        PrivateName("transformers", "Trainer._not_set", assigned_in="Trainer.__init__"),
    )
    problems = missing_private_names(entries)
    assert len(problems) == 3
    assert problems[0].startswith("transformers.Trainer._no_such_method: no attribute")
    assert "no parameter ['no_such_parameter']" in problems[1]
    assert "not assigned in Trainer.__init__" in problems[2]


def private_uses() -> set[str]:
    """The private names the package's sources reach on other libraries' objects."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        for match in USE.finditer(path.read_text()):
            found.add(next(group for group in match.groups() if group))
    return found


def test_every_private_use_is_listed():
    listed = {part for e in PRIVATE_NAMES for part in e.attribute.split(".")}
    listed |= {part for e in PRIVATE_NAMES for part in e.module.split(".")}
    listed |= {p for e in PRIVATE_NAMES for p in e.parameters}
    unlisted = sorted(private_uses() - listed)
    assert unlisted == [], f"add these to hf_triaccel/integrations/private_api.py: {unlisted}"
