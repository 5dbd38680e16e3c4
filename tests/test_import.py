"""`import hf_triaccel` needs neither a GPU nor the Hugging Face libraries nor Triton."""

import subprocess
import sys
from pathlib import Path

# this checkout's package, from a folder where nothing else shadows an installed one
ROOT = str(Path(__file__).resolve().parents[1])


def test_import_loads_no_optional_library(tmp_path):
    # timm too: its models are registered when a timm name of the package is used
    code = (
        f"import sys; sys.path.insert(0, {ROOT!r}); import hf_triaccel; "
        "print(','.join(m for m in ('transformers', 'accelerate', 'timm', "
        "'matplotlib', 'datasets') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path
    )
    assert out.stdout.strip() == ""


def test_import_works_without_timm(tmp_path):
    code = (
        "import sys; sys.modules['timm'] = None; "  # as if timm were not installed
        "import torch, hf_triaccel; "
        "print(sys.modules['timm'] is not None, 'triton' in sys.modules); "
        "opt = hf_triaccel.AdaFisherW.from_model(torch.nn.Linear(2, 2))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path
    )
    assert out.stdout.strip() == "False False"


def test_lazy_integrations_resolve():
    import hf_triaccel

    assert hf_triaccel.TriAccelTrainer.__name__ == "TriAccelTrainer"
    assert hf_triaccel.prepare_triaccel.__name__ == "prepare_triaccel"
