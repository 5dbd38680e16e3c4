"""tools/check_cpu_install.py: the README's CPU install command, and the check it makes
of an environment (here, the one the tests run in)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "check_cpu_install.py"


def load_tool():
    spec = importlib.util.spec_from_file_location("check_cpu_install", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_installs_torch_and_torchvision_together_from_the_cpu_index():
    command = load_tool().cpu_install_command()
    assert command[:4] == ["python3", "-m", "pip", "install"]
    assert {"torch", "torchvision"} <= set(command[4:-2])
    assert command[-2:] == ["--index-url", "https://download.pytorch.org/whl/cpu"]


def test_the_check_reports_this_environment_as_it_is():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--python", sys.executable], capture_output=True, text=True
    )
    nvidia = [
        d.metadata["Name"]
        for d in importlib.metadata.distributions()
        if d.metadata["Name"].lower().startswith("nvidia")
    ]
    line = done.stdout.strip()
    assert f"torch {torch.__version__}, torch.version.cuda {torch.version.cuda}, " in line
    assert f"{len(set(nvidia))} nvidia-* distributions" in line
    cpu_build = torch.version.cuda is None and not nvidia
    assert done.returncode == (0 if cpu_build and line.endswith(": OK") else 1), line
    if torch.version.cuda is not None:
        assert f"torch.version.cuda is {torch.version.cuda}" in line


def test_a_cuda_build_or_a_mismatched_torchvision_fails_the_check():
    tool = load_tool()
    cpu = {"torch": "2.9.0+cpu", "cuda": None, "nvidia": [], "torchvision": "0.24.0+cpu"}
    assert tool.verdict({**cpu, "torchvision_ops": True}).endswith(": OK")
    assert "built for another torch" in tool.verdict({**cpu, "torchvision_ops": False})
    cuda = {**cpu, "cuda": "13.0", "nvidia": ["nvidia-cublas"], "torchvision_ops": True}
    assert tool.verdict(cuda).endswith(
        "torch.version.cuda is 13.0; nvidia distributions installed: nvidia-cublas"
    )


def test_a_torchvision_built_for_another_torch_gets_the_fix(tmp_path, monkeypatch, capsys):
    """A torchvision that fails as a mismatched build fails (its operators unregistered at
    import), first on the path of the checked Python: the check names the fix."""
    package = tmp_path / "torchvision"
    package.mkdir()
    (package / "__init__.py").write_text(
        'raise RuntimeError("operator torchvision::nms does not exist")\n'
    )
    info = tmp_path / "torchvision-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torchvision\nVersion: 0.1.0\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    assert load_tool().main(["--python", sys.executable]) == 1
    line = capsys.readouterr().out.strip()
    assert "torchvision 0.1.0: " in line and "built for another torch" in line
    release = torch.__version__.split("+")[0]
    assert (
        f"Fix: python3 -m pip install --force-reinstall torch=={release} torchvision "
        "--index-url https://download.pytorch.org/whl/cpu" in line
    )
