"""Model cards for trained runs, rendered with ``huggingface_hub.ModelCard``, and
publishing a run's folder to the Hugging Face Hub.

``Trainer.create_model_card`` is a fixed template that fails on models without a
``.config`` (timm's), so cards are rendered from the Jinja templates in
``hf_triaccel/model_card_templates/`` instead, one per task: ``image_classification.md``
(timm image classifiers) and ``text_generation.md`` (transformers causal language models, results
with ``"task": "text-generation"``). The card's YAML front matter carries the evaluation
accuracy or perplexity and the run's efficiency figures (training time, GPU-hours,
throughput, peak memory) as ``model-index`` results (``ModelCardData.eval_results``),
which the Hub shows as the model's results, and the emissions from the measured GPU
energy as ``co2_eq_emissions``. The card's "Use" block loads the model from where it is:
the run's folder, or the Hub repository once :func:`push_run` has published it.

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
IMAGE_TASK = "image-classification"
TEXT_TASK = "text-generation"
# task -> (display name, library, template)
TASKS = {
    IMAGE_TASK: ("Image Classification", "timm", DEFAULT_TEMPLATE),
    TEXT_TASK: ("Text Generation", "transformers", "text_generation.md"),
}
# checkpoints hold optimizer state for resuming: not part of a published model
PUSH_IGNORE = ["checkpoint-*/**", "*/checkpoint-*/**"]


class PushToHubError(RuntimeError):
    """Publishing to the Hub failed; the message says why and where the local files are."""


def templates_dir() -> Path:
    """The folder of the Jinja model-card templates.

    The templates are package data of ``hf_triaccel.model_card_templates``.

    Example:
        >>> (templates_dir() / DEFAULT_TEMPLATE).is_file()
        True
    """
    return Path(os.fspath(resources.files("hf_triaccel.model_card_templates")))


def task_of(results: Mapping[str, Any]) -> str:
    """The run's task: ``results["task"]``, image classification for results without one.

    Example:
        >>> task_of({}), task_of({"task": "text-generation"})
        ('image-classification', 'text-generation')
    """
    task = results.get("task") or IMAGE_TASK
    if task not in TASKS:
        raise ValueError(f"no model card for task {task!r}; tasks: {sorted(TASKS)}")
    return task


def card_metrics(results: Mapping[str, Any]) -> list[tuple[str, str, float]]:
    """The ``(type, name, value)`` of every metric the card's ``model-index`` carries for
    the evaluation split: the accuracy, or the perplexity of a text-generation run (when
    the run evaluated), then the training time, GPU-hours, steady training throughput and
    peak GPU memory (those the run measured), each named with what it counts.

    Example:
        >>> card_metrics({"eval_accuracy": 0.9, "eval_samples": 1000, "eval_split": "test",
        ...               "train_runtime_s": 61.5, "gpu_hours": None,
        ...               "steady_samples_per_second": 812.25, "peak_memory_gb": None})[0]
        ('accuracy', 'Accuracy (1000 test images)', 0.9)
        >>> card_metrics({"task": "text-generation", "eval_perplexity": 101.234,
        ...               "eval_tokens": 217646, "eval_split": "validation"})
        [('perplexity', 'Perplexity (217646 validation tokens)', 101.23)]
    """
    metrics = []
    if task_of(results) == TEXT_TASK:
        if results.get("eval_perplexity") is not None:
            name = f"Perplexity ({results['eval_tokens']} {results['eval_split']} tokens)"
            metrics.append(("perplexity", name, round(float(results["eval_perplexity"]), 2)))
    elif results.get("eval_accuracy") is not None:
        name = f"Accuracy ({results['eval_samples']} {results['eval_split']} images)"
        metrics.append(("accuracy", name, round(float(results["eval_accuracy"]), 4)))
    throughput = (
        (
            "tokens_per_second",
            "training_tokens_per_second",
            "Training throughput (tokens/s, steady state)",
        )
        if task_of(results) == TEXT_TASK
        else (
            "steady_samples_per_second",
            "training_samples_per_second",
            "Training throughput (samples/s, steady state)",
        )
    )
    for key, kind, name in (
        ("train_runtime_s", "training_time_s", "Training time (s, evaluations included)"),
        ("gpu_hours", "gpu_hours", "GPU-hours of training"),
        throughput,
        ("peak_memory_gb", "peak_gpu_memory_gib", "Peak GPU memory (GiB, allocated)"),
    ):
        if results.get(key) is not None:
            metrics.append((kind, name, results[key]))
    return metrics


def co2_eq_emissions(results: Mapping[str, Any]) -> dict[str, Any] | None:
    """The Hub's ``co2_eq_emissions`` entry from the run's measured GPU energy (grams of
    CO2-equivalent); ``None`` when the run had no GPU energy reading.

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
        "source": "GPU energy from NVML's energy counter over the training run "
        f"(hf_triaccel), at {co2['carbon_intensity_g_per_kwh']:g} g CO2eq/kWh",
        "training_type": "pre-training",
        "hardware_used": results["hardware"],
    }
    if co2.get("geographical_location"):
        entry["geographical_location"] = co2["geographical_location"]
    return entry


def card_data(results: Mapping[str, Any], model_name: str) -> ModelCardData:
    """The card's YAML metadata: library, task, data set, every metric of
    :func:`card_metrics` as ``model-index`` results (and a text-generation run's test
    perplexity, on its own split), and ``co2_eq_emissions``.

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
    task = task_of(results)
    task_name, library, _ = TASKS[task]
    dataset_id = results.get("dataset_id")
    dataset = {
        "task_type": task,
        "task_name": task_name,
        "dataset_type": results["dataset_type"],
        "dataset_name": results["dataset_name"],
    }
    split = results.get("eval_split") or results["train_split"]
    eval_results = [
        EvalResult(
            **dataset, dataset_split=split, metric_type=kind, metric_name=name, metric_value=value
        )
        for kind, name, value in card_metrics(results)
    ]
    metric = "perplexity" if task == TEXT_TASK else "accuracy"
    if results.get("test_perplexity") is not None:
        eval_results.append(
            EvalResult(
                **dataset,
                dataset_split=results["test_split"],
                metric_type="perplexity",
                metric_name=f"Perplexity ({results['test_tokens']} {results['test_split']} tokens)",
                metric_value=round(float(results["test_perplexity"]), 2),
            )
        )
    return ModelCardData(
        model_name=model_name,
        license="apache-2.0",
        library_name=library,
        pipeline_tag=task,
        tags=[task, library, "hf-triaccel", results["settings"]["optim"]],
        datasets=[dataset_id] if dataset_id else None,
        metrics=[metric] if results.get(f"eval_{metric}") is not None else None,
        co2_eq_emissions=co2_eq_emissions(results),
        eval_results=eval_results,
    )


def load_reference(
    results: Mapping[str, Any],
    repo_id: str,
    *,
    pushed: bool = False,
    local_dir: str | os.PathLike | None = None,
) -> str:
    """What the card's "Use" block loads the model from: the Hub repository when the run
    was published, else the absolute path of the run's folder; for a timm model, with
    timm's ``hf-hub:`` or ``local-dir:`` prefix.

    Example:
        >>> load_reference({}, "me/cifar10-resnet18", pushed=True)
        'hf-hub:me/cifar10-resnet18'
        >>> load_reference({}, "x", local_dir="/runs/x")
        'local-dir:/runs/x'
        >>> load_reference({"task": "text-generation"}, "x", local_dir="/runs/x")
        '/runs/x'
    """
    timm = task_of(results) == IMAGE_TASK
    if pushed:
        return f"hf-hub:{repo_id}" if timm else repo_id
    folder = str(Path(local_dir if local_dir is not None else results["output_dir"]).resolve())
    return f"local-dir:{folder}" if timm else folder


def build_card(
    results: Mapping[str, Any],
    *,
    repo_id: str | None = None,
    template: str | os.PathLike | None = None,
    pushed: bool = False,
    local_dir: str | os.PathLike | None = None,
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
            and optionally ``baseline`` / ``comparison`` and ``plots``. A
            text-generation run (``"task": "text-generation"``) has perplexities instead
            of the accuracy and image fields (see ``recipes/wikitext2_gpt2.py``).
        repo_id: the Hub repository the card is for (``user/name``); defaults to the
            name of the run's output folder.
        template: a template file name in :func:`templates_dir`, or a path to one;
            default: the task's (:data:`TASKS`).
        pushed: the model is published as ``repo_id`` (the full ``user/name``): the
            "Use" block loads it from the Hub; otherwise from ``local_dir``.
        local_dir: the folder holding the model (default: ``results["output_dir"]``).

    Returns:
        The card; ``card.save(path)`` writes it, ``str(card)`` is its text.

    Example:
        >>> card = build_card(results, repo_id="me/cifar10-resnet18")  # doctest: +SKIP
        >>> "model-index" in card.content  # doctest: +SKIP
        True
    """
    repo_id = repo_id or Path(results["output_dir"]).resolve().name
    template = template if template is not None else TASKS[task_of(results)][2]
    path = Path(template)
    if not path.is_file():
        path = templates_dir() / template
    return ModelCard.from_template(
        card_data(results, model_name=repo_id.split("/")[-1]),
        template_path=str(path),
        repo_id=repo_id,
        results=results,
        load_from=load_reference(results, repo_id, pushed=pushed, local_dir=local_dir),
    )


def write_card(
    results: Mapping[str, Any],
    output_dir: str | os.PathLike,
    *,
    repo_id: str | None = None,
    template: str | os.PathLike | None = None,
    pushed: bool = False,
) -> Path:
    """Renders the card (:func:`build_card`) and saves it as ``output_dir/README.md``;
    unless ``pushed``, its "Use" block loads the model from ``output_dir``.

    Example:
        >>> write_card(results, "outputs/cifar10_resnet18")  # doctest: +SKIP
        PosixPath('outputs/cifar10_resnet18/README.md')
    """
    path = Path(output_dir) / CARD_NAME
    card = build_card(
        results, repo_id=repo_id, template=template, pushed=pushed, local_dir=output_dir
    )
    card.save(path)
    return path


def push_run(
    results: Mapping[str, Any],
    output_dir: str | os.PathLike,
    repo_id: str,
    *,
    token: str | None = None,
    private: bool | None = None,
    template: str | os.PathLike | None = None,
) -> str:
    """Publishes a run's folder as a Hub model repository, with its model card.

    Creates the repository if needed, renders the card again for the repository's full
    id (a bare ``repo_id`` gets the logged-in user's namespace), its "Use" block loading
    from there, then uploads the folder, checkpoints left out.

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
    write_card(results, folder, repo_id=url.repo_id, template=template, pushed=True)
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
