"""What a WikiText-2 recipe run will do, said before it starts, and the recipe's quick form.

Before training the recipe logs the model and its size, the optimizer steps and tokens,
the epochs they make, the evaluations and the device; on a CPU it also times one training
step and one evaluation block of the model on a copy and says about how long the run
will take, and for the full recipe that ``--quick`` is the form sized for a CPU.

Example:
    >>> quick_defaults()["n_layer"], quick_defaults()["baseline"]
    (2, True)
"""

from __future__ import annotations

import copy
import math
import time
from typing import Any

import torch

from recipe_results import duration

# --quick: a 2-layer, 128-wide model over the 4,096 most frequent words (the output layer
# over all 33,278 words of WikiText-2 would take most of a CPU's time), on blocks of 64
# tokens, 200 steps of 512 tokens, its evaluations on the first 16,384 tokens of each
# split, after the AdamW baseline: both optimizers' perplexity in a few minutes on a
# 2-core CPU (recipes/README.md)
QUICK = {
    "n_layer": 2,
    "n_head": 4,
    "n_embd": 128,
    "block_size": 64,
    "max_vocab": 4096,
    "per_device_train_batch_size": 8,
    "per_device_eval_batch_size": 64,
    "max_tokens": 102_400,
    "eval_every_tokens": 51_200,
    "max_eval_tokens": 16_384,
    "logging_steps": 20,
    "baseline": True,
}


def quick_defaults() -> dict[str, Any]:
    """The defaults ``--quick`` gives on top of the recipe's (any flag still wins)."""
    return dict(QUICK)


def probe_seconds(model: torch.nn.Module, block_size: int, batch: int) -> tuple[float, float]:
    """Seconds of one training forward and backward of ``model`` on ``batch`` blocks of
    ``block_size`` random tokens, and of one evaluation forward per block, timed on a copy
    (the model itself and the run's random numbers are left as they are).

    A CPU's time grows with the batch: up to 8 blocks are timed, the fastest of three runs
    after an untimed one, and scaled.

    Example:
        >>> from transformers import GPT2Config, GPT2LMHeadModel
        >>> model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=16,
        ...                                    n_positions=8, bos_token_id=0, eos_token_id=0))
        >>> step, block = probe_seconds(model, 8, 4)
        >>> step > 0 and block > 0
        True
    """
    probe = copy.deepcopy(model).train()
    size = min(batch, 8)
    vocab = probe.config.vocab_size
    train_times, eval_times = [], []
    with torch.random.fork_rng(devices=[]):
        ids = torch.randint(0, vocab, (size, block_size))
        for _ in range(4):  # the first run allocates
            start = time.perf_counter()
            probe(input_ids=ids, labels=ids).loss.backward()
            train_times.append(time.perf_counter() - start)
            with torch.no_grad():
                start = time.perf_counter()
                probe.eval()(input_ids=ids, labels=ids)
                eval_times.append(time.perf_counter() - start)
                probe.train()
    return min(train_times[1:]) * batch / size, min(eval_times[1:]) / size


def plan_message(
    *,
    steps: int,
    tokens_per_step: int,
    train_tokens: int,
    eval_tokens: int,
    eval_steps: int,
    parameters: int,
    shape: str,
    device: str,
    runs: int,
    quick: bool,
    timing: tuple[float, float, int] | None,
) -> str:
    """The plan in words; ``timing`` (seconds of a training step, of an evaluation block,
    blocks per evaluation) adds the estimate, for a CPU.

    Example:
        >>> print(plan_message(steps=2442, tokens_per_step=8192, train_tokens=2_088_628,
        ...                    eval_tokens=217_600, eval_steps=100, parameters=21_900_000,
        ...                    shape="4 layers x 512", device="cpu", runs=1, quick=False,
        ...                    timing=(35.0, 0.5, 850)))  # doctest: +NORMALIZE_WHITESPACE
        wikitext2_gpt2: a GPT-2-style model (4 layers x 512, 21.90 M parameters), 2442
        optimizer steps of 8,192 tokens (20.0 M tokens, 9.58 epochs of 2,088,628 training
        tokens) on cpu, evaluating 217,600 validation tokens every 100 steps and at the
        end. One step takes about 35.00 s here: about 23.7 h of training and 3.1 h of
        evaluation; --quick trains the form of this recipe sized for a CPU.
    """
    tokens = steps * tokens_per_step
    form = " --quick" if quick else ""
    message = (
        f"wikitext2_gpt2{form}: a GPT-2-style model ({shape}, {parameters / 1e6:.2f} M "
        f"parameters), {steps} optimizer steps of {tokens_per_step:,} tokens "
        f"({tokens / 1e6:.1f} M tokens, {tokens / train_tokens:.2f} epochs of "
        f"{train_tokens:,} training tokens) on {device}, evaluating {eval_tokens:,} "
        f"validation tokens every {eval_steps} steps and at the end"
    )
    if runs > 1:
        message += ", after the AdamW baseline run of the same plan"
    if timing is not None:
        step_s, block_s, blocks = timing
        evaluations = math.ceil(steps / eval_steps) + 1  # and the test split at the end
        each = " each run" if runs > 1 else ""
        message += (
            f". One step takes about {step_s:.2f} s here: about {duration(steps * step_s)} of "
            f"training and {duration(evaluations * blocks * block_s)} of evaluation{each}"
        )
        if not quick:
            message += "; --quick trains the form of this recipe sized for a CPU"
    return message + "."
