"""The dtype each module computes in, observed inside its forward, and clean removal."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from hf_triaccel.precision import PrecisionController, PrecisionHook, PrecisionPolicy


class Probe(nn.Module):
    """Records, inside its forward, the input dtype, the dtype its matmul produced and
    whether CPU autocast was on."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d, d) / d)
        self.seen: list[tuple[torch.dtype, torch.dtype, bool]] = []

    def forward(self, x):
        y = x @ self.weight.t()
        self.seen.append((x.dtype, y.dtype, torch.is_autocast_enabled("cpu")))
        return y


class ProbeLayerNorm(nn.LayerNorm):
    def __init__(self, d: int = 4) -> None:
        super().__init__(d)
        self.seen: list[tuple[torch.dtype, torch.dtype, bool]] = []

    def forward(self, x):
        y = super().forward(x)
        self.seen.append((x.dtype, y.dtype, torch.is_autocast_enabled("cpu")))
        return y


def probe_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Probe(), Probe(), Probe(), ProbeLayerNorm(), Probe())


RULES = [("0", "fp32"), ("1", "bf16"), ("2", "fp16"), ("3", "fp16")]
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


@pytest.mark.parametrize("ambient", [None, torch.bfloat16, torch.float16])
def test_each_module_computes_in_its_decided_precision(ambient):
    model = probe_model()
    controller = PrecisionController(model, PrecisionPolicy(rules=RULES))
    assert controller.decisions == {"0": "fp32", "1": "bf16", "2": "fp16", "3": "fp32"}
    region = (
        torch.autocast("cpu", dtype=ambient) if ambient is not None else contextlib.nullcontext()
    )
    with region:
        # a half-precision input: the fp32 module casts it up
        out = model(torch.randn(3, 4, dtype=BF16))
    assert model[0].seen == [(F32, F32, False)]
    # under autocast, an fp32 module hands its output on in autocast's dtype; without it,
    # a module's half-precision output is cast back to float32
    assert model[1].seen == [(ambient or F32, BF16, True)]
    assert model[2].seen == [(BF16 if ambient else F32, F16, True)]
    assert model[3].seen == [(F32, F32, False)]  # norm: fp32 despite the fp16 rule
    # the undecided module follows the surrounding autocast
    expected_last = (ambient or F32, ambient or F32, ambient is not None)
    assert model[4].seen == [expected_last]
    assert out.dtype == (ambient or F32)
    assert not torch.is_autocast_enabled("cpu")  # every region was closed


def test_innermost_decision_wins_and_parent_ops_keep_their_precision():
    class Parent(nn.Module):
        def __init__(self):
            super().__init__()
            self.child = Probe()
            self.weight = nn.Parameter(torch.eye(4))
            self.seen = []

        def forward(self, x):
            y = self.child(x)
            z = y @ self.weight
            self.seen.append(z.dtype)
            return z

    model = Parent()
    PrecisionController(model, PrecisionPolicy(rules=[("child", "bf16"), ("", "fp32")]))
    model(torch.randn(2, 4))
    assert model.child.seen[0][1] == BF16
    assert model.seen == [F32]


def test_region_is_closed_when_the_forward_raises():
    class Failing(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(1))

        def forward(self, x):
            raise RuntimeError("boom")

    module = Failing()
    PrecisionHook(module, "bf16")
    with pytest.raises(RuntimeError, match="boom"):
        module(torch.ones(1))
    assert not torch.is_autocast_enabled("cpu")


def hook_counts(model: nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


def hook_bookkeeping(model: nn.Module) -> int:
    return sum(
        len(m._forward_hooks_always_called) + len(m._forward_pre_hooks_with_kwargs)
        for m in model.modules()
    )


def test_remove_leaves_no_hook_and_the_original_outputs():
    model = probe_model()
    x = torch.randn(3, 4)
    reference = model(x)
    controller = PrecisionController(model, PrecisionPolicy(rules=RULES))
    controller.update({"4": 1.0}, step=1)
    hooked = model(x)
    assert hook_counts(model) == 2 * len(controller.decisions)
    assert not torch.equal(hooked, reference)  # low precision changed the numbers
    controller.remove()
    assert hook_counts(model) == 0 and hook_bookkeeping(model) == 0
    assert torch.equal(model(x), reference)
    with pytest.raises(RuntimeError, match="removed"):
        controller.update({"4": 1.0}, step=2)


def test_half_precision_models_are_refused():
    with pytest.raises(ValueError, match="float32 parameters"):
        PrecisionController(nn.Linear(2, 2).to(torch.bfloat16))


@pytest.mark.parametrize("ambient", [None, torch.bfloat16])
def test_fp32_batchnorm_keeps_its_input_dtype_and_computes_in_float32(ambient):
    # BatchNorm kernels take half inputs with float32 parameters and compute in float32:
    # a float32 copy of the input would only cost memory
    torch.manual_seed(0)
    x = torch.randn(4, 3, 5, 5, dtype=BF16)
    reference = nn.BatchNorm2d(3)
    expected = reference(x.float())
    bn = nn.BatchNorm2d(3)
    controller = PrecisionController(bn)
    assert controller.decisions == {"": "fp32"}
    assert not bn._forward_pre_hooks and not bn._forward_hooks  # native float32: no hook
    region = (
        torch.autocast("cpu", dtype=ambient) if ambient is not None else contextlib.nullcontext()
    )
    with region:
        out = bn(x)
    assert out.dtype == BF16
    assert bn.running_mean.dtype == F32
    # float32 arithmetic: only the output's rounding to bf16 differs
    torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(bn.running_var, reference.running_var)


class _SeesBenchmark(torch.autograd.Function):
    """Identity that records cuDNN's autotuning flag in its forward and backward."""

    @staticmethod
    def forward(ctx, x, seen):
        ctx.seen = seen
        seen.append(("forward", torch.backends.cudnn.benchmark))
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.seen.append(("backward", torch.backends.cudnn.benchmark))
        return grad, None


class BenchmarkProbe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))
        self.seen: list[tuple[str, bool]] = []

    def forward(self, x):
        return _SeesBenchmark.apply(x * self.weight, self.seen)


@pytest.mark.parametrize("precision, untuned", [("fp32", True), ("bf16", False)])
def test_cudnn_autotuning_is_off_only_around_modules_in_another_dtype(precision, untuned):
    """Under bf16 autocast an fp32 module runs forward and backward without autotuning
    (a new dtype would autotune again); a bf16 module keeps it; it is restored after."""
    module = BenchmarkProbe()
    hook = PrecisionHook(module, precision)
    previous = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True
    try:
        with torch.autocast("cpu", dtype=BF16):
            out = module(torch.randn(2, 4, requires_grad=True))
        assert torch.backends.cudnn.benchmark
        out.float().sum().backward()
        assert torch.backends.cudnn.benchmark
    finally:
        torch.backends.cudnn.benchmark = previous
        hook.remove()
    assert module.seen == [("forward", not untuned), ("backward", not untuned)]
