"""The house rules that the code's shape must keep, checked on the installed package.

- The import-linter contracts of ``.importlinter`` (dependencies run one way, kernels are
  leaves, the library never imports recipes/ or benchmarks/), run with ``lint-imports``.
- The same rule for kernels, checked again without import-linter: a kernel module imports
  torch, triton, the standard library and ``hf_triaccel._types``, nothing else.
- No private name (leading underscore) is imported from another module.
- No module of the library is over :data:`MAX_LINES` lines without saying why at its top
  ("Over N lines: ..." within its first :data:`REASON_WITHIN` lines): files are cut by
  feature, and one that stays longer says what holds it together.
- Nothing at the top of the checkout hides an installed distribution when Python runs from
  the repository root (a ``kernels/`` folder there once hid Hugging Face's ``kernels``).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "hf_triaccel"
LEAF = "hf_triaccel._types"
# the only outside packages a kernel may import (besides the standard library)
KERNEL_IMPORTS = {"torch", "triton"}
MAX_LINES = 600
# where a longer module says why: this many lines from its top
REASON_WITHIN = 30
# how it says why: "Over 600 lines: ..." (any count it stayed over when it was written)
REASON = re.compile(r"\bover \d+ lines:", re.IGNORECASE)


def listed_packages() -> list[str]:
    """The packages pyproject.toml installs."""
    tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]["packages"]


def package_dirs() -> dict[str, Path]:
    """Each package of the distribution (as pyproject.toml lists them) -> the folder Python
    imports it from."""
    dirs = {}
    for name in listed_packages():
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.submodule_search_locations, f"{name} is not installed"
        dirs[name] = Path(next(iter(spec.submodule_search_locations)))
    return dirs


def modules() -> dict[str, Path]:
    """Every Python module of the installed package: dotted name -> file."""
    found = {}
    for package, folder in package_dirs().items():
        for path in sorted(folder.glob("*.py")):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            found[name] = path
    return found


def imported_modules(path: Path, module: str) -> list[tuple[str, list[str], int]]:
    """(module imported, names taken from it, line) for every import statement of ``path``,
    at any depth (imports inside functions count), relative imports made absolute."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.stem == "__init__" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            found.append((base, [alias.name for alias in node.names], node.lineno))
    return found


def test_every_package_is_installed():
    """Every folder with an ``__init__.py`` below an installed package is listed in
    pyproject.toml's packages: one that is not works in an editable install and is
    missing from a wheel."""
    listed = set(listed_packages())
    missing = []
    for package, folder in package_dirs().items():
        for init in folder.glob("*/__init__.py"):
            name = f"{package}.{init.parent.name}"
            if name not in listed:
                missing.append(name)
    assert missing == []


def test_import_contracts():
    config = ROOT / ".importlinter"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            "from importlinter.cli import lint_imports_command; lint_imports_command()",
            str(config),
            "--no-cache",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert "0 broken" in run.stdout


def kernel_violations(files: dict[str, Path]) -> list[str]:
    """What the kernel modules among ``files`` import besides torch, triton, the standard
    library, other kernel modules and the leaf."""
    kernels = f"{PACKAGE}.kernels"
    bad = []
    for name, path in files.items():
        if name != kernels and not name.startswith(kernels + "."):
            continue
        for target, names, line in imported_modules(path, name):
            top = target.split(".")[0]
            if top == PACKAGE:
                # `from hf_triaccel import _types` names the leaf as an imported name
                targets = [f"{target}.{n}" for n in names] if target == PACKAGE else [target]
                ok = all(
                    t == LEAF or t.startswith(LEAF + ".") or t.startswith(kernels) for t in targets
                )
            else:
                ok = top in KERNEL_IMPORTS or top in sys.stdlib_module_names
            if not ok:
                bad.append(f"{path.name}:{line} imports {target} {names or ''}".rstrip())
    return bad


def test_kernels_import_only_torch_triton_and_the_leaf():
    files = modules()
    assert any(name.startswith(f"{PACKAGE}.kernels.") for name in files), "no kernel found"
    assert kernel_violations(files) == []


def test_the_kernel_check_catches_an_import_from_the_package(tmp_path):
    """The check above, shown to fail: a kernel importing a layer above it."""
    leaf = tmp_path / "fine.py"
    leaf.write_text("import torch\nimport triton.language\nfrom hf_triaccel._types import X\n")
    upward = tmp_path / "upward.py"
    upward.write_text("def f():\n    from hf_triaccel.optim.functional import adafisher\n")
    package = tmp_path / "package.py"
    package.write_text("from hf_triaccel import dispatch\n")
    other = tmp_path / "other.py"
    other.write_text("import numpy\n")
    files = {f"{PACKAGE}.kernels.{p.stem}": p for p in (leaf, upward, package, other)}
    assert kernel_violations(files) == [
        "upward.py:2 imports hf_triaccel.optim.functional ['adafisher']",
        "package.py:1 imports hf_triaccel ['dispatch']",
        "other.py:1 imports numpy",
    ]


def is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # the parent is a module, not a package
        return False


def test_no_private_name_is_imported_from_another_module():
    bad = []
    for name, path in modules().items():
        for target, names, line in imported_modules(path, name):
            if target.split(".")[0] != PACKAGE or target == name:
                continue
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            # a private module is not a private name: `from hf_triaccel import _types`
            private = [n for n in private if not is_module(f"{target}.{n}")]
            if private:
                bad.append(f"{name} (line {line}) imports {private} from {target}")
    assert bad == []


def unexplained_long_modules(files: dict[str, Path]) -> list[str]:
    """The modules among ``files`` over :data:`MAX_LINES` lines that do not say why in
    their first :data:`REASON_WITHIN` lines."""
    long = []
    for name, path in files.items():
        lines = path.read_text().splitlines()
        top = "\n".join(lines[:REASON_WITHIN])
        if len(lines) > MAX_LINES and not REASON.search(top):
            long.append(f"{name}: {len(lines)} lines")
    return long


def test_long_modules_say_why_at_their_top():
    """A module over MAX_LINES lines says why in its first lines (e.g. "Over 600 lines:
    the kernel and the tables it reads are one unit")."""
    assert unexplained_long_modules(modules()) == []


def test_the_length_check_catches_a_long_module_that_says_nothing(tmp_path):
    """The check above, shown to fail: a long module without its reason is named; one
    with it, or a short one, is not."""
    body = "x = 1\n" * MAX_LINES
    silent = tmp_path / "silent.py"
    silent.write_text('"""A module."""\n' + body)
    said = tmp_path / "said.py"
    said.write_text('"""A module.\n\nOver 600 lines: one unit."""\n' + body)
    short = tmp_path / "short.py"
    short.write_text('"""A module."""\n' + "x = 1\n" * (MAX_LINES - 1))
    files = {p.stem: p for p in (silent, said, short)}
    assert unexplained_long_modules(files) == [f"silent: {MAX_LINES + 1} lines"]


def origins(names: list[str], cwd: Path) -> dict[str, str | None]:
    """Where ``python`` started in ``cwd`` finds each top-level name: the file or folder of
    its spec, or None when nothing by that name is importable."""
    probe = (
        "import importlib.util, json, sys\n"
        "def origin(name):\n"
        "    try:\n"
        "        spec = importlib.util.find_spec(name)\n"
        "    except (ImportError, ValueError):\n"
        "        return None\n"
        "    if spec is None:\n"
        "        return None\n"
        "    return spec.origin or ','.join(spec.submodule_search_locations or [])\n"
        "print(json.dumps({n: origin(n) for n in sys.argv[1:]}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    env.update(EXTRA_PATH_ENV)
    run = subprocess.run(
        [sys.executable, "-c", probe, *names],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(run.stdout)


# set by the self-test below to stand for an installed distribution
EXTRA_PATH_ENV: dict[str, str] = {}


def top_level_names(root: Path) -> list[str]:
    """The names Python could import from the top of ``root``: its modules and folders."""
    names = {p.stem for p in root.glob("*.py")}
    names |= {p.name for p in root.iterdir() if p.is_dir() and p.name.isidentifier()}
    return sorted(names)


def hidden_by_checkout(root: Path, empty: Path, own: tuple[str, ...] = (PACKAGE,)) -> list[str]:
    """The names that resolve elsewhere from an empty folder (an installed distribution)
    and to something else from ``root``: the checkout hides that distribution. ``own`` is
    this project's package, which from the checkout is the checkout's copy by design."""
    names = [n for n in top_level_names(root) if n not in own]
    inside, outside = origins(names, root), origins(names, empty)
    return [
        f"{name}: {inside[name]} hides {outside[name]}"
        for name in names
        if outside[name] is not None and inside[name] != outside[name]
    ]


def test_nothing_in_the_checkout_hides_an_installed_package(tmp_path):
    """Run from the repository root, every top-level name of the checkout resolves where it
    resolves from an empty folder: a checkout folder named like an installed distribution
    (``kernels``, which transformers requires since 5.25) would shadow it."""
    assert hidden_by_checkout(ROOT, tmp_path) == []


def test_the_shadowing_check_catches_a_hiding_folder(tmp_path, monkeypatch):
    """The check above, shown to fail: a checkout folder that is a regular package named
    like an installed one hides it; a folder without ``__init__.py`` does not."""
    site = tmp_path / "site"
    for name in ("installed_pkg", "namespace_pkg"):
        (site / name).mkdir(parents=True)
        (site / name / "__init__.py").write_text("")
    checkout = tmp_path / "checkout"
    (checkout / "installed_pkg").mkdir(parents=True)
    (checkout / "installed_pkg" / "__init__.py").write_text("")
    (checkout / "namespace_pkg").mkdir()
    (checkout / "only_here.py").write_text("")
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setitem(EXTRA_PATH_ENV, "PYTHONPATH", str(site))
    assert hidden_by_checkout(checkout, empty) == [
        f"installed_pkg: {checkout / 'installed_pkg' / '__init__.py'} hides "
        f"{site / 'installed_pkg' / '__init__.py'}"
    ]
