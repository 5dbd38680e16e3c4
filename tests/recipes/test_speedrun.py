"""The CIFAR-10 speedrun recipe: its parts on CPU, and the script end to end on a tiny slice."""

from __future__ import annotations

import doctest
import json
import sys
from importlib import resources
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("matplotlib")
pq = pytest.importorskip("pyarrow.parquet")

RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"
sys.path.insert(0, str(RECIPES_DIR))

import cifar10_speedrun  # noqa: E402
import speedrun_net  # noqa: E402
import speedrun_optim  # noqa: E402
from speedrun_net import (  # noqa: E402
    EpochAugmenter,
    SpeedrunNet,
    random_crop,
    whitening_filters,
)
from speedrun_optim import (  # noqa: E402
    FilterMuon,
    NewtonSchulzMuon,
    OptimSettings,
    SpeedrunOptimizer,
)

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("module", [speedrun_net, speedrun_optim])
def test_docstring_examples_run(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="this torch has no torch.optim.Muon")
def test_newton_schulz_muon_matches_torch_muon():
    torch.manual_seed(0)
    shapes = [(16, 72), (48, 12)]  # wide, and tall (scaled update, transposed iteration)
    ours = [torch.randn(s) for s in shapes]
    theirs = [p.clone() for p in ours]
    kwargs = dict(lr=0.05, weight_decay=0.1, momentum=0.6, nesterov=True)
    opt_ours, opt_theirs = NewtonSchulzMuon(ours, **kwargs), torch.optim.Muon(theirs, **kwargs)
    steps = 3
    for _ in range(steps):
        for a, b in zip(ours, theirs, strict=True):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        opt_ours.step()
        opt_theirs.step()
    # The same operations in the same order; should an order differ, each step may move an
    # entry by one bf16 rounding (2^-8 relative) of an update entry, which is at most the
    # iteration's largest singular value (< 1.5) times lr times the tall-shape scale (2).
    atol = steps * kwargs["lr"] * 2 * 1.5 * 2**-8
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=atol)


def test_filter_muon_steps_the_filters_as_matrices_in_place():
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 8, 3)
    matrix = conv.weight.detach().clone().view(8, -1)
    reference = getattr(torch.optim, "Muon", NewtonSchulzMuon)(
        [matrix], lr=0.1, momentum=0.6, nesterov=True, weight_decay=0.0
    )
    opt = FilterMuon([conv.weight], lr=0.1, momentum=0.6)
    for _ in range(2):
        conv.weight.grad = torch.randn_like(conv.weight)
        matrix.grad = conv.weight.grad.view(8, -1).clone()
        opt.step()
        reference.step()
    assert torch.equal(conv.weight.detach().view(8, -1), matrix)


def test_whitening_filters_decorrelate_patches():
    torch.manual_seed(0)
    images = torch.randn(64, 3, 16, 16)
    images[:, 1] += 0.8 * images[:, 0]  # correlated channels
    eps = 5e-4
    filters = whitening_filters(images, eps=eps)
    half = filters[: filters.shape[0] // 2]
    assert torch.equal(filters[half.shape[0] :], -half)
    out = F.conv2d(images, half).permute(0, 2, 3, 1).reshape(-1, half.shape[0]).double()
    covariance = out.T @ out / out.shape[0]
    patches = images.unfold(2, 2, 1).unfold(3, 2, 1).permute(0, 2, 3, 1, 4, 5).reshape(-1, 12)
    eigenvalues = torch.linalg.eigvalsh(patches.double().T @ patches.double() / patches.shape[0])
    # V^T C V / (lambda + eps) = diag(lambda / (lambda + eps)); float32 filters and
    # outputs leave errors of a few 1e-7 relative to entries of order one
    expected = torch.diag(eigenvalues / (eigenvalues + eps))
    torch.testing.assert_close(covariance, expected, rtol=0, atol=1e-4)


def test_random_crop_takes_each_images_own_window():
    torch.manual_seed(0)
    padded = torch.randn(6, 3, 12, 12)
    dy, dx = torch.randint(0, 5, (6,)), torch.randint(0, 5, (6,))
    crops = random_crop(padded, 8, dy, dx)
    for n in range(6):
        assert torch.equal(crops[n], padded[n, :, dy[n] : dy[n] + 8, dx[n] : dx[n] + 8])


def test_flips_alternate_between_epochs():
    images = torch.randn(50, 3, 8, 8)
    aug = EpochAugmenter(images, pad=0, generator=torch.Generator().manual_seed(0))
    assert bool((aug.flips(0) ^ aug.flips(1)).all())
    assert torch.equal(aug.flips(0), aug.flips(2))
    assert 0 < int(aug.flips(0).sum()) < 50
    out = aug.epoch(1)
    flipped = aug.flips(1)
    assert torch.equal(out[flipped], images[flipped].flip(-1))
    assert torch.equal(out[~flipped], images[~flipped])


def test_settings_parse_presets_overrides_and_errors():
    assert OptimSettings.parse("muon").on == ()
    s = OptimSettings.parse("adafisher:lr=0.01,on=block1+head,adafisher_update_every=none")
    assert (s.adafisher_lr, s.on, s.adafisher_update_every) == (0.01, ("block1", "head"), None)
    assert OptimSettings.parse("muon:lr=0.1").muon_lr == 0.1
    assert s.label() == "adafisher (on=block1+head, adafisher_lr=0.01, adafisher_update_every=None)"
    with pytest.raises(ValueError, match="preset 'adam' is not one of"):
        OptimSettings.parse("adam")
    with pytest.raises(ValueError, match="'momentum=0.9' is not key=value with a key of"):
        OptimSettings.parse("muon:momentum=0.9")
    with pytest.raises(ValueError, match="not among"):
        OptimSettings.parse("adafisher:on=block4")
    with pytest.raises(ValueError, match="muon_lr='fast' is not a number"):
        OptimSettings.parse("muon:muon_lr=fast")


@pytest.mark.parametrize(
    ("spec", "adafisher_modules"),
    [
        ("muon", []),
        ("adafisher:on=head", ["head"]),
        (
            "adafisher",
            [f"block{b}.conv{i}" for b in (1, 2, 3) for i in (1, 2)] + ["head"],
        ),
    ],
)
def test_every_trained_parameter_has_exactly_one_optimizer(spec, adafisher_modules):
    net = SpeedrunNet(widths=(8, 16, 16))
    opt = SpeedrunOptimizer(net, OptimSettings.parse(spec), batch=8)
    owned = [
        id(p)
        for o in opt.optimizers
        for p in (
            o.filters
            if isinstance(o, FilterMuon)
            else (q for g in o.param_groups for q in g["params"])
        )
    ]
    trained = [id(p) for p in net.parameters() if p.requires_grad]
    assert sorted(owned) == sorted(trained)
    assert opt.adafisher_modules == adafisher_modules
    hooked = [] if opt.collector is None else sorted(opt.collector.layers)
    assert hooked == sorted(adafisher_modules)
    if opt.collector is not None:
        opt.collector.remove()


def test_step_keeps_filter_norms_and_trains(tmp_path):
    torch.manual_seed(0)
    net = SpeedrunNet(widths=(8, 16, 16))
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
    net.reset(whitening_filters(x))
    opt = SpeedrunOptimizer(net, OptimSettings.parse("adafisher:on=block3+head"), batch=16)
    whiten = net.whiten.weight.detach().clone()
    before = [f.detach().clone() for f in net.filters()]
    F.cross_entropy(net(x), y).backward()
    opt.step(1.0, 0.0)
    opt.zero_grad()
    assert torch.equal(net.whiten.weight, whiten)  # frozen
    for f, b in zip(net.filters(), before, strict=True):
        assert not torch.equal(f, b)
    F.cross_entropy(net(x), y).backward()
    opt.step(0.0, 1.0)  # learning rate 0: the filters are only rescaled to norm sqrt(out)
    # a float32 norm of at most 2,304 entries and one multiply: a few 1e-7 relative
    for f in net.filters():
        torch.testing.assert_close(f.norm(), torch.tensor(f.shape[0] ** 0.5), rtol=1e-5, atol=0)
    opt.collector.remove()


def tiny_parquet(folder: Path, rows: dict[str, int]) -> Path:
    """Prefixes of the CIFAR-10 slice shipped in the package, in the Hub layout."""
    folder.mkdir()
    for split, n in rows.items():
        source = resources.files("hf_triaccel.data") / f"cifar10_{split}.parquet"
        with resources.as_file(source) as path:
            pq.write_table(pq.read_table(path).slice(0, n), folder / f"{split}.parquet")
    return folder


def test_script_trains_both_optimizers_and_writes_results_and_curves(tmp_path):
    data = tiny_parquet(tmp_path / "cifar10", {"train": 200, "test": 64})
    out = tmp_path / "out"
    argv = [
        "--data", str(data), "--widths", "8,16,16", "--batch_size", "100", "--epochs", "1.5",
        "--seeds", "1", "--eval_batch", "32", "--out_dir", str(out),
        "--config", "muon", "--config", "adafisher:adafisher_update_every=1",
    ]  # fmt: skip
    summary = cifar10_speedrun.main(argv)

    assert [c["config"] for c in summary["configs"]] == [
        "muon",
        "adafisher (adafisher_update_every=1)",
    ]
    runs = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    assert [(r["config"], r["seed"]) for r in runs] == [
        ("muon", 0),
        ("adafisher (adafisher_update_every=1)", 0),
    ]
    for r in runs:
        assert r["steps"] == 3  # 1.5 epochs of 2 steps, rounded
        assert len(r["epoch_acc"]) == len(r["epoch_time_s"]) == 2
        assert r["acc"] == r["epoch_acc"][-1]
        assert all(0.0 <= a <= 1.0 for a in r["epoch_acc"] + [r["acc_tta"]])
        assert 0.0 < r["train_s"] < r["time_s"] and r["tta_s"] > 0.0
        assert r["epoch_time_s"][-1] == pytest.approx(r["train_s"])
    assert json.loads(json.dumps(summary)) == json.loads((out / "summary.json").read_text())
    assert summary["configs"][0]["runs"] == 1 and summary["configs"][0]["compile_s"] is None
    assert (out / "speedrun_curves.png").read_bytes().startswith(PNG)


def test_bad_flags_are_rejected(tmp_path):
    with pytest.raises(SystemExit):
        cifar10_speedrun.parse_args(["--data", str(tmp_path), "--widths", "8,16"])
    with pytest.raises(ValueError, match="preset"):
        cifar10_speedrun.parse_args(["--data", str(tmp_path), "--config", "sgd"])
