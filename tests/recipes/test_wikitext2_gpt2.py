"""The WikiText-2 recipe end to end on a tiny generated corpus (CPU, a few steps of a
2-layer model), its command line, and AdaFisher's rules on its GPT-2 model."""

from __future__ import annotations

import contextlib
import doctest
import io
import json
import math
import os
import random
import re
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("matplotlib")
datasets = pytest.importorskip("datasets")

# the recipes' folder is on the import path (conftest.py)
import wikitext2_gpt2 as recipe  # noqa: E402
import wikitext2_grid as grid  # noqa: E402
import yaml  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from transformers.pytorch_utils import Conv1D  # noqa: E402

from hf_triaccel import AdaFisherW  # noqa: E402

WORDS = [f"w{i}" for i in range(40)] + ["the", "game", "began", ",", ".", "<unk>"]
SPLIT_LINES = {"train": 240, "validation": 60, "test": 60}
# 2 layers of width 64 on blocks of 32 tokens, 4 blocks a step: a few steps in seconds
TINY = [
    "--n_layer",
    "2",
    "--n_head",
    "2",
    "--n_embd",
    "64",
    "--block_size",
    "32",
    "--per_device_train_batch_size",
    "4",
    "--per_device_eval_batch_size",
    "16",
    "--max_tokens",
    "768",  # 6 steps of 128 tokens
    "--eval_every_tokens",
    "384",  # evaluations at steps 3 and 6
    "--logging_steps",
    "2",
    "--use_cpu",
    "--disable_tqdm",
    "true",
]


def corpus(lines: int, seed: int) -> list[str]:
    """Lines as the Hub's WikiText stores them: a leading space and a trailing newline,
    every third line empty."""
    rng = random.Random(seed)
    return [
        ""
        if i % 3 == 0
        else " " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) + " \n"
        for i in range(lines)
    ]


@pytest.fixture(scope="module")
def text_folder(tmp_path_factory) -> Path:
    """``{train,validation,test}.parquet`` with one ``text`` column, as the Hub lays out
    ``Salesforce/wikitext``."""
    folder = tmp_path_factory.mktemp("wikitext")
    for seed, (split, lines) in enumerate(SPLIT_LINES.items()):
        datasets.Dataset.from_dict({"text": corpus(lines, seed)}).to_parquet(
            folder / f"{split}.parquet"
        )
    return folder


def flags(folder: Path, out: Path, *extra: str) -> list[str]:
    return ["--dataset", str(folder), "--output_dir", str(out), *TINY, *extra]


@pytest.fixture(scope="module")
def run(text_folder, tmp_path_factory) -> dict:
    """One command: the AdamW baseline, then AdaFisherW, each run recorded in a runs file."""
    out = tmp_path_factory.mktemp("run")
    argv = flags(text_folder, out, "--baseline", "--runs_file", str(out / "runs.jsonl"))
    console = io.StringIO()
    with contextlib.redirect_stdout(console):
        results = recipe.run_recipe(argv)
    return {"argv": argv, "out": out, "results": results, "console": console.getvalue()}


def test_docstring_examples_run():
    result = doctest.testmod(recipe, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_results_hold_finite_perplexities_and_the_curve(run):
    out = run["out"]
    for folder, optim in ((out, "adafisherw"), (out / "baseline", "adamw_torch_fused")):
        results = json.loads((folder / "results.json").read_text())
        assert results["settings"]["optim"] == optim
        for key in ("eval_perplexity", "test_perplexity", "best_eval_perplexity"):
            assert math.isfinite(results[key]) and results[key] > 1, (optim, key)
        assert results["eval_perplexity"] == pytest.approx(math.exp(results["eval_loss"]))
        assert results["optimizer_steps"] == 6 and results["tokens_trained"] == 768
        steps = [p["step"] for p in results["curve"]]
        times = [p["train_time_s"] for p in results["curve"]]
        assert steps == [3, 6] and [p["tokens"] for p in results["curve"]] == [384, 768]
        # the evaluations are left out of the training time (each figure rounded to 1 ms)
        train_only = results["train_runtime_s"] - results["eval_runtime_s"]
        assert 0 < times[0] < times[1] <= train_only + 0.002
        assert (folder / "efficiency_report.json").is_file()
    results = run["results"]
    assert results["baseline"]["optim"] == "adamw_torch_fused"
    assert results["comparison"]["target_perplexity"] == results["baseline"]["best_eval_perplexity"]


def test_vocabulary_and_tokens_come_from_the_splits(run):
    results = run["results"]
    train = corpus(SPLIT_LINES["train"], 0)
    # one <eos> per line, empty lines included
    assert results["train_tokens"] == sum(len(line.split()) + 1 for line in train)
    words = {w for line in train for w in line.split()}
    assert results["architecture"]["vocab_size"] == len(words | {"<unk>", "<eos>"})
    tokenizer = AutoTokenizer.from_pretrained(run["out"])
    assert tokenizer.convert_ids_to_tokens([0, 1]) == ["<unk>", "<eos>"]
    assert tokenizer("w1 notaword")["input_ids"] == [tokenizer.convert_tokens_to_ids("w1"), 0]


@pytest.mark.parametrize("which", ["run", "baseline"])
def test_saved_model_and_tokenizer_load_and_generate(run, which):
    folder = run["out"] if which == "run" else run["out"] / "baseline"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    prompt = tokenizer("the game began", return_tensors="pt")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no pad-token or attention-mask warning
        output = model.generate(**prompt, max_new_tokens=5, do_sample=False)
    assert output.shape[1] > prompt["input_ids"].shape[1]
    assert tokenizer.decode(output[0]).startswith("the game began ")


def test_card_is_a_text_generation_card_whose_use_block_runs(run, capsys):
    card = (run["out"] / "README.md").read_text()
    _, header, body = card.split("---\n", 2)
    meta = yaml.safe_load(header)
    assert meta["pipeline_tag"] == "text-generation" and meta["library_name"] == "transformers"
    splits = {r["dataset"]["split"]: r["metrics"] for r in meta["model-index"][0]["results"]}
    assert splits["validation"][0]["type"] == "perplexity"
    assert splits["test"] == [
        {
            "type": "perplexity",
            "value": round(run["results"]["test_perplexity"], 2),
            "name": f"Perplexity ({run['results']['test_tokens']} test tokens)",
        }
    ]
    assert "## Perplexity against training time" in body and "## Against the baseline" in body
    (use,) = re.findall(r"## Use\n\n```python\n(.*?)```", body, flags=re.S)
    assert json.dumps(str(run["out"].resolve())) in use  # the run's own folder
    torch.manual_seed(0)
    exec(compile(use, "card", "exec"), {})  # as a reader runs it
    printed = capsys.readouterr().out.split()
    # the prompt, its unknown words as <unk>, then at least one generated token
    assert printed[:3] == ["<unk>", "game", "began"] and len(printed) > 5


def test_a_recorded_run_is_skipped(run):
    runs_file = run["out"] / "runs.jsonl"
    lines = [json.loads(line) for line in runs_file.read_text().splitlines()]
    assert [line["key"]["optim"] for line in lines] == ["adamw_torch_fused", "adafisherw"]
    assert lines[1]["key"]["adafisher"]["ema"] == "paper"  # the recipe's rule
    assert lines[1]["key"]["learning_rate"] == recipe.recipe_defaults()["learning_rate"]
    assert lines[0]["key"]["learning_rate"] == recipe.TextRecipeArguments.baseline_learning_rate
    assert recipe.run_recipe(run["argv"]) is None  # both already there: nothing trains
    assert len(runs_file.read_text().splitlines()) == 2


def test_command_line_is_recorded(run):
    assert run["results"]["command"].startswith("python recipes/wikitext2_gpt2.py --dataset ")


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda folder: folder / "missing", "no such folder"),
        (lambda folder: folder, "no test.parquet"),
    ],
    ids=["missing folder", "missing split"],
)
def test_bad_data_is_one_line_at_the_start(text_folder, tmp_path, capsys, mutate, message):
    folder = tmp_path / "data"
    folder.mkdir()
    for split in ("train", "validation"):
        (folder / f"{split}.parquet").write_bytes((text_folder / f"{split}.parquet").read_bytes())
    with pytest.raises(SystemExit) as exit_info:
        recipe.run_recipe(flags(mutate(folder), tmp_path / "out"))
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("wikitext2_gpt2.py: error: --dataset ") and message in line
    assert not (tmp_path / "out").exists()


def test_bad_value_names_its_flag(text_folder, tmp_path, capsys):
    with pytest.raises(SystemExit):
        recipe.run_recipe(flags(text_folder, tmp_path, "--adafisher_gamma", "2"))
    assert "error: --adafisher_gamma 2.0: needs 0 < gamma < 1" in capsys.readouterr().err


def test_help_documents_every_flag_with_the_recipe_defaults():
    parser = recipe.build_parser()
    actions = {option: a for a in parser._actions for option in a.option_strings}
    for action in parser._actions:
        assert action.help, action.option_strings
    for flag, default in (
        ("--block_size", 256),
        ("--n_layer", 4),
        ("--n_embd", 512),
        ("--max_tokens", 20_000_000),
        ("--per_device_train_batch_size", 32),
        ("--optim", "adafisherw"),
        ("--logging_steps", 50),
    ):
        # the entry --help prints for the flag
        entry = " ".join(parser._get_formatter()._format_action(actions[flag]).split())
        assert entry.endswith(f"(default: {default})"), entry


def test_token_budget_and_evaluation_interval_become_steps():
    recipe_args, args = recipe.build_parser().parse_args_into_dataclasses(
        args=["--use_cpu", "--max_tokens", "1000000", "--eval_every_tokens", "100000"]
    )
    args = recipe.schedule(recipe_args, args, set())
    assert (args.max_steps, args.eval_steps) == (123, 12)  # 8,192 tokens a step
    kept = recipe.schedule(recipe_args, args, {"max_steps", "eval_steps"})
    assert (kept.max_steps, kept.eval_steps) == (args.max_steps, args.eval_steps)


def test_gpt2_small_shape_has_about_110m_parameters():
    recipe_args = recipe.TextRecipeArguments(n_layer=12, n_head=12, n_embd=768)
    with torch.device("meta"):
        model = recipe.build_model(recipe_args, vocab_size=33_278, eos=1)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert recipe.parameter_count(model) == 110_810_112


@pytest.mark.parametrize("ema", ["reference", "paper"])
def test_adafisher_rules_cover_the_gpt2_model(ema):
    recipe_args = recipe.TextRecipeArguments(n_layer=2, n_head=2, n_embd=32, block_size=16)
    torch.manual_seed(0)
    model = recipe.build_model(recipe_args, vocab_size=50, eos=1)
    optimizer = AdaFisherW.from_model(model, ema=ema, update_every=1)
    ids = torch.randint(0, 50, (4, 16), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    layers = optimizer.collector.layers
    kinds = {name: type(layer.module) for name, layer in layers.items()}
    assert {torch.nn.Embedding, Conv1D, torch.nn.LayerNorm} == set(kinds.values())
    assert sum(kind is Conv1D for kind in kinds.values()) == 8  # 4 per block
    # the tied weight takes the input embedding's factors, once; the output layer none
    assert "lm_head" not in layers
    assert optimizer.collector.factors_for(model.lm_head.weight).layout is not None
    for name, layer in layers.items():
        assert torch.isfinite(layer.a).all() and torch.isfinite(layer.g).all(), name
    assert all(torch.isfinite(p).all() for p in model.parameters())


def flag_values(argv: list[str]) -> dict[str, str]:
    """Each flag of a command line with the word after it."""
    return dict(zip(argv, argv[1:], strict=False))


def fake_training(runs_file: Path, perplexity_at) -> list[list[str]]:
    """A stand-in for the recipe: records a run of ``--lr`` / ``--seed`` / ``--run_name``
    with ``perplexity_at(lr)``; returns the command lines it was given."""
    calls: list[list[str]] = []

    def train(argv: list[str]) -> None:
        calls.append(argv)
        value = flag_values(argv)
        key = {"learning_rate": float(value["--lr"]), "seed": int(value["--seed"])}
        ppl = perplexity_at(key["learning_rate"])
        line = {"key": key, "name": value["--run_name"], "best_eval_perplexity": ppl}
        with open(value["--runs_file"], "a") as f:
            f.write(json.dumps(line) + "\n")

    train.calls = calls
    return train


def test_grid_grows_past_the_best_end_then_runs_the_seeds(tmp_path):
    runs_file = str(tmp_path / "runs.jsonl")
    # the best learning rate is 9e-3, above the list: one step past its top end
    train = fake_training(tmp_path, lambda lr: abs(math.log(lr / 9e-3)) + 50)
    done = grid.run_grid(
        {"adafisher": ["--optim", "adafisherw"]},
        {"adafisher": [1e-3, 3e-3]},
        [42, 43],
        runs_file,
        ["--dataset", "DIR"],
        out_dir=str(tmp_path / "runs"),
        train=train,
    )
    assert done
    tried = [(float(flag_values(a)["--lr"]), flag_values(a)["--seed"]) for a in train.calls]
    assert tried == [(1e-3, "42"), (3e-3, "42"), (9e-3, "42"), (2.7e-2, "42"), (9e-3, "43")]
    first = train.calls[0]
    assert first[:4] == ["--dataset", "DIR", "--optim", "adafisherw"]
    assert first[-1] == str(tmp_path / "runs" / "adafisher" / "lr0.001_seed42")


def test_grid_continues_where_it_stopped(tmp_path):
    runs_file = str(tmp_path / "runs.jsonl")
    arms, lrs = {"adamw": ["--optim", "adamw_torch_fused"]}, {"adamw": [1e-4, 1e-3, 1e-2]}
    train = fake_training(tmp_path, lambda lr: abs(math.log(lr / 1e-3)) + 60)
    assert not grid.run_grid(arms, lrs, [1, 2], runs_file, [], train=train, max_wall=-1)
    assert train.calls == []  # past the wall clock: no run starts
    assert grid.run_grid(arms, lrs, [1, 2], runs_file, [], train=train)
    assert len(train.calls) == 4
    again = fake_training(tmp_path, lambda lr: 0.0)
    assert grid.run_grid(arms, lrs, [1, 2], runs_file, [], train=again)
    assert again.calls == []  # every run is in the runs file


def test_grid_summary_of_recorded_runs(run):
    lines = grid.records(run["out"] / "runs.jsonl")
    for line, name in zip(lines, ("adamw", "adafisher"), strict=True):
        line["name"] = name
    table = grid.summary(lines, "adamw", first_seed=42)
    rows = {r.split(" | ")[0].strip("| "): r for r in table.splitlines()[3:] if r.startswith("|")}
    assert set(rows) == {"adamw", "adafisher"}
    assert table.endswith("tuning runs at seed 42: adamw 1, adafisher 1")
    assert rows["adamw"].endswith("(runs) | 1.000 |")  # the target reaches itself
    assert f"{lines[1]['test_perplexity']:.2f}" in rows["adafisher"]


def test_grid_summary_times_the_target_at_solo_speed():
    def run(name, ppls, seed=0):
        curve = [
            {"tokens": 1e6 * (i + 1), "train_time_s": 50.0 * (i + 1), "eval_perplexity": p}
            for i, p in enumerate(ppls)
        ]
        key = {"optim": name, "learning_rate": 1e-3, "seed": seed, "max_steps": 4}
        return {
            "name": name,
            "key": key,
            "curve": curve,
            "eval_perplexity": ppls[-1],
            "best_eval_perplexity": min(ppls),
            "test_perplexity": ppls[-1],
        }

    # the target is the lowest point of the seeds' mean curve (100 at 3M tokens), not
    # the mean of the seeds' own best points (99)
    runs = [
        run("adamw", [130, 110, 100, 101]),
        run("adamw", [130, 110, 100, 99], seed=1),
        run("fast", [120, 100, 95, 94]),
    ]
    timing = [
        {
            "key": {"optim": "adamw", "learning_rate": 3e-4, "seed": 7, "max_steps": 300},
            "tokens_per_second": 1e5,
        },
        {
            "key": {"optim": "fast", "learning_rate": 3e-4, "seed": 7, "max_steps": 300},
            "tokens_per_second": 5e4,
        },
    ]
    table = grid.summary(runs, "adamw", first_seed=0, timing=timing)
    assert table.splitlines()[0].endswith(", 100.00")
    rows = {row.split(" | ")[0].strip("| "): row for row in table.splitlines()[3:]}
    # adamw: 3M tokens at 1e5 tokens/s; fast: 2M at 5e4: 40 s, 4/3 of adamw's 30 s
    assert rows["adamw"].endswith("| 3.0 | 30.0 (solo) | 1.000 |")
    assert rows["fast"].endswith("| 2.0 | 40.0 (solo) | 1.333 |")


RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def test_recipe_defaults_are_the_best_of_its_grid():
    """The recipe's rule and learning rates are the committed grid's best
    (benchmarks/results/wikitext2_runs.jsonl, BENCHMARKS.md)."""
    runs = grid.records(RESULTS / "wikitext2_runs.jsonl")
    best = grid.best_learning_rates(runs, first_seed=42)

    at_best = {
        arm: [r for r in runs if r["name"] == arm and r["key"]["learning_rate"] == lr]
        for arm, lr in best.items()
    }
    assert {arm: len(seeds) for arm, seeds in at_best.items()} == dict.fromkeys(best, 3)
    winner = min(
        (arm for arm in best if arm != "adamw"),
        key=lambda arm: sum(map(grid.score, at_best[arm])),
    )
    rule = at_best[winner][0]["key"]["adafisher"]
    defaults = recipe.recipe_defaults()
    assert defaults["adafisher_ema"] == rule["ema"]
    assert defaults["learning_rate"] == best[winner]
    assert recipe.TextRecipeArguments.baseline_learning_rate == best["adamw"]


def test_the_plan_says_the_time_on_a_cpu_and_offers_the_quick_form(text_folder, tmp_path, capsys):
    assert recipe.run_recipe(flags(text_folder, tmp_path / "out", "--dry_run")) is None
    printed = " ".join(capsys.readouterr().out.split())
    assert "wikitext2_gpt2: a GPT-2-style model (2 layers x 64, 2 heads, " in printed
    assert "6 optimizer steps of 128 tokens" in printed and "on cpu" in printed
    assert re.search(r"One step takes about [\d.]+ s here: about \d+ s of training", printed)
    assert "--quick trains the form of this recipe sized for a CPU" in printed
    assert not (tmp_path / "out").exists()


def test_quick_form_defaults_and_its_output_folder(text_folder):
    recipe_args, args = recipe.parse_args(["--quick", "--dataset", str(text_folder), "--use_cpu"])
    assert (recipe_args.n_layer, recipe_args.n_embd, recipe_args.max_vocab) == (2, 128, 4096)
    assert recipe_args.baseline and recipe_args.max_eval_tokens == 16_384
    assert args.output_dir.startswith(os.path.join("outputs", "wikitext2_gpt2-quick-wikitext"))
    args = recipe.schedule(recipe_args, args, set())
    assert args.max_steps == 200 and args.eval_steps == 100
    # any flag still wins
    recipe_args, _ = recipe.parse_args(["--quick", "--dataset", str(text_folder), "--n_layer", "3"])
    assert recipe_args.n_layer == 3


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max_tok", "5"], "did you mean '--max_tokens'?"),
        (
            ["--optim", "sgd", "--muon"],
            "--optim sgd with --muon: the rest of the model takes AdamW",
        ),
        (["--dataset", "/no/such/wikitext"], "--dataset /no/such/wikitext: no such folder: '/no"),
    ],
    ids=["prefix", "muon with sgd", "absolute path"],
)
def test_bad_flags_are_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        recipe.parse_args(argv)
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert message in line and "relative to" not in line


def test_without_the_hub_the_default_command_says_what_runs_offline(monkeypatch, tmp_path, capsys):
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HTTPS_PROXY", "https_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "https://hub.invalid")  # no resolver answers it
    monkeypatch.chdir(tmp_path)
    assert recipe.main([]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) <= 3
    assert lines[-1].startswith("wikitext2_gpt2.py: error: --dataset Salesforce/wikitext: ")
    assert "a local folder of the splits' parquet files" in lines[-1] and "--quick" in lines[-1]


def test_the_run_states_what_ran_and_prints_the_comparison(run):
    results = run["results"]
    s = results["settings"]
    assert s["cudnn_benchmark"] is None and s["num_train_epochs"] is None
    assert {"baseline", "max_tokens", "runs_file"} <= set(s["set_on_command_line"])
    assert s["adafisher"]["variant"] == "the paper's EMA rule (ema=paper), as published"
    assert results["device"].startswith("CPU: ")
    assert results["plan"].startswith("wikitext2_gpt2: a GPT-2-style model")
    assert "6 optimizer steps" in results["plan"] and results["optimizer_steps"] == 6
    console = run["console"].splitlines()
    header = next(i for i, line in enumerate(console) if line.startswith("optimizer "))
    rows = {line.split()[0]: line for line in console[header + 1 : header + 3]}
    assert f"{results['eval_perplexity']:.2f}" in rows["adafisherw"]
    assert f"{results['baseline']['eval_perplexity']:.2f}" in rows["adamw_torch_fused"]


# the new arms on the tiny model: Muon with AdamW on the rest, the paper rule refreshed
# every 10 steps, and its damping at the paper arm's best learning rate
ARMS = {
    "muon": ["--muon", "--muon_adamw_lr", "1e-3"],
    "paper10": ["--optim", "adafisherw", "--adafisher_ema", "paper"]
    + ["--adafisher_update_every", "10"],
    "paper10/d1e-2": ["--optim", "adafisherw", "--adafisher_ema", "paper"]
    + ["--adafisher_update_every", "10", "--adafisher_damping", "1e-2"],
}


def test_the_grid_trains_and_records_the_new_arms(text_folder, tmp_path):
    runs_file = str(tmp_path / "runs.jsonl")
    lrs = {"muon": [3e-3], "paper10": [3e-3], "paper10/d1e-2": "best:paper10"}
    common = flags(text_folder, tmp_path / "unused", "--no_plot")
    done = grid.run_grid(
        ARMS, lrs, [42], runs_file, common, out_dir=str(tmp_path / "runs"), extend=0
    )
    assert done
    lines = {line["name"]: line for line in grid.records(runs_file)}
    assert set(lines) == set(ARMS)
    muon = lines["muon"]["key"]
    assert muon["optim"] == "muon" and muon["muon"]["adamw_lr"] == 1e-3
    assert muon["muon"]["lr"] == 3e-3 and muon["muon"]["adamw"] == "adamw_torch_fused"
    assert lines["paper10"]["key"]["adafisher"]["update_every"] == 10
    damped = lines["paper10/d1e-2"]["key"]
    assert damped["adafisher"]["damping"] == 1e-2 and damped["learning_rate"] == 3e-3
    for line in lines.values():
        assert math.isfinite(line["best_eval_perplexity"]), line["name"]
    results = json.loads(
        (tmp_path / "runs" / "muon" / "lr0.003_seed42" / "results.json").read_text()
    )
    assert results["settings"]["optim"] == "muon"
    matrices = results["settings"]["muon"]["matrices"]
    assert len(matrices) == 8 and all(".h." in name for name in matrices)  # 4 per block
    table = grid.summary(grid.records(runs_file), "muon", 42, versus=["muon", "paper10"])
    assert "time / the better of muon, paper10" in table
    assert "tuning runs at seed 42: muon 1, paper10 2 (2 arms, best paper10" in table


@pytest.mark.parametrize("arm", ["muon", "paper10"])
def test_a_resumed_run_ends_where_the_whole_run_ends(arm, text_folder, tmp_path):
    """6 steps at once, against 3 then 3 more from the checkpoint (dropout off: the
    same arithmetic in both)."""
    common = [*ARMS[arm], "--dropout", "0", "--eval_strategy", "no", "--no_plot", "--lr", "3e-3"]
    whole = flags(text_folder, tmp_path / "whole", *common, "--save_strategy", "steps")
    recipe.run_recipe([*whole, "--save_steps", "3"])
    resumed = flags(text_folder, tmp_path / "resumed", *common)
    checkpoint = tmp_path / "whole" / "checkpoint-3"
    results = recipe.run_recipe([*resumed, "--resume_from_checkpoint", str(checkpoint)])
    assert results["resumed_from_step"] == 3 and results["global_step"] == 6
    assert results["optimizer_steps"] == 3
    ends = [
        load_file(folder / "model.safetensors")
        for folder in (tmp_path / "whole", tmp_path / "resumed")
    ]
    for name, tensor in ends[0].items():
        torch.testing.assert_close(ends[1][name], tensor, msg=name)
    card = (tmp_path / "resumed" / "README.md").read_text()
    assert "resumed from the checkpoint at step 3: these figures cover steps 4 to 6" in card
