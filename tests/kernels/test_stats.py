"""Triton Fisher-statistic kernels against their PyTorch references.

CPU runs use Triton's interpreter on small, odd shapes chosen to cross block and split
boundaries; the ``gpu`` tests repeat the checks at training sizes.
"""

from __future__ import annotations

import pytest
import torch

from hf_triaccel.curvature.collection.fold import FactorFold, fold_factors, fold_reference
from hf_triaccel.curvature.rules.reductions import (
    channel_sum,
    channel_sum_reference,
    sum_rows,
    sum_rows_reference,
)
from hf_triaccel.kernels import reductions
from hf_triaccel.kernels.fold import fold_table, fold_triton
from hf_triaccel.kernels.launch import direct_launch_supported
from hf_triaccel.kernels.reductions import channel_sum_triton, sum_rows_triton

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def randn(*shape: int, dtype: torch.dtype = torch.float32, device="cpu", seed: int = 0):
    """Standard normal values, never exactly zero, rounded to ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen)
    x = torch.where(x.abs() < 1e-3, torch.full_like(x, 1e-3), x)
    return x.to(device=device, dtype=dtype)


def assert_sums_close(got: torch.Tensor, ref: torch.Tensor, abs_ref: torch.Tensor, rtol: float):
    """float32 sums agree to ``rtol`` of the sum of magnitudes (plain sums can cancel)."""
    assert got.dtype == torch.float32
    assert got.shape == ref.shape
    bound = rtol * abs_ref + 1e-6
    err = (got - ref).abs()
    assert bool((err <= bound).all()), f"max error {err.max().item():.3g}"


def check_sum_rows(x: torch.Tensor, square: bool, rtol: float = 1e-5) -> None:
    got = sum_rows_triton(x, square)
    assert_sums_close(got, sum_rows_reference(x, square), sum_rows_reference(x.abs(), square), rtol)


def check_channel_sum(x: torch.Tensor, square: bool, rtol: float = 1e-5) -> None:
    got = channel_sum_triton(x, square)
    assert_sums_close(
        got, channel_sum_reference(x, square), channel_sum_reference(x.abs(), square), rtol
    )


# ---------------------------------------------------------------- sum_rows


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("square", [True, False])
@pytest.mark.parametrize(
    "shape",
    [
        (37, 19),  # odd, one block
        (1, 7),  # a single row
        (5, 1),  # a single column
        (300, 300),  # more than one column block and several row splits
        (20, 600),  # enough column blocks not to split rows
        (40000, 5),  # many row blocks per split
    ],
)
def test_sum_rows_matches_reference(shape, square, dtype):
    check_sum_rows(randn(*shape, dtype=dtype), square)


@pytest.mark.parametrize("square", [True, False])
def test_sum_rows_strided_layouts(square):
    base = randn(40, 30, dtype=torch.bfloat16)
    check_sum_rows(base[3:, :19], square)  # row stride 30, unit column stride
    check_sum_rows(base.t(), square)  # unit row stride: summed as channels
    check_sum_rows(base[:, ::2], square)  # no unit stride: copied first


def test_split_sums_are_added_by_the_last_program(monkeypatch):
    # 200 splits of one column block: the finishing program adds them in several tiles
    monkeypatch.setattr(reductions, "_INTERPRETED_PROGRAMS", 400)
    x = randn(200 * (reductions.TILE // 128), 100)  # 200 row blocks of one column block
    launch = reductions.reduction_launch(x, square=True)
    assert launch.grid == (1, 200) and launch.kwargs["BLOCK_S"] < 200
    out = torch.full((100,), 7.0)
    launch(x, out, scale=0.5)
    expected = sum_rows_reference(x, True, scale=0.5)
    assert_sums_close(out, expected, expected, 1e-5)
    # the tickets were reset: the next launch with the same tickets finishes again
    launch(x, out, accumulate=True)
    assert_sums_close(out, 3 * expected, 3 * expected, 1e-5)
    assert not launch.tickets.any()


@pytest.mark.parametrize("split", [False, True])
def test_launch_writes_the_tail(monkeypatch, split):
    monkeypatch.setattr(reductions, "_INTERPRETED_PROGRAMS", 8 if split else 1)
    x = randn(4, 3, 50)
    out = torch.full((3 + 2500,), 7.0)  # a tail longer than the tail's block, twice over
    launch = reductions.reduction_launch(x, square=False, tail=(2500, 12.0))
    assert launch.kwargs["SPLIT"] == split
    launch(x, out, scale=2.0)
    torch.testing.assert_close(out[:3], 2 * channel_sum_reference(x, False))
    assert out[3:].tolist() == [0.0] * 2499 + [12.0]


def test_sum_rows_empty():
    assert torch.equal(sum_rows_triton(torch.ones(0, 4), True), torch.zeros(4))
    assert sum_rows_triton(torch.ones(3, 0), True).shape == (0,)


def test_sum_rows_is_deterministic():
    x = randn(700, 45)
    assert torch.equal(sum_rows_triton(x, True), sum_rows_triton(x, True))


def test_sum_rows_dispatch_reaches_triton():
    x = randn(9, 4, dtype=torch.float16)
    assert torch.equal(sum_rows(x, True, impl="triton"), sum_rows_triton(x, True))


# ---------------------------------------------------------------- channel_sum


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("square", [True, False])
@pytest.mark.parametrize(
    "shape",
    [
        (3, 5, 11),  # odd, one block
        (2, 9, 1500),  # longer than one position block, several channel blocks
        (6, 300, 3),  # many channels, short rows
        (5, 7, 1),  # L == 1: summed as rows
    ],
)
def test_channel_sum_matches_reference(shape, square, dtype):
    check_channel_sum(randn(*shape, dtype=dtype), square)


@pytest.mark.parametrize("square", [True, False])
def test_channel_sum_strided_layouts(square):
    nchw = randn(3, 6, 5, 7, dtype=torch.float16)
    last = nchw.to(memory_format=torch.channels_last).reshape(3, 6, -1)
    assert last.stride(1) == 1
    check_channel_sum(last, square)  # channels-last: summed as rows of a view
    check_channel_sum(nchw.reshape(3, 6, -1)[:, 1:, ::2], square)  # no unit stride
    check_channel_sum(nchw.reshape(3, 6, -1)[::2, :, 4:], square)  # strided batch
    check_channel_sum(randn(5, 14, 1)[:, ::2], square)  # L == 1, channel stride 2


def test_channel_sum_empty():
    assert torch.equal(channel_sum_triton(torch.ones(0, 3, 5), False), torch.zeros(3))


def test_channel_sum_is_deterministic_and_dispatched():
    x = randn(4, 3, 900)
    assert torch.equal(channel_sum(x, True, impl="triton"), channel_sum_triton(x, True))


# ---------------------------------------------------------------- epilogue: out, scale


EPILOGUE_CASES = [
    ("rows", (37, 19)),  # one split
    ("rows", (20000, 5)),  # split, then the finishing kernel
    ("rows_transposed", (40, 30)),  # summed as channels
    ("channels", (3, 5, 11)),
    ("channels", (2, 9, 1500)),  # split
    ("channels_last", (3, 6, 35)),  # summed as rows
]


def _epilogue_input(kind: str, shape: tuple[int, ...]) -> torch.Tensor:
    if kind == "rows_transposed":
        return randn(*shape[::-1], dtype=torch.bfloat16).t()
    if kind == "channels_last":
        b, c, length = shape
        return randn(b, length, c, dtype=torch.float16).transpose(1, 2)
    return randn(*shape, dtype=torch.bfloat16)


@pytest.mark.parametrize("kind, shape", EPILOGUE_CASES)
@pytest.mark.parametrize("square", [True, False])
def test_epilogue_writes_and_accumulates_like_the_reference(kind, shape, square):
    """out (+)= scale * sums: the kernels and the references agree."""
    x = _epilogue_input(kind, shape)
    rows = kind.startswith("rows")
    triton_fn = sum_rows_triton if rows else channel_sum_triton
    reference_fn = sum_rows_reference if rows else channel_sum_reference
    n = x.shape[1]
    start = randn(n, seed=1)
    options = dict(scale=0.37)
    for accumulate in (False, True):
        got, want = start.clone(), start.clone()
        out = triton_fn(x, square, out=got, accumulate=accumulate, **options)
        assert out is got
        reference_fn(x, square, out=want, accumulate=accumulate, **options)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # without out: a new tensor holding the scaled result
    torch.testing.assert_close(
        triton_fn(x, square, **options), reference_fn(x, square, **options), rtol=1e-5, atol=1e-5
    )


def test_epilogue_dispatch_and_empty_inputs():
    x = randn(6, 4)
    out = torch.full((4,), 2.0)
    sum_rows(x, True, impl="triton", out=out, scale=0.5, accumulate=True)
    torch.testing.assert_close(out, 2.0 + 0.5 * x.square().sum(0))
    channel_sum(x.view(2, 3, 4).transpose(1, 2), False, impl="reference", out=out)
    torch.testing.assert_close(out, x.view(2, 3, 4).sum((0, 1)))
    # a reduction over nothing: zeros when written, unchanged when added to
    kept = torch.ones(3)
    sum_rows_triton(torch.ones(0, 3), True, out=kept, accumulate=True)
    assert torch.equal(kept, torch.ones(3))
    channel_sum_triton(torch.ones(0, 3, 5), True, out=kept)
    assert torch.equal(kept, torch.zeros(3))


@pytest.mark.parametrize("fn", [sum_rows_triton, sum_rows_reference])
def test_epilogue_rejects_bad_outputs(fn):
    x = randn(5, 4)
    with pytest.raises(ValueError, match="accumulate"):
        fn(x, True, accumulate=True)
    with pytest.raises(ValueError, match="out"):
        fn(x, True, out=torch.zeros(5))
    with pytest.raises(ValueError, match="out"):
        fn(x, True, out=torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="out"):
        fn(x, True, out=torch.zeros(8)[::2])


# ---------------------------------------------------------------- fold

FOLD_LENGTHS = (2, 37, 2100, 5)  # 2100 spans two fold blocks


def fold_inputs(lengths, device="cpu", seed: int = 0, scale: float = 1.0):
    """emas (positive), news of about ``scale`` with non-finite entries and a constant
    factor."""
    gen = torch.Generator().manual_seed(seed)
    emas = [torch.rand(n, generator=gen).add_(0.1).mul_(scale).to(device) for n in lengths]
    news = [torch.randn(n, generator=gen).exp_().mul_(scale).to(device) for n in lengths]
    news[1][[3, 8, 20]] = torch.tensor([float("inf"), float("-inf"), float("nan")], device=device)
    news[-1].fill_(0.5)  # all equal: max - min is 0
    return emas, news


def run_both(lengths, mode, alias, gamma=0.9, steps=1, normalise="absolute", scale=1.0):
    """Folds with the kernel and the reference; ``alias[i]`` makes used i be ema i."""
    emas, news = fold_inputs(lengths, scale=scale)
    useds = [e if a else torch.full_like(e, -1.0) for e, a in zip(emas, alias, strict=True)]
    ref_emas = [e.clone() for e in emas]
    ref_useds = [r if a else u.clone() for r, u, a in zip(ref_emas, useds, alias, strict=True)]
    table = fold_table(emas, news, useds)
    for _ in range(steps):
        fold_triton(table, mode, gamma, normalise)
        for e, w, u in zip(ref_emas, news, ref_useds, strict=True):
            fold_reference(e, w, u, mode, gamma, normalise)
    # the same operations, rounded alike but for the order of a product and a sum the
    # compiler may fuse: a few float32 roundings of values at most 1 (normalised) or of
    # about the statistics' scale (paper EMAs)
    for got, ref in zip(emas + useds, ref_emas + ref_useds, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-7 * scale, equal_nan=True)
    return emas, useds


@pytest.mark.parametrize("mode", ["reference", "paper"])
@pytest.mark.parametrize("aliased", [False, True])
@pytest.mark.parametrize("normalise", ["absolute", "relative"])
def test_fold_matches_reference(mode, aliased, normalise):
    run_both(FOLD_LENGTHS, mode, [aliased] * len(FOLD_LENGTHS), normalise=normalise)


@pytest.mark.parametrize("mode", ["reference", "paper"])
@pytest.mark.parametrize("normalise", ["absolute", "relative"])
def test_fold_mixed_aliasing_repeated(mode, normalise):
    # a second step reuses the table
    run_both(FOLD_LENGTHS, mode, [True, False, True, False], 0.8, 2, normalise)


@pytest.mark.parametrize("mode", ["reference", "paper"])
def test_fold_relative_reaches_one_at_any_scale(mode):
    """Statistics of about 1e-11: the relative kernel spans [0, 1) as the reference does,
    the absolute one stays near 0."""
    lengths = (37, 2100, 5)  # the first factor's statistic is finite and not constant
    _, useds = run_both(lengths, mode, [False] * 3, normalise="relative", scale=1e-11)
    # the reference rule's used factor is 0.01 * gamma * normalise(new) plus 1e-12 or less
    relative = useds[0] if mode == "paper" else useds[0] / 0.009
    assert 0.99 < relative.max().item() < 1.0
    _, useds = run_both(lengths, mode, [False] * 3, scale=1e-11)
    absolute = useds[0] if mode == "paper" else useds[0] / 0.009
    assert absolute.max().item() < 1e-3


def test_fold_nonfinite_mapping():
    # reference mode, used separate: used = 0.01 * normalise(new) with ema 0 and gamma 1
    new = torch.tensor([1.0, float("inf"), 3.0, float("-inf"), float("nan"), 2.0])
    ema, used = torch.zeros(6), torch.empty(6)
    fold_triton(fold_table([ema], [new], [used]), "reference", 1.0)
    expected = 0.01 * torch.tensor([0.0, 1.0, 2.0 / (2.0 + 1e-6), 0.0, 0.0, 1.0 / (2.0 + 1e-6)])
    torch.testing.assert_close(used, expected)
    torch.testing.assert_close(ema, expected)


def test_fold_factors_dispatch_reaches_triton():
    emas, news = fold_inputs(FOLD_LENGTHS)
    ref = [e.clone() for e in emas]
    fold_factors(emas, news, emas, "reference", 0.9, impl="triton")
    for e, w in zip(ref, news, strict=True):
        fold_reference(e, w, e, "reference", 0.9)
    for got, want in zip(emas, ref, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_fold_rejects_bad_input():
    ema, new = torch.zeros(4), torch.ones(4)
    with pytest.raises(ValueError, match="one of"):
        fold_triton(fold_table([ema], [new], [ema]), "bogus", 0.9)
    with pytest.raises(ValueError, match="normalise='bogus' is not one of"):
        fold_triton(fold_table([ema], [new], [ema]), "paper", 0.9, "bogus")
    with pytest.raises(ValueError, match="float32"):
        fold_table([ema], [new.double()], [ema])
    with pytest.raises(ValueError, match="length"):
        fold_table([ema], [torch.ones(5)], [ema])
    with pytest.raises(ValueError, match="length"):
        fold_table([ema], [new, new], [ema])
    with pytest.raises(ValueError, match="at least one"):
        fold_table([], [], [])
    with pytest.raises(ValueError, match="one of"):
        fold_factors([ema], [new], [ema], "bogus", 0.9, impl="triton")
    fold_factors([], [], [], "paper", 0.9, impl="triton")  # nothing to do


def test_a_fold_made_once_folds_the_tensors_it_was_made_for():
    """FactorFold builds the kernel's table once; later folds read the same tensors,
    whatever their contents became in between."""
    emas, news = fold_inputs(FOLD_LENGTHS)
    fold = FactorFold(emas, news, emas, impl="triton")
    assert fold.table is not None
    ref = [e.clone() for e in emas]
    for _ in range(2):
        for w in news:
            w.mul_(1.5)  # new statistics written in place, as the collector's hooks do
        fold("reference", 0.9)
        for e, w in zip(ref, news, strict=True):
            fold_reference(e, w, e, "reference", 0.9)
        for got, want in zip(emas, ref, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    assert FactorFold(emas, news, emas, impl="reference").table is None


# ---------------------------------------------------------------- GPU, training sizes


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(512 * 1024, 64), (512 * 1024, 768), (512, 64 * 32 * 32)])
def test_gpu_sum_rows(shape, dtype, device):
    x = randn(*shape, dtype=dtype, device=device)
    for square in (True, False):
        check_sum_rows(x, square, rtol=1e-4)
    first = sum_rows_triton(x, True)
    assert torch.equal(first, sum_rows_triton(x, True))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape", [(512, 64, 1024), (512, 512, 49), (8, 64, 224 * 224)])
def test_gpu_channel_sum(shape, device):
    x = randn(*shape, dtype=torch.bfloat16, device=device)
    for square in (True, False):
        check_channel_sum(x, square, rtol=1e-4)
        last = x.unsqueeze(-1).to(memory_format=torch.channels_last).squeeze(-1)
        check_channel_sum(last, square, rtol=1e-4)
    assert torch.equal(channel_sum_triton(x, True), channel_sum_triton(x, True))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("mode", ["reference", "paper"])
@pytest.mark.parametrize("normalise", ["absolute", "relative"])
def test_gpu_fold(mode, normalise, device):
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(2, 50_000, (100,), generator=gen).tolist()
    lengths[1] = 1000  # room for the non-finite entries
    emas, news = fold_inputs(lengths, device=device)
    useds = [e if i % 3 == 0 else torch.empty_like(e) for i, e in enumerate(emas)]
    ref_emas = [e.clone() for e in emas]
    ref_useds = [r if u is e else u.clone() for r, u, e in zip(ref_emas, useds, emas, strict=True)]
    table = fold_table(emas, news, useds)
    for _ in range(2):
        fold_triton(table, mode, 0.95, normalise)
        for e, w, u in zip(ref_emas, news, ref_useds, strict=True):
            fold_reference(e, w, u, mode, 0.95, normalise)
    for got, ref in zip(emas + useds, ref_emas + ref_useds, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-7, equal_nan=True)


@pytest.mark.gpu
@needs_cuda
def test_gpu_repeated_launches_match_the_reference(device):
    """A kept launch (as the statistics hooks keep them) launched again and again: after
    each variant's first launch Triton's compiled kernel is launched directly."""
    base = randn(512 * 64 + 1, 97, dtype=torch.bfloat16, device=device)
    n = 512 * 64
    x = base[:n, :96]  # row stride 97: the same geometry as the shifted view
    shifted = base[1:, :96]  # starts 194 bytes in: a pointer not 16-byte aligned
    as_float = base.float()[:n, :96]
    launch = reductions.reduction_launch(x, square=True)
    assert launch.kwargs["SPLIT"]
    out = torch.zeros(96, device=device)
    expected = torch.zeros(96, device=device)
    calls = [(x, False), (x, False), (x, True), (shifted, True), (shifted, True)]
    calls += [(as_float, True), (as_float, True), (x, False)]
    for t, accumulate in calls:
        launch(t, out, 0.5, accumulate)
        sums = sum_rows_reference(t, True, scale=0.5)
        expected = expected + sums if accumulate else sums
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=0.0)
    if direct_launch_supported(x.device):
        assert len(launch.compiled) == 4  # written or added, bf16 aligned or not, float32
