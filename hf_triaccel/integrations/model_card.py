"""Model cards for trained runs, rendered with ``huggingface_hub.ModelCard``, and
publishing a run's folder to the Hugging Face Hub.

``Trainer.create_model_card`` is a fixed template that fails on models without a
``.config`` (timm's), so cards are rendered from the Jinja templates in
``model_card_templates/`` instead. The card's YAML front matter carries the evaluation
accuracy as a ``model-index`` entry (``ModelCardData.eval_results``), which the Hub shows
as the model's results.

Example:
    >>> card = build_card(results, repo_id="me/cifar10-resnet18")  # doctest: +SKIP
    >>> card.data.eval_results[0].metric_value  # doctest: +SKIP
    0.8991
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


def card_data(results: Mapping[str, Any], model_name: str) -> ModelCardData:
    """The card's YAML metadata: library, task, dataset and the accuracy as ``model-index``.

    Args:
        results: a run's results (see :func:`build_card`).
        model_name: the model's name in ``model-index``.

    Example:
        >>> data = card_data({"dataset_id": "uoft-cs/cifar10", "dataset": "uoft-cs/cifar10",
        ...                   "title": "CIFAR-10", "eval_split": "test", "eval_accuracy": 0.9,
        ...                   "settings": {"optim": "adafisher"}}, "cifar10-resnet18")
        >>> data.to_dict()["model-index"][0]["results"][0]["metrics"][0]["value"]
        0.9
    """
    dataset_id = results.get("dataset_id")
    return ModelCardData(
        model_name=model_name,
        license="apache-2.0",
        library_name="timm",
        pipeline_tag="image-classification",
        tags=["image-classification", "timm", "hf-triaccel", results["settings"]["optim"]],
        datasets=[dataset_id] if dataset_id else None,
        metrics=["accuracy"],
        eval_results=[
            EvalResult(
                task_type="image-classification",
                task_name="Image Classification",
                # model-index needs a dataset identifier: a local copy is named by its folder
                dataset_type=dataset_id or Path(results["dataset"]).name,
                dataset_name=results["title"],
                dataset_split=results["eval_split"],
                metric_type="accuracy",
                metric_name="Accuracy",
                metric_value=round(float(results["eval_accuracy"]), 4),
            )
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
        results: the run's ``results.json`` content, as written by
            :func:`hf_triaccel.integrations.recipes.run_recipe`: ``title``, ``model``, ``dataset``,
            ``dataset_id`` (the Hub id, or ``None`` for local data), ``eval_split``,
            ``eval_accuracy``, the timing and memory figures, ``device``, ``settings``,
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
