"""The recipes as a user meets them, through their entry points and offline: flags taken
only as typed, bad input in at most three lines with exit status 2, the network's absence
said at once with what runs without it, the plan's steps as the Trainer counts them, the
comparison on the console, and results and cards that state what happened."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("timm")
pytest.importorskip("matplotlib")

# the recipes' folder is on the import path (conftest.py)
import recipe_config  # noqa: E402
import train  # noqa: E402
import wikitext2_grid as grid  # noqa: E402
import yaml  # noqa: E402

from hf_triaccel import quickstart  # noqa: E402

from .conftest import RECIPES_DIR  # noqa: E402
from .test_recipes import tiny_run  # noqa: E402

ROOT = RECIPES_DIR.parent
# an endpoint no resolver answers (RFC 2606): the Hub unreachable, without any network
UNREACHABLE = "https://hub.invalid"


def error_lines(capsys) -> list[str]:
    return capsys.readouterr().err.strip().splitlines()


@pytest.fixture
def no_network(monkeypatch, tmp_path):
    """The Hub out of reach (its endpoint a name no resolver answers), neither offline
    mode nor a proxy set, in a scratch folder."""
    for name in (*recipe_config.OFFLINE_VARIABLES, *recipe_config.PROXY_VARIABLES):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", UNREACHABLE)
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize(
    "argv, meant",
    [
        (["--learning_rat", "0.01"], "--learning_rate"),
        (["--max_step", "2"], "--max_steps"),
        (["--max_step=2"], "--max_steps"),
        (["--qui"], "--quick"),
    ],
)
def test_no_prefix_of_a_flag_is_taken_for_it(argv, meant, capsys):
    with pytest.raises(SystemExit) as exit_info:
        recipe_config.parse_args(argv, recipe="cifar10_resnet18")
    assert exit_info.value.code == 2
    (line,) = error_lines(capsys)
    assert "unrecognised arguments" in line and f"did you mean '{meant}'?" in line


@pytest.mark.parametrize(
    "parse",
    [
        lambda: grid.main(["summary", "runs.jsonl", "--target", "adamw", "--vers", "x"]),
        lambda: quickstart.parse_args(["--optimizer", "adamw"]),
    ],
    ids=["grid", "quickstart"],
)
def test_the_plain_command_lines_take_no_prefix_either(parse, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse()
    assert exit_info.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err


def test_without_the_hub_the_default_command_names_what_runs_offline(no_network, capsys):
    start = time.perf_counter()
    assert train.main([], recipe="cifar10_resnet18") == 2
    # datasets' own retries take half a minute before failing
    assert time.perf_counter() - start < 10
    lines = error_lines(capsys)
    assert len(lines) <= 3
    assert lines[0].startswith("cifar10_resnet18.py: error: --dataset uoft-cs/cifar10: ")
    assert "the Hub cannot be reached (hub.invalid: " in lines[0]
    assert "--dataset embedded --quick" in lines[0]
    assert not (Path("outputs") / "cifar10_resnet18").exists()


def test_a_recipe_of_other_classes_names_the_offline_recipe(no_network, capsys):
    assert train.main(["--dataset", "uoft-cs/cifar-100"], recipe="cifar100_resnet18") == 2
    (line,) = error_lines(capsys)
    assert "python recipes/cifar10_resnet18.py --dataset embedded --quick" in line


def test_offline_mode_default_command_is_one_error_line(tmp_path):
    """The command as a user types it, with the Hub's offline mode on: no traceback."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(RECIPES_DIR / "cifar10_resnet18.py"), "--dataset", "uoft-cs/cifar-10"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) <= 3 and "Traceback" not in done.stderr, done.stderr
    assert "could not load it from the Hub" in lines[-1]
    assert "--dataset embedded --quick" in lines[-1]


def test_data_of_another_class_count_is_one_line_and_exit_2(capsys, tmp_path):
    argv = ["--dataset", "embedded", "--output_dir", str(tmp_path / "out"), "--use_cpu"]
    assert train.main(argv, recipe="cifar100_resnet18") == 2
    lines = error_lines(capsys)  # after the data set's progress bars, when it shows them
    line = lines[-1]
    assert not any("Traceback" in x or "error" in x for x in lines[:-1])
    assert line.startswith("cifar100_resnet18.py: error: recipe cifar100_resnet18 trains a ")
    assert "has 10 classes" in line and "Give --dataset a copy of uoft-cs/cifar100" in line


def test_an_absolute_path_is_not_called_relative(capsys):
    with pytest.raises(SystemExit):
        recipe_config.parse_args(["--dataset", "/no/such/cifar10"], recipe="cifar10_resnet18")
    (line,) = error_lines(capsys)
    assert "--dataset '/no/such/cifar10': no such file or folder" in line
    assert "relative to" not in line


def test_an_unknown_optimizer_is_one_short_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        recipe_config.parse_args(["--optim", "adamw_torch_fuse"], recipe="cifar10_resnet18")
    assert exit_info.value.code == 2
    (line,) = error_lines(capsys)
    assert "did you mean 'adamw_torch_fused'?" in line and len(line) < 300


def test_quick_output_folders_name_their_data(hub_folders):
    def folder(*argv: str) -> str:
        return recipe_config.parse_args(["--quick", *argv], recipe="cifar10_resnet18")[2].output_dir

    embedded = folder("--dataset", "embedded")
    local = folder("--dataset", str(hub_folders["cifar10_resnet18"]))
    assert embedded == os.path.join("outputs", "cifar10_resnet18-quick-embedded")
    assert local != embedded and local.startswith(
        os.path.join("outputs", "cifar10_resnet18-quick-")
    )
    # the same data, the same folder: a requeued run finds its own folder again
    assert folder("--dataset", str(hub_folders["cifar10_resnet18"]) + "/") == local
    assert folder("--dataset", "embedded", "--output_dir", "mine") == "mine"


def test_quickstart_help_names_what_it_trains(capsys):
    with pytest.raises(SystemExit):
        quickstart.parse_args(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert f"Train the same model with {' and with '.join(quickstart.COMPARED)} " in help_text
    assert quickstart.parse_args([]).optimizers == list(quickstart.COMPARED)


@pytest.fixture(scope="module")
def epoch_run(hub_folders, tmp_path_factory):
    """One epoch of 16 images in batches of 5 (the last, smaller batch skipped), after its
    AdamW baseline, with the console's output."""
    out = tmp_path_factory.mktemp("epochs") / "run"
    argv = tiny_run("cifar10_resnet18", hub_folders["cifar10_resnet18"], out, "--baseline")
    at = argv.index("--max_steps")
    del argv[at : at + 2]
    argv[argv.index("--per_device_train_batch_size") + 1] = "5"
    previous = os.umask(0o022)
    try:
        console = io.StringIO()
        with contextlib.redirect_stdout(console):
            results = train.run_recipe([*argv, "--epochs", "1"])
    finally:
        os.umask(previous)
    return {"results": results, "out": out, "console": console.getvalue()}


def test_the_plan_counts_the_steps_the_trainer_takes(epoch_run):
    results = epoch_run["results"]
    assert results["optimizer_steps"] == 3  # 16 // 5, not ceil(16 / 5)
    assert re.search(r": test_resnet \([\d.]+ M parameters\), 3 optimizer steps ", results["plan"])


def test_the_comparison_prints_on_the_console(epoch_run):
    results, console = epoch_run["results"], epoch_run["console"].splitlines()
    header = next(i for i, line in enumerate(console) if line.startswith("optimizer "))
    rows = {line.split()[0]: line for line in console[header + 1 : header + 3]}
    for optim, figures in (("adafisher", results), ("adamw_torch_fused", results["baseline"])):
        assert f"{100 * figures['eval_accuracy']:.2f}%" in rows[optim]
        assert f"{figures['train_runtime_s']:.1f} s" in rows[optim]
    points = results["comparison"]["accuracy_points"]
    assert f"adafisher - adamw_torch_fused: {points:+.2f} accuracy points" in console[header + 3]


def test_results_and_card_state_what_ran(epoch_run):
    out, results = epoch_run["out"], epoch_run["results"]
    s = results["settings"]
    assert s["num_train_epochs"] == 1.0 and results["epochs"] == pytest.approx(1.0)
    assert s["cudnn_benchmark"] is None  # a CPU run: no cuDNN
    assert s["adafisher"]["factor_init"] == "zeros"
    assert 'factor_init="zeros"' in s["adafisher"]["variant"]
    assert "not the published algorithm" in s["adafisher"]["variant"]
    assert {"num_train_epochs", "baseline"} <= set(s["set_on_command_line"])
    assert "learning_rate" not in s["set_on_command_line"]  # the recipe's default
    assert results["device"].startswith("CPU: ") and "unknown" not in results["hardware"]
    assert results["resumed_from_step"] == 0 and results["global_step"] == 3
    card = (out / "README.md").read_text()
    assert 'factor_init="zeros"' in card and "`--baseline`" in card
    assert "every other setting is the recipe's default" in card
    report = json.loads((out / "efficiency_report.json").read_text())
    assert report["device"] == results["device"]
    # written as the user's umask (0o022) says, not the owner-only 0o600 of safetensors
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o644


def test_a_quick_run_states_its_steps_not_the_full_epochs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["--quick", "--dataset", "embedded", "--max_steps", "2", "--use_cpu"]
    argv += ["--eval_strategy", "no", "--no_plot", "--disable_tqdm", "true"]
    results = train.run_recipe(argv, recipe="cifar10_resnet18")
    assert results["output_dir"] == os.path.join("outputs", "cifar10_resnet18-quick-embedded")
    s = results["settings"]
    assert s["max_steps"] == 2 and s["num_train_epochs"] is None
    assert results["epochs"] == pytest.approx(2 / (5000 // 64))
    assert s["set_on_command_line"] == sorted(
        ["quick", "dataset", "max_steps", "use_cpu", "eval_strategy", "no_plot", "disable_tqdm"]
    )
    card = (Path(results["output_dir"]) / "README.md").read_text()
    assert "2 steps" in card and "30 epochs" not in card


def test_a_resumed_run_states_the_steps_it_trained(hub_folders, tmp_path):
    folder = hub_folders["cifar10_resnet18"]
    first = tiny_run("cifar10_resnet18", folder, tmp_path / "a", "--save_strategy", "steps")
    first += ["--save_steps", "1", "--eval_strategy", "no", "--no_plot"]
    train.run_recipe(first)
    resumed = tiny_run("cifar10_resnet18", folder, tmp_path / "b", "--eval_strategy", "no")
    resumed += ["--no_plot", "--resume_from_checkpoint", str(tmp_path / "a" / "checkpoint-1")]
    results = train.run_recipe(resumed)
    assert results["optimizer_steps"] == 1 and results["global_step"] == 2
    assert results["resumed_from_step"] == 1
    card = (tmp_path / "b" / "README.md").read_text()
    assert "resumed from the checkpoint at step 1: these figures cover steps 2 to 2" in card
    meta = yaml.safe_load(card.split("---\n")[1])
    assert meta["model-index"][0]["results"]


def test_the_fsdp2_gpu_check_refuses_without_a_gpu(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    done = subprocess.run(
        ["bash", str(RECIPES_DIR / "fsdp2_gpu_check.sh")],
        env={**env, "OUT": str(tmp_path / "out")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert "no CUDA GPU here" in line and "--smoke --cpu" in line
    assert not (tmp_path / "out").exists()


def test_an_interrupt_ends_the_fsdp2_check_and_every_process_it_started(tmp_path):
    """The script with stand-ins: a ``python`` that says a GPU is there and an
    ``accelerate`` whose launch starts a long child, as a launcher starts its workers."""
    bin_dir, pids = tmp_path / "bin", tmp_path / "pids"
    bin_dir.mkdir()
    pids.mkdir()
    (bin_dir / "python").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "accelerate").write_text(
        '#!/bin/sh\nsleep 300 &\necho $! > "$PIDS/worker.tmp"\nmv "$PIDS/worker.tmp" '
        '"$PIDS/worker"\nwait\n'
    )
    for name in ("python", "accelerate"):
        (bin_dir / name).chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "PIDS": str(pids), "OUT": str(tmp_path / "out")}
    script = subprocess.Popen(
        ["bash", str(RECIPES_DIR / "fsdp2_gpu_check.sh")],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while not (pids / "worker").is_file() and time.monotonic() < deadline:
        time.sleep(0.1)
    worker = int((pids / "worker").read_text())
    os.killpg(script.pid, signal.SIGINT)  # as the terminal sends Ctrl-C to the script
    assert script.wait(timeout=30) == 130

    def alive(pid: int) -> bool:
        stat = Path(f"/proc/{pid}/stat")
        return stat.is_file() and stat.read_text().split()[2] not in ("Z", "X")

    deadline = time.monotonic() + 10
    while alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(worker)
