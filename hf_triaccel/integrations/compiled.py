"""``torch.compile`` with AdaFisher: refresh steps run the module under the compile wrapper.

AdaFisher takes its statistics with hooks on the model's modules, on refresh steps only
(``collector.collecting``). Traced by ``torch.compile``, those hooks would put the
collector's flag into the compiled graph's guards (a recompilation whenever it changes)
and break the graph around the statistics' kernels on every refresh step. Instead, the
hooks stay on the original modules and a refresh step calls the module that the compile
wrapper holds (``OptimizedModule._orig_mod``: the same parameters, hooks and wrappers
such as DDP or autocast) eagerly; every other step runs the compiled graph, traced while
the collector is off. The statistics are those of an eager run.

Under ``mode="reduce-overhead"`` the compiled graphs replay as CUDA graphs: a training
step bound by the host's launches becomes bound by the device. A graph's outputs live in
its memory until the next replay, which rules out several micro-batches per optimizer
step (:func:`check_cuda_graphs`).

:class:`CompileClock` reports the compilation's cost apart from training: the wall time
of the first compiled step less that of the next.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from accelerate.utils import is_compiled_module
from torch import nn


def eager_module(model: nn.Module) -> nn.Module | None:
    """The module inside ``torch.compile``'s wrapper, ``None`` for a module that is not
    compiled.

    Example:
        >>> model = nn.Linear(2, 2)
        >>> eager_module(torch.compile(model)) is model, eager_module(model)
        (True, None)
    """
    return model._orig_mod if is_compiled_module(model) else None


def step_module(model: nn.Module, collector: Any) -> nn.Module:
    """The module a training step calls: the eager one under a compiled ``model`` when the
    ``collector`` (an AdaFisher :class:`~hf_triaccel.curvature.collector.FisherCollector`,
    or ``None``) takes statistics this step, else ``model`` itself.

    Example:
        >>> from hf_triaccel import AdaFisherW
        >>> model = nn.Linear(2, 2)
        >>> opt = AdaFisherW.from_model(model, update_every=2)
        >>> step_module(torch.compile(model), opt.collector) is model  # the first step refreshes
        True
    """
    eager = eager_module(model)
    if eager is None or collector is None or not collector.collecting:
        return model
    return eager


def route_refresh_steps(compiled: nn.Module, collector: Any) -> nn.Module:
    """Makes calls of the compiled ``compiled`` run its eager module while ``collector``
    takes statistics with autograd on (refresh steps), the compiled graph otherwise; for
    hand-written loops that call the model themselves (``prepare_triaccel`` does this).

    Returns:
        ``compiled``, its ``forward`` routed.

    Example:
        >>> from hf_triaccel import AdaFisherW
        >>> model = nn.Linear(2, 2)
        >>> opt = AdaFisherW.from_model(model)
        >>> compiled = route_refresh_steps(torch.compile(model, backend="eager"), opt.collector)
        >>> compiled(torch.ones(1, 2)).shape
        torch.Size([1, 2])
    """
    eager = eager_module(compiled)
    if eager is None:
        raise TypeError(f"route_refresh_steps needs a torch.compile'd module, got {compiled!r}")
    graph = compiled.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        if collector.collecting and torch.is_grad_enabled():
            return eager(*args, **kwargs)
        return graph(*args, **kwargs)

    compiled.forward = forward
    return compiled


# torch.compile modes that replay the compiled graphs as CUDA graphs
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def check_cuda_graphs(args: Any) -> None:
    """Refuses CUDA graphs (``torch_compile_mode`` of the Trainer's ``args``) where one
    optimizer step runs the model on several micro-batches: gradient accumulation or the
    elastic batch (``elastic_batch``, ``auto_find_batch_size``), which splits a batch
    that ran out of memory. A graph's backward leaves the first micro-batch's gradients
    in the graph's own memory, which its next replay overwrites before they are added to
    (pytorch/pytorch#169545): the gradients would be wrong.

    Raises:
        ValueError: naming the settings that conflict.

    Example:
        >>> from transformers import TrainingArguments
        >>> check_cuda_graphs(TrainingArguments("out", torch_compile_mode="reduce-overhead"))
        >>> check_cuda_graphs(
        ...     TrainingArguments(
        ...         "out", torch_compile_mode="reduce-overhead", gradient_accumulation_steps=4
        ...     )
        ... )
        Traceback (most recent call last):
        ...
        ValueError: torch_compile_mode='reduce-overhead' (CUDA graphs) with gradient_accumul...
    """
    mode = args.torch_compile_mode if args.torch_compile else None
    if mode not in CUDA_GRAPH_MODES:
        return
    if args.gradient_accumulation_steps > 1:
        conflict = f"gradient_accumulation_steps={args.gradient_accumulation_steps}"
    elif getattr(args, "elastic_batch", False) or args.auto_find_batch_size:
        conflict = "the elastic batch (elastic_batch / auto_find_batch_size)"
    else:
        return
    raise ValueError(
        f"torch_compile_mode={mode!r} (CUDA graphs) with {conflict}: a CUDA graph's "
        "next replay overwrites the gradients of the micro-batch before it; use one "
        "micro-batch per optimizer step, or torch_compile_mode=None (compiled without "
        "CUDA graphs)"
    )


class CompileClock:
    """The compilation time of a compiled model's training: the wall time of its first
    compiled step (compilation, forward and backward graphs, plus one step's work) less
    that of the second (one step's work). The device is synchronised around these two
    steps only.

    Example:
        >>> clock = CompileClock(torch.device("cpu"))
        >>> for _ in range(3):
        ...     _ = clock.time(lambda: sum(range(1000)))
        >>> clock.metrics()["compile_seconds"] >= 0.0
        True
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.steps = 0
        self._first: float | None = None
        self.seconds: float | None = None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def time(self, step: Callable[[], Any]) -> Any:
        """Runs one compiled ``step``, timing it when it is the first or the second."""
        if self.steps >= 2:
            return step()
        self._sync()
        start = time.perf_counter()
        out = step()
        self._sync()
        elapsed = time.perf_counter() - start
        self.steps += 1
        if self.steps == 1:
            self._first = elapsed
        else:
            self.seconds = max(self._first - elapsed, 0.0)
        return out

    def metrics(self) -> dict[str, float]:
        """``{"compile_seconds": ...}`` once two compiled steps ran, else ``{}``."""
        return {} if self.seconds is None else {"compile_seconds": round(self.seconds, 3)}
