"""Every Python block of the documentation runs as written, on the CPU.

The blocks are the ```python fences of README.md, of the docs pages that took its long
explanations (:data:`DOCS`) and of recipes/README.md, and the one of the model-card
template as a recipe run renders it. Each runs on its own, in a fresh namespace
in an empty working folder: a block must hold its imports and its small model and data.
A block whose first line is :data:`GPU_MARK` needs CUDA and is skipped without it. Shell
blocks (indented, or fenced as anything but python) are not run. These pages' blocks run
with warnings turned into errors and fail on a warning logged by transformers or
hf_triaccel: a reader could not act on one.

The card's block loads the model from the run's folder (``local-dir:``) and, once the run
is published, from the Hub (``hf-hub:``); here the Hub is offline and its cache holds the
run's output folder, as after a download. (That the card's import registers the model's
architecture with timm, and ``import hf_triaccel`` alone leaves timm as it is, is checked
in a fresh interpreter by tests/test_timm_models.py.)
"""

from __future__ import annotations

import contextlib
import logging
import re
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DOCS = (
    "README.md",
    "docs/usage.md",
    "docs/scaling.md",
    "docs/preemption.md",
    "recipes/README.md",
)
GPU_MARK = "# Needs a CUDA GPU"
_FENCE = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def python_blocks(text: str) -> list[tuple[int, str]]:
    """The ``(line, code)`` of every ```python block of a Markdown text."""
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in _FENCE.finditer(text)]


def run_block(code: str, name: str) -> None:
    """Runs a block as a script of its own, skipping it without CUDA when it is marked."""
    if code.startswith(GPU_MARK) and not torch.cuda.is_available():
        pytest.skip("the block is marked as needing a CUDA GPU")
    exec(compile(code, name, "exec"), {"__name__": "__main__"})


class _Logged(logging.Handler):
    """Keeps the messages of the records it receives."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(f"{record.name}: {record.getMessage()}")


@contextlib.contextmanager
def no_warnings() -> Iterator[None]:
    """Turns warnings into errors and fails on a warning logged meanwhile (transformers'
    loggers do not propagate to the root)."""
    logged = _Logged()
    loggers = [logging.getLogger(), logging.getLogger("transformers")]
    for logger in loggers:
        logger.addHandler(logged)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            yield
    finally:
        for logger in loggers:
            logger.removeHandler(logged)
    assert not logged.messages, logged.messages


def doc_blocks() -> list:
    return [
        pytest.param(code, id=f"{doc}:{line}")
        for doc in DOCS
        for line, code in python_blocks((ROOT / doc).read_text())
    ]


def test_the_harness_finds_the_blocks():
    assert python_blocks(
        "text\n```python\nx = 1\n```\n    python -m shell\n```bash\nls\n```\n"
    ) == [(2, "x = 1\n")]
    # the README's quickstarts (TriAccelTrainer, the stock Trainer's callback); the pages
    # hold plain PyTorch, the image data, Accelerate, TRL, timm; FSDP2; the two preemptible
    for doc, least in (
        ("README.md", 2),
        ("docs/usage.md", 5),
        ("docs/scaling.md", 1),
        ("docs/preemption.md", 2),
        ("recipes/README.md", 1),
    ):
        assert len(python_blocks((ROOT / doc).read_text())) >= least, doc


@pytest.mark.parametrize("code", doc_blocks())
def test_doc_block_runs(code, request, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with no_warnings():
        run_block(code, request.node.callspec.id)


def test_model_card_block_loads_the_run_and_the_published_model(tmp_path, monkeypatch):
    pytest.importorskip("timm")
    hub = pytest.importorskip("huggingface_hub")
    monkeypatch.syspath_prepend(str(ROOT / "recipes"))
    import train

    from hf_triaccel.integrations.model_card import write_card

    out, repo_id = tmp_path / "run", "hf-triaccel-test/cifar10-resnet18"
    results = train.run_recipe(
        [
            *("--recipe", "cifar10_resnet18", "--dataset", "embedded", "--use_cpu"),
            *("--output_dir", str(out), "--hub_model_id", repo_id, "--no_plot"),
            *("--max_steps", "1", "--per_device_train_batch_size", "4"),
            *("--optim", "adamw_torch", "--eval_strategy", "no", "--disable_tqdm", "true"),
        ]
    )
    monkeypatch.chdir(tmp_path)
    # not published: the run's own folder
    (line, code), *others = python_blocks((out / "README.md").read_text())
    assert not others and f'"local-dir:{out.resolve()}"' in code
    run_block(code, f"model card:{line}")
    # published (push_run renders the card so): the Hub repository
    write_card(results, out, repo_id=repo_id, pushed=True)
    (line, code), *others = python_blocks((out / "README.md").read_text())
    assert not others and f'"hf-hub:{repo_id}"' in code
    # the Hub's cache after a download of the repository: refs/main -> a snapshot
    repo = tmp_path / "hub" / f"models--{repo_id.replace('/', '--')}"
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for file in ("config.json", "model.safetensors"):
        shutil.copy(out / file, snapshot / file)
    monkeypatch.setattr(hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub.constants, "HF_HUB_OFFLINE", True)
    run_block(code, f"model card:{line}")


def test_readme_says_what_the_main_job_does_and_costs():
    readme = (ROOT / "README.md").read_text()
    start = readme.index("## Set-up")
    setup = readme[start : readme.index("\n## ", start)]
    assert "python3 -m hf_triaccel.quickstart" in setup
    cpu = "pip install torch torchvision --index-url https://download.pytorch.org/whl/cpu"
    assert cpu in setup
    for text in ("AdaFisher", "AdamW", "CPU (2 cores)", "GPU", "test accuracy", "tuned"):
        assert text in setup, text
