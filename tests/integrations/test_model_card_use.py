"""The model card's "Use" block, executed as a reader copies it, loads the model the run
wrote: from the run's folder until the run is published, from the Hub repository after."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("jinja2")
timm = pytest.importorskip("timm")

from hf_triaccel.integrations.model_card import build_card, load_reference, write_card  # noqa: E402
from hf_triaccel.integrations.timm_models import save_model  # noqa: E402
from tests.recipes.test_model_card import sample_results  # noqa: E402

LABELS = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def use_block(card: str) -> str:
    (code,) = re.findall(r"## Use\n\n```python\n(.*?)```", card, flags=re.S)
    return code


def test_image_card_of_a_local_run_loads_the_model_it_names(tmp_path, capsys):
    run_dir = tmp_path / "outputs" / "cifar10_resnet18"
    model = timm.create_model("test_resnet", num_classes=10)
    save_model(model, run_dir, label_names=LABELS, mean=(0.5,) * 3, std=(0.25,) * 3)
    results = sample_results(baseline=False)
    results["output_dir"] = str(run_dir)
    # as a recipe writes it: the repository named after the folder, nothing published
    card = write_card(results, run_dir, repo_id="cifar10_resnet18").read_text()
    code = use_block(card)
    assert f'timm.create_model("local-dir:{run_dir.resolve()}", pretrained=True)' in code
    exec(compile(code, "card", "exec"), {})
    (printed,) = capsys.readouterr().out.split()
    assert printed in LABELS  # the class names saved with the model


def test_a_relative_output_folder_becomes_an_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    results = sample_results(baseline=False)
    code = use_block(build_card(results, repo_id="cifar10_resnet18").content)
    expected = tmp_path.resolve() / "outputs" / "cifar10_resnet18"
    assert f'"local-dir:{expected}"' in code


def test_published_cards_load_from_the_full_repository_id():
    image = use_block(
        build_card(sample_results(), repo_id="me/cifar10-resnet18", pushed=True).content
    )
    assert 'timm.create_model("hf-hub:me/cifar10-resnet18", pretrained=True)' in image
    text = {"task": "text-generation"}
    assert load_reference(text, "me/wikitext2-gpt2", pushed=True) == "me/wikitext2-gpt2"


def test_paths_are_written_as_python_strings(tmp_path):
    folder = tmp_path / 'a "quoted" folder'
    reference = load_reference({"task": "text-generation"}, "x", local_dir=folder)
    results = sample_results(baseline=False)
    code = use_block(build_card(results, repo_id="x", local_dir=folder).content)
    literal = re.search(r"timm\.create_model\((.*), pretrained=True\)", code).group(1)
    assert json.loads(literal) == f"local-dir:{folder.resolve()}"
    assert reference == str(folder.resolve())
