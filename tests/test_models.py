"""AdaFisher / AdaFisherW on real timm and transformers models (small, CPU).

Every trainable parameter must move on every step and stay finite, and every
supported module with trainable parameters must carry Fisher factors whose hooks
actually fire.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hf_triaccel.curvature.rules import rule_for
from hf_triaccel.optim.adafisher import AdaFisher, AdaFisherW

timm = pytest.importorskip("timm")
transformers = pytest.importorskip("transformers")

STEPS = 3


def _image_model(name: str, **kwargs):
    def build():
        model = timm.create_model(name, pretrained=False, num_classes=10, **kwargs)
        x = torch.randn(2, 3, 32, 32)
        y = torch.tensor([1, 7])
        return model, lambda m: F.cross_entropy(m(x), y)

    return build


def _gpt2():
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=100, n_positions=32, n_inner=128
    )
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 100, (2, 12))
    return model, lambda m: m(input_ids=ids, labels=ids).loss


MODELS = {
    # zero_init_last=False: a zero last-BN scale would zero every gradient in the branch
    "resnet18": _image_model("resnet18", zero_init_last=False),
    "efficientnet_b0": _image_model("efficientnet_b0"),
    "vit_tiny": _image_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2),
    "gpt2": _gpt2,
}
# parameters that belong to no supported module (preconditioned with F = 1)
UNSUPPORTED = {
    "resnet18": set(),
    "efficientnet_b0": set(),
    "vit_tiny": {"cls_token", "pos_embed"},
    "gpt2": set(),
}


def coverage(model: nn.Module, collector) -> tuple[list[str], set[str]]:
    """(supported modules whose trainable parameters got no factors, names of the
    trainable parameters without factors)."""
    names = {id(p): n for n, p in model.named_parameters()}
    missing_modules = []
    for name, module in model.named_modules():
        rule = rule_for(module)
        if rule is None:
            continue
        layouts = rule.layouts(module)
        for attr, p in module.named_parameters(recurse=False):
            if p.requires_grad and attr in layouts and collector.factors_for(p) is None:
                missing_modules.append(f"{name}.{attr}")
    without = {names[id(p)] for p in model.parameters() if collector.factors_for(p) is None}
    return missing_modules, without


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Batch-2 models: intra-op threads only add synchronisation cost (large on a busy host)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("impl", ["foreach", "reference"])
@pytest.mark.parametrize("cls", [AdaFisher, AdaFisherW], ids=lambda c: c.__name__)
@pytest.mark.parametrize("name", list(MODELS))
def test_every_parameter_moves_every_step(name, cls, impl):
    torch.manual_seed(0)
    model, loss_fn = MODELS[name]()
    model.train()
    opt = cls.from_model(model, lr=1e-3, weight_decay=1e-2, update_every=1, impl=impl)
    collector = opt.collector

    missing, without = coverage(model, collector)
    assert not missing, f"supported modules without factors: {missing}"
    assert without == UNSUPPORTED[name]
    assert collector.layers

    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    seeds = {n: (ly.a_ema.clone(), ly.g_ema.clone()) for n, ly in collector.layers.items()}
    for step in range(STEPS):
        before = {n: p.detach().clone() for n, p in params.items()}
        prev = {n: (ly.a_ema.clone(), ly.g_ema.clone()) for n, ly in collector.layers.items()}
        loss = loss_fn(model)
        assert torch.isfinite(loss)
        loss.backward()
        no_grad = [n for n, p in params.items() if p.grad is None]
        assert not no_grad, no_grad
        opt.step()
        opt.zero_grad()
        stuck = [n for n, p in params.items() if torch.equal(p.detach(), before[n])]
        assert not stuck, f"step {step}: parameters that did not move: {stuck}"
        bad = [n for n, p in params.items() if not torch.isfinite(p).all()]
        assert not bad, f"step {step}: non-finite parameters: {bad}"
        # update_every=1: every layer's hooks fired and its factors were refreshed
        stale = [
            n
            for n, ly in collector.layers.items()
            if torch.equal(ly.a_ema, prev[n][0]) or torch.equal(ly.g_ema, prev[n][1])
        ]
        assert not stale, f"step {step}: factors not refreshed: {stale}"
        for n, ly in collector.layers.items():
            assert torch.isfinite(ly.a).all() and torch.isfinite(ly.g).all(), n
    never = [n for n, ly in collector.layers.items() if torch.equal(ly.a_ema, seeds[n][0])]
    assert not never
    collector.remove()


def test_resnet18_layers_cover_every_conv_bn_linear():
    model = timm.create_model("resnet18", pretrained=False, num_classes=10)
    opt = AdaFisher.from_model(model, update_every=1)
    expected = {
        n for n, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.BatchNorm2d, nn.Linear))
    }
    assert len(expected) == 20 + 20 + 1
    assert set(opt.collector.layers) == expected
    kinds = {type(ly.module) for ly in opt.collector.layers.values()}
    assert kinds == {nn.Conv2d, nn.BatchNorm2d, nn.Linear}
    opt.collector.remove()


def test_efficientnet_b0_layers():
    from timm.layers import BatchNormAct2d

    model = timm.create_model("efficientnet_b0", pretrained=False, num_classes=10)
    opt = AdaFisherW.from_model(model, update_every=1)
    layers = opt.collector.layers
    bn = {n for n, m in model.named_modules() if isinstance(m, BatchNormAct2d)}
    convs = {n for n, m in model.named_modules() if isinstance(m, nn.Conv2d)}
    assert bn and convs and bn | convs | {"classifier"} == set(layers)
    # depthwise convolutions: a is shared by all groups (length kh*kw (+1 if bias))
    dw = model.blocks[1][0].conv_dw
    assert dw.groups == dw.in_channels
    assert layers["blocks.1.0.conv_dw"].a.shape == (9 + (dw.bias is not None),)
    opt.collector.remove()


def test_gpt2_tied_head_and_conv1d():
    model, loss_fn = _gpt2()
    opt = AdaFisherW.from_model(model, update_every=1)
    layers = opt.collector.layers
    assert model.lm_head.weight is model.transformer.wte.weight
    assert "lm_head" not in layers and "transformer.wte" in layers
    assert opt.collector.factors_for(model.lm_head.weight) is not None
    conv1d = {n for n, m in model.named_modules() if type(m).__name__ == "Conv1D"}
    assert len(conv1d) == 2 * 4 and conv1d <= set(layers)
    attn = layers["transformer.h.0.attn.c_attn"]
    assert attn.a.shape == (65,) and attn.g.shape == (192,)
    opt.collector.remove()
