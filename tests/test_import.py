"""`import hf_triaccel` needs neither a GPU nor the Hugging Face libraries nor Triton."""

import subprocess
import sys


def test_import_loads_no_optional_library():
    code = (
        "import sys, hf_triaccel; "
        "print(','.join(m for m in ('transformers', 'accelerate', 'timm', 'triton', "
        "'matplotlib', 'datasets') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_lazy_integrations_resolve():
    import hf_triaccel

    assert hf_triaccel.TriAccelTrainer.__name__ == "TriAccelTrainer"
    assert hf_triaccel.prepare_triaccel.__name__ == "prepare_triaccel"
