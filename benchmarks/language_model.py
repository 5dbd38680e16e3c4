"""The language model: GPT-2 on WikiText-2 through the recipe, a learning-rate and seed
grid per optimizer that survives interruptions, and its summary (perplexity against
training time).

The recipe's grid (``recipes/wikitext2_grid.py``), run from here so that every
measurement has one command; its arguments pass through unchanged. The grid's runs file
(``benchmarks/results/wikitext2_runs.jsonl``) is its record: each line a run with its
settings, perplexities, times and versions.

Usage:
    python -m benchmarks language-model summary benchmarks/results/wikitext2_runs.jsonl \\
        --target adamw --timing benchmarks/results/wikitext2_step_cost.jsonl
    python -m benchmarks language-model run --runs_file RUNS.jsonl \\
        --arm "adamw=--optim adamw_torch_fused" --lrs adamw=1e-4,3e-4,1e-3 -- --dataset DIR
"""

from __future__ import annotations

import argparse
import importlib
import sys

from benchmarks import harness

NAME = "language-model"
HELP = "GPT-2 on WikiText-2 through the recipe: the grid per optimizer and its summary"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Everything after the subcommand goes to the recipe's grid."""
    parser.add_argument("grid", nargs=argparse.REMAINDER, help="run ... | summary RUNS ...")


def run(args: argparse.Namespace) -> int:
    """Runs the recipe's grid command; returns its exit status."""
    recipes = str(harness.REPO_ROOT / "recipes")
    if recipes not in sys.path:  # the recipes import each other as top-level modules
        sys.path.insert(0, recipes)
    return importlib.import_module("wikitext2_grid").main(args.grid)
