"""Train a GPT-2-style language model on WikiText-2 with ``TriAccelTrainer``: perplexity
against training time, the efficiency figures, and a model that generates after loading.

Usage::

    accelerate launch recipes/wikitext2_gpt2.py --dataset DIR              # a parquet folder
    accelerate launch recipes/wikitext2_gpt2.py --dataset DIR --baseline   # and AdamW
    accelerate launch recipes/wikitext2_gpt2.py --dataset Salesforce/wikitext \\
        --dataset_config wikitext-2-v1                                      # from the Hub
    python recipes/wikitext2_gpt2.py --help                                 # every flag

``--dataset`` is a folder of ``{train,validation,test}.parquet`` (or the Hub's
``{split}-*.parquet`` shards) with one ``text`` column, one row per line, or a Hub data
set id with ``--dataset_config``. The vocabulary is every word of the training split
(``<unk>`` and ``<eos>`` first); each line ends with ``<eos>``; the token stream of a
split is cut into blocks of ``--block_size`` tokens. The model is built from a
``GPT2Config`` (no download). Training runs for ``--max_tokens`` tokens and evaluates
the validation perplexity every ``--eval_every_tokens``; the test perplexity is taken
once at the end. A run writes into ``output_dir``:

- the model and its tokenizer: ``AutoTokenizer.from_pretrained(DIR)`` and
  ``AutoModelForCausalLM.from_pretrained(DIR)`` load them;
- ``efficiency_report.json`` (the Trainer's telemetry), ``history.json`` (every log
  entry with its step, tokens and times) and ``results.json`` (perplexities, the
  perplexity-against-time ``curve``, time figures, settings, the command);
- ``loss.png`` (and ``memory.png`` on a GPU) and the model card ``README.md``;
- with ``--baseline``, the AdamW (fused) run of the same command in ``output_dir/baseline``,
  and both runs side by side on the console.

``--runs_file FILE`` appends every finished run to a JSON-lines file and skips a run whose
settings are already there, so that a grid of commands can be run again after an
interruption and only trains what is missing.

``--quick`` is the form sized for a CPU (``wikitext2_plan.py``: a small model over the
most frequent words, a few hundred steps, after the AdamW baseline); ``--muon`` trains
Muon on the hidden matrices and AdamW on the rest (``muon_split.py``).

Over 1,000 lines: one command line (its flags and their checks), its data, its run, its
runs file and its comparison, each needing the others' names; the plan and the Muon arm
live in their own files.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import logging
import math
import os
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    PreTrainedTokenizerFast,
    TrainerCallback,
    set_seed,
)
from transformers.hf_argparser import string_to_bool

from hf_triaccel import TriAccelArguments, TriAccelTrainer
from hf_triaccel.data.loading import is_hub_dataset_id
from hf_triaccel.data.text import (
    EOS,
    UNK,
    causal_lm_dataset,
    check_text_source,
    load_text_split,
    pack_blocks,
    token_ids,
    word_level_tokenizer,
)
from hf_triaccel.integrations.model_card import PushToHubError
from hf_triaccel.integrations.plots import plot_run
from hf_triaccel.integrations.telemetry import REPORT_NAME
from hf_triaccel.integrations.trainer_args import TriAccelArgumentParser, resolve_learning_rate

from muon_split import ADJUST_LR, MuonWithAdamW, hidden_matrices
from recipe_config import (
    BASELINE_OPTIM,
    ReportArguments,
    UsageError,
    first_line,
    given_flags,
    hub_unreachable,
    output_folder,
)
from recipe_energy import EnergyMeter, total_energy
from recipe_results import (
    DEFINITIONS,
    HISTORY_NAME,
    RESULTS_NAME,
    emissions,
    publish,
    respect_umask,
    resumed_from,
    run_figures,
    settings,
    timing_figures,
    true_device,
    write_json,
)
from wikitext2_plan import plan_message, probe_seconds, quick_defaults

logger = logging.getLogger("recipes")


RECIPE = "wikitext2_gpt2"
SCRIPT = "recipes/wikitext2_gpt2.py"
DEFAULT_DATASET = ("Salesforce/wikitext", "wikitext-2-v1")
# the AdamW variants that can step the rest of the model beside Muon
MUON_REST = ("adamw_torch", BASELINE_OPTIM)
# Muon's learning rates until the recipe's grid chooses them: under match_rms_adamw a
# matrix's update has an AdamW update's RMS, so its rate sits on AdamW's scale
MUON_LR = 1e-3
OFFLINE_ADVICE = (
    "Without a network, give --dataset a local folder of the splits' parquet files (a copy "
    "of Salesforce/wikitext, configuration wikitext-2-v1); with it, --quick trains the form "
    "of this recipe sized for a CPU"
)
BASELINE_DIR = "baseline"
SPLITS = ("train", "validation", "test")
TEXT_DEFINITIONS = {
    **DEFINITIONS,
    "train_time_s": "seconds of training before an evaluation: wall time since "
    "Trainer.train() started, less every evaluation so far (from the end of the step "
    "before it, the device synchronised, to the end of the evaluation)",
    "perplexity": "exp of the mean cross-entropy over the predicted tokens of the split's "
    "blocks (every token of a block but its first; the last, incomplete block is left out)",
    "tokens_per_second": "steady_samples_per_second x block_size",
}


@dataclass
class TextRecipeArguments(ReportArguments):
    """The recipe's own flags; every ``TriAccelArguments`` field is a flag too."""

    dataset: str = field(
        default="Salesforce/wikitext",
        metadata={
            "help": "A folder of {train,validation,test}.parquet files (or the Hub's "
            "{split}-*.parquet shards) with a 'text' column, one row per line; or a Hub data "
            "set id (needs the network), with --dataset_config."
        },
    )
    dataset_config: str = field(
        default="wikitext-2-v1",
        metadata={"help": "The Hub data set's configuration; unused for a local folder."},
    )
    hub_dataset_id: str | None = field(
        default=None,
        metadata={
            "help": "The Hub data set a local --dataset folder is a copy of, named in the "
            "model card (e.g. Salesforce/wikitext); without it the card names the folder."
        },
    )
    block_size: int = field(
        default=256, metadata={"help": "Tokens per training block (and context length)."}
    )
    n_layer: int = field(default=4, metadata={"help": "Transformer blocks."})
    n_head: int = field(default=8, metadata={"help": "Attention heads per block."})
    n_embd: int = field(default=512, metadata={"help": "Width (embedding size)."})
    dropout: float = field(
        default=0.1, metadata={"help": "Dropout of embeddings, attention and residuals."}
    )
    max_tokens: int = field(
        default=20_000_000,
        metadata={
            "help": "Training budget in tokens: max_steps = ceil(max_tokens / tokens per "
            "step), tokens per step = block_size x batch x accumulation x processes. "
            "--max_steps, when given, wins."
        },
    )
    eval_every_tokens: int = field(
        default=819_200,
        metadata={
            "help": "Evaluate the validation perplexity every this many training tokens "
            "(rounded to whole steps; 100 steps at the default batch); --eval_steps, when "
            "given, wins."
        },
    )
    baseline: bool = field(
        default=False,
        metadata={
            "help": f"Also train the baseline ({BASELINE_OPTIM}, same model, data, schedule, "
            "budget, precision and seed) first, into OUTPUT_DIR/baseline, and compare."
        },
    )
    baseline_learning_rate: float = field(
        default=3e-4,
        metadata={"help": "Learning rate of the --baseline run (the best of the recipe's grid)."},
    )
    baseline_weight_decay: float = field(
        default=0.01, metadata={"help": "Weight decay of the --baseline run."}
    )
    runs_file: str | None = field(
        default=None,
        metadata={
            "help": "A JSON-lines file: each finished run appends one line (settings, "
            "perplexities, curve, times); a run whose settings are already there is skipped."
        },
    )
    dry_run: bool = field(
        default=False,
        metadata={
            "help": "Read the data, build the vocabulary and the model, print the plan (on "
            "a CPU with the time it would take) and exit without training."
        },
    )
    quick: bool = field(
        default=False,
        metadata={
            "help": "The recipe's quick form, sized for a CPU: a 2-layer, 128-wide model over "
            "the 4,096 most frequent words, 200 steps of 512 tokens, evaluations on the first "
            "16,384 tokens of each split, after the AdamW baseline (--baseline false to skip "
            "it); outputs in outputs/wikitext2_gpt2-quick. Any flag still wins."
        },
    )
    max_vocab: int | None = field(
        default=None,
        metadata={
            "help": "Keep the this many most frequent words of the training split in the "
            "vocabulary, every other word becoming <unk>; default: every word."
        },
    )
    max_eval_tokens: int | None = field(
        default=None,
        metadata={
            "help": "Evaluate on the first this many tokens of the validation and test splits "
            "(whole blocks); default: the whole splits."
        },
    )
    muon: bool = field(
        default=False,
        metadata={
            "help": "Muon (torch.optim.Muon) on the hidden weight matrices, at --learning_rate "
            f"(default {MUON_LR:g} under --muon); AdamW (--optim, default {BASELINE_OPTIM}) on "
            "the embeddings, output layer, norms and biases, at --muon_adamw_lr."
        },
    )
    muon_adamw_lr: float = field(
        default=3e-4, metadata={"help": "Under --muon: the AdamW part's learning rate."}
    )
    muon_momentum: float = field(
        default=0.95, metadata={"help": "Under --muon: Muon's (Nesterov) momentum."}
    )
    muon_adjust_lr: str = field(
        default="match_rms_adamw",
        metadata={
            "help": "Under --muon: torch.optim.Muon's adjust_lr_fn, one of "
            f"{', '.join(ADJUST_LR)} (match_rms_adamw treats a matrix and its transpose alike: "
            "GPT-2 stores its weights as (in, out))."
        },
    )


def recipe_defaults() -> dict[str, Any]:
    """The defaults the recipe gives ``TriAccelArguments``; a flag on the command line wins.

    Example:
        >>> defaults = recipe_defaults()
        >>> defaults["optim"], defaults["per_device_train_batch_size"]
        ('adafisherw', 32)
    """
    return {
        "output_dir": os.path.join("outputs", RECIPE),
        "optim": "adafisherw",
        # the rule and learning rate of the recipe's grid (BENCHMARKS.md): on this model the
        # published rule's near-uniform preconditioner trails AdamW, the paper rule (a
        # refresh every step) beats it
        "adafisher_ema": "paper",
        "learning_rate": 3e-3,
        "weight_decay": 0.01,
        "per_device_train_batch_size": 32,
        "per_device_eval_batch_size": 64,
        "lr_scheduler_type": "cosine",
        "warmup_steps": 0.05,
        "bf16": torch.cuda.is_available(),
        "eval_strategy": "steps",
        # half the evaluation interval at the default batch: the windows between two
        # evaluations give the steady step time (a window that holds an evaluation is
        # left out of it)
        "logging_steps": 50,
        # checkpoints would add their writes to the measured training time
        "save_strategy": "no",
        # the evaluations need the loss only: gathering the logits (block x vocabulary
        # per sample) would cost memory and time
        "prediction_loss_only": True,
        # text batches: nothing to augment (the settings in results.json say so)
        "device_data_augment": False,
        "ddp_find_unused_parameters": False,
    }


def build_parser(prog: str | None = None, argv: list[str] = ()) -> TriAccelArgumentParser:
    """The command line: :class:`TextRecipeArguments`, every ``TriAccelArguments`` field
    with the recipe's defaults (the quick form's under ``--quick`` in ``argv``; the output
    folder named after the data), and ``--lr`` for ``--learning_rate``; errors are one
    line naming the flag, and no flag is taken for a longer one it begins."""
    head = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    head.add_argument("--quick", nargs="?", const=True, default=False, type=string_to_bool)
    head.add_argument("--dataset", default=DEFAULT_DATASET[0])
    head.add_argument("--dataset_config", default=DEFAULT_DATASET[1])
    known = head.parse_known_args(argv)[0]
    parser = TriAccelArgumentParser(
        (TextRecipeArguments, TriAccelArguments),
        prog=Path(prog or SCRIPT).name,
        description="Train a GPT-2-style causal language model on WikiText-2 with hf_triaccel.",
        allow_abbrev=False,
    )
    parser.add_argument(
        "--lr",
        dest="learning_rate",
        type=float,
        help="Same as --learning_rate (default: the optimizer's own).",
    )
    defaults = recipe_defaults() | (quick_defaults() if known.quick else {})
    data = known.dataset
    if known.dataset_config != DEFAULT_DATASET[1] and not Path(data).expanduser().is_dir():
        data = f"{data}-{known.dataset_config}"
    defaults["output_dir"] = output_folder(RECIPE, data, DEFAULT_DATASET[0], known.quick)
    parser.set_defaults(**defaults)
    return parser


def parse_args(
    argv: list[str], prog: str | None = None
) -> tuple[TextRecipeArguments, TriAccelArguments]:
    """Parses and checks the flags, the data source included, before anything is read.

    Raises:
        SystemExit: a bad flag or value, a missing data folder or split (status 2, after
            one line naming the flag).
    """
    parser = build_parser(prog, argv)
    recipe_args, args = parser.parse_args_into_dataclasses(args=argv)
    for name in ("block_size", "n_layer", "n_head", "n_embd", "max_tokens", "eval_every_tokens"):
        if getattr(recipe_args, name) < 1:
            parser.error(f"--{name} {getattr(recipe_args, name)}: needs a positive integer")
    if recipe_args.max_vocab is not None and recipe_args.max_vocab < 1:
        parser.error(f"--max_vocab {recipe_args.max_vocab}: needs a positive integer")
    if (
        recipe_args.max_eval_tokens is not None
        and recipe_args.max_eval_tokens < recipe_args.block_size
    ):
        parser.error(
            f"--max_eval_tokens {recipe_args.max_eval_tokens}: needs at least one block of "
            f"--block_size {recipe_args.block_size} tokens"
        )
    if recipe_args.muon:
        given = given_flags(argv)
        optim = str(getattr(args.optim, "value", args.optim))
        if "optim" not in given:
            args = dataclasses.replace(args, optim=BASELINE_OPTIM)
        elif optim not in MUON_REST:
            parser.error(
                f"--optim {optim} with --muon: the rest of the model takes AdamW, one of "
                f"{', '.join(MUON_REST)}"
            )
        if "learning_rate" not in given:
            args = dataclasses.replace(args, learning_rate=MUON_LR)
        if recipe_args.muon_adjust_lr not in ADJUST_LR:
            parser.error(
                f"--muon_adjust_lr {recipe_args.muon_adjust_lr}: one of {', '.join(ADJUST_LR)}"
            )
        if not 0 <= recipe_args.muon_momentum < 1:
            parser.error(f"--muon_momentum {recipe_args.muon_momentum:g}: needs 0 <= momentum < 1")
    if recipe_args.n_embd % recipe_args.n_head:
        parser.error(
            f"--n_embd {recipe_args.n_embd} is not a multiple of --n_head {recipe_args.n_head}"
        )
    hub_id = recipe_args.hub_dataset_id
    if hub_id is not None and not is_hub_dataset_id(hub_id):
        parser.error(f"--hub_dataset_id {hub_id!r}: a Hub id has the form owner/name")
    try:
        check_text_source(recipe_args.dataset, SPLITS)
    except FileNotFoundError as exc:
        parser.error(f"--dataset {recipe_args.dataset}: {exc}")
    return recipe_args, args


@dataclass
class TextData:
    """The tokenizer and the three splits as blocks, with their token counts."""

    tokenizer: PreTrainedTokenizerFast
    blocks: dict[str, torch.Tensor]
    tokens: dict[str, int]

    @classmethod
    @functools.lru_cache(maxsize=1)
    def load(
        cls, dataset: str, config_name: str, block_size: int, max_vocab: int | None = None
    ) -> TextData:
        """Reads the splits, builds the vocabulary of the training split, packs each split.
        The last data set stays cached: the runs of a grid in one process read it once.

        Raises:
            UsageError: data without a split or its text column, or too short for a block.
        """
        from_hub = not Path(dataset).expanduser().is_dir()
        if from_hub and (reason := hub_unreachable()) is not None:
            raise UsageError(
                f"--dataset {dataset}: the Hub cannot be reached ({reason}). {OFFLINE_ADVICE}"
            )
        try:
            lines = {
                split: load_text_split(dataset, split, config_name=config_name) for split in SPLITS
            }
        except (ValueError, FileNotFoundError) as exc:
            raise UsageError(f"--dataset {dataset}: {exc}") from None
        # the Hub client raises many types (connection, offline mode, unknown id)
        except Exception as exc:
            if not from_hub:
                raise
            raise UsageError(
                f"--dataset {dataset}: could not load it from the Hub ({first_line(exc)}). "
                f"Check the id and the network. {OFFLINE_ADVICE}"
            ) from None
        words = word_level_tokenizer(lines["train"], max_vocab)
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=words,
            unk_token=UNK,
            eos_token=EOS,
            bos_token=EOS,
            # no padding token in the vocabulary: batches of one prompt, or padded with
            # <eos>, as GPT-2 does
            pad_token=EOS,
            # GPT-2 would embed token_type_ids with its word embeddings: never produce them
            model_input_names=["input_ids", "attention_mask"],
            model_max_length=block_size,
            # decoded text keeps the corpus's tokenisation (" ." stays " .")
            clean_up_tokenization_spaces=False,
        )
        blocks, tokens = {}, {}
        for split, split_lines in lines.items():
            ids = token_ids(split_lines, words)
            tokens[split] = len(ids)
            try:
                blocks[split] = pack_blocks(ids, block_size)
            except ValueError as exc:
                raise UsageError(f"split {split!r}: {exc} (--block_size)") from None
        return cls(tokenizer, blocks, tokens)

    def dataset(self, split: str, max_tokens: int | None = None):
        """A split as the Trainer's data set (``input_ids`` and ``labels``): its first
        ``max_tokens`` tokens in whole blocks, or all of it."""
        return causal_lm_dataset(self.blocks[split][: self.block_count(split, max_tokens)])

    def block_count(self, split: str, max_tokens: int | None = None) -> int:
        """The blocks of a split that :meth:`dataset` gives."""
        blocks = self.blocks[split]
        return (
            len(blocks) if max_tokens is None else min(len(blocks), max_tokens // blocks.shape[1])
        )

    def evaluated_tokens(self, split: str, max_tokens: int | None = None) -> int:
        """The tokens of a split an evaluation reads (whole blocks)."""
        return self.block_count(split, max_tokens) * self.blocks[split].shape[1]


def build_model(recipe_args: TextRecipeArguments, vocab_size: int, eos: int) -> GPT2LMHeadModel:
    """The GPT-2-style model of the flags' shape, untrained, with tied input and output
    embeddings; token ``eos`` starts, ends and pads generated text."""
    config = GPT2Config(
        vocab_size=vocab_size,
        n_positions=recipe_args.block_size,
        n_embd=recipe_args.n_embd,
        n_layer=recipe_args.n_layer,
        n_head=recipe_args.n_head,
        resid_pdrop=recipe_args.dropout,
        embd_pdrop=recipe_args.dropout,
        attn_pdrop=recipe_args.dropout,
        bos_token_id=eos,
        eos_token_id=eos,
    )
    model = GPT2LMHeadModel(config)
    # padding with <eos> for generation only: a pad id in the model's config would make
    # every training block that holds an <eos> look padded (transformers warns of it)
    model.generation_config.pad_token_id = eos
    # the class name matches none of transformers' loss names: name the causal LM loss it
    # falls back to, which saves a warning at the first loss
    model.loss_type = "ForCausalLM"
    return model


def parameter_count(model: torch.nn.Module) -> int:
    """Trainable parameters, a tied weight counted once."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def tokens_per_step(recipe_args: TextRecipeArguments, args: TriAccelArguments) -> int:
    """Training tokens per optimizer step, over every process."""
    return (
        recipe_args.block_size
        * args.per_device_train_batch_size
        * args.gradient_accumulation_steps
        * args.world_size
    )


def schedule(
    recipe_args: TextRecipeArguments, args: TriAccelArguments, given: set[str]
) -> TriAccelArguments:
    """The arguments with ``max_steps`` from the token budget and ``eval_steps`` from the
    evaluation interval, unless ``given`` (the flags on the command line) names them.
    (``TrainingArguments`` sets an evaluation interval left unset to the logging
    interval, so only the command line tells whether one was given.)"""
    per_step = tokens_per_step(recipe_args, args)
    changes: dict[str, Any] = {}
    if "max_steps" not in given:
        changes["max_steps"] = math.ceil(recipe_args.max_tokens / per_step)
    if "eval_steps" not in given:
        changes["eval_steps"] = max(1, round(recipe_args.eval_every_tokens / per_step))
    return dataclasses.replace(args, **changes) if changes else args


class PerplexityCurve(TrainerCallback):
    """Every log entry with its ``step``, ``tokens`` (trained so far), ``wall_time_s``
    (since training started) and, for an evaluation, ``train_time_s`` (the wall time less
    the evaluations so far) and ``eval_perplexity``; the efficiency report as it stands
    when training ends.

    The training clock stops at the end of the step before each evaluation, the device
    synchronised, and starts again when the evaluation ends.
    """

    def __init__(self, trainer: TriAccelTrainer, tokens_per_step: int) -> None:
        self.telemetry = trainer.telemetry
        self.tokens_per_step = tokens_per_step
        self.entries: list[dict[str, Any]] = []
        self.eval_runtime_s = 0.0
        self.report: dict[str, Any] | None = None
        self._start = self._paused = time.perf_counter()
        self._train_time = 0.0
        self._training = False

    def on_train_begin(self, args, state, control, **kwargs):
        self._start, self._training = time.perf_counter(), True

    def on_step_end(self, args, state, control, **kwargs):
        if control.should_evaluate:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self._paused = time.perf_counter()
            self._train_time = self._paused - self._start - self.eval_runtime_s

    def on_evaluate(self, args, state, control, **kwargs):
        if self._training:
            self.eval_runtime_s += time.perf_counter() - self._paused

    def on_train_end(self, args, state, control, **kwargs):
        self._training = False
        self.report = self.telemetry.report()

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = dict(logs or {})
        entry = {
            "wall_time_s": round(time.perf_counter() - self._start, 3),
            "step": state.global_step,
            "tokens": state.global_step * self.tokens_per_step,
            **logs,
        }
        if "eval_loss" in logs and self._training:
            entry["train_time_s"] = round(self._train_time, 3)
            entry["eval_perplexity"] = perplexity(logs["eval_loss"])
        self.entries.append(entry)


def perplexity(loss: float | None) -> float | None:
    """``exp(loss)``, ``None`` for a missing loss and ``inf`` past float range.

    Example:
        >>> perplexity(0.0), perplexity(None), perplexity(1e6)
        (1.0, None, inf)
    """
    if loss is None:
        return None
    return math.exp(loss) if loss < 700 else math.inf


def curve(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The evaluations during training: step, tokens, training time and perplexity.

    Example:
        >>> curve([{"step": 5, "loss": 3.0}, {"step": 5, "tokens": 40, "train_time_s": 1.5,
        ...         "eval_loss": 2.0, "eval_perplexity": 7.39}])
        [{'step': 5, 'tokens': 40, 'train_time_s': 1.5, 'eval_perplexity': 7.39}]
    """
    keys = ("step", "tokens", "train_time_s", "eval_perplexity")
    return [{k: e[k] for k in keys} for e in history if "train_time_s" in e]


def time_to(points: list[dict[str, Any]], target: float | None) -> float | None:
    """The training time of the first evaluation at or below ``target`` perplexity.

    Example:
        >>> time_to([{"train_time_s": 1.0, "eval_perplexity": 90.0},
        ...          {"train_time_s": 2.0, "eval_perplexity": 70.0}], 80.0)
        2.0
    """
    if target is None:
        return None
    return next((p["train_time_s"] for p in points if p["eval_perplexity"] <= target), None)


def run_key(
    recipe_args: TextRecipeArguments, args: TriAccelArguments, muon: bool = False
) -> dict[str, Any]:
    """What makes two runs the same run for ``--runs_file``: the optimizer with its
    resolved settings (``muon``: Muon's beside the AdamW part's), the model, data,
    budget, batch, schedule and seed."""
    key: dict[str, Any] = {
        "optim": "muon" if muon else str(getattr(args.optim, "value", args.optim)),
        "learning_rate": resolve_learning_rate(args),
        "weight_decay": args.weight_decay,
        "model": [recipe_args.n_layer, recipe_args.n_head, recipe_args.n_embd],
        "dropout": recipe_args.dropout,
        "block_size": recipe_args.block_size,
        "dataset": recipe_args.dataset,
        "max_steps": args.max_steps,
        "eval_steps": args.eval_steps,
        "total_batch_size": tokens_per_step(recipe_args, args) // recipe_args.block_size,
        "lr_scheduler_type": str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)),
        "warmup_steps": args.warmup_steps,
        "precision": "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32",
        "seed": args.seed,
    }
    if args.uses_adafisher:
        plugin = args.to_plugin()
        key["adafisher"] = {
            "ema": plugin.ema,
            "normalise": plugin.normalise,
            "update_every": plugin.resolved_update_every,
            "gamma": plugin.gamma,
            "damping": plugin.damping,
            "beta": plugin.beta,
        }
        if plugin.ema == "reference":  # the paper rule's normalisation removes any seed
            key["adafisher"]["factor_init"] = plugin.factor_init
    if muon:
        key["muon"] = muon_settings(recipe_args, args)
    if recipe_args.max_eval_tokens is not None:
        key["max_eval_tokens"] = recipe_args.max_eval_tokens
    return key


def muon_settings(recipe_args: TextRecipeArguments, args: TriAccelArguments) -> dict[str, Any]:
    """The Muon arm's settings: its learning rate, momentum and scaling, and the AdamW
    part's optimizer and learning rate."""
    return {
        "lr": resolve_learning_rate(args),
        "momentum": recipe_args.muon_momentum,
        "adjust_lr": recipe_args.muon_adjust_lr,
        "adamw": str(getattr(args.optim, "value", args.optim)),
        "adamw_lr": recipe_args.muon_adamw_lr,
    }


def muon_optimizer(
    recipe_args: TextRecipeArguments, args: TriAccelArguments, model: GPT2LMHeadModel
) -> tuple[type, dict[str, Any]]:
    """The Trainer's ``optimizer_cls_and_kwargs`` of the Muon arm: Muon on the hidden
    matrices at the run's learning rate, AdamW (fused when ``--optim`` says so) on the
    rest at ``--muon_adamw_lr``, with the run's AdamW betas and epsilon."""
    fused = str(getattr(args.optim, "value", args.optim)) == BASELINE_OPTIM
    return MuonWithAdamW, {
        "matrices": [p for _, p in hidden_matrices(model)],
        "lr": resolve_learning_rate(args),
        "adamw_lr": recipe_args.muon_adamw_lr,
        "momentum": recipe_args.muon_momentum,
        "adjust_lr": recipe_args.muon_adjust_lr,
        "betas": (args.adam_beta1, args.adam_beta2),
        "eps": args.adam_epsilon,
        "fused": fused or None,
    }


def recorded(runs_file: str | None, key: dict[str, Any]) -> bool:
    """Whether ``runs_file`` already holds a run of these settings."""
    if runs_file is None or not Path(runs_file).is_file():
        return False
    with open(runs_file) as f:
        return any(json.loads(line)["key"] == key for line in f if line.strip())


def record(runs_file: str, key: dict[str, Any], name: str | None, results: dict[str, Any]) -> None:
    """Appends one finished run to ``runs_file`` (one JSON line), with its ``--run_name``."""
    kept = (
        "eval_perplexity",
        "best_eval_perplexity",
        "test_perplexity",
        "train_runtime_s",
        "eval_runtime_s",
        "steady_step_time_ms",
        "tokens_per_second",
        "peak_memory_gb",
        "optimizer_steps",
        "tokens_trained",
        "device",
        "output_dir",
        "curve",
    )
    line = {"key": key, "name": name, **{k: results.get(k) for k in kept}}
    Path(runs_file).parent.mkdir(parents=True, exist_ok=True)
    with open(runs_file, "a") as f:
        f.write(json.dumps(line) + "\n")


def dataset_identity(recipe_args: TextRecipeArguments) -> dict[str, str | None]:
    """How the model card names the data (see ``recipe_results.identity``)."""
    source = recipe_args.dataset
    local = Path(source).expanduser()
    if local.is_dir():
        hub = recipe_args.hub_dataset_id
        own = local.resolve().name
        return {
            "dataset_id": hub,
            "dataset_type": hub or own,
            "dataset_name": "WikiText-2 (local copy)" if hub else own,
        }
    return {"dataset_id": source, "dataset_type": source, "dataset_name": "WikiText-2"}


@dataclass
class RunOutcome:
    """A finished run on the main process: its results and timed history."""

    results: dict[str, Any]
    history: list[dict[str, Any]]


def train_and_evaluate(
    recipe_args: TextRecipeArguments,
    args: TriAccelArguments,
    data: TextData,
    *,
    muon: bool = False,
    given: frozenset[str] = frozenset(),
    plan: str | None = None,
) -> RunOutcome | None:
    """Trains one model (``muon``: the Muon arm), evaluates it on the validation and test
    splits, and writes its model, tokenizer, ``history.json`` and efficiency report into
    ``args.output_dir``; ``given`` names the settings set on the command line and
    ``plan`` is the plan logged before training, for the results.

    Returns:
        The run's outcome on the main process, ``None`` on the others.
    """
    set_seed(args.seed)  # the same initial weights for a run and its baseline
    model = build_model(recipe_args, len(data.tokenizer), data.tokenizer.eos_token_id)
    per_step = tokens_per_step(recipe_args, args)
    limit = recipe_args.max_eval_tokens
    trainer = TriAccelTrainer(
        model=model,
        args=args,
        train_dataset=data.dataset("train"),
        eval_dataset=data.dataset("validation", limit),
        optimizer_cls_and_kwargs=muon_optimizer(recipe_args, args, model) if muon else None,
        # no processing_class: the Trainer would copy the tokenizer's padding token into
        # the model's config (see build_model); the tokenizer is saved beside the model
    )
    history, meter = PerplexityCurve(trainer, per_step), EnergyMeter()
    trainer.add_callback(history)
    trainer.add_callback(meter)
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    last = next((e for e in reversed(history.entries) if "eval_loss" in e), None)
    at_end = last is not None and last["step"] == trainer.state.global_step
    validation = last if at_end else trainer.evaluate()
    test = trainer.evaluate(data.dataset("test", limit), metric_key_prefix="test")
    run_energy = total_energy(trainer, meter)
    if not trainer.is_world_process_zero():
        return None
    out = Path(args.output_dir)
    trainer.save_model(str(out))
    data.tokenizer.save_pretrained(out)
    respect_umask(out)
    # the report as training ended: save_model's would also count the final evaluations
    report = {**history.report, "device": true_device(history.report["device"])}
    write_json(report, out / REPORT_NAME)
    write_json(history.entries, out / HISTORY_NAME)
    run_settings = settings(trainer, given)
    run_settings["learning_rate"] = trainer.triaccel_settings["learning_rate"]
    run_settings["max_grad_norm"] = args.max_grad_norm
    run_settings["augmentation"] = None
    run_settings["muon"] = None
    if muon:
        run_settings["optim"] = "muon"
        run_settings["muon"] = {
            **muon_settings(recipe_args, args),
            "matrices": [name for name, _ in hidden_matrices(model)],
            "variant": "torch.optim.Muon on the hidden weight matrices; AdamW on the "
            "embeddings, the output layer, norms and biases",
        }
    timing = timing_figures(
        report,
        history.entries,
        eval_runtime_s=history.eval_runtime_s,
        batch_size=run_settings["total_batch_size"],
    )
    points = curve(history.entries)
    steady = timing["steady_samples_per_second"]
    results = {
        "task": "text-generation",
        "recipe": RECIPE,
        "title": "WikiText-2",
        "model": "GPT-2-style causal language model",
        "architecture": {
            "n_layer": recipe_args.n_layer,
            "n_head": recipe_args.n_head,
            "n_embd": recipe_args.n_embd,
            "n_positions": recipe_args.block_size,
            "vocab_size": len(data.tokenizer),
            "dropout": recipe_args.dropout,
            "parameters": parameter_count(model),
            "max_vocab": recipe_args.max_vocab,
        },
        "dataset": recipe_args.dataset,
        "dataset_config": None
        if Path(recipe_args.dataset).is_dir()
        else recipe_args.dataset_config,
        **dataset_identity(recipe_args),
        "train_split": "train",
        "eval_split": "validation",
        "test_split": "test",
        "block_size": recipe_args.block_size,
        "train_tokens": data.tokens["train"],
        # the splits' tokens, or under --max_eval_tokens the tokens of the whole blocks read
        "eval_tokens": data.tokens["validation"]
        if limit is None
        else data.evaluated_tokens("validation", limit),
        "test_tokens": data.tokens["test"]
        if limit is None
        else data.evaluated_tokens("test", limit),
        "split_tokens": {"validation": data.tokens["validation"], "test": data.tokens["test"]},
        "quick": recipe_args.quick,
        "plan": plan,
        "tokens_per_step": per_step,
        "eval_every_tokens": args.eval_steps * per_step if args.eval_steps >= 1 else None,
        "tokens_trained": report["optimizer_steps"] * per_step,
        "eval_loss": validation.get("eval_loss"),
        "eval_perplexity": perplexity(validation.get("eval_loss")),
        "best_eval_perplexity": min((p["eval_perplexity"] for p in points), default=None),
        "test_loss": test.get("test_loss"),
        "test_perplexity": perplexity(test.get("test_loss")),
        "curve": points,
        "tokens_per_second": None if steady is None else round(steady * recipe_args.block_size),
        **run_figures(report, trainer, args, timing, run_energy, run_settings),
        **resumed_from(trainer, report),
        "definitions": TEXT_DEFINITIONS,
        "output_dir": str(out),
    }
    return RunOutcome(results, history.entries)


def compare(results: dict[str, Any], baseline: dict[str, Any]) -> dict[str, float | None]:
    """The run against its baseline: ratios (run / baseline) of the perplexities, the
    training time, steady throughput and peak memory, and the training time each took to
    reach the baseline's best validation perplexity.

    Example:
        >>> run = {"eval_perplexity": 90.0, "test_perplexity": 85.0, "train_runtime_s": 12.0,
        ...        "tokens_per_second": 1000, "peak_memory_gb": None,
        ...        "curve": [{"train_time_s": 4.0, "eval_perplexity": 95.0},
        ...                  {"train_time_s": 8.0, "eval_perplexity": 90.0}]}
        >>> base = {"eval_perplexity": 100.0, "test_perplexity": 100.0, "train_runtime_s": 10.0,
        ...         "tokens_per_second": 1250, "peak_memory_gb": 1.0, "best_eval_perplexity": 96.0,
        ...         "curve": [{"train_time_s": 5.0, "eval_perplexity": 96.0}]}
        >>> figures = compare(run, base)
        >>> figures["time_to_target_s"], figures["baseline_time_to_target_s"]
        (4.0, 5.0)
        >>> figures["time_to_target_ratio"], figures["throughput_ratio"]
        (0.8, 0.8)
    """

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    target = baseline.get("best_eval_perplexity")
    ours, theirs = time_to(results["curve"], target), time_to(baseline["curve"], target)
    return {
        "perplexity_ratio": ratio(results["eval_perplexity"], baseline["eval_perplexity"]),
        "test_perplexity_ratio": ratio(results["test_perplexity"], baseline["test_perplexity"]),
        "train_time_ratio": ratio(results["train_runtime_s"], baseline["train_runtime_s"]),
        "throughput_ratio": ratio(results["tokens_per_second"], baseline["tokens_per_second"]),
        "peak_memory_ratio": ratio(results["peak_memory_gb"], baseline["peak_memory_gb"]),
        "target_perplexity": target,
        "time_to_target_s": ours,
        "baseline_time_to_target_s": theirs,
        "time_to_target_ratio": ratio(ours, theirs),
    }


def baseline_summary(baseline: dict[str, Any]) -> dict[str, Any]:
    """What ``results.json`` and the card keep of the baseline run."""
    keys = (
        "eval_perplexity",
        "best_eval_perplexity",
        "test_perplexity",
        "train_runtime_s",
        "steady_step_time_ms",
        "tokens_per_second",
        "peak_memory_gb",
        "device",
    )
    return {
        "optim": baseline["settings"]["optim"],
        **{k: baseline.get(k) for k in keys},
        "settings": baseline["settings"],
        "source": baseline["output_dir"],
        "same_run": True,
    }


def baseline_arguments(args: TriAccelArguments, recipe_args: TextRecipeArguments):
    """The baseline run's arguments: the run's, with fused AdamW and its own learning rate
    and weight decay, written to ``output_dir/baseline``."""
    return dataclasses.replace(
        args,
        optim=BASELINE_OPTIM,
        learning_rate=recipe_args.baseline_learning_rate,
        weight_decay=recipe_args.baseline_weight_decay,
        output_dir=os.path.join(args.output_dir, BASELINE_DIR),
        resume_from_checkpoint=None,
    )


def run_one(
    recipe_args: TextRecipeArguments,
    args: TriAccelArguments,
    data: TextData,
    *,
    muon: bool = False,
    given: frozenset[str] = frozenset(),
    plan: str | None = None,
) -> RunOutcome | None:
    """Trains one run (see :func:`train_and_evaluate`) unless ``--runs_file`` already has
    it; records it there after."""
    key = run_key(recipe_args, args, muon)
    if recorded(recipe_args.runs_file, key):
        logger.info("%s: already in %s, skipped", key["optim"], recipe_args.runs_file)
        return None
    outcome = train_and_evaluate(recipe_args, args, data, muon=muon, given=given, plan=plan)
    if outcome is not None:
        outcome.results["co2"] = emissions(outcome.results, recipe_args)
        if recipe_args.runs_file is not None:
            record(recipe_args.runs_file, key, args.run_name, outcome.results)
    return outcome


def command_line(argv: list[str], prog: str | None) -> str:
    """The command as it was typed: the launcher (``accelerate launch`` sets
    ``ACCELERATE_MIXED_PRECISION`` for the processes it starts) and the script."""
    launcher = ["accelerate", "launch"] if "ACCELERATE_MIXED_PRECISION" in os.environ else []
    return shlex.join([*(launcher or ["python"]), prog or SCRIPT, *argv])


def run_recipe(argv: list[str], prog: str | None = None) -> dict[str, Any] | None:
    """Runs the recipe: the baseline first when asked, then the run, its results, plots
    and model card, then the Hub upload when asked.

    Returns:
        The run's results (as in ``results.json``) on the main process; ``None`` on the
        others, for a ``--dry_run`` and for a run already in ``--runs_file``.

    Raises:
        SystemExit: bad flags (status 2, the reason in one line).
        UsageError: data the recipe cannot train on, before any training.
        PushToHubError: ``--push_to_hub`` failed; every output is already written.
    """
    recipe_args, args = parse_args(argv, prog)
    given = given_flags(argv)
    push = args.push_to_hub
    # the Trainer would create the Hub repository when it starts: the push happens here
    # instead, once every output is written
    args = schedule(recipe_args, dataclasses.replace(args, push_to_hub=False), given)
    data = TextData.load(
        recipe_args.dataset,
        recipe_args.dataset_config,
        recipe_args.block_size,
        recipe_args.max_vocab,
    )
    plan = announce_plan(recipe_args, args, data)
    if recipe_args.dry_run:
        print(f"vocabulary {len(data.tokenizer)}; tokens {data.tokens}; {plan}")
        return None

    baseline = None
    if recipe_args.baseline:
        baseline_args = baseline_arguments(args, recipe_args)
        outcome = run_one(recipe_args, baseline_args, data, given=given, plan=plan)
        if outcome is not None:
            write_json(outcome.results, Path(baseline_args.output_dir) / RESULTS_NAME)
            baseline = outcome
        # free the baseline's model and optimizer before the run measures its own peak
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    run = run_one(recipe_args, args, data, muon=recipe_args.muon, given=given, plan=plan)
    if run is None:
        return None
    results = run.results
    results["command"] = command_line(argv, prog)
    results["baseline"] = results["comparison"] = None
    curves = {results["settings"]["optim"]: run.history}
    if baseline is not None:
        results["baseline"] = baseline_summary(baseline.results)
        results["comparison"] = compare(results, baseline.results)
        curves[f"{results['baseline']['optim']} (baseline)"] = baseline.history
    results["plots"] = plot_run(args.output_dir, curves) if recipe_args.plot else {}
    outcome = (
        f"validation perplexity {results['eval_perplexity']:.2f}, "
        f"test {results['test_perplexity']:.2f}"
    )
    if baseline is not None:  # on the console too, before any upload
        print(comparison_table(results), flush=True)
    publish(results, args, push, outcome)
    return results


def announce_plan(recipe_args: TextRecipeArguments, args: TriAccelArguments, data: TextData) -> str:
    """Says, before training, what the command will train and, on a CPU, about how long
    it takes (:func:`~wikitext2_plan.probe_seconds` on the model); logged on the main
    process, and returned."""
    model = build_model(recipe_args, len(data.tokenizer), data.tokenizer.eos_token_id)
    per_step = tokens_per_step(recipe_args, args)
    blocks = data.block_count("validation", recipe_args.max_eval_tokens)
    timing = None
    if args.device.type == "cpu":
        step_s, block_s = probe_seconds(
            model, recipe_args.block_size, args.per_device_train_batch_size
        )
        timing = (step_s * args.gradient_accumulation_steps, block_s, blocks)
    message = plan_message(
        steps=args.max_steps,
        tokens_per_step=per_step,
        train_tokens=data.tokens["train"],
        eval_tokens=blocks * recipe_args.block_size,
        eval_steps=args.eval_steps,
        parameters=parameter_count(model),
        shape=f"{recipe_args.n_layer} layers x {recipe_args.n_embd}, {recipe_args.n_head} heads",
        device=args.device.type,
        runs=2 if recipe_args.baseline else 1,
        quick=recipe_args.quick,
        timing=timing,
    )
    if args.process_index == 0:
        logger.info("%s", message)
    return message


def comparison_table(results: dict[str, Any]) -> str:
    """The run and its baseline side by side, as the console shows them.

    Example:
        >>> print(comparison_table({
        ...     "settings": {"optim": "adafisherw"}, "eval_perplexity": 410.2,
        ...     "test_perplexity": 400.0, "train_runtime_s": 30.0, "tokens_per_second": 2000,
        ...     "baseline": {"optim": "adamw_torch_fused", "eval_perplexity": 450.0,
        ...                  "test_perplexity": 440.1, "train_runtime_s": 25.0,
        ...                  "tokens_per_second": 2400},
        ...     "comparison": {"target_perplexity": 450.0, "time_to_target_ratio": 0.5}}))
        optimizer          validation ppl   test ppl  training time  tokens/s
        adafisherw                 410.20     400.00         30.0 s      2000
        adamw_torch_fused          450.00     440.10         25.0 s      2400
        time to the baseline's best validation perplexity (450.00): 0.500x the baseline's
    """

    def row(name: str, r: dict[str, Any]) -> str:
        speed = r.get("tokens_per_second")
        return (
            f"{name:<18} {r['eval_perplexity']:>14.2f} {r['test_perplexity']:>10.2f} "
            f"{r['train_runtime_s']:>12.1f} s {'n/a' if speed is None else speed:>9}"
        )

    comparison = results["comparison"]
    ratio = comparison.get("time_to_target_ratio")
    reached = "not reached" if ratio is None else f"{ratio:.3f}x the baseline's"
    return "\n".join(
        [
            f"{'optimizer':<18} {'validation ppl':>14} {'test ppl':>10} {'training time':>14} "
            f"{'tokens/s':>9}",
            row(results["settings"]["optim"], results),
            row(results["baseline"]["optim"], results["baseline"]),
            f"time to the baseline's best validation perplexity "
            f"({comparison['target_perplexity']:.2f}): {reached}",
        ]
    )


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """The entry point: runs the recipe; returns the exit status, 2 for bad data and 1 for
    a failed ``--push_to_hub``, with the reason in one line (bad flags exit with 2 while
    they are parsed)."""
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s", level=logging.INFO)
    try:
        run_recipe(list(sys.argv[1:] if argv is None else argv), prog)
    except UsageError as exc:
        print(f"{Path(prog or SCRIPT).name}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except PushToHubError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(prog=sys.argv[0]))
