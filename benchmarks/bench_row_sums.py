"""Bandwidth of the Fisher statistics' row sums, per setting of the row-sum kernel, on the
sums one refresh step of a model launches.

Most of a refresh's device time is column sums (of squares) of 2-D views: a Linear's input
and output gradient, a channels_last convolution's or batch norm's, launched alone or
grouped (``kernels.grouped`` runs the same loop over each input). The script records
every row sum of one refresh step of ``--model`` (``bench_train_step.py``'s model, batch,
layout and bf16 autocast): rows, columns, row stride, dtype, squared or not. Then, for
each setting of the kernel (``--tiles``: elements a program loads per iteration;
``--warps``; ``--programs``: programs a split launch aims for per SM), it launches each
recorded sum alone on a random input of its geometry, checks it against a float64 sum
(float32 accumulation: within 4 sqrt(rows) unit roundoffs of the sum of magnitudes), and
times the kernel on the device: :data:`LAUNCHES` launches captured in one CUDA graph
(a launch's host work, longer than a small sum's kernel, is not timed), each reading
its own copy of the input while the copies fit in twice the L2 cache (so that a large
sum's bytes come from memory), the median of ``--repeats`` replays between CUDA events
(on the CPU, the median of ``--repeats`` calls). One table: per
setting, the step's sums in total (each geometry times its count), the bytes they read and
the bandwidth, against the package's setting; a second: each geometry at the package's
setting and at the fastest.

With ``--grouped``, the settings are the grouped kernel's (``kernels.grouped``: ``TILE``,
``NUM_WARPS``, ``PROGRAMS_PER_SM``) and the work is the step's own grouped launches, on
the step's own inputs: per setting, every launch cut again, each sum checked as above,
and the launches of the whole step timed as one CUDA graph.

Usage:
    python benchmarks/bench_row_sums.py [--model M] [--tiles 4096,8192] --out "$OUT"
    python benchmarks/bench_row_sums.py --grouped --tiles 4096,8192,16384 --out "$OUT"
    TRITON_INTERPRET=1 python benchmarks/bench_row_sums.py --smoke --out /tmp/rows  # CPU
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import bench_train_step as bench
import harness
import torch

from hf_triaccel.kernels import grouped, reductions

OPTIONS = {
    "batch_size": (int, 4, None, "batch (default by --model)"),
    "image_size": (int, None, None, "image side, or tokens a sample (default by --model)"),
    "repeats": (int, 2, 20, "timed replays (calls on the CPU) per sum and setting"),
}
FLOAT32_ROUNDOFF = 2.0**-24
LAUNCHES = 8  # launches in one timed graph


def parse_list(text: str) -> list[int]:
    """``"4096,8192"`` -> ``[4096, 8192]``."""
    return [int(s) for s in text.split(",") if s.strip()]


def record_step(args: Any) -> tuple[Counter, list[list[tuple]]]:
    """The row sums one refresh step of the model launches, alone or grouped, as a count
    per geometry ``(rows, columns, row stride, dtype name, squared)``; and its grouped
    launches, each as its entries ``(launch, input, output, scale, accumulate)`` (the
    inputs kept)."""
    row = {"optimizer": "AdaFisherW", "impl": "triton", "refresh": True, "status": "ok"}
    row["layout"] = "none" if args.model in harness.TEXT_MODELS else "channels_last"
    args.warmup = 1
    model = bench.build(row, args)
    opt, step = bench.prepare(row, model, args)
    seen: Counter = Counter()
    groups: list[list[tuple]] = []

    def note(launch: reductions.ReductionLaunch, x: torch.Tensor) -> None:
        if launch.rows is not None:
            n_rows, n_cols, stride_row, square, _ = launch.rows
            seen[(n_rows, n_cols, stride_row, str(x.dtype).split(".")[-1], square)] += 1

    single, together = reductions.ReductionLaunch.__call__, grouped.launch_grouped

    def called(self, x, out, scale=1.0, accumulate=False):
        note(self, x)
        return single(self, x, out, scale, accumulate)

    def grouped_called(key, entries):
        for launch, x, *_ in entries:
            note(launch, x)
        groups.append(list(entries))
        return together(key, entries)

    reductions.ReductionLaunch.__call__, grouped.launch_grouped = called, grouped_called
    try:
        step()
        harness.synchronize(args.device)
    finally:
        reductions.ReductionLaunch.__call__, grouped.launch_grouped = single, together
    opt.collector.remove()
    return seen, groups


def check(out: torch.Tensor, x: torch.Tensor, square: bool, scale: float = 1.0) -> None:
    """``out`` against ``scale`` times the float64 column sums of ``x`` (of squares when
    ``square``)."""
    wide = x.double()
    terms = wide.square() if square else wide
    want = terms.sum(0) * scale
    slack = 4 * math.sqrt(x.shape[0]) * FLOAT32_ROUNDOFF * terms.abs().sum(0) * abs(scale)
    error = (out.double() - want).abs()
    if bool((error > slack + 1e-30).any()):
        worst = float((error / (slack + 1e-30)).max())
        raise AssertionError(f"row sums of {tuple(x.shape)}: {worst:.1f}x the float32 slack")


def random_inputs(geometry: tuple, device: torch.device) -> list[torch.Tensor]:
    """Random inputs laid out as the row sum ``geometry`` reads them: on CUDA, as many as
    fill twice the L2 cache (at least one, at most :data:`LAUNCHES`), else one."""
    n_rows, n_cols, stride_row, dtype, _ = geometry
    copies = 1
    if device.type == "cuda":
        l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size
        nbytes = n_rows * stride_row * getattr(torch, dtype).itemsize
        copies = max(1, min(LAUNCHES, math.ceil(2 * l2_bytes / nbytes)))
    inputs = []
    for _ in range(copies):
        storage = torch.randn(n_rows * stride_row, device=device).to(getattr(torch, dtype))
        inputs.append(storage.as_strided((n_rows, n_cols), (stride_row, 1)))
    return inputs


def timed_ms(run: Callable[[], None], device: torch.device, repeats: int) -> float:
    """Median milliseconds of ``run``'s work: on CUDA, replays of a CUDA graph that
    captured it (its host work not timed; ``run`` must have run once already, outside
    the capture), else calls."""
    if device.type != "cuda":
        return statistics.median(harness.time_steps(run, device, warmup=1, steps=repeats))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    graph.replay()
    return statistics.median(harness.time_steps(graph.replay, device, warmup=1, steps=repeats))


def measure(geometry: tuple, inputs: list, setting: tuple[int, int, int], args: Any) -> float:
    """Milliseconds of one launch of the row sum ``geometry`` at ``setting``, checked: on
    CUDA, over :data:`LAUNCHES` launches cycling over ``inputs``."""
    n_rows, n_cols, stride_row, _, square = geometry
    tile, warps, programs = setting
    out = torch.zeros(n_cols, device=args.device)
    launch = reductions.rows_launch(
        n_rows, n_cols, stride_row, args.device, square,
        tile=tile, num_warps=warps, programs_per_sm=programs,
    )  # fmt: skip
    for x in inputs:  # compiles outside the capture, and checks every copy
        launch(x, out)
        check(out, x, square)
    count = LAUNCHES if args.device.type == "cuda" else 1

    def launches() -> None:
        for i in range(count):
            launch(inputs[i % len(inputs)], out)

    return timed_ms(launches, args.device, args.repeats) / count


def rows_view(launch: reductions.ReductionLaunch, x: torch.Tensor) -> torch.Tensor:
    """The (rows, columns) view of ``x`` that the row sum ``launch`` reads (a queued sum
    holds its input as the layer gave it)."""
    n_rows, n_cols, stride_row, _, _ = launch.rows
    return x.as_strided((n_rows, n_cols), (stride_row, 1))


def measure_grouped(groups: list[list[tuple]], setting: tuple[int, int, int], args: Any) -> float:
    """Milliseconds of the step's grouped launches ``groups`` cut at the grouped kernel's
    ``setting``, each sum checked: one CUDA graph of them all (on the CPU, calls)."""
    names = ("TILE", "NUM_WARPS", "PROGRAMS_PER_SM")
    kept = [getattr(grouped, name) for name in names]
    for name, value in zip(names, setting, strict=True):
        setattr(grouped, name, value)
    grouped.forget_plans()
    try:
        launches = []
        for entries in groups:
            fresh = [(r, x, torch.zeros_like(out), sc, acc) for r, x, out, sc, acc in entries]
            by_key: dict[tuple, list[tuple]] = {}
            for entry in fresh:
                entry[0].group = None  # cut again at this setting
                by_key.setdefault(grouped.group_key(entry[0], entry[1]), []).append(entry)
            launches += by_key.items()
        for key, entries in launches:  # compiles outside the capture; checked
            grouped.launch_grouped(key, entries)
            for launch, x, out, scale, _ in entries:
                rows = rows_view(launch, x)
                check(out[: rows.shape[1]], rows, launch.rows[3], scale)

        def run() -> None:
            for key, entries in launches:
                grouped.launch_grouped(key, entries)

        return timed_ms(run, args.device, args.repeats)
    finally:
        for name, value in zip(names, kept, strict=True):
            setattr(grouped, name, value)
        grouped.forget_plans()
        for entries in groups:
            for entry in entries:
                entry[0].group = None


def grouped_sweep(groups: list[list[tuple]], args: Any) -> int:
    """The ``--grouped`` run: the step's grouped launches at every setting, one table."""
    ours = (grouped.TILE, grouped.NUM_WARPS, grouped.PROGRAMS_PER_SM)
    total_bytes = sum(rows_view(r, x).nbytes for entries in groups for r, x, *_ in entries)
    results = [
        result(setting, ours, measure_grouped(groups, setting, args), total_bytes)
        for setting in settings(args, ours)
    ]
    text = compare(results, "the step's grouped launches, ms")
    sums = sum(len(entries) for entries in groups)
    print(f"{args.model}, batch {args.batch_size}: {len(groups)} grouped launches, {sums} sums")
    payload = {"results": results, "launches": len(groups), "sums": sums}
    harness.finish("bench_row_sums_grouped", __file__, args, payload, text)
    return 0


def settings(args: Any, ours: tuple[int, int, int]) -> list[tuple[int, int, int]]:
    """The settings ``(tile, warps, programs per SM)`` the flags ask for, and ``ours``."""
    grid = itertools.product(*(parse_list(v) for v in (args.tiles, args.warps, args.programs)))
    return sorted(set(grid) | {ours})


def result(setting: tuple[int, int, int], ours: tuple, total_ms: float, nbytes: int) -> dict:
    """One setting's row of the record: its time for the work and the bandwidth."""
    return {
        "tile": setting[0], "warps": setting[1], "programs_per_sm": setting[2],
        "ours": setting == ours, "total_ms": total_ms, "bytes": nbytes,
        "tb_per_s": nbytes / total_ms / 1e9 if total_ms else None,
    }  # fmt: skip


def compare(results: list[dict], what: str) -> str:
    """Adds each setting's time against the package's (``vs_ours``); the table, fastest
    first, with ``what`` naming the time column."""
    base = next(r for r in results if r["ours"])
    for r in results:
        r["vs_ours"] = r["total_ms"] / base["total_ms"] if base["total_ms"] else None
    fmt = harness.fmt
    return harness.table(
        sorted(results, key=lambda r: r["total_ms"]),
        {
            "tile": lambda r: r["tile"],
            "warps": lambda r: r["warps"],
            "programs per SM": lambda r: r["programs_per_sm"],
            what: lambda r: fmt(r["total_ms"]),
            "TB/s": lambda r: fmt(r["tb_per_s"], ".2f"),
            "x ours": lambda r: fmt(r["vs_ours"], ".2f", "x") + (" (ours)" if r["ours"] else ""),
        },
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Records the row sums, measures them at every setting, writes the tables."""
    parser = harness.base_parser(__doc__.split("\n\n")[0], OPTIONS, impls=False)
    parser.add_argument("--model", choices=tuple(bench.MODELS), default="resnet18_cifar")
    parser.add_argument("--tiles", default="2048,4096,8192,16384", help="elements per tile")
    parser.add_argument("--warps", default="4,8", help="warps per program")
    parser.add_argument("--programs", default="2,4,8", help="programs per SM of a split launch")
    parser.add_argument("--grouped", action="store_true", help="the grouped kernel's settings")
    parser.set_defaults(host=False)  # bench_train_step's defaults read it
    args = harness.parse(parser, argv, bench.defaults)
    if args.smoke:  # the interpreter runs every program in Python: one setting besides ours
        args.tiles, args.warps, args.programs = "2048", "4", "2"
    geometries, groups = record_step(args)
    if args.grouped:
        return grouped_sweep(groups, args)
    ours = (reductions.TILE, reductions.NUM_WARPS, reductions.PROGRAMS_PER_SM)
    inputs = {g: random_inputs(g, args.device) for g in geometries}
    total_bytes = sum(xs[0].nbytes * geometries[g] for g, xs in inputs.items())  # bytes read
    results: list[dict] = []
    for setting in settings(args, ours):
        per_sum = {g: measure(g, inputs[g], setting, args) for g in geometries}
        total_ms = sum(ms * geometries[g] for g, ms in per_sum.items())
        results.append(result(setting, ours, total_ms, total_bytes))
        results[-1]["per_sum_ms"] = {str(g): ms for g, ms in per_sum.items()}
    text = compare(results, "the step's row sums, ms")
    base = next(r for r in results if r["ours"])
    best = min(results, key=lambda r: r["total_ms"])
    fmt = harness.fmt
    rows = []
    for g, c in sorted(geometries.items(), key=lambda gc: -gc[0][0] * gc[0][1] * gc[1]):
        own = min(results, key=lambda r: r["per_sum_ms"][str(g)])
        rows.append(
            {"geometry": g, "count": c, "ours": base["per_sum_ms"][str(g)] * 1e3,
             "best": best["per_sum_ms"][str(g)] * 1e3, "own": own["per_sum_ms"][str(g)] * 1e3,
             "own_setting": f"{own['tile']}/{own['warps']}/{own['programs_per_sm']}"}
        )  # fmt: skip
    text += "\n\nPer row sum (rows, columns, row stride, dtype, squared), us a launch:\n\n"
    text += harness.table(
        rows,
        {
            "geometry": lambda r: r["geometry"],
            "per step": lambda r: r["count"],
            "ours": lambda r: fmt(r["ours"], ".1f"),
            f"fastest setting {best['tile']}/{best['warps']}/{best['programs_per_sm']}": (
                lambda r: fmt(r["best"], ".1f")
            ),
            "its own fastest": lambda r: f"{fmt(r['own'], '.1f')} ({r['own_setting']})",
        },
    )
    print(f"{args.model}, batch {args.batch_size}: {sum(geometries.values())} row sums a refresh")
    payload = {"results": results, "geometries": [[*g, c] for g, c in geometries.items()]}
    harness.finish("bench_row_sums", __file__, args, payload, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
