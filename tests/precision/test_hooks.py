"""The dtype each module computes in, observed inside its forward, and clean removal."""

from __future__ import annotations

import contextlib
import gc
import weakref

import pytest
import torch
import torch.utils.checkpoint
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


class RecordsInput(nn.Module):
    """A Linear that keeps a weak reference to the input its forward received and may
    first modify that input in place."""

    def __init__(self, scale_in_place: float | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(8, 8)
        self.scale_in_place = scale_in_place
        self.received: list[weakref.ref] = []

    def forward(self, x):
        self.received.append(weakref.ref(x))
        if self.scale_in_place is not None:
            x.mul_(self.scale_in_place)
        return self.linear(x)


def reference(module: RecordsInput, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Output and weight gradient of the module computed in float32 without hooks, the
    output rounded to bf16 before the loss as under the hook."""
    inner = x.detach().float() * (module.scale_in_place or 1.0)
    out = nn.functional.linear(inner, module.linear.weight, module.linear.bias).to(BF16)
    (grad,) = torch.autograd.grad(out.float().square().sum(), module.linear.weight)
    return out.detach(), grad


@pytest.mark.parametrize("shape", [(4, 8), (2, 3, 8)])  # 3-d: the matmul saves a view
@pytest.mark.parametrize("scale_in_place", [None, 3.0])
def test_fp32_module_saves_its_half_inputs_not_their_float32_copies(scale_in_place, shape):
    module = RecordsInput(scale_in_place)
    hook = PrecisionHook(module, "fp32")
    x = torch.randn(shape).to(BF16)
    expected_out, expected_grad = reference(module, x)
    with torch.autocast("cpu", dtype=BF16):
        out = module(x)
    gc.collect()
    # the float32 copy the module computed on is gone unless it was changed in place
    # before being saved: then the backward needs its new values
    assert (module.received[0]() is not None) == (scale_in_place is not None)
    out.float().square().sum().backward()
    assert out.dtype == BF16
    torch.testing.assert_close(out, expected_out, rtol=0, atol=0)
    torch.testing.assert_close(module.linear.weight.grad, expected_grad)
    hook.remove()


def test_fp32_module_input_changed_after_the_forward_fails_the_backward():
    module = RecordsInput()
    hook = PrecisionHook(module, "fp32")
    x = torch.randn(4, 8).to(BF16)
    with torch.autocast("cpu", dtype=BF16):
        out = module(x)
    x.add_(1.0)
    with pytest.raises(RuntimeError, match="modified in place after the forward"):
        out.float().sum().backward()
    hook.remove()


def test_fp32_module_inside_activation_checkpointing_matches_without():
    """Inside non-reentrant checkpointing the checkpoint's own saved-tensor hooks keep
    the saved tensors; gradients match an unchecked forward."""
    grads = []
    for checkpointed in (False, True):
        module = RecordsInput()
        hook = PrecisionHook(module.linear, "fp32")
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)).to(BF16)
        x.requires_grad_(True)
        with torch.autocast("cpu", dtype=BF16):
            if checkpointed:
                out = torch.utils.checkpoint.checkpoint(module, x, use_reentrant=False)
            else:
                out = module(x)
        out.float().square().sum().backward()
        grads.append((module.linear.weight.grad, x.grad))
        hook.remove()
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)
