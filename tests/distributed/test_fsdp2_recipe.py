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


def test_fsdp2_is_accepted_and_the_flattening_modes_name_it():
    """(TrainingArguments with deepspeed need the deepspeed package, absent here.)"""
    from accelerate.utils import DistributedType

    from hf_triaccel import TriAccelArguments
    from hf_triaccel.integrations.plugin import check_distributed_support

    check_distributed_support(DistributedType.FSDP, fsdp_version=2)
    check_distributed_support(DistributedType.MULTI_GPU)
    for kind, version in ((DistributedType.FSDP, 1), (DistributedType.DEEPSPEED, None)):
        with pytest.raises(NotImplementedError, match="use FSDP2"):
            check_distributed_support(kind, fsdp_version=version)
    common = dict(output_dir="unused", fsdp="full_shard", use_cpu=True, report_to=[])
    TriAccelArguments(fsdp_config={"version": 2}, **common)
    with pytest.raises(ValueError, match="FSDP version 1: use FSDP2"):
        TriAccelArguments(fsdp_config={"version": 1}, **common)
