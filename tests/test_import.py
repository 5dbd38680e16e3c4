"""`import hf_triaccel` needs neither a GPU nor the Hugging Face libraries nor Triton."""

import subprocess
import sys


def test_import_loads_no_optional_library(tmp_path):
    # timm is loaded only to register the package's models with it, when it is installed
    # (and timm itself may load Triton: the package does not, see the test below)
    code = (
        "import sys, hf_triaccel; "
        "print(','.join(m for m in ('transformers', 'accelerate', "
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
