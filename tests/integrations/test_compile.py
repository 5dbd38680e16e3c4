"""torch.compile with AdaFisher: refresh steps run eagerly, statistics equal eager's (CPU).

The compiled runs use dynamo's ``eager`` backend: the captured graph runs the same
operators in the same order as the module itself, so every factor and parameter must be
bitwise equal to the uncompiled run's (no tolerance to derive). What is tested is the
routing: which module runs on a refresh step, where the hooks are, and that the graph
is compiled once.
"""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn

timm = pytest.importorskip("timm")
transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

from accelerate.state import AcceleratorState  # noqa: E402

from hf_triaccel.integrations.layout import channels_last_batch  # noqa: E402
from hf_triaccel.integrations.plugin import TriAccelPlugin, prepare_triaccel  # noqa: E402
from hf_triaccel.integrations.trainer import TriAccelTrainer  # noqa: E402
from tests.integrations.tiny import ImageSet, Logs, make_args, tiny_timm  # noqa: E402


class HFStyleConv(nn.Module):
    """The Hugging Face convention: ``forward(pixel_values, labels) -> {"loss", "logits"}``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 10)

    def forward(self, pixel_values, labels=None):
        logits = self.head(F.relu(self.norm(self.conv(pixel_values))).mean(dim=(2, 3)))
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


def _compiled_frames() -> int:
    return torch._dynamo.utils.counters["frames"]["ok"]


@pytest.fixture
def fresh_dynamo():
    """No compiled code from earlier tests; for later ones, neither the
    ``ACCELERATE_DYNAMO_*`` variables that ``TrainingArguments(torch_compile=True)`` sets
    nor the shared ``AcceleratorState`` that keeps its dynamo backend (an ``Accelerator``
    would compile every model it prepares)."""
    environ = dict(os.environ)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()
    os.environ.clear()
    os.environ.update(environ)
    AcceleratorState._reset_state(reset_partial_state=True)


def _train(tmp_path, build, compiled: bool):
    logs = Logs()
    kwargs = dict(torch_compile=True, torch_compile_backend="eager") if compiled else {}
    args = make_args(tmp_path, max_steps=6, per_device_train_batch_size=4, **kwargs)
    model = build()
    trainer = TriAccelTrainer(model=model, args=args, train_dataset=ImageSet(), callbacks=[logs])
    trainer.train()
    return model, trainer, logs


@pytest.mark.parametrize("build", [tiny_timm, HFStyleConv], ids=["timm", "hf-style"])
def test_trainer_compiled_statistics_equal_eager(tmp_path, build, fresh_dynamo):
    eager, eager_trainer, _ = _train(tmp_path / "eager", build, compiled=False)
    torch._dynamo.utils.counters.clear()
    model, trainer, logs = _train(tmp_path / "compiled", build, compiled=True)
    assert type(trainer.model_wrapped).__name__ == "OptimizedModule"
    # update_every=2 over 6 steps: three refreshes, run eagerly, and three compiled steps
    # on one graph, traced with the collector off (no recompilation when it changes)
    assert trainer.optimizer.optimizer.fisher_steps == 6
    assert _compiled_frames() == 1
    factors, expected = trainer.collector.state_dict(), eager_trainer.collector.state_dict()
    assert list(factors) == list(expected)  # the eager modules' names
    for name, entry in expected.items():
        for key, tensor in entry.items():
            assert torch.equal(factors[name][key], tensor), (name, key)
    for (name, p), q in zip(eager.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q), name
    compile_logs = [e["compile_seconds"] for e in logs.entries if "compile_seconds" in e]
    assert compile_logs and all(s >= 0.0 for s in compile_logs)
    assert "compile_seconds" not in str(trainer.state.log_history)


def _loop(model: nn.Module, compile_it: bool):
    plugin = TriAccelPlugin(lr=1e-2, update_every=2)
    given = torch.compile(model, backend="eager") if compile_it else model
    run = prepare_triaccel(accelerate.Accelerator(cpu=True), given, plugin)
    data = ImageSet(24)
    for start in range(0, 24, 4):
        x, y = data.x[start : start + 4], data.y[start : start + 4]
        F.cross_entropy(run.model(x), y).backward()
        run.optimizer.step()
        run.optimizer.zero_grad()
    return run


def test_prepare_triaccel_with_a_compiled_model_equals_eager(fresh_dynamo):
    eager_model, compiled_model = tiny_timm(), tiny_timm()
    eager = _loop(eager_model, compile_it=False)
    torch._dynamo.utils.counters.clear()
    compiled = _loop(compiled_model, compile_it=True)
    assert _compiled_frames() == 1
    assert type(compiled.model).__name__ == "OptimizedModule"
    factors, expected = compiled.collector.state_dict(), eager.collector.state_dict()
    assert list(factors) == list(expected)  # hooks on the eager modules: the same names
    for name, entry in expected.items():
        for key, tensor in entry.items():
            assert torch.equal(factors[name][key], tensor), (name, key)
    for (name, p), q in zip(
        eager_model.named_parameters(), compiled_model.parameters(), strict=True
    ):
        assert torch.equal(p, q), name


@pytest.mark.parametrize(
    "extra",
    [dict(gradient_accumulation_steps=2), dict(elastic_batch=True)],
    ids=["accumulation", "elastic"],
)
def test_cuda_graphs_refused_with_several_micro_batches_a_step(tmp_path, extra, fresh_dynamo):
    args = make_args(tmp_path, torch_compile_mode="reduce-overhead", **extra)
    with pytest.raises(ValueError, match="reduce-overhead.*CUDA graphs"):
        TriAccelTrainer(model=tiny_timm(), args=args, train_dataset=ImageSet())
    # the same micro-batches without CUDA graphs, and CUDA graphs with one, are accepted
    TriAccelTrainer(model=tiny_timm(), args=make_args(tmp_path, **extra), train_dataset=ImageSet())
    args = make_args(tmp_path, torch_compile_mode="reduce-overhead")
    TriAccelTrainer(model=tiny_timm(), args=args, train_dataset=ImageSet())


class RecordingTrainer(TriAccelTrainer):
    """Keeps, for each training step, the parameters it started from, its batch and the
    gradients it left."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.records: list[tuple[list[torch.Tensor], dict, list[torch.Tensor]]] = []

    def training_step(self, model, inputs, num_items_in_batch=None):
        start = [p.detach().clone() for p in self.model.parameters()]
        batch = {k: v.clone() for k, v in inputs.items()}
        loss = super().training_step(model, inputs, num_items_in_batch)
        grads = [p.grad.detach().clone() for p in self.model.parameters()]
        self.records.append((start, batch, grads))
        return loss


def compiled_step_gaps(
    tmp_path, mode: str, use_cpu: bool, **arguments
) -> list[tuple[int, float, float, str]]:
    """Trains ``tiny_timm`` on 32x32 images for 6 steps compiled in ``mode`` (AdaFisherW
    refreshing every second step, eagerly, unless ``arguments`` for the Trainer say
    otherwise), then recomputes each step's gradients from the parameters and batch that
    step started from, eagerly in float32 and in float64.

    Returns, per step: the error of the step's gradients (all parameters' together)
    against the float64 ones, relative to the float64 gradients' norm; the same for the
    eager float32 gradients; the parameter whose gradient holds most of the step's
    error."""
    torch._dynamo.reset()
    args = make_args(tmp_path, max_steps=6, use_cpu=use_cpu, torch_compile_mode=mode, **arguments)
    model = tiny_timm()
    trainer = RecordingTrainer(model=model, args=args, train_dataset=ImageSet(size=32))
    single = copy.deepcopy(model)  # in the layout the trainer gave the model
    trainer.train()
    assert type(trainer.model_wrapped).__name__ == "OptimizedModule"
    single.to(args.device).train()
    double = copy.deepcopy(single).double()
    gaps = []
    for step, (start, batch, grads) in enumerate(trainer.records, 1):
        batch = {k: v.to(args.device) for k, v in batch.items()}
        batch = channels_last_batch(batch) if trainer.channels_last else batch
        eager = {}
        for reference in (single, double):
            dtype = next(reference.parameters()).dtype
            with torch.no_grad():
                for p, value in zip(reference.parameters(), start, strict=True):
                    p.copy_(value)
            reference.zero_grad(set_to_none=True)
            cast = {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.items()}
            trainer.compute_loss(reference, cast).backward()
            eager[dtype] = [p.grad.double() for p in reference.parameters()]
        exact = eager[torch.float64]
        norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in exact])).item()
        compiled_errors = [
            (got.double() - want).norm().item() for got, want in zip(grads, exact, strict=True)
        ]
        eager_errors = [
            (g - want).norm().item() for g, want in zip(eager[torch.float32], exact, strict=True)
        ]
        names = [name for name, _ in single.named_parameters()]
        worst = names[max(range(len(names)), key=compiled_errors.__getitem__)]
        gaps.append(
            (step, math.hypot(*compiled_errors) / norm, math.hypot(*eager_errors) / norm, worst)
        )
    return gaps


def test_compiled_steps_compute_eager_gradients_on_the_cpu(tmp_path, fresh_dynamo):
    """The GPU test's measurement on the CPU, compiled through AOTAutograd with eager
    kernels (no compiler needed): there the compiled steps' gradients are within float32
    rounding of float64's (about 1e-6 of the gradient), as eager's are."""
    gaps = compiled_step_gaps(tmp_path, "default", use_cpu=True, torch_compile_backend="aot_eager")
    assert [s for s, *_ in gaps] == list(range(1, 7))
    for step, compiled, eager, name in gaps:
        assert compiled < 10 * eager + 1e-4, (step, compiled, eager, name)
        assert eager < 1e-4, (step, eager)  # float32 against float64 at a well-conditioned state


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_steps_compute_eager_gradients(tmp_path, fresh_dynamo, monkeypatch, mode):
    """Each step of compiled training (inductor's kernels, replayed as CUDA graphs under
    ``reduce-overhead``; the refresh steps between them eager) leaves the gradients that
    the eager model computes from the same parameters and batch.

    Whole runs cannot be compared: on this small network a relative change of 1e-6 in the
    initial weights already moves some weights after 6 steps by a fifth of the distance
    they move (a sensitive trajectory, not an error), so each step is checked from the
    state it started in.

    Tolerance: compiled kernels reorder and fuse the float32 sums behind each gradient,
    and their convolutions may run in another layout, for which cuDNN may pick another
    algorithm: a compiled gradient differs from eager's by rounding, which the state's
    conditioning amplifies (cancelling sums behind batch norm's gradients). So both are
    measured against the float64 gradient, all parameters together: the compiled step's
    error may be ten times the eager float32 error at the same state, plus 1e-3 (a
    rounding floor of 1e-4 of the gradient for each of the network's 47 parameters, in
    quadrature, for a state where eager float32 happens to be exact). A gradient a
    replay overwrote, or a step run on the wrong module, is off by the order of the
    gradient itself.

    The images are 32x32: at 16x16 the last block's shortcut average-pools a 1x1 map
    with a 2x2 ``ceil_mode`` window, where inductor on CUDA (torch 2.11) computes the
    wrong gradient (BENCHMARKS.md, "Compiled gradients on the GPU").
    """
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # matmuls: off by default
    gaps = compiled_step_gaps(tmp_path, mode, use_cpu=False)
    assert {s for s, *_ in gaps} == set(range(1, 7))  # three refreshes, three compiled steps
    wrong = [g for g in gaps if g[1] > 10 * g[2] + 1e-3]
    assert not wrong, [
        f"step {s}: error {c:.2g} of the gradient (eager's {e:.2g}), most in {n}"
        for s, c, e, n in wrong
    ]
