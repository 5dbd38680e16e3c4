"""The project's measurements, one command: ``python -m benchmarks <what>`` (README.md).

Every measurement is a subcommand module with ``NAME``, ``HELP``, ``add_arguments(parser)``
and ``run(args)``, listed in ``benchmarks.__main__.SUBCOMMANDS``; each appends its records
in the one format of :mod:`benchmarks.records`.
"""
