"""The FSDP2 recipe's smoke mode on one CPU process: both loops (the Accelerate helper and
TriAccelTrainer) train, save and restore AdaFisher's state. Accelerate switches FSDP on
for GPUs only: the sharded run is the GPU check's (recipes/fsdp2_gpu_check.sh); here the
recipe's own code runs end to end."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "fsdp2_vit.py"


@pytest.fixture
def recipe():
    spec = importlib.util.spec_from_file_location("fsdp2_vit", RECIPE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ViT's small operations run faster unthreaded
    yield module
    torch.set_num_threads(threads)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("loop", [[], ["--trainer"]], ids=["accelerate", "trainer"])
def test_recipe_smoke_on_cpu(recipe, loop, tmp_path, capsys):
    recipe.main(["--smoke", "--cpu", "--output_dir", str(tmp_path), *loop])
    out = capsys.readouterr().out
    assert out.count("OK: ") == 2, out
