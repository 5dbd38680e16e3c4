"""Checks that the README's CPU install keeps the CPU build of torch.

In a fresh virtual environment it runs the README's CPU install command (torch and
torchvision together, from PyTorch's CPU index), then the package's own install
(``pip install -e ".[hf]"``), then asks that environment's Python whether torch was built
with CUDA and which ``nvidia-*`` distributions are installed. It prints one dated line
with the findings and exits 0 when torch has no CUDA, no ``nvidia-*`` distribution came
and torchvision's compiled operators load (a torchvision built for another torch does not
load them), else 1. Both installs need the network.

Usage::

    python3 tools/check_cpu_install.py                      # a fresh venv in a temporary folder
    python3 tools/check_cpu_install.py --venv /tmp/venvcpu  # a fresh venv there
    python3 tools/check_cpu_install.py --python PYTHON      # only the check, on that Python

Example:
    >>> cpu_install_command()[-2:]
    ['--index-url', 'https://download.pytorch.org/whl/cpu']
    >>> found = {"torch": "2.9.0+cpu", "cuda": None, "nvidia": [],
    ...          "torchvision": "0.24.0+cpu", "torchvision_ops": True}
    >>> verdict(found).endswith(": OK")
    True
    >>> "Fix: python3 -m pip install" in verdict({**found, "torchvision_ops": False})
    True
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# run by the checked environment's Python: what it installed, as JSON
PROBE = """
import importlib.metadata, json, torch
names = {d.metadata["Name"] for d in importlib.metadata.distributions()}
nvidia = sorted(n for n in names if n.lower().startswith("nvidia"))
try:  # a torchvision built for another torch fails on import, registering its operators
    import torchvision
    torchvision.ops.nms(torch.zeros(1, 4), torch.zeros(1), 0.5)
    ops = True
except RuntimeError:
    ops = False
found = {"torch": torch.__version__, "cuda": torch.version.cuda, "nvidia": nvidia}
vision = importlib.metadata.version("torchvision")
print(json.dumps({**found, "torchvision": vision, "torchvision_ops": ops}))
"""


def cpu_install_command() -> list[str]:
    """The README's CPU install command, as its words (``python3 -m pip install ...``).

    Raises:
        LookupError: the README has no command that installs from the CPU index.
    """
    for line in (ROOT / "README.md").read_text().splitlines():
        words = shlex.split(line.strip()) if "pip install" in line else []
        if words[-2:] == ["--index-url", CPU_INDEX]:
            return words
    raise LookupError(f"README.md has no `pip install ... --index-url {CPU_INDEX}` line")


def probe(python: str) -> dict[str, Any]:
    """What ``python``'s environment holds: torch's version, its CUDA version, the
    ``nvidia-*`` distributions, torchvision's version and whether its operators load."""
    done = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def verdict(found: dict[str, Any]) -> str:
    """One dated line: the findings, then ``OK`` or what is wrong."""
    problems = []
    if found["cuda"] is not None:
        problems.append(f"torch.version.cuda is {found['cuda']}")
    if found["nvidia"]:
        problems.append(f"nvidia distributions installed: {', '.join(found['nvidia'])}")
    if not found["torchvision_ops"]:
        problems.append(
            "torchvision's operators do not load: it was built for another torch. "
            + matching_pair_advice(found["torch"])
        )
    return (
        f"{datetime.date.today().isoformat()} CPU install check: torch {found['torch']}, "
        f"torch.version.cuda {found['cuda']}, {len(found['nvidia'])} nvidia-* distributions, "
        f"torchvision {found['torchvision']}: " + ("; ".join(problems) if problems else "OK")
    )


def matching_pair_advice(torch_version: str) -> str:
    """How to get a torchvision built for the installed torch: both from one index in one
    command (pip then picks the torchvision release made for that torch).

    Example:
        >>> matching_pair_advice("2.9.0+cpu")  # doctest: +ELLIPSIS
        'Fix: python3 -m pip install --force-reinstall torch==2.9.0 torchvision --index-url ...'
    """
    release = torch_version.split("+")[0]
    return (
        f"Fix: python3 -m pip install --force-reinstall torch=={release} torchvision "
        f"--index-url {CPU_INDEX} (both from one index; where that index cannot be reached, "
        "`python3 -m pip install --force-reinstall torch torchvision` from PyPI gives a "
        "matching pair, with CUDA libraries on Linux)"
    )


def install(venv: Path) -> str:
    """Creates the virtual environment, runs the README's CPU install then the package's,
    and returns the environment's Python."""
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    cpu = cpu_install_command()
    # the README's `python3 -m pip install ...`, run by the new environment's Python
    subprocess.run([python, *cpu[1:]], check=True)
    subprocess.run([python, "-m", "pip", "install", "-e", ".[hf]"], cwd=ROOT, check=True)
    return python


def main(argv: list[str] | None = None) -> int:
    """Runs the check; returns 0 when the CPU build was kept, else 1."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--venv", type=Path, help="where to create the fresh environment")
    where.add_argument("--python", help="check this Python's environment; install nothing")
    args = parser.parse_args(argv)
    if args.python:
        python = args.python
    else:
        venv = args.venv or Path(tempfile.mkdtemp(prefix="cpu-install-")) / "venv"
        python = install(venv)
    line = verdict(probe(python))
    print(line)
    return 0 if line.endswith(": OK") else 1


if __name__ == "__main__":
    sys.exit(main())
