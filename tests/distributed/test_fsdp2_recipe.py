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


@pytest.mark.parametrize("field", ["triaccel_precision", "triaccel_lr_steering"])
def test_signal_features_are_refused_with_fsdp(field):
    from hf_triaccel import TriAccelArguments

    common = dict(output_dir="unused", fsdp="full_shard", use_cpu=True, report_to=[])
    with pytest.raises(NotImplementedError, match=f"TriAccelArguments.{field}=True: .* FSDP2"):
        TriAccelArguments(fsdp_config={"version": 2}, **{field: True}, **common)
    TriAccelArguments(**{field: True}, use_cpu=True, output_dir="unused", report_to=[])


def _tracker_meets_sharded_parameters(rank: int, world: int) -> list[str]:
    """The tracker refuses FSDP2-sharded parameters: built after ``fully_shard``, and at
    its first evaluation when built before."""
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from hf_triaccel import AdaFisherW
    from hf_triaccel.curvature.signals import SignalTracker

    errors = []
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    optimizer = AdaFisherW.from_model(model, update_every=1)
    early = SignalTracker(optimizer.collector, optimizer, every=1)
    fully_shard(model)
    try:
        SignalTracker(optimizer.collector)
    except NotImplementedError as error:
        errors.append(str(error))
    F.cross_entropy(model(torch.randn(4, 4)), torch.tensor([0, 1, 0, 1])).backward()
    try:
        optimizer.step()
    except NotImplementedError as error:
        errors.append(str(error))
    assert early.steps == 1
    return errors


@pytest.mark.timeout(120)
def test_signals_refuse_fsdp2_sharded_parameters(tmp_path):
    from hf_triaccel.testing import run_distributed

    (errors,) = run_distributed(_tracker_meets_sharded_parameters, 1, tmp_path)
    assert len(errors) == 2
    assert all("sharded by FSDP2" in e and "'0.weight'" in e for e in errors), errors


def _oom_under_fsdp2(rank: int, world: int) -> list[str]:
    """An out-of-memory error in the forward of an FSDP2-sharded model, on every rank at
    once (so that no rank waits in a collective): each raises instead of re-running."""
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from hf_triaccel.memory import ElasticBatchController, ElasticBatchError, NullProbe
    from hf_triaccel.testing import oom

    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    fully_shard(model)
    calls = []

    def loss_fn(piece):
        calls.append(len(piece[0]))
        out = model(piece[0])  # the parameters gathered: the OOM comes after the collective
        if len(calls) == 1:
            raise oom()
        return torch.nn.functional.cross_entropy(out, piece[1])

    controller = ElasticBatchController(4, probe=NullProbe())
    batch = (torch.randn(4, 4), torch.tensor([0, 1, 0, 1]))
    try:
        controller.run_step(batch, loss_fn, model=model)
    except ElasticBatchError as error:
        return [str(error), str(calls)]
    return ["re-run", str(calls)]


@pytest.mark.timeout(120)
def test_an_oom_under_fsdp2_is_not_re_run_by_one_process(tmp_path):
    from hf_triaccel.testing import run_distributed

    for message, calls in run_distributed(_oom_under_fsdp2, 2, tmp_path):
        assert "under FSDP2" in message and "re-run by one process alone" in message, message
        assert calls == "[4]"  # one attempt, no re-run
