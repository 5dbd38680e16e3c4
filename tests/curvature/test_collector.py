"""FisherCollector: when statistics are taken, how they are accumulated and folded,
which parameters get factors, and the hooks' life cycle."""

from __future__ import annotations

import copy
import io
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hf_triaccel import AdaFisherW
from hf_triaccel.curvature.collection.fold import minmax_normalise
from hf_triaccel.curvature.collector import FisherCollector
from hf_triaccel.curvature.rules import (
    FisherRule,
    LinearRule,
    a_statistic,
    g_statistic,
    register_fisher_rule,
    rule_for,
)
from tests.curvature.rounding import FactorBound, Recorder

GAMMA = 0.8


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def mlp(inplace: bool = False) -> nn.Sequential:
    return nn.Sequential(nn.Linear(5, 6), nn.ReLU(inplace=inplace), nn.Linear(6, 3))


def forward_backward(model: nn.Module, x: torch.Tensor, w: torch.Tensor | None = None):
    out = model(x)
    w = torch.randn_like(out) if w is None else w
    (out * w).sum().backward()
    return w


def n_forward_hooks(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) for m in model.modules())


def mlp_oracle(model: nn.Sequential, x: torch.Tensor, w: torch.Tensor):
    """(a, g) of both Linear layers of ``mlp`` for loss sum(out * w), in float64,
    computed functionally (no module call, so no hook fires)."""
    l0, l2 = model[0], model[2]
    x = x.double()
    w0, b0, w2, b2 = (p.detach().double() for p in (l0.weight, l0.bias, l2.weight, l2.bias))
    y0 = F.linear(x, w0, b0).requires_grad_()
    h = torch.relu(y0)
    y2 = F.linear(h, w2, b2)
    y2.retain_grad()
    (y2 * w.double()).sum().backward()
    ones = torch.ones(1, dtype=torch.float64)

    def a_of(inp):
        return torch.cat([inp.detach().square().mean(0), ones])

    return {
        "0": (a_of(x), y0.grad.square().mean(0)),
        "2": (a_of(h), y2.grad.square().mean(0)),
    }


def reference_fold(x: torch.Tensor) -> torch.Tensor:
    """One refresh of a factor from the default seed (zeros), ema='reference'."""
    return 0.01 * GAMMA * minmax_normalise(x)


# --------------------------------------------------------------------------- when


def test_statistics_only_while_collecting():
    model = mlp()
    collector = FisherCollector(model, impl="reference")
    collector.collecting = False
    forward_backward(model, torch.randn(4, 5))
    for layer in collector.layers.values():
        assert layer.a_count == layer.g_count == 0
        assert not any(t.any() for t in layer.statistics())
    collector.fold(GAMMA)  # nothing seen: factors keep their seed
    for layer in collector.layers.values():
        assert torch.equal(layer.a, torch.zeros_like(layer.a))  # still the seed
    collector.collecting = True
    forward_backward(model, torch.randn(4, 5))
    for layer in collector.layers.values():
        assert layer.a_count == layer.g_count == 1


def test_hooks_hold_their_layer_and_the_shared_state_not_the_collector():
    """No circle by attribute access: what the collector registers on the model holds
    its layer and the state the hooks share, never the collector."""
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
    collector = FisherCollector(model)
    hooks = [
        hook
        for module in model.modules()
        for hooks in (module._forward_hooks, module._forward_pre_hooks)
        for hook in hooks.values()
    ]
    assert len(hooks) == 2  # a LayerHook each: both read their own output gradient
    for hook in hooks:
        held = [getattr(hook, name) for name in ("state", "layer", "saved")]
        assert not any(value is collector for value in held)
        assert hook.state is collector.hook_state
        assert any(hook.layer is layer for layer in collector.layers.values())
    collector.detach()


def test_no_grad_and_inference_forward_do_not_accumulate():
    model = mlp()
    collector = FisherCollector(model, impl="reference")
    with torch.no_grad():
        model(torch.randn(4, 5))
    with torch.inference_mode():
        model(torch.randn(4, 5))
    model.eval()
    with torch.no_grad():
        model(torch.randn(4, 5))
    for layer in collector.layers.values():
        assert layer.a_count == layer.g_count == 0
        assert not layer.a_stat.any()  # not even written
        assert not any(t.any() for t in layer.statistics())


def test_forward_without_backward_does_not_skew_the_next_fold():
    model = mlp()
    twin = copy.deepcopy(model)
    x, w = torch.randn(4, 5), torch.randn(4, 3)
    c1 = FisherCollector(model, impl="reference")
    model.eval()
    model(torch.randn(4, 5) * 10)  # evaluation pass, autograd left on, no backward
    model.train()
    forward_backward(model, x, w)
    c1.fold(GAMMA)
    c2 = FisherCollector(twin, impl="reference")
    forward_backward(twin, x, w)
    c2.fold(GAMMA)
    for name in c1.layers:
        torch.testing.assert_close(c1.layers[name].a, c2.layers[name].a)


# --------------------------------------------------------------------------- accumulation


@pytest.mark.parametrize("ema", ["reference", "paper"])
def test_micro_batches_are_summed_then_finished_and_folded_once(ema):
    model = mlp()
    collector = FisherCollector(model, ema=ema, impl="reference")
    x1, x2 = torch.randn(3, 5), torch.randn(5, 5)
    w1 = forward_backward(model, x1)
    w2 = forward_backward(model, x2)
    # the statistics of the whole batch of 8 (the loss is a sum: the same output gradients)
    mean = mlp_oracle(model, torch.cat([x1, x2]), torch.cat([w1, w2]))
    for name, layer in collector.layers.items():
        assert layer.a_count == layer.g_count == 2
        assert layer.a_n == layer.g_n == 8
        a, g = layer.statistics()
        torch.testing.assert_close(a.double(), mean[name][0])
        torch.testing.assert_close(g.double(), mean[name][1])
    before = {n: (ly.a_ema.double(), ly.g_ema.double()) for n, ly in collector.layers.items()}
    collector.fold(GAMMA)
    for name, layer in collector.layers.items():
        for i, (ema_t, used) in enumerate(((layer.a_ema, layer.a), (layer.g_ema, layer.g))):
            if ema == "reference":  # cur <- 0.1 gamma cur + 0.01 gamma normalise(X)
                expected = 0.1 * GAMMA * before[name][i] + 0.01 * GAMMA * minmax_normalise(
                    mean[name][i]
                )
                torch.testing.assert_close(used.double(), expected)
                assert used is ema_t
            else:  # cur <- gamma cur + (1 - gamma) X, normalised after the EMA
                expected = GAMMA * before[name][i] + (1 - GAMMA) * mean[name][i]
                torch.testing.assert_close(ema_t.double(), expected)
                torch.testing.assert_close(used, minmax_normalise(ema_t))
        assert layer.a_count == layer.g_count == 0
        assert not any(t.any() for t in layer.statistics())
    # a fold with nothing new keeps the factors (no second EMA step)
    after = {
        n: [t.clone() for t in (ly.a, ly.g, ly.a_ema, ly.g_ema)]
        for n, ly in collector.layers.items()
    }
    collector.fold(GAMMA)
    for name, layer in collector.layers.items():
        for old, cur in zip(after[name], (layer.a, layer.g, layer.a_ema, layer.g_ema), strict=True):
            assert torch.equal(old, cur)


def test_a_module_called_twice_in_one_graph_counts_twice():
    lin = nn.Linear(4, 4)
    collector = FisherCollector(lin, impl="reference")
    x = torch.randn(3, 4)
    h = lin(x)
    out = lin(h)
    out.square().sum().backward()
    layer = collector.layers[""]
    assert layer.a_count == layer.g_count == 2
    expected = (x.square().mean(0) + h.detach().square().mean(0)) / 2
    torch.testing.assert_close(layer.statistics()[0][:4], expected)
    assert layer.statistics()[0][4] == 1.0  # the bias column


def test_a_held_evaluation_output_keeps_its_slot():
    """A forward whose output is still alive may yet get its gradient: its statistic
    keeps its slot, and the next forward's statistic goes to another one."""
    model = mlp()
    twin = copy.deepcopy(model)
    collector = FisherCollector(model, impl="reference")
    held = model(torch.randn(4, 5) * 10)
    x, w = torch.randn(4, 5), torch.randn(4, 3)
    forward_backward(model, x, w)
    layer = collector.layers["0"]
    assert len(layer.slots) == 2 and layer.confirmed == [1]
    collector.fold(GAMMA)
    plain = FisherCollector(twin, impl="reference")
    forward_backward(twin, x, w)
    plain.fold(GAMMA)
    for name, ly in collector.layers.items():
        torch.testing.assert_close(ly.a, plain.layers[name].a)
        torch.testing.assert_close(ly.g, plain.layers[name].g)
    del held  # its graph goes, and with it the hold on the slot
    assert layer.free_slot() == 0


def test_micro_batches_of_several_sizes_and_refreshes():
    """Micro-batches of different sizes give the statistics of their samples taken
    together (the constant entries included), refresh after refresh, whatever the last
    one was: each layer's statistic is the rule's statistic of every input and output
    gradient it saw since the last fold, concatenated."""
    torch.manual_seed(1)
    model = ResidualNet(inplace=True)
    collector = FisherCollector(model, ema="paper", impl="reference")
    recorder = Recorder(collector)

    def batch(n):
        return torch.randn(n, 3, 6, 6), torch.randn(n, 2)

    for sizes in ((2, 3, 2), (4,), (4,), (2,), (3, 1)):
        for x, w in [batch(n) for n in sizes]:
            forward_backward(model, x, w)
        seen, bounds = recorder.seen, recorder.bounds()
        before = {name: ly.g_ema.clone() for name, ly in collector.layers.items()}
        collector.fold(GAMMA)
        for name, ly in collector.layers.items():
            x, dy = seen[name]
            da, dg = bounds[name]
            a = a_statistic(ly.rule, ly.module, x)
            g = g_statistic(ly.rule, ly.module, dy)
            msg = f"{name} after {sizes}"
            torch.testing.assert_close(ly.a_stat, a, rtol=0, atol=da, msg=msg)
            torch.testing.assert_close(ly.g_stat, g, rtol=0, atol=dg, msg=msg)
            torch.testing.assert_close(ly.g_ema, GAMMA * before[name] + (1 - GAMMA) * ly.g_stat)


def test_reset_forgets_the_gathered_statistics():
    model = mlp()
    twin = copy.deepcopy(model)
    collector = FisherCollector(model, impl="reference")
    forward_backward(model, torch.randn(4, 5) * 3)
    for layer in collector.layers.values():
        layer.reset()
    x, w = torch.randn(4, 5), torch.randn(4, 3)
    forward_backward(model, x, w)
    plain = FisherCollector(twin, impl="reference")
    forward_backward(twin, x, w)
    for name, layer in collector.layers.items():
        assert layer.a_count == layer.g_count == 1
        for got, want in zip(layer.statistics(), plain.layers[name].statistics(), strict=True):
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize("channels_last", [False, True])
def test_triton_statistics_match_the_reference(channels_last):
    """The collector's fast path with the Triton kernels (interpreted on the CPU), within
    the bound two summation orders of the same statistic may differ by
    (``tests/curvature/rounding.py``), statistic and fold alike."""
    pytest.importorskip("triton")
    torch.manual_seed(2)
    model = ResidualNet(inplace=True)
    twin = copy.deepcopy(model)
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    model, twin = (m.to(memory_format=memory_format) for m in (model, twin))
    fast = FisherCollector(model, ema="paper", impl="triton")
    plain = FisherCollector(twin, ema="paper", impl="reference")
    recorder = Recorder(plain)
    for n in (3, 2):
        x = torch.randn(n, 3, 6, 6).contiguous(memory_format=memory_format)
        w = forward_backward(model, x)
        forward_backward(twin, x, w)
    bounds = recorder.bounds()
    for name, layer in fast.layers.items():
        stats = zip(
            layer.statistics(), plain.layers[name].statistics(), bounds[name], "ag", strict=True
        )
        for got, want, bound, which in stats:
            torch.testing.assert_close(got, want, rtol=0, atol=bound, msg=f"{which} of {name}")
    fast.fold(GAMMA)
    plain.fold(GAMMA)
    for name, layer in fast.layers.items():
        reference = plain.layers[name]
        for i, which in enumerate("ag"):
            bound = FactorBound("paper")
            ema = getattr(reference, f"{which}_ema")
            factor_atol = bound.fold(getattr(reference, f"{which}_stat"), bounds[name][i], ema)
            for attr, atol in ((f"{which}_ema", bound.error), (which, factor_atol)):
                got, want = getattr(layer, attr), getattr(reference, attr)
                torch.testing.assert_close(got, want, rtol=0, atol=atol, msg=f"{attr} of {name}")


@pytest.mark.parametrize("ema", ["reference", "paper"])
def test_triton_folds_of_layers_that_take_turns_match_the_reference(ema):
    """The folds the collector keeps per set of ready layers (one kernel table each): a
    head left out of a step keeps its factors, and every later fold, of all layers or of
    a few, reads the right tensors."""
    pytest.importorskip("triton")
    model = nn.ModuleDict({"body": nn.Linear(4, 5), "a": nn.Linear(5, 2), "b": nn.Linear(5, 3)})
    twin = copy.deepcopy(model)
    fast = FisherCollector(model, ema=ema, impl="triton")
    plain = FisherCollector(twin, ema=ema, impl="reference")
    for heads in (("a", "b"), ("a",), ("b",), ("a", "b"), ("a",)):
        x = torch.randn(3, 4)
        for net in (model, twin):
            h = net["body"](x)
            sum(net[head](h).square().sum() for head in heads).backward()
        before = {name: layer.a.clone() for name, layer in fast.layers.items()}
        fast.fold(GAMMA)
        plain.fold(GAMMA)
        for name, layer in fast.layers.items():
            if name not in ("body", *heads):
                assert torch.equal(layer.a, before[name]), name
            for attr in ("a", "g", "a_ema", "g_ema"):
                torch.testing.assert_close(
                    getattr(layer, attr), getattr(plain.layers[name], attr), rtol=1e-5, atol=1e-7
                )


# --------------------------------------------------------------------------- in-place ops


def test_inplace_relu_after_a_hooked_layer():
    model = mlp(inplace=True)
    twin = mlp(inplace=False)
    twin.load_state_dict(model.state_dict())
    c1 = FisherCollector(model, impl="reference")
    c2 = FisherCollector(twin, impl="reference")
    x, w = torch.randn(6, 5), torch.randn(6, 3)
    forward_backward(model, x, w)
    forward_backward(twin, x, w)
    oracle = mlp_oracle(twin, x, w)
    for name in ("0", "2"):
        a1, g1 = c1.layers[name].statistics()
        a2, g2 = c2.layers[name].statistics()
        torch.testing.assert_close(a1, a2)
        torch.testing.assert_close(g1, g2)
        torch.testing.assert_close(a1.double(), oracle[name][0])
        torch.testing.assert_close(g1.double(), oracle[name][1])


class SecondOfASplit(nn.Linear):
    """A Linear whose output is the second output of a split: its gradient reaches the
    node the hook is on as that node's second gradient (the first one gets none)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(torch.cat([x, x])).split(len(x))[1]


def test_the_gradient_of_a_node_s_second_output_is_the_one_taken():
    model, plain = SecondOfASplit(5, 3), nn.Linear(5, 3)
    plain.load_state_dict(model.state_dict())
    c1 = FisherCollector(model, impl="reference")
    c2 = FisherCollector(plain, impl="reference")
    x, w = torch.randn(6, 5), torch.randn(6, 3)
    out = model(x)
    assert out.output_nr == 1  # the case under test
    (out * w).sum().backward()
    (plain(x) * w).sum().backward()
    for got, want in zip(c1.layers[""].statistics(), c2.layers[""].statistics(), strict=True):
        torch.testing.assert_close(got, want)


class ResidualNet(nn.Module):
    """timm-style block: in-place ReLU and ``x += shortcut`` after hooked layers."""

    def __init__(self, inplace: bool):
        super().__init__()
        self.inplace = inplace
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.bn0 = nn.BatchNorm2d(4)
        self.conv1 = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(4)
        self.act = nn.ReLU(inplace=inplace)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        x = self.act(self.bn0(self.stem(x)))
        shortcut = x
        out = self.act(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.inplace:
            out += shortcut
        else:
            out = out + shortcut
        out = self.act(out)
        return self.head(out.mean((2, 3)))


def test_inplace_residual_add_gives_the_out_of_place_statistics():
    model = ResidualNet(inplace=True)
    twin = ResidualNet(inplace=False)
    twin.load_state_dict(model.state_dict())
    c1 = FisherCollector(model, impl="reference")
    c2 = FisherCollector(twin, impl="reference")
    x, w = torch.randn(2, 3, 6, 6), torch.randn(2, 2)
    forward_backward(model, x, w)
    forward_backward(twin, x, w)
    assert set(c1.layers) == {"stem", "bn0", "conv1", "bn1", "conv2", "bn2", "head"}
    for name, layer in c1.layers.items():
        assert layer.a_count == layer.g_count == 1, name
        for t1, t2 in zip(layer.statistics(), c2.layers[name].statistics(), strict=True):
            torch.testing.assert_close(t1, t2)
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)


# --------------------------------------------------------------------------- hooks


def test_second_collector_replaces_the_first():
    model = mlp()
    first = FisherCollector(model, impl="reference")
    assert first.attached and n_forward_hooks(model) == 2
    with pytest.warns(UserWarning, match="already had a FisherCollector"):
        second = FisherCollector(model, impl="reference")
    assert not first.attached and second.attached
    assert n_forward_hooks(model) == 2
    for m in (model[0], model[2]):
        assert len(m._forward_hooks) == 1
    forward_backward(model, torch.randn(4, 5))
    for name in ("0", "2"):
        assert first.layers[name].a_count == first.layers[name].g_count == 0
        assert second.layers[name].a_count == second.layers[name].g_count == 1


def test_remove_takes_every_hook_away():
    model = ResidualNet(inplace=True)
    user_hook = model.head.register_forward_hook(lambda *args: None)
    collector = FisherCollector(model, impl="reference")
    assert n_forward_hooks(model) == len(collector.layers) + 1
    collector.remove()
    assert not collector.attached
    assert n_forward_hooks(model) == 1  # the user's own hook stays
    assert not hasattr(model, "_hf_triaccel_collector")
    forward_backward(model, torch.randn(2, 3, 6, 6))
    for layer in collector.layers.values():
        assert layer.a_count == layer.g_count == 0
    collector.remove()  # idempotent
    user_hook.remove()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing attached any more: no warning
        again = FisherCollector(model, impl="reference")
    assert n_forward_hooks(model) == len(again.layers)
    with again:
        pass
    assert n_forward_hooks(model) == 0


def n_hooks(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_deep_copy_of_a_hooked_model_does_not_feed_the_original():
    model = mlp()
    collector = FisherCollector(model, impl="reference")
    clone = copy.deepcopy(model)  # e.g. an EMA / teacher copy of the model being trained
    forward_backward(clone, torch.randn(4, 5))
    for layer in collector.layers.values():
        assert layer.a_count == layer.g_count == 0
    # the copy's stand-ins take nothing, and hold nothing of the collector
    hooks = [
        h
        for m in clone.modules()
        for d in (m._forward_pre_hooks, m._forward_hooks)
        for h in d.values()
    ]
    assert hooks and all(type(h).__name__ == "InertHook" for h in hooks)


def test_hooks_are_registered_only_for_refresh_steps():
    """Between refreshes the model runs unhooked: its modules' calls take torch's fast
    path, with no Python hook to call."""
    model = mlp()
    opt = AdaFisherW.from_model(model, lr=1e-2, update_every=3, impl="reference")
    hooked = []
    for _ in range(7):
        hooked.append(n_hooks(model))
        forward_backward(model, torch.randn(4, 5))
        opt.step()
        opt.zero_grad()
    assert hooked == [2, 0, 0, 2, 0, 0, 2]  # one forward hook per layer
    assert opt.collector.attached


def test_detach_and_attach_again():
    model = mlp()
    collector = FisherCollector(model, impl="reference")
    forward_backward(model, torch.randn(4, 5))
    collector.detach()
    assert not collector.attached and n_hooks(model) == 0
    forward_backward(model, torch.randn(4, 5))  # not taken
    collector.attach()
    assert collector.attached and n_hooks(model) == 2
    collector.collecting = False
    assert n_hooks(model) == 0 and collector.attached
    collector.collecting = True
    forward_backward(model, torch.randn(4, 5))
    for layer in collector.layers.values():  # the first and the last micro-batch
        assert layer.a_count == layer.g_count == 2
    collector.attach()  # attached already: nothing doubles
    assert n_hooks(model) == 2


def test_attach_takes_the_model_back_from_another_collector():
    model = mlp()
    first = FisherCollector(model, impl="reference")
    first.detach()
    second = FisherCollector(model, impl="reference")
    with pytest.warns(UserWarning, match="already had a FisherCollector"):
        first.attach()
    assert first.attached and not second.attached
    assert n_hooks(model) == 2


def _train(model, opt, seed: int, steps: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(4, 5, generator=gen)
        forward_backward(model, x, torch.randn(4, 3, generator=gen))
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("how", ["deepcopy", "deepcopy_optimizer_first", "pickle"])
def test_a_copied_model_and_optimizer_keep_taking_statistics_on_the_copy(how):
    """Copied together, mid-accumulation (a refresh step's backward done, its fold to
    come), the copy hooks the copied model, steps like the original, and the original's
    collector sees none of the copy's forwards."""
    model = mlp()
    opt = AdaFisherW.from_model(model, lr=1e-2, update_every=2, impl="reference")
    _train(model, opt, seed=1, steps=2)
    forward_backward(model, torch.randn(4, 5))  # step 2 refreshes: statistics pending
    if how == "deepcopy":
        twin, twin_opt = copy.deepcopy((model, opt))
    elif how == "deepcopy_optimizer_first":
        twin_opt, twin = copy.deepcopy((opt, model))
    else:
        twin, twin_opt = pickle.loads(pickle.dumps((model, opt)))
    collector = twin_opt.collector
    assert collector is not opt.collector and collector.attached
    assert all(ly.module is twin.get_submodule(name) for name, ly in collector.layers.items())
    assert n_hooks(twin) == 2 and n_hooks(model) == 2
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        q.grad = p.grad.clone()  # a Parameter copies without its gradient
    opt.step()
    twin_opt.step()
    opt.zero_grad()
    twin_opt.zero_grad()
    counts = [ly.a_count for ly in opt.collector.layers.values()]
    _train(twin, twin_opt, seed=2, steps=3)
    assert [ly.a_count for ly in opt.collector.layers.values()] == counts
    _train(model, opt, seed=2, steps=3)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)
    for a, b in zip(opt.collector.layers.values(), collector.layers.values(), strict=True):
        assert torch.equal(a.a, b.a) and torch.equal(a.g, b.g)


def test_a_copied_detached_collector_stays_detached():
    model = mlp()
    collector = FisherCollector(model, impl="reference")
    collector.detach()
    twin, twin_collector = copy.deepcopy((model, collector))
    assert not twin_collector.attached and n_hooks(twin) == 0


# --------------------------------------------------------------------------- which params


def test_frozen_parameters_get_no_factors():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2), nn.LayerNorm(2))
    model[0].weight.requires_grad_(False)
    model[1].requires_grad_(False)
    model[3].bias.requires_grad_(False)
    collector = FisherCollector(model, impl="reference")
    assert sorted(collector.layers) == ["0", "2", "3"]
    assert set(collector.layers["0"].layouts) == {"bias"}
    assert set(collector.layers["3"].layouts) == {"weight"}
    assert collector.factors_for(model[0].weight) is None
    assert collector.factors_for(model[0].bias) is not None
    assert collector.factors_for(model[3].bias) is None
    assert not model[1]._forward_hooks
    assert all(collector.factors_for(p) is None for p in model[1].parameters())
    forward_backward(model, torch.randn(3, 4))
    assert collector.layers["0"].a_count == collector.layers["0"].g_count == 1


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.mix = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(torch.tanh(self.mix(self.emb(idx))))


def test_tied_parameter_is_assigned_once():
    model = TiedLM()
    collector = FisherCollector(model, impl="reference")
    assert sorted(collector.layers) == ["emb", "mix"]
    assert not model.head._forward_hooks
    factors = collector.factors_for(model.head.weight)
    assert factors.a is collector.layers["emb"].a and factors.g is collector.layers["emb"].g
    assert factors.a.shape == (10,) and factors.g.shape == (4,)
    idx = torch.randint(0, 10, (2, 5))
    logits = model(idx)
    F.cross_entropy(logits.reshape(-1, 10), idx.reshape(-1)).backward()
    assert collector.layers["emb"].a_count == collector.layers["emb"].g_count == 1
    # a_v: share of the tokens that are v
    counts = torch.bincount(idx.reshape(-1), minlength=10).float() / idx.numel()
    torch.testing.assert_close(collector.layers["emb"].statistics()[0], counts)


class WithExtra(nn.Module):
    """An unsupported parameter registered before the supported layers."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(5))
        self.l1 = nn.Linear(5, 6)
        self.l2 = nn.Linear(6, 3)

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x * self.scale)))


def test_parameters_are_matched_by_identity():
    model = WithExtra()
    collector = FisherCollector(model, impl="reference")
    assert collector.factors_for(model.scale) is None
    assert collector.factors_for(nn.Parameter(model.l1.weight.detach().clone())) is None
    for name in ("l1", "l2"):
        layer = collector.layers[name]
        mod = getattr(model, name)
        for attr in ("weight", "bias"):
            f = collector.factors_for(getattr(mod, attr))
            assert f.a is layer.a and f.g is layer.g
            assert f.layout == rule_for(mod).layouts(mod)[attr]
    assert collector.factors_for(model.l2.bias).layout.a_off == 6
    forward_backward(model, torch.randn(3, 5))
    assert collector.layers["l2"].statistics()[0].shape == (7,)


# --------------------------------------------------------------------------- dtypes


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_activations_give_float32_statistics(dtype):
    model = mlp().to(dtype)
    collector = FisherCollector(model, impl="reference")
    x = (torch.randn(4, 5) * 300).to(dtype)  # x^2 overflows fp16
    out = model(x)
    (out.float() * 300).sum().backward()
    layer = collector.layers["0"]
    a_sum, g_sum = layer.statistics()
    assert a_sum.dtype == torch.float32 and g_sum.dtype == torch.float32
    assert torch.isfinite(a_sum).all() and torch.isfinite(g_sum).all()
    expected = x.double().square().mean(0)
    torch.testing.assert_close(a_sum[:5].double(), expected, rtol=1e-6, atol=0)
    collector.fold(GAMMA)
    for ly in collector.layers.values():
        assert ly.a.dtype == torch.float32 and torch.isfinite(ly.a).all()


def test_autocast_bf16_statistics_are_float32():
    model = mlp()
    collector = FisherCollector(model, impl="reference")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.randn(4, 5))
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    for layer in collector.layers.values():
        assert layer.g_stat.dtype == torch.float32 and layer.g_count == 1
        assert layer.a_stat.dtype == torch.float32


# --------------------------------------------------------------------------- GradScaler


@pytest.mark.parametrize("ema", ["reference", "paper"])
def test_grad_scaler_scale_is_removed(ema):
    model = mlp()
    twin, third = copy.deepcopy(model), copy.deepcopy(model)
    x, w = torch.randn(4, 5), torch.randn(4, 3) * 1e-4  # small grads: the scale matters
    plain = FisherCollector(twin, ema=ema, impl="reference")
    forward_backward(twin, x, w)
    plain_g_sum = plain.layers["2"].statistics()[1]
    plain.fold(GAMMA)

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    assert scaler.is_enabled()
    scaled = FisherCollector(model, ema=ema, impl="reference")
    scaled.grad_scaler = scaler
    scaler.scale((model(x) * w).sum()).backward()
    g_sum = scaled.layers["2"].statistics()[1]
    torch.testing.assert_close(g_sum / 2.0**24, plain_g_sum, rtol=1e-5, atol=0)
    scaled.fold(GAMMA)
    for name, layer in scaled.layers.items():
        for attr in ("a_ema", "g_ema", "a", "g"):
            torch.testing.assert_close(
                getattr(layer, attr), getattr(plain.layers[name], attr), rtol=1e-5, atol=1e-7
            )
    # without the scaler attached the factors differ: the check above can fail
    unscaled = FisherCollector(third, ema=ema, impl="reference")
    scaler.scale((third(x) * w).sum()).backward()
    unscaled.fold(GAMMA)
    assert not torch.allclose(unscaled.layers["2"].g_ema, plain.layers["2"].g_ema, rtol=1e-3)


def test_disabled_grad_scaler_is_ignored():
    model = mlp()
    collector = FisherCollector(model, impl="reference")
    collector.grad_scaler = torch.amp.GradScaler("cpu", enabled=False)
    x, w = torch.randn(4, 5), torch.randn(4, 3)
    forward_backward(model, x, w)
    collector.fold(GAMMA)
    oracle = mlp_oracle(model, x, w)
    torch.testing.assert_close(collector.layers["2"].g.double(), reference_fold(oracle["2"][1]))


# --------------------------------------------------------------------------- state dict


def test_state_dict_round_trip():
    model = ResidualNet(inplace=True)
    collector = FisherCollector(model, impl="reference")
    before_any = collector.state_dict()  # before any statistic: fine
    assert set(before_any) == set(collector.layers)
    forward_backward(model, torch.randn(2, 3, 6, 6))
    collector.fold(GAMMA)
    sd = collector.state_dict()
    buffer = io.BytesIO()
    torch.save(sd, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)

    fresh_model = ResidualNet(inplace=True)
    fresh = FisherCollector(fresh_model, impl="reference")
    fresh.load_state_dict(loaded)
    for name, layer in collector.layers.items():
        other = fresh.layers[name]
        for attr in ("a_ema", "g_ema", "a", "g"):
            assert torch.equal(getattr(layer, attr), getattr(other, attr)), (name, attr)
    # the factor tensors kept their identity (the optimizer holds references to them)
    f = fresh.factors_for(fresh_model.conv1.weight)
    assert f.a is fresh.layers["conv1"].a
    # the saved dict is a copy
    sd["head"]["a"].add_(1.0)
    assert not torch.equal(sd["head"]["a"], collector.layers["head"].a_ema)


def test_load_state_dict_mismatch_errors():
    model = mlp()
    collector = FisherCollector(model, impl="reference")
    sd = collector.state_dict()
    missing = {k: v for k, v in sd.items() if k != "2"}
    with pytest.raises(KeyError, match="missing"):
        collector.load_state_dict(missing)
    extra = dict(sd, other=sd["0"])
    with pytest.raises(KeyError, match="unexpected"):
        collector.load_state_dict(extra)
    bad = copy.deepcopy(sd)
    bad["0"]["a"] = torch.ones(3)
    with pytest.raises(ValueError, match="shape"):
        collector.load_state_dict(bad)


# --------------------------------------------------------------------------- options, errors


def test_exclude():
    model = mlp()
    collector = FisherCollector(model, impl="reference", exclude=("0",))
    assert list(collector.layers) == ["2"]
    assert not model[0]._forward_hooks
    assert collector.factors_for(model[0].weight) is None
    with pytest.raises(ValueError, match="nope"):
        FisherCollector(mlp(), exclude=("nope",))


def test_bad_inputs():
    with pytest.raises(TypeError, match="nn.Module"):
        FisherCollector(lambda x: x)
    with pytest.raises(ValueError, match="ema"):
        FisherCollector(mlp(), ema="adam")
    with pytest.raises(TypeError):
        register_fisher_rule(int, LinearRule())
    with pytest.raises(TypeError):
        register_fisher_rule(nn.Linear, "linear")


def test_registered_rule_for_a_custom_module():
    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(3))

        def forward(self, x):
            return x * self.weight

    class ScaleRule(FisherRule):
        def sizes(self, module):
            return 1, 3

        def layouts(self, module):
            from hf_triaccel.curvature.rules import per_entry_layout

            return {"weight": per_entry_layout(3, 0)}

        def a_write(self, module, x, out, impl, cache):
            out.copy_(x.float().square().sum().reshape(1))
            return x.numel()

        def g_write(self, module, grad, out, accumulate, impl, cache):
            stat = grad.float().square().sum(0)
            out.add_(stat) if accumulate else out.copy_(stat)
            return grad.shape[0]

    model = nn.Sequential(nn.Linear(3, 3), Scale())
    assert rule_for(model[1]) is None
    register_fisher_rule(Scale, ScaleRule())
    collector = FisherCollector(model, impl="reference")
    assert sorted(collector.layers) == ["0", "1"]
    forward_backward(model, torch.randn(4, 3))
    assert collector.layers["1"].a_count == collector.layers["1"].g_count == 1
