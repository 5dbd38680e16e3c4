"""``python -m benchmarks <what> [options]``: every measurement of the project, one command.

``python -m benchmarks --help`` lists them; ``python -m benchmarks <what> --help`` gives
one's options. Run from the repository root.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from benchmarks import (
    accuracy,
    chaos,
    cifar,
    commits,
    elastic,
    language_model,
    low_memory_accuracy,
    low_memory_ledger,
    optimizer,
    refresh,
    report,
    step,
    suite,
    time_to_accuracy,
    trainer,
)

# the subcommands, in the order --help lists them; each a module with NAME, HELP,
# add_arguments(parser) and run(args) -> exit status
SUBCOMMANDS = (
    step,
    optimizer,
    refresh,
    trainer,
    cifar,
    accuracy,
    time_to_accuracy,
    language_model,
    elastic,
    chaos,
    low_memory_ledger,
    low_memory_accuracy,
    commits,
    suite,
    report,
)


def parser() -> argparse.ArgumentParser:
    """The command line: one subparser per module of :data:`SUBCOMMANDS`."""
    main = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n")[0])
    commands = main.add_subparsers(dest="command", required=True, metavar="MEASUREMENT")
    for module in SUBCOMMANDS:
        doc = (module.__doc__ or module.HELP).split("\n\n")[0]
        sub = commands.add_parser(module.NAME, help=module.HELP, description=doc)
        module.add_arguments(sub)
        sub.set_defaults(run=module.run)
    return main


def main(argv: Sequence[str] | None = None) -> int:
    """Parses ``argv`` and runs the subcommand it names; returns its exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    args.argv = argv  # the command line as given, for the records
    return int(args.run(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
