"""Model-card templates, card rendering and Hub publishing (the Hub mocked, no network)."""

from __future__ import annotations

import copy

import pytest
import yaml

pytest.importorskip("jinja2")

from huggingface_hub import ModelCard, RepoUrl  # noqa: E402

from hf_triaccel.integrations import model_card  # noqa: E402
from hf_triaccel.integrations.model_card import (  # noqa: E402
    PushToHubError,
    build_card,
    push_run,
    templates_dir,
    write_card,
)

# the image classification templates: the sample results below are an image run's
TEMPLATES = [templates_dir() / model_card.DEFAULT_TEMPLATE]


def sample_results(baseline: bool = True) -> dict:
    """Results of a GPU run as the recipes write them."""
    results = {
        "recipe": "cifar10_resnet18",
        "title": "CIFAR-10",
        "model": "resnet18_cifar",
        "dataset": "uoft-cs/cifar10",
        "dataset_id": "uoft-cs/cifar10",
        "dataset_type": "uoft-cs/cifar10",
        "dataset_name": "CIFAR-10",
        "train_split": "train",
        "eval_split": "test",
        "train_samples": 50000,
        "eval_samples": 10000,
        "num_classes": 10,
        "image_size": [32, 32],
        "normalisation": {"mean": [0.49, 0.48, 0.45], "std": [0.25, 0.24, 0.26]},
        "eval_accuracy": 0.89913,
        "eval_loss": 0.61,
        "train_runtime_s": 73.25,
        "eval_runtime_s": 6.5,
        "step_time_ms": 25.17,
        "samples_per_second": 20341.2,
        "steady_step_time_ms": 20.18,
        "steady_samples_per_second": 25371.6,
        "timing_windows": 145,
        "gpu_hours": 0.020347,
        "peak_memory_gb": 1.331,
        "energy": {"energy_kwh": 0.0123},
        "co2": {
            "emissions_g": 5.843,
            "carbon_intensity_g_per_kwh": 475.0,
            "geographical_location": None,
        },
        "optimizer_steps": 2910,
        "epochs": 30.0,
        "device": "NVIDIA H200",
        "hardware": "1 x NVIDIA H200",
        "versions": {"hf-triaccel": "0.1.0", "torch": "2.11.0", "triton": None},
        "settings": {
            "optim": "adafisher",
            "learning_rate": 3e-3,
            "weight_decay": 5e-4,
            "lr_scheduler_type": "cosine",
            "warmup_steps": 0.3,
            "per_device_train_batch_size": 512,
            "gradient_accumulation_steps": 1,
            "world_size": 1,
            "total_batch_size": 512,
            "num_train_epochs": 30.0,
            "max_steps": -1,
            "precision": "static bf16 autocast",
            "label_smoothing": 0.1,
            "augmentation": "random crop and flip",
            "seed": 42,
            "adafisher": {
                "gamma": 0.8,
                "damping": 1e-3,
                "beta": 0.9,
                "update_every": 100,
                "ema": "reference",
                "impl": "auto",
            },
        },
        "output_dir": "outputs/cifar10_resnet18",
        "command": "accelerate launch recipes/train.py --recipe cifar10_resnet18 --baseline",
        "baseline": None,
        "comparison": None,
        "plots": {"loss": "loss.png", "accuracy": "accuracy.png", "memory": "memory.png"},
    }
    if baseline:
        settings = dict(results["settings"], optim="adamw_torch_fused", adafisher=None)
        results["baseline"] = {
            "optim": "adamw_torch_fused",
            "eval_accuracy": 0.8885,
            "train_runtime_s": 74.0,
            "steady_samples_per_second": 25321.0,
            "steady_step_time_ms": 20.22,
            "peak_memory_gb": 1.38,
            "device": "NVIDIA H200",
            "settings": dict(settings, learning_rate=3e-3, weight_decay=0.05),
            "source": "outputs/cifar10_resnet18/baseline",
            "same_run": True,
        }
        results["comparison"] = {
            "accuracy_points": 1.06,
            "train_time_ratio": 0.99,
            "throughput_ratio": 1.002,
            "peak_memory_ratio": 0.964,
        }
    return results


def metadata(card: ModelCard) -> dict:
    _, header, _ = str(card).split("---\n", 2)
    return yaml.safe_load(header)


def test_there_is_a_template_for_every_task():
    for task, (_, _, template) in model_card.TASKS.items():
        assert (templates_dir() / template).is_file(), f"no template for {task}"


EXPECTED_METRICS = {
    "accuracy": ("Accuracy (10000 test images)", 0.8991),
    "training_time_s": ("Training time (s, evaluations included)", 73.25),
    "gpu_hours": ("GPU-hours of training", 0.020347),
    "training_samples_per_second": ("Training throughput (samples/s, steady state)", 25371.6),
    "peak_gpu_memory_gib": ("Peak GPU memory (GiB, allocated)", 1.331),
}


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda p: p.name)
@pytest.mark.parametrize("baseline", [True, False], ids=["baseline", "alone"])
def test_template_renders_with_parseable_front_matter(template, baseline):
    results = sample_results(baseline)
    card = build_card(results, repo_id="me/cifar10-resnet18", template=template)
    meta = metadata(card)
    index = meta["model-index"][0]
    assert index["name"] == "cifar10-resnet18"
    (result,) = index["results"]  # one result: every metric of the same run and data set
    assert result["task"]["type"] == "image-classification"
    assert result["dataset"] == {"name": "CIFAR-10", "type": "uoft-cs/cifar10", "split": "test"}
    assert {m["type"]: (m["name"], m["value"]) for m in result["metrics"]} == EXPECTED_METRICS
    assert meta["datasets"] == ["uoft-cs/cifar10"] and meta["library_name"] == "timm"
    # the Hub's parser reads every metric back
    parsed = ModelCard(str(card)).data.eval_results
    assert {r.metric_type: r.metric_value for r in parsed} == {
        kind: value for kind, (_, value) in EXPECTED_METRICS.items()
    }
    assert ("## Against the baseline" in card.content) == baseline


def test_emissions_come_from_the_measured_energy():
    card = build_card(sample_results(), repo_id="me/cifar10-resnet18")
    co2 = metadata(card)["co2_eq_emissions"]
    assert co2["emissions"] == 5.843 and co2["training_type"] == "pre-training"
    assert co2["hardware_used"] == "1 x NVIDIA H200" and "475 g CO2eq/kWh" in co2["source"]
    assert "geographical_location" not in co2
    assert ModelCard(str(card)).data.co2_eq_emissions == co2
    assert "0.0123 kWh of GPU energy" in card.content and "5.84 g CO2eq at 475.0" in card.content


def test_no_power_reading_no_emissions_but_a_note():
    results = sample_results(baseline=False)
    results.update(energy=None, co2=None, gpu_hours=None, peak_memory_gb=None)
    card = build_card(results, repo_id="me/x")
    assert "co2_eq_emissions" not in metadata(card)
    assert "not estimated: no GPU energy reading" in card.content
    metrics = {m["type"] for m in metadata(card)["model-index"][0]["results"][0]["metrics"]}
    assert metrics == {"accuracy", "training_time_s", "training_samples_per_second"}


def test_card_carries_the_run_figures():
    content = build_card(sample_results(), repo_id="me/cifar10-resnet18", pushed=True).content
    for text in (
        "89.91%",  # accuracy
        "73.2 s: `Trainer.train()` wall time",
        "6.5 s in evaluations",
        "25.17 ms (training time / optimizer steps, evaluations included)",
        "20.18 ms (median of the 145 logging windows after the first",
        "25371.6 samples/s at the steady step time; 20341.2 samples/s over the whole",
        "0.0203 (training time x 1 GPU)",
        "1.331 GiB",
        "1 x NVIDIA H200",
        "`adafisher`, learning rate 0.003, weight decay 0.0005",
        "refreshed every 100 steps",
        "static bf16 autocast",
        "88.85%",  # the baseline's accuracy
        "+1.06 points",
        "0.964x",
        "same command",
        "![memory](memory.png)",
        'timm.create_model("hf-hub:me/cifar10-resnet18", pretrained=True)',
        "import hf_triaccel",
        'Image.new("RGB", (32, 32))',
        "accelerate launch recipes/train.py --recipe cifar10_resnet18 --baseline",
    ):
        assert text in content, text
    assert "triton" not in content.split("Versions:")[1]  # versions not installed are left out
    assert "hf_triaccel.recipes" not in content and "load_trained" not in content


def test_card_without_gpu_figures_or_hub_dataset():
    results = sample_results(baseline=False)
    results.update(
        peak_memory_gb=None,
        timing_windows=0,
        dataset="/data/cifar10",
        dataset_id=None,
        dataset_type="cifar10",
        dataset_name="cifar10",
    )
    card = build_card(results)
    meta = metadata(card)
    assert "datasets" not in meta
    assert meta["model-index"][0]["results"][0]["dataset"]["type"] == "cifar10"
    assert meta["model-index"][0]["name"] == "cifar10_resnet18"  # the output folder's name
    assert "| peak GPU memory | n/a" in card.content
    assert "(local data: `/data/cifar10`)" in card.content
    assert "too few logging windows for a median" in card.content


def test_card_of_a_run_without_evaluation():
    results = sample_results(baseline=False)
    results.update(eval_accuracy=None, eval_loss=None, eval_samples=None, eval_split=None)
    card = build_card(results, repo_id="me/x")
    (result,) = metadata(card)["model-index"][0]["results"]
    assert result["dataset"]["split"] == "train"
    assert "accuracy" not in {m["type"] for m in result["metrics"]}
    assert "not evaluated" in card.content


def test_card_of_a_separate_baseline_run():
    results = sample_results()
    results["baseline"]["same_run"] = False
    assert "separate run (`outputs/cifar10_resnet18/baseline`" in build_card(results).content


def test_write_card_saves_readme(tmp_path):
    path = write_card(sample_results(), tmp_path, repo_id="me/x")
    assert path == tmp_path / "README.md"
    assert ModelCard.load(path).data.model_name == "x"


class RecordingHfApi:
    """A Hub client that records calls; ``create_repo`` names the repo in ``me/``."""

    calls: list = []

    def __init__(self, token=None) -> None:
        self.calls.append(("init", token))

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))
        return RepoUrl(f"https://huggingface.co/me/{repo_id.split('/')[-1]}")

    def upload_folder(self, **kwargs):
        self.calls.append(("upload_folder", kwargs))


def test_push_creates_the_repo_then_uploads_the_folder_with_its_card(tmp_path, monkeypatch):
    monkeypatch.setattr(model_card, "HfApi", RecordingHfApi)
    RecordingHfApi.calls = []
    results = sample_results()
    write_card(results, tmp_path, repo_id="cifar10-resnet18")
    url = push_run(results, tmp_path, "cifar10-resnet18", token="hf_x", private=True)
    assert url == "https://huggingface.co/me/cifar10-resnet18"
    init, create, upload = RecordingHfApi.calls
    assert init == ("init", "hf_x")
    assert create == (
        "create_repo",
        "cifar10-resnet18",
        {"private": True, "exist_ok": True, "repo_type": "model"},
    )
    assert upload[1]["repo_id"] == "me/cifar10-resnet18"
    assert upload[1]["folder_path"] == tmp_path
    assert "checkpoint-*/**" in upload[1]["ignore_patterns"]
    # the card now names the full repository id
    card = (tmp_path / "README.md").read_text()
    assert 'timm.create_model("hf-hub:me/cifar10-resnet18", pretrained=True)' in card


@pytest.mark.parametrize("failing", ["create_repo", "upload_folder"])
def test_push_failure_is_one_clear_error_and_keeps_the_card(tmp_path, monkeypatch, failing):
    class FailingHfApi(RecordingHfApi):
        def create_repo(self, repo_id, **kwargs):
            if failing == "create_repo":
                raise OSError("Network is unreachable")
            return super().create_repo(repo_id, **kwargs)

        def upload_folder(self, **kwargs):
            raise OSError("Network is unreachable")

    monkeypatch.setattr(model_card, "HfApi", FailingHfApi)
    results = copy.deepcopy(sample_results())
    card = write_card(results, tmp_path, repo_id="me/x")
    with pytest.raises(PushToHubError, match="could not publish") as error:
        push_run(results, tmp_path, "me/x")
    message = str(error.value)
    assert "OSError: Network is unreachable" in message and "Nothing is lost" in message
    assert f"hf upload me/x {tmp_path} ." in message
    assert card.is_file() and "model-index" in card.read_text()
