"""The collector's Triton statistics against the reference implementation on real models
at training sizes, on the GPU: every layer, every entry, after one refresh on the whole
batch (the CPU tests check the same on small models under Triton's interpreter)."""

from __future__ import annotations

import copy

import pytest
import torch

from hf_triaccel.curvature.collector import FisherCollector

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def image_model(name: str, batch: int, side: int, channels_last: bool):
    timm = pytest.importorskip("timm")
    model = timm.create_model(name, num_classes=10)
    x = torch.randn(batch, 3, side, side)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    return model, lambda m: m(x.cuda()).float()


def gpt2_model():
    transformers = pytest.importorskip("transformers")
    # no dropout: both copies must see the same activations
    config = transformers.GPT2Config(
        n_layer=2, n_positions=512, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, config.vocab_size, (4, 512))
    return model, lambda m: m(input_ids=ids.to("cuda")).logits.float()


CASES = {
    "resnet18_nchw": lambda: image_model("resnet18", 256, 32, False),
    "resnet18_channels_last": lambda: image_model("resnet18", 256, 32, True),
    "efficientnet_b0": lambda: image_model("efficientnet_b0", 128, 32, True),
    "vit_tiny": lambda: image_model("vit_tiny_patch16_224", 32, 224, False),
    "gpt2_two_layers": gpt2_model,
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_gpu_statistics_and_factors_match_the_reference(case):
    torch.manual_seed(0)
    model, run = CASES[case]()
    model = model.cuda()
    twin = copy.deepcopy(model)
    fast = FisherCollector(model, ema="paper", impl="triton")
    plain = FisherCollector(twin, ema="paper", impl="reference")
    weights = None
    for net in (model, twin):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = run(net)
        weights = torch.randn_like(out) if weights is None else weights
        (out * weights).sum().backward()
    # Both sum the same bf16 inputs in float32, in different orders: the sums of up to a
    # million terms agree to ~1e-5 of the sum of their magnitudes, and a square of a sum
    # (a norm layer's g) to twice that; entries that cancel are bounded by the layer's
    # largest entry. 1e-3 leaves room above both.
    for name, layer in fast.layers.items():
        for got, want in zip(layer.statistics(), plain.layers[name].statistics(), strict=True):
            scale = want.abs().max().item()
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3 * scale, msg=name)
    fast.fold(0.9)
    plain.fold(0.9)
    for name, layer in fast.layers.items():
        for attr in ("a", "g", "a_ema", "g_ema"):
            want = getattr(plain.layers[name], attr)
            scale = want.abs().max().item()
            torch.testing.assert_close(
                getattr(layer, attr), want, rtol=1e-3, atol=1e-3 * scale, msg=f"{name}.{attr}"
            )
    assert len(fast.layers) == len(plain.layers) > 0
