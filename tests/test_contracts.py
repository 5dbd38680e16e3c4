"""The house rules that the code's shape must keep, checked on the installed package.

- The import-linter contracts of ``.importlinter`` (dependencies run one way, kernels are
  leaves, the library never imports recipes/ or benchmarks/), run with ``lint-imports``.
- The same rule for kernels, checked again without import-linter: a kernel module imports
  torch, triton, the standard library and ``hf_triaccel._types``, nothing else.
- No private name (leading underscore) is imported from another module.
- No module of the library is over :data:`MAX_LINES` lines without saying why at its top.
- The tests run against the installed package, not the checkout's ``hf_triaccel/`` folder.

Each check reads the package where Python imports it from. An editable install maps
``hf_triaccel.kernels`` onto the checkout's ``kernels/`` folder, which import-linter cannot
follow (it walks the folder of the top-level package), so the contracts are checked on a
copy of the package laid out as pyproject.toml installs it.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "hf_triaccel"
LEAF = "hf_triaccel._types"
# the only outside packages a kernel may import (besides the standard library)
KERNEL_IMPORTS = {"torch", "triton"}
MAX_LINES = 400
# where a longer module says why: this many lines from its top
REASON_WITHIN = 30


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


@pytest.fixture(scope="module")
def installed_copy(tmp_path_factory) -> Path:
    """A folder holding the package laid out as it installs (sources only)."""
    root = tmp_path_factory.mktemp("installed")
    for package, folder in package_dirs().items():
        sources = list(folder.glob("*.py"))
        if not sources:  # a data-only package (templates): nothing to import
            continue
        target = root.joinpath(*package.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for path in sources:
            shutil.copy2(path, target / path.name)
    return root


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


def test_import_contracts(installed_copy):
    config = ROOT / ".importlinter"
    env = {**os.environ, "PYTHONPATH": str(installed_copy)}
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            "from importlinter.cli import lint_imports_command; lint_imports_command()",
            str(config),
            "--no-cache",
        ],
        cwd=installed_copy,
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


def test_long_modules_say_why_at_their_top():
    """A module over MAX_LINES lines names the limit and its reason in its first lines
    (e.g. "Over 400 lines: ...")."""
    long = []
    for name, path in modules().items():
        lines = path.read_text().splitlines()
        top = "\n".join(lines[:REASON_WITHIN])
        if len(lines) > MAX_LINES and f"{MAX_LINES} lines" not in top:
            long.append(f"{name}: {len(lines)} lines")
    assert long == []


def test_the_tests_import_the_installed_package():
    """The root conftest.py imports the installed package before the checkout's folder can
    shadow it: with a regular install, nothing comes from the checkout; with an editable
    one, the kernels come from kernels/ as mapped."""
    import hf_triaccel
    import hf_triaccel.kernels

    # the installed metadata, not the checkout's own egg-info in the current folder
    site = [p for p in sys.path if Path(p or os.curdir).resolve() != ROOT]
    # the first along the path, as Python's import found the package
    dist = next(importlib.metadata.distributions(name="hf-triaccel", path=site))
    direct_url = dist.read_text("direct_url.json")
    editable = bool(direct_url) and json.loads(direct_url).get("dir_info", {}).get("editable")
    package = Path(hf_triaccel.__file__).resolve().parent
    kernels = Path(hf_triaccel.kernels.__file__).resolve().parent
    if editable:
        assert package == ROOT / PACKAGE and kernels == ROOT / "kernels"
    else:
        assert ROOT not in package.parents and ROOT not in kernels.parents
        assert kernels == package / "kernels"


# the scripts that run an uninstalled checkout by assembling the package in a scratch folder
ASSEMBLING_SCRIPTS = ("benchmarks/fast_defaults.sh", "recipes/fsdp2_gpu_check.sh")


@pytest.mark.parametrize("script", ASSEMBLING_SCRIPTS)
def test_scratch_assemblies_copy_every_mapped_folder(script):
    """A script that assembles the package from the checkout copies each folder that
    pyproject.toml's ``package-dir`` maps inside the package (``kernels/``,
    ``model_card_templates/``): an editable install would hide one it left out."""
    tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")
    with open(ROOT / "pyproject.toml", "rb") as f:
        mapped = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    text = (ROOT / script).read_text()
    for package, folder in mapped.items():
        if package == folder:  # the package itself, copied as it is
            assert f"cp -r {folder} " in text
            continue
        inside = package.replace(".", "/")
        assert f'cp -r {folder} "$scratch/{inside}"' in text, (script, folder)
