"""Model cards for trained runs, rendered with ``huggingface_hub.ModelCard``, and
publishing a run's folder to the Hugging Face Hub.

``Trainer.create_model_card`` is a fixed template that fails on models without a
``.config`` (timm's), so cards are rendered from the Jinja templates in
``model_card_templates/`` instead. The card's YAML front matter carries the evaluation
accuracy and the run's efficiency figures (training time, GPU-hours, throughput, peak
memory) as ``model-index`` results (``ModelCardData.eval_results``), which the Hub shows as
the model's results, and the emissions from the measured GPU energy as
``co2_eq_emissions``.

Example:
    >>> card = build_card(results, repo_id="me/cifar10-resnet18")  # doctest: +SKIP
    >>> [(r.metric_type, r.metric_value) for r in card.data.eval_results]  # doctest: +SKIP
    [('accuracy', 0.8991), ('training_time_s', 73.25), ...]
    >>> write_card(results, "outputs/cifar10_resnet18")  # doctest: +SKIP
    PosixPath('outputs/cifar10_resnet18/README.md')
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from huggingface_hub import EvalResult, HfApi, ModelCard, ModelCardData

DEFAULT_TEMPLATE = "image_classification.md"
CARD_NAME = "README.md"
# checkpoints hold optimizer state for resuming: not part of a published model
PUSH_IGNORE = ["checkpoint-*/**", "*/checkpoint-*/**"]


class PushToHubError(RuntimeError):
    """Publishing to the Hub failed; the message says why and where the local files are."""


def templates_dir() -> Path:
    """The folder of the Jinja model-card templates.

    Installed, the templates are package data of ``hf_triaccel.model_card_templates``;
    in a source checkout that is not installed that way, they are the repository's
    ``model_card_templates/`` folder.

    Example:
        >>> (templates_dir() / DEFAULT_TEMPLATE).is_file()
        True
    """
    try:
        return Path(os.fspath(resources.files("hf_triaccel.model_card_templates")))
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[2] / "model_card_templates"


def card_metrics(results: Mapping[str, Any]) -> list[tuple[str, str, float]]:
    """The ``(type, name, value)`` of every metric the card's ``model-index`` carries: the
    accuracy (when the run evaluated), then the training time, GPU-hours, steady training
    throughput and peak GPU memory (those the run measured), each named with what it counts.

    Example:
        >>> card_metrics({"eval_accuracy": 0.9, "eval_samples": 1000, "eval_split": "test",
        ...               "train_runtime_s": 61.5, "gpu_hours": None,
        ...               "steady_samples_per_second": 812.25, "peak_memory_gb": None})[0]
        ('accuracy', 'Accuracy (1000 test images)', 0.9)
    """
    metrics = []
    if results.get("eval_accuracy") is not None:
        name = f"Accuracy ({results['eval_samples']} {results['eval_split']} images)"
        metrics.append(("accuracy", name, round(float(results["eval_accuracy"]), 4)))
    for key, kind, name in (
        ("train_runtime_s", "training_time_s", "Training time (s, evaluations included)"),
        ("gpu_hours", "gpu_hours", "GPU-hours of training"),
        (
            "steady_samples_per_second",
            "training_samples_per_second",
            "Training throughput (samples/s, steady state)",
        ),
        ("peak_memory_gb", "peak_gpu_memory_gib", "Peak GPU memory (GiB, allocated)"),
    ):
        if results.get(key) is not None:
            metrics.append((kind, name, results[key]))
    return metrics


def co2_eq_emissions(results: Mapping[str, Any]) -> dict[str, Any] | None:
    """The Hub's ``co2_eq_emissions`` entry from the run's measured GPU energy (grams of
    CO2-equivalent); ``None`` when the run had no GPU power reading.

    Example:
        >>> co2_eq_emissions({"co2": {"emissions_g": 12.5, "carbon_intensity_g_per_kwh": 475.0,
        ...                           "geographical_location": None},
        ...                   "hardware": "1 x NVIDIA H200"})["emissions"]
        12.5
    """
    co2 = results.get("co2")
    if not co2:
        return None
    entry = {
        "emissions": co2["emissions_g"],
        "source": "GPU energy from NVML power readings integrated over the training run "
        f"(hf_triaccel), at {co2['carbon_intensity_g_per_kwh']:g} g CO2eq/kWh",
        "training_type": "pre-training",
        "hardware_used": results["hardware"],
    }
    if co2.get("geographical_location"):
        entry["geographical_location"] = co2["geographical_location"]
    return entry


def card_data(results: Mapping[str, Any], model_name: str) -> ModelCardData:
    """The card's YAML metadata: library, task, data set, every metric of
    :func:`card_metrics` as ``model-index`` results, and ``co2_eq_emissions``.

    Args:
        results: a run's results (see :func:`build_card`).
        model_name: the model's name in ``model-index``.

    Example:
        >>> data = card_data({"dataset_id": "uoft-cs/cifar10", "dataset_type": "uoft-cs/cifar10",
        ...                   "dataset_name": "CIFAR-10", "eval_split": "test",
        ...                   "train_split": "train", "eval_accuracy": 0.9, "eval_samples": 10000,
        ...                   "train_runtime_s": 61.5, "settings": {"optim": "adafisher"}},
        ...                  "cifar10-resnet18")
        >>> [m["value"] for m in data.to_dict()["model-index"][0]["results"][0]["metrics"]]
        [0.9, 61.5]
    """
    dataset_id = results.get("dataset_id")
    dataset = {
        "dataset_type": results["dataset_type"],
        "dataset_name": results["dataset_name"],
        "dataset_split": results.get("eval_split") or results["train_split"],
    }
    return ModelCardData(
        model_name=model_name,
        license="apache-2.0",
        library_name="timm",
        pipeline_tag="image-classification",
        tags=["image-classification", "timm", "hf-triaccel", results["settings"]["optim"]],
        datasets=[dataset_id] if dataset_id else None,
        metrics=["accuracy"] if results.get("eval_accuracy") is not None else None,
        co2_eq_emissions=co2_eq_emissions(results),
        eval_results=[
            EvalResult(
                task_type="image-classification",
                task_name="Image Classification",
                **dataset,
                metric_type=kind,
                metric_name=name,
                metric_value=value,
            )
            for kind, name, value in card_metrics(results)
        ],
    )


def build_card(
    results: Mapping[str, Any],
    *,
    repo_id: str | None = None,
    template: str | os.PathLike = DEFAULT_TEMPLATE,
) -> ModelCard:
    """Renders a run's model card.

    Args:
        results: a run's results, as the recipes write them to ``results.json``:
            ``title``, ``model``, ``dataset`` (as given), ``dataset_id`` (the Hub data set,
            or ``None``), ``dataset_type`` / ``dataset_name`` (model-index's identifier and
            display name), the splits and sample counts, ``eval_accuracy`` (``None`` when
            not evaluated), the time figures with their ``definitions``, ``gpu_hours``,
            ``peak_memory_gb``, ``energy`` / ``co2`` (``None`` without a GPU power
            reading), ``device``, ``hardware``, ``settings``, ``versions``, ``command``,
            and optionally ``baseline`` / ``comparison`` and ``plots``.
        repo_id: the Hub repository the card is for (``user/name``); defaults to the
            name of the run's output folder.
        template: a template file name in :func:`templates_dir`, or a path to one.

    Returns:
        The card; ``card.save(path)`` writes it, ``str(card)`` is its text.

    Example:
        >>> card = build_card(results, repo_id="me/cifar10-resnet18")  # doctest: +SKIP
        >>> "model-index" in card.content  # doctest: +SKIP
        True
    """
    repo_id = repo_id or Path(results["output_dir"]).resolve().name
    path = Path(template)
    if not path.is_file():
        path = templates_dir() / template
    return ModelCard.from_template(
        card_data(results, model_name=repo_id.split("/")[-1]),
        template_path=str(path),
        repo_id=repo_id,
        results=results,
    )


def write_card(
    results: Mapping[str, Any],
    output_dir: str | os.PathLike,
    *,
    repo_id: str | None = None,
    template: str | os.PathLike = DEFAULT_TEMPLATE,
) -> Path:
    """Renders the card (:func:`build_card`) and saves it as ``output_dir/README.md``.

    Example:
        >>> write_card(results, "outputs/cifar10_resnet18")  # doctest: +SKIP
        PosixPath('outputs/cifar10_resnet18/README.md')
    """
    path = Path(output_dir) / CARD_NAME
    build_card(results, repo_id=repo_id, template=template).save(path)
    return path


def push_run(
    results: Mapping[str, Any],
    output_dir: str | os.PathLike,
    repo_id: str,
    *,
    token: str | None = None,
    private: bool | None = None,
    template: str | os.PathLike = DEFAULT_TEMPLATE,
) -> str:
    """Publishes a run's folder as a Hub model repository, with its model card.

    Creates the repository if needed, renders the card again for the repository's full
    id (a bare ``repo_id`` gets the logged-in user's namespace), then uploads the folder,
    checkpoints left out.

    Args:
        results: the run's results (see :func:`build_card`).
        output_dir: the run's folder (model, reports, plots).
        repo_id: ``user/name``, or a bare name for the logged-in user's namespace.
        token: a Hub token (default: the stored login or ``HF_TOKEN``).
        private: create the repository private.
        template: the card template (see :func:`build_card`).

    Returns:
        The repository's URL.

    Raises:
        PushToHubError: the Hub could not be reached, no token, or the upload failed. The
            local folder keeps every output.

    Example:
        >>> push_run(results, "outputs/cifar10_resnet18", "me/cifar10-resnet18")  # doctest: +SKIP
        'https://huggingface.co/me/cifar10-resnet18'
    """
    folder = Path(output_dir)
    api = HfApi(token=token)
    try:
        url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    # the Hub client raises many unrelated types (HTTP, offline mode, missing token,
    # connection and OS errors): each becomes the one error that says what to do
    except Exception as exc:
        raise _push_error(folder, repo_id, exc) from exc
    write_card(results, folder, repo_id=url.repo_id, template=template)
    try:
        api.upload_folder(
            repo_id=url.repo_id,
            folder_path=folder,
            commit_message="Upload model trained with hf_triaccel",
            ignore_patterns=PUSH_IGNORE,
        )
    except Exception as exc:
        raise _push_error(folder, url.repo_id, exc) from exc
    return str(url)


def _push_error(folder: Path, repo_id: str, exc: Exception) -> PushToHubError:
    return PushToHubError(
        f"could not publish {folder} to the Hugging Face Hub as {repo_id!r} "
        f"({type(exc).__name__}: {exc}). Nothing is lost: the model, reports, plots and "
        f"model card stay in {folder}. Check the network and the login (`hf auth login`, "
        f"or --hub_token), then upload the folder with `hf upload {repo_id} {folder} .`"
    )
