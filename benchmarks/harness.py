"""The benchmark harness: command line, timing, host costs, models, optimizers, data,
environment, output.

Every measurement runs its variants next to a baseline measured in the same process
(README.md says why) and ends with :func:`finish`: ``<name>.json`` (the full payload),
``<name>.md`` (the printed table under its command line) and a record appended in the one
format of :mod:`benchmarks.records`.
"""

import argparse
import contextlib
import datetime
import gc
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import timm
import torch
from torch import nn
from transformers import PrinterCallback, TrainerCallback
from transformers.trainer_utils import speed_metrics

from benchmarks import records
from hf_triaccel import AdaFisher, AdaFisherW
from hf_triaccel.data.images import GPUBatchLoader, ImageTensors, load_image_dataset
from hf_triaccel.integrations import timm_models  # noqa: F401  registers the CIFAR models
from hf_triaccel.integrations.telemetry import environment as package_environment
from hf_triaccel.optim.groups import param_groups

if not torch.cuda.is_available():  # read when the package's kernels are first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO_ROOT = Path(__file__).resolve().parent.parent
LR, WEIGHT_DECAY = 1e-3, 0.01
NEVER = 10**9  # an update_every no benchmark reaches: only a first step refreshes factors
GIB = 2**30
# (learning rate, weight decay) per optimizer on the CIFAR ResNet-18. AdaFisherW's: the best
# of 3e-3 and 1e-2 over 30 epochs (BENCHMARKS.md); AdaFisher, AdamW, SGD (Nesterov) and the
# curvature-off control: the chosen values of the CIFAR-10 15-epoch comparison
# (the accuracy subcommand; benchmarks/results/chosen.json)
HYPERPARAMETERS = {
    "adafisherw": (1e-2, 5e-4),
    "adafisher": (1.2e-2, 5e-4),
    "adamw": (2.4e-2, 0.1),
    "sgd": (0.8, 5e-4),
    "sgd_ema": (6.0, 5e-4),
}
MOMENTUM = 0.9  # SGD's, and AdaFisher's default beta
DECAY_CHOICES = ("all", "exempt")  # make_optimizer's weight-decay groups of the torch optimizers


def add_common(
    parser: argparse.ArgumentParser, options: dict[str, tuple] | None = None, *, impls=True
) -> None:
    """Adds ``--out``, ``--records``, ``--smoke``, ``--device``, ``--impls`` (with
    ``impls``) and ``options``: name -> ``(type, smoke default, full default, help)``, as
    ``--name`` (dashes for underscores), for :func:`resolve`."""
    parser.add_argument("--out", help="results directory (default: $OUT, else the current one)")
    parser.add_argument("--records", type=Path, help=records.RECORDS_HELP)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, on CPU, in seconds")
    parser.add_argument("--device", help="default: cuda when available, else cpu")
    if impls:
        parser.add_argument("--impls", help="AdaFisher implementations, comma-separated")
    parser.set_defaults(smoke_defaults={})
    for name, (kind, smoke, full, help_) in (options or {}).items():
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, type=kind, help=f"{help_} (default {full}; smoke {smoke})")
        parser.get_default("smoke_defaults")[name] = (smoke, full)


def resolve(
    args: argparse.Namespace, mode: Callable[[argparse.Namespace], dict[str, Any]] | None = None
) -> argparse.Namespace:
    """Completes parsed arguments: ``device`` becomes a ``torch.device`` (default: CUDA
    when there is one, the CPU for a smoke run), ``impls`` a list (default: by device);
    each option left unset takes its default from ``mode(args)`` (a mode the flags chose),
    else the smoke or full one. Adds ``size`` (the models' size). A smoke run computes on
    one CPU thread: waking a pool costs more than tiny tensors' work."""
    cuda = torch.cuda.is_available() and not args.smoke
    args.device = torch.device(args.device or ("cuda" if cuda else "cpu"))
    if "impls" in args:
        default = "triton,foreach" if args.device.type == "cuda" else "foreach,reference"
        args.impls = [s.strip() for s in (args.impls or default).split(",") if s.strip()]
    chosen = mode(args) if mode is not None else {}
    for name, (smoke, full) in args.smoke_defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, chosen.get(name, smoke if args.smoke else full))
    args.size = "full"
    if args.smoke:
        args.size = "tiny"
        torch.set_num_threads(1)
    return args


def split(text: str, choices: Sequence[str], flag: str) -> list[str]:
    """A comma-separated list of ``choices``; a clear error names any other."""
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items or set(items) - set(choices):
        raise SystemExit(f"error: {flag} {text!r}: choose from {list(choices)}")
    return items


def synchronize(device: torch.device) -> None:
    """Waits for queued device work (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    """Collects garbage and returns cached device memory, between measured variants."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def wall_ms(fn: Callable[[], Any], device: torch.device, *, wait: bool = True) -> float:
    """Wall time of one call of ``fn`` in milliseconds, from an idle device; ``wait``:
    until its device work is done, else the host's own time."""
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    if wait:
        synchronize(device)
    return (time.perf_counter() - t0) * 1e3


def time_steps(fn: Callable[[], Any], device: torch.device, *, warmup: int, steps: int) -> list:
    """Per-call times of ``fn`` in milliseconds after ``warmup`` untimed calls: on CUDA
    between two events, the host synchronised once after the last call (so that a call's
    time includes any gap the host leaves while launching it), else ``perf_counter``."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        return [wall_ms(fn, device) for _ in range(steps)]
    synchronize(device)
    events = [[torch.cuda.Event(enable_timing=True) for _ in "se"] for _ in range(steps)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    synchronize(device)
    return [start.elapsed_time(end) for start, end in events]


def refresh_bytes(collector: Any, step: Callable[[], Any]) -> int:
    """The bytes a refresh must read, counted over one ``step`` (a refresh step): each
    Fisher layer's input and output gradient as the collector's hooks see them, in their
    own dtype, once each (ids for an embedding, the gradient where the rule takes it)."""
    seen: list[int] = []

    def on_input(module: nn.Module, args: tuple) -> None:
        if args and torch.is_tensor(args[0]):
            seen.append(args[0].nbytes)

    def on_output(module: nn.Module, args: tuple, out: Any) -> None:
        if torch.is_tensor(out) and out.requires_grad:
            out.register_hook(lambda grad: seen.append(grad.nbytes))

    handles = []
    for layer in collector.layers.values():
        handles.append(layer.module.register_forward_pre_hook(on_input))
        handles.append((layer.output_module or layer.module).register_forward_hook(on_output))
    try:
        step()
    finally:
        for handle in handles:
            handle.remove()
    return sum(seen)


def summarize(times: Sequence[float], method: str) -> dict[str, Any]:
    """Median and 20th/80th percentiles of per-call times in milliseconds."""
    p20, p50, p80 = map(float, np.percentile(np.asarray(times, dtype=np.float64), [20, 50, 80]))
    return {"median_ms": p50, "p20_ms": p20, "p80_ms": p80, "reps": len(times), "method": method}


def benchmark(
    fn: Callable[[], Any], device: torch.device, *, warmup_ms: float, rep_ms: float
) -> dict[str, Any]:
    """Median time of ``fn`` (:func:`summarize`'s fields) within time budgets: on CUDA
    ``triton.testing.do_bench`` (the L2 cache flushed before each call), elsewhere
    :func:`time_steps` with warm-up and repetitions sized from a first estimate."""
    if device.type == "cuda":
        from triton.testing import do_bench

        p20, p50, p80 = do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.2, 0.5, 0.8])
        method = "triton.testing.do_bench"
        return {"median_ms": p50, "p20_ms": p20, "p80_ms": p80, "reps": None, "method": method}
    estimate = max(float(np.median(time_steps(fn, device, warmup=1, steps=3))), 1e-3)
    steps = max(3, int(rep_ms / estimate))
    times = time_steps(fn, device, warmup=int(warmup_ms / estimate), steps=steps)
    return summarize(times, "time.perf_counter")


class LaunchCounter:
    """Counts (and, with ``stub``, skips) the launches of the package's Triton kernels;
    :meth:`restore` puts them back. Stubbed, what remains of a step is its host work."""

    def __init__(self, stub: bool) -> None:
        from triton.runtime.jit import KernelInterface

        from hf_triaccel.kernels import fold, grouped, reductions, update

        self.count = 0
        # the kernels only: the @triton.jit helpers they call are not launched
        named = [(n, k) for m in (reductions, fold, update, grouped) for n, k in vars(m).items()]
        self._patched = [
            k for n, k in named if isinstance(k, KernelInterface) and n.endswith("_kernel")
        ]
        for kernel in self._patched:
            run = kernel.run

            def counted(*args: Any, run=run, **kwargs: Any) -> Any:
                self.count += 1
                return None if stub else run(*args, **kwargs)

            kernel.run = counted  # ``kernel[grid](...)`` calls ``kernel.run``

    def restore(self) -> None:
        for kernel in self._patched:
            del kernel.run
        self._patched = []


def count_aten_ops(fn: Callable[[], Any]) -> int:
    """``aten::`` operator calls made by one call of ``fn`` (nested calls included)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name.startswith("aten::"))


def count_python(fn: Callable[[], Any]) -> dict[str, list[int]]:
    """Python opcodes and calls executed in this thread by one call of ``fn``, per function
    (``file:qualified name``, the file from its package folder on): ``{function: [opcodes,
    calls]}``. A count of the host's Python work that does not depend on the host's speed
    or load; C code (PyTorch's operators, Triton's launcher) is not in it. On a CUDA device
    the autograd engine runs the backward's hooks in a thread of its own, which is not
    traced: count on the CPU."""
    counts: dict[tuple[str, str], list[int]] = {}

    def trace(frame: Any, event: str, arg: Any) -> Any:
        code = frame.f_code
        key = (code.co_filename, getattr(code, "co_qualname", code.co_name))
        if event == "call":
            counts.setdefault(key, [0, 0])[1] += 1
            frame.f_trace_opcodes = True
        elif event == "opcode":
            counts[key][0] += 1
        return trace

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        fn()
    finally:
        sys.settrace(previous)
    out: dict[str, list[int]] = {}
    for (filename, name), (opcodes, calls) in counts.items():
        total = out.setdefault(f"{_source_label(filename)}:{name}", [0, 0])
        total[0] += opcodes
        total[1] += calls
    return out


def _source_label(filename: str) -> str:
    """A source file named from its package's folder on (``hf_triaccel/...``,
    ``kernels/...``, ``torch/...``), else by its name."""
    parts = Path(filename).parts
    for i, part in enumerate(parts):
        if part in ("hf_triaccel", "kernels"):
            return "/".join(parts[i:])
    if "site-packages" in parts:
        return "/".join(parts[len(parts) - parts[::-1].index("site-packages") :])
    return parts[-1] if parts else filename


class StepClock(TrainerCallback):
    """Times training steps from a loop (:meth:`step_end`) or a Trainer (callback).

    The window runs from the end of step ``warmup`` (>= 1) to the end of step ``warmup +
    steps``, the device synchronised at its edges only, or at every step end with
    ``every_step`` (``ends``: seconds since :meth:`start`). Over it: ``window``
    (``speed_metrics``: ``timed_runtime``, ``timed_samples_per_second``) and
    ``peak_bytes`` on CUDA. ``record`` is called at each step end into ``records``. A
    Trainer restarting training (``auto_find_batch_size``) starts the count over;
    ``attempts`` holds each attempt's per-device batch.
    """

    def __init__(self, device: torch.device, *, warmup, steps, every_step=False, record=None):
        self.device, self.warmup, self.steps, self.every_step = device, warmup, steps, every_step
        self.record: Callable[[], Any] | None = record
        self.count = self.samples = 0
        self.ends, self.records, self.attempts = [], [], []
        self.window: dict[str, float] | None = None
        self.peak_bytes: int | None = None
        self._t0 = self._window_start = 0.0

    def start(self) -> None:
        """Marks the start of training."""
        synchronize(self.device)
        self._t0 = time.time()

    def step_end(self, samples: int) -> None:
        """Counts a finished step of ``samples`` samples over all processes."""
        self.count += 1
        cuda, end = self.device.type == "cuda", self.count == self.warmup + self.steps
        if self.every_step or end or self.count == self.warmup:
            synchronize(self.device)
        if self.every_step:
            self.ends.append(time.time() - self._t0)
        if self.record is not None:
            self.records.append(self.record())
        if self.count == self.warmup:
            self._window_start, self.samples = time.time(), 0
            if cuda:  # the peak of the steady state, not of the warm-up's autotuning
                torch.cuda.reset_peak_memory_stats(self.device)
        elif self.count > self.warmup:
            self.samples += samples
        if end:
            self.window = speed_metrics("timed", self._window_start, self.samples, self.steps)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) if cuda else None

    def on_train_begin(self, args, state, control, **kwargs):
        self.attempts.append(state.train_batch_size)
        self.count, self.ends, self.records = 0, [], []

    def on_step_end(self, args, state, control, **kwargs):
        self.step_end(state.train_batch_size * args.gradient_accumulation_steps * args.world_size)


# smaller variants of the benchmarked models: "tiny" for CPU smoke runs, "narrow" keeps
# the module structure (layers, tensors, hooks) and cuts the widths (the ResNet's stem
# keeps 64 channels whatever the widths: so does its first stage here)
SIZES: dict[str, dict[str, dict[str, Any]]] = {
    "resnet18_cifar": {
        "tiny": {"layers": (1, 1, 1, 1), "channels": (8, 16, 32, 64)},
        "narrow": {"channels": (64, 64, 64, 64)},
    },
    "vit_base_patch16_224": {
        "tiny": {"img_size": 32, "patch_size": 8, "embed_dim": 32, "depth": 2, "num_heads": 2},
        "narrow": {"img_size": 32, "patch_size": 8, "embed_dim": 32, "num_heads": 2},
    },
    # timm's efficientnet_b0 takes no width or depth argument: small runs use small images
    "efficientnet_b0_cifar": {"tiny": {}, "narrow": {}},
    # GPT-2 small from transformers' GPT2Config() (124M parameters); its "narrow" keeps the
    # 12 blocks
    "gpt2": {
        "tiny": {"n_layer": 2, "n_head": 2, "n_embd": 32, "vocab_size": 128, "n_positions": 64},
        "narrow": {"n_head": 2, "n_embd": 64, "vocab_size": 1024},
    },
}
TEXT_MODELS = ("gpt2",)  # causal language models, built by transformers


def build_model(
    name: str = "resnet18_cifar", size: str = "full", *, seed: int = 0, **kwargs: Any
) -> nn.Module:
    """A randomly initialised model (``size``: ``"full"`` or one of :data:`SIZES`), seeded
    with ``seed``, in train mode: a timm model, or for ``"gpt2"`` transformers'
    ``GPT2LMHeadModel`` from ``GPT2Config`` (``kwargs`` then set the config).
    ``resnet18_cifar`` is the package's CIFAR ResNet-18 (3x3 stride-1 stem, no max-pool, 10
    classes, 11.17M parameters)."""
    if size != "full" and size not in SIZES.get(name, {}):
        raise ValueError(f"size {size!r} of {name}: choose 'full' or one of {list(SIZES[name])}")
    torch.manual_seed(seed)
    variant = SIZES[name][size] if size != "full" else {}
    if name in TEXT_MODELS:
        from transformers import GPT2Config, GPT2LMHeadModel

        model = GPT2LMHeadModel(GPT2Config(**variant, **kwargs)).train()
        model.loss_type = "ForCausalLM"  # transformers cannot tell it from the class name
        return model
    return timm.create_model(name, pretrained=False, **variant, **kwargs).train()


def make_optimizer(
    kind: str,
    model: nn.Module,
    *,
    lr=LR,
    weight_decay: float = WEIGHT_DECAY,
    decay: str = "all",
    **adafisher: Any,
) -> torch.optim.Optimizer:
    """``"adamw"`` (fused; capturable when ``lr`` is a tensor), ``"sgd"`` (Nesterov) or
    ``"sgd_ema"`` (AdaFisher's momentum, the curvature-off control; both fused on CUDA,
    else foreach), or ``"adafisher"`` / ``"adafisherw"`` built by ``from_model`` with
    ``adafisher`` (``impl``, ``update_every``, ...; the others ignore them). Names are
    case-insensitive. ``decay``, for the torch optimizers: ``"all"`` decays every
    parameter; ``"exempt"`` leaves biases and normalisation weights undecayed, as
    ``from_model`` groups AdaFisher's parameters (and as timm and transformers' Trainer
    group theirs)."""
    kind = kind.lower()
    if decay not in DECAY_CHOICES:
        raise ValueError(f"decay={decay!r}: choose one of {DECAY_CHOICES}")
    params: list[Any] = [p for p in model.parameters() if p.requires_grad]
    fused = all(p.is_cuda for p in params)  # else foreach: fused SGD needs CUDA on older torch
    if decay == "exempt":
        params = param_groups(model, weight_decay)
    if kind == "adamw":
        return torch.optim.AdamW(
            params, lr=lr, weight_decay=weight_decay, fused=True, capturable=torch.is_tensor(lr)
        )
    if kind in ("sgd", "sgd_ema"):
        # "sgd": Nesterov momentum. "sgd_ema": the momentum as AdaFisher keeps it,
        # m <- beta*m + (1 - beta)*g, which is AdaFisher's L2 update with every
        # preconditioner entry equal to the damping: lr here = AdaFisher's lr / damping
        # (torch seeds the buffer with the first gradient, AdaFisher's bias correction
        # gives the same first step)
        ema = kind == "sgd_ema"
        return torch.optim.SGD(
            params,
            lr=lr,
            momentum=MOMENTUM,
            dampening=MOMENTUM if ema else 0.0,
            nesterov=not ema,
            weight_decay=weight_decay,
            fused=fused or None,
            foreach=None if fused else True,
        )
    optimizers = {"adafisher": AdaFisher, "adafisherw": AdaFisherW}
    if kind not in optimizers:
        raise ValueError(f"optimizer {kind!r}: choose one of {tuple(HYPERPARAMETERS)}")
    return optimizers[kind].from_model(model, lr=lr, weight_decay=weight_decay, **adafisher)


def load_images(source: str, split: str, *, smoke=False, n=256, progress=True) -> ImageTensors:
    """The ``split`` of ``source`` (``"embedded"`` or a local parquet folder, see
    ``load_image_dataset``); under ``smoke``, ``n`` random 16x16 images of 10 classes
    (nothing to decode)."""
    if not smoke:
        return load_image_dataset(source, split, progress=progress)
    gen = torch.Generator().manual_seed(0 if split == "train" else 1)
    images = torch.randint(0, 256, (n, 3, 16, 16), generator=gen, dtype=torch.uint8)
    return ImageTensors(images, torch.randint(0, 10, (n,), generator=gen), list("0123456789"))


def image_batches(data: ImageTensors, batch_size: int, **kwargs: Any) -> GPUBatchLoader:
    """Training batches built on the data's device: shuffled, randomly cropped and flipped,
    normalised, full batches only (``kwargs`` go to ``GPUBatchLoader``)."""
    kwargs = {"shuffle": True, "augment": True, "drop_last": True, **kwargs}
    return GPUBatchLoader(data, batch_size, **kwargs)


def train(trainer_cls, arguments_cls, model, data, clock: StepClock, before=None, **kwargs):
    """Trains ``model`` on ``data`` with a Trainer of ``trainer_cls`` and arguments of
    ``arguments_cls`` (``kwargs``; no checkpoints, reports or progress bar), ``clock`` as
    a callback started with ``train()``, ``before(trainer)`` called first. Returns it."""
    with tempfile.TemporaryDirectory() as output_dir:
        kwargs.update(output_dir=output_dir, use_cpu=clock.device.type == "cpu")
        kwargs.update(save_strategy="no", report_to="none", disable_tqdm=True)
        trainer = trainer_cls(model=model, args=arguments_cls(**kwargs), train_dataset=data)
        # with the progress bar off the Trainer prints every log: keep stdout for the table
        trainer.remove_callback(PrinterCallback)
        trainer.add_callback(clock)
        if before is not None:
            before(trainer)
        clock.start()
        trainer.train()
    return trainer


def endless(loader: Iterable[Any]) -> Iterator[Any]:
    """Batches epoch after epoch (each ``iter`` of the loader, a ``GPUBatchLoader`` or a
    ``DataLoader``, starts the next epoch)."""
    while True:
        yield from loader


def environment(argv: Sequence[str], device: torch.device) -> dict[str, Any]:
    """What a result was measured on and with: the package's environment record (device,
    versions, Python), the CUDA version, git commit, UTC date and the command line."""
    try:
        git = ["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"]
        commit = subprocess.run(git, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    env = {**package_environment(), "device_type": device.type, "cuda": torch.version.cuda}
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    env.update(git_commit=commit or None, date_utc=now)
    return {**env, "command": shlex.join(["python", "-m", "benchmarks", *argv])}


def report_error(exc: BaseException) -> str:
    """Prints the traceback to stderr and returns a one-line description for a row."""
    traceback.print_exception(exc, file=sys.stderr)
    return f"{type(exc).__name__}: {exc}".strip()


@contextlib.contextmanager
def variant(row: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Runs one measured variant: an exception becomes the row's ``error`` status and
    note, so that a failing variant does not hide the others' results."""
    try:
        yield row
    except Exception as exc:
        row["status"], row["note"] = "error", report_error(exc)


def fmt(value: float | None, spec: str = ".3f", suffix: str = "") -> str:
    """A number for a table cell, or ``n/a`` when it was not measured."""
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def gib(nbytes: float | None) -> str:
    """Bytes as GiB for a table cell."""
    return fmt(nbytes and nbytes / GIB, ".2f")


def add_ratio(rows: list[dict], key: str, out: str, base: Callable[[dict], bool]) -> None:
    """Sets ``row[out] = row[key] / base[key]`` against the first row that ``base``
    accepts and that measured ``key`` (``None`` where either is missing)."""
    ref = next((r for r in rows if base(r) and r.get(key)), None)
    for r in rows:
        r[out] = r[key] / ref[key] if ref is not None and r.get(key) else None


def table(rows: Sequence[dict], columns: dict[str, Callable[[dict], Any]]) -> str:
    """A GitHub-flavoured markdown table: one column per header, its cell from the row."""
    cells = [[str(cell(r)).replace("|", "/") for cell in columns.values()] for r in rows]
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    return "\n".join(lines + ["| " + " | ".join(c) + " |" for c in cells])


def note(row: dict[str, Any]) -> str:
    """The row's note, cut for a table cell."""
    return (row.get("note") or "")[:200]


def out_dir(args) -> Path:
    """The results directory, created: ``--out``, else ``$OUT``, else the current one."""
    directory = Path(args.out or os.environ.get("OUT") or ".")
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def finish(name: str, args, payload: dict, text: str, processes: int = 1) -> dict:
    """Prints the device and ``text``; writes ``<name>.json`` (``payload`` with the
    :func:`environment` and the arguments in its ``config``) and ``<name>.md`` (``text``
    under the command line) into ``--out``, else ``$OUT``, else the current directory; and
    appends the run's record (:mod:`benchmarks.records`). Returns the environment record."""
    env = environment(args.argv, args.device)
    if processes > 1:  # the launcher's own command line is not visible from inside
        env.update(processes=processes, command=f"{processes} processes: {env['command']}")
    print(f"device: {env['device']}; torch {env['versions']['torch']}\n{text}")
    directory = out_dir(args)
    path = directory / f"{name}.json"
    skip = ("argv", "smoke_defaults", "out", "records", "run")  # what the arguments chose
    config = {k: str(v) if k in ("device", "records") else v for k, v in vars(args).items()}
    config = {k: v for k, v in config.items() if k not in skip}
    payload = {"env": env, **payload, "config": {**config, **payload.get("config", {})}}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    header = f"`{env['command']}` on {env['device']} ({env['date_utc']})\n\n"
    (directory / f"{name}.md").write_text(header + text + "\n")
    record = records.from_payload(name, payload, kind=args.command)
    records.append(records.destination(args, directory), record)
    print(f"wrote {path}")
    return env
