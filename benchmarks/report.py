"""BENCHMARKS.md's tables rendered from the committed records.

A rendered table stands in BENCHMARKS.md between ``<!-- table: ID -->`` and ``<!-- end
table -->``; :data:`TABLES` maps each ID to the function that renders it from the
records. ``--check`` exits 1 when a table differs from its records (a test runs it);
``--write`` puts the rendered tables in place.

Usage:
    python -m benchmarks report            # print every table
    python -m benchmarks report --check    # BENCHMARKS.md against the records
    python -m benchmarks report --write    # after new records
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import re
import sys
from collections.abc import Callable
from pathlib import Path

from benchmarks import accuracy, harness, records, time_to_accuracy

NAME = "report"
HELP = "BENCHMARKS.md's current tables from the records: print, --check or --write"

BENCHMARKS = harness.REPO_ROOT / "BENCHMARKS.md"
BLOCK = re.compile(r"(<!-- table: (?P<id>[\w-]+) -->\n)(?P<body>.*?)(<!-- end table -->)", re.S)


def time_to_accuracy_table(dataset: str, batch: int) -> str:
    """Accuracy per epoch budget and time to AdamW's best of the ResNet-18 on ``dataset``
    at ``batch``, from the accuracy grid's records and the solo epoch times."""
    runs = accuracy.read_records([accuracy.RESULTS])
    summary = time_to_accuracy.summarise(runs, accuracy.read_records([time_to_accuracy.TIMES]))
    key = (dataset, accuracy.MODEL, batch)
    if key not in summary:
        raise LookupError(f"no accuracy records of {key}")
    text = time_to_accuracy.report({key: summary[key]})
    return text.split("\n", 2)[2].strip()  # without its heading: BENCHMARKS.md names it


def language_model_table() -> str:
    """The WikiText-2 grid's summary: perplexities, tokens and time to AdamW's best."""
    recipes = str(harness.REPO_ROOT / "recipes")
    if recipes not in sys.path:  # the recipes import each other as top-level modules
        sys.path.insert(0, recipes)
    grid = importlib.import_module("wikitext2_grid")
    runs = grid.records(records.RESULTS / "wikitext2_runs.jsonl")
    timing = grid.records(records.RESULTS / "wikitext2_step_cost.jsonl")
    return grid.summary(runs, "adamw", 42, timing).strip().replace("\n", "\n\n", 1)


TABLES: dict[str, Callable[[], str]] = {
    "accuracy-cifar10": lambda: time_to_accuracy_table("cifar10", 512),
    "accuracy-cifar100": lambda: time_to_accuracy_table("cifar100", 512),
    "accuracy-cifar100-batch2048": lambda: time_to_accuracy_table("cifar100", 2048),
    "language-model": language_model_table,
}


def render(markdown: str) -> str:
    """``markdown`` with every table block replaced by its rendering (an unknown ID is an
    error naming it).

    Example:
        >>> TABLES["demo"] = lambda: "| a |\\n|---|\\n| 1 |"
        >>> render("x\\n<!-- table: demo -->\\nold\\n<!-- end table -->\\ny")
        'x\\n<!-- table: demo -->\\n| a |\\n|---|\\n| 1 |\\n<!-- end table -->\\ny'
        >>> del TABLES["demo"]
    """

    def table(match: re.Match) -> str:
        if match["id"] not in TABLES:
            raise KeyError(f"table {match['id']!r}: none of {sorted(TABLES)}")
        return f"{match.group(1)}{TABLES[match['id']]()}\n{match.group(4)}"

    return BLOCK.sub(table, markdown)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--check`` or ``--write``, and the file."""
    parser.add_argument("--check", action="store_true", help="exit 1 when a table differs")
    parser.add_argument("--write", action="store_true", help="write the tables in place")
    parser.add_argument("--file", type=Path, default=BENCHMARKS, help="default: BENCHMARKS.md")


def run(args: argparse.Namespace) -> int:
    """Prints the tables, or checks or writes them; returns 1 when ``--check`` differs."""
    current = args.file.read_text()
    rendered = render(current)
    if args.write:
        args.file.write_text(rendered)
    elif args.check:
        diff = difflib.unified_diff(
            current.splitlines(), rendered.splitlines(), "BENCHMARKS.md", "records", lineterm=""
        )
        text = "\n".join(diff)
        print(text or "BENCHMARKS.md's tables match the records")
        return 1 if text else 0
    else:
        for match in BLOCK.finditer(rendered):
            print(f"<!-- {match['id']} -->\n{match['body']}")
    return 0
