"""The one record format of every measurement: JSON lines, one run a line.

A record holds ``kind`` (the subcommand, or the script of a record converted from an
earlier result file), ``name`` (the measurement's variant: the model, the mode), ``date``
(UTC, ISO 8601), ``commit``, ``machine`` (the device), ``versions`` (the libraries'),
``command``, ``config`` (every setting) and ``metrics`` (everything measured); a converted
record adds ``source``, the file it came from. Records are appended to
``benchmarks/results/records.jsonl`` (smoke runs: next to their output), never rewritten;
``python -m benchmarks report`` renders BENCHMARKS.md's tables from them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
RECORDS = RESULTS / "records.jsonl"
RECORDS_HELP = "JSON-lines file the run's record is appended to (default: " + (
    "benchmarks/results/records.jsonl; --smoke: records.jsonl in --out)"
)
FIELDS = ("kind", "name", "date", "commit", "machine", "versions", "command", "config")


def from_payload(name: str, payload: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """The record of a measurement's payload (its ``env`` and ``config`` and what it
    measured); ``extra`` overrides fields (``kind``, ``source``).

    Example:
        >>> env = {"date_utc": "2026-12-01T00:00:00+00:00", "git_commit": "abc",
        ...        "device": "H200", "versions": {"torch": "2.11"}, "command": "python x"}
        >>> record = from_payload("step", {"env": env, "config": {"steps": 3}, "rows": [1]})
        >>> record["kind"], record["machine"], record["config"], record["metrics"]
        ('step', 'H200', {'steps': 3}, {'rows': [1]})
    """
    env = payload.get("env", {})
    metrics = {k: v for k, v in payload.items() if k not in ("env", "config")}
    record = {
        "kind": extra.pop("kind", name),
        "name": name,
        "date": env.get("date_utc"),
        "commit": env.get("git_commit"),
        "machine": env.get("device"),
        "versions": env.get("versions", {}),
        "command": env.get("command"),
        "config": payload.get("config", {}),
        "metrics": metrics,
    }
    return {**record, **extra}


def destination(args: Any, out: Path) -> Path:
    """Where a run appends its record: ``--records``, else ``records.jsonl`` in ``out``
    for a smoke run, else :data:`RECORDS`."""
    if getattr(args, "records", None):
        return Path(args.records)
    return out / "records.jsonl" if args.smoke else RECORDS


def append(path: Path, record: dict[str, Any]) -> None:
    """Appends one record as a JSON line (the file and its folder created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")


def read(path: Path = RECORDS) -> list[dict[str, Any]]:
    """The records of a JSON-lines file, in the order they were appended."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def find(records: Iterable[dict[str, Any]], **where: Any) -> dict[str, Any]:
    """The last record whose fields equal ``where`` (a clear error when there is none).

    Example:
        >>> find([{"kind": "a", "n": 1}, {"kind": "a", "n": 2}], kind="a")["n"]
        2
    """
    found = [r for r in records if all(r.get(k) == v for k, v in where.items())]
    if not found:
        raise LookupError(f"no record with {where}")
    return found[-1]
