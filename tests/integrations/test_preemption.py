"""Preemption: jobs stopped by a signal (or killed during a save) and restarted end exactly
as an uninterrupted run; checkpoints count only once marked complete.

The jobs (:mod:`hf_triaccel.testing.preemptible`) are forked from this process, which has
already imported torch and transformers, so each launch takes about a second. The full
chaos run (random moments, more configurations, the stock Trainer) is
``benchmarks/chaos.py``.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time

import pytest
import torch
from transformers import TrainerControl, TrainerState, TrainingArguments

from hf_triaccel.integrations.checkpoints import (
    COMPLETE_MARKER,
    RESUME_OR_START,
    CrashConsistentCheckpoints,
    is_complete,
    last_complete_checkpoint,
    mark_complete,
    resume_path,
)
from hf_triaccel.integrations.preemption import EXIT_PREEMPTED, PreemptionHandler
from hf_triaccel.testing import preemptible as job

LAUNCH_TIMEOUT = 120  # seconds: far above a launch's ~2 s, for a loaded CI host


def wait_for(condition, timeout: float = LAUNCH_TIMEOUT) -> None:
    began = time.monotonic()
    while not condition():
        if time.monotonic() - began > timeout:
            raise TimeoutError("the job never got there")
        time.sleep(0.005)


def finish(argv: list[str], world_size: int = 1, port: int = 0) -> None:
    """Runs the job's ranks to their end; each must exit 0."""
    processes = job.run_ranks(argv, world_size, port)
    for p in processes:
        p.join(LAUNCH_TIMEOUT)
    assert [p.exitcode for p in processes] == [0] * world_size


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_references: dict[tuple[str, int, str], dict] = {}


def reference(tmp_path_factory, config: str, epochs: str, world_size: int = 1) -> dict:
    """The uninterrupted run's final state (computed once per configuration)."""
    key = (config, world_size, epochs)
    if key not in _references:
        out = str(tmp_path_factory.mktemp(f"reference-{config}-{world_size}"))
        argv = ["--output_dir", out, "--config", config, "--epochs", epochs]
        finish(argv, world_size, free_port())
        _references[key] = job.load_final(out)
    return _references[key]


def completed(out: str, after: int = 0):
    """A condition: a complete checkpoint newer than step ``after`` exists."""

    def condition() -> bool:
        found = last_complete_checkpoint(out)
        return found is not None and int(found.rsplit("-", 1)[1]) > after

    return condition


def test_a_job_forked_after_parallel_torch_work_runs(tmp_path):
    """The caller has run a parallel torch operation (as the test process has, after
    other tests): the forked job must not hang on the copied thread pool."""
    torch.nn.functional.conv2d(torch.randn(8, 3, 64, 64), torch.randn(16, 3, 3, 3)).sum()
    (torch.randn(512, 512) @ torch.randn(512, 512)).sum()
    finish(["--output_dir", str(tmp_path), "--config", "adamw", "--epochs", "1"])


def test_sigterm_at_several_moments_resumes_bitwise(tmp_path_factory, tmp_path):
    """AdaFisherW with gradient accumulation: a signal right after the start, one just
    after a checkpoint (mid-step), one to the whole process group; each launch exits with
    EXIT_PREEMPTED (or, before the handler is installed, dies of the signal), and the
    restarted run ends bitwise equal to the uninterrupted one."""
    expected = reference(tmp_path_factory, "accumulation", "2")  # 16 steps
    out = str(tmp_path / "run")
    argv = ["--output_dir", out, "--config", "accumulation", "--epochs", "2"]

    early = job.launch(argv)
    wait_for(lambda: os.path.exists(os.path.join(out, "pid-0")))
    job.send(early, signal.SIGTERM)
    early.join(LAUNCH_TIMEOUT)
    assert early.exitcode in (EXIT_PREEMPTED, -signal.SIGTERM)

    for group in (False, True):
        job.clear_stops(out)
        done = int((last_complete_checkpoint(out) or "checkpoint-0").rsplit("-", 1)[1])
        process = job.launch(argv)
        wait_for(lambda d=done, p=process: completed(out, d)() or not p.is_alive())
        job.send(process, signal.SIGTERM, group=group)
        process.join(LAUNCH_TIMEOUT)
        last = last_complete_checkpoint(out) or ""
        if process.exitcode in (0, -signal.SIGTERM) and last.endswith("-16"):
            # training had ended before the signal could stop it (after train() returns,
            # the signal has its default action again: the job's own epilogue dies)
            break
        assert process.exitcode == EXIT_PREEMPTED
        (stop,) = job.stops(out)
        assert is_complete(os.path.join(out, f"checkpoint-{stop['stopped_at']}"))
    finish(argv)
    assert job.same_state(job.load_final(out), expected)


def test_group_signal_with_dataloader_workers(tmp_path_factory, tmp_path):
    """SIGTERM to the whole process group with two DataLoader workers: the workers do not
    die first, the job stops with a checkpoint and resumes exactly."""
    expected = reference(tmp_path_factory, "workers", "1")  # 24 steps
    out = str(tmp_path / "run")
    argv = ["--output_dir", out, "--config", "workers", "--epochs", "1"]
    process = job.launch(argv)
    wait_for(completed(out))
    job.send(process, signal.SIGTERM, group=True)
    process.join(LAUNCH_TIMEOUT)
    assert process.exitcode == EXIT_PREEMPTED
    finish(argv)
    assert job.same_state(job.load_final(out), expected)


def test_kill_during_slow_save_resumes_from_newest_complete(tmp_path_factory, tmp_path, caplog):
    """SIGKILL while checkpoint-20 is written: it stays, incomplete, and is skipped with a
    warning; the restart resumes from checkpoint-10 and ends bitwise equal."""
    expected = reference(tmp_path_factory, "adamw", "1")  # 24 steps
    out = str(tmp_path / "run")
    argv = ["--output_dir", out, "--config", "adamw", "--epochs", "1"]
    argv += ["--slow_save", "30", "--slow_save_from", "20"]
    process = job.launch(argv)
    weights = os.path.join(out, "checkpoint-20", "model.safetensors")
    wait_for(lambda: os.path.exists(weights))
    job.send(process, signal.SIGKILL, group=True)
    process.join(LAUNCH_TIMEOUT)
    assert process.exitcode == -signal.SIGKILL
    with caplog.at_level(logging.WARNING):
        found = last_complete_checkpoint(out)
    assert found == os.path.join(out, "checkpoint-10")
    assert "checkpoint-20 is incomplete" in caplog.text
    assert os.path.isdir(os.path.join(out, "checkpoint-20"))
    finish(["--output_dir", out, "--config", "adamw", "--epochs", "1"])
    assert job.same_state(job.load_final(out), expected)


def test_ddp_signal_to_one_rank_stops_both_at_one_step(tmp_path_factory, tmp_path):
    """2 gloo ranks, SIGTERM to rank 1 only: both stop at the same step with
    EXIT_PREEMPTED, and the resumed run ends bitwise equal to the uninterrupted one."""
    expected = reference(tmp_path_factory, "adamw", "2", world_size=2)  # 24 steps
    out = str(tmp_path / "run")
    argv = ["--output_dir", out, "--config", "adamw", "--epochs", "2"]
    ranks = job.run_ranks(argv, 2, free_port())
    wait_for(completed(out))
    job.send(ranks[1], signal.SIGTERM)
    for p in ranks:
        p.join(LAUNCH_TIMEOUT)
    assert [p.exitcode for p in ranks] == [EXIT_PREEMPTED] * 2
    first, second = job.stops(out)
    assert first["stopped_at"] == second["stopped_at"]
    assert first["agreements"] >= first["stopped_at"]  # the flag combined at every step
    finish(argv, 2, free_port())
    assert job.same_state(job.load_final(out), expected)


def _checkpoint(out, step: int, complete: bool) -> str:
    folder = os.path.join(out, f"checkpoint-{step}")
    os.makedirs(folder)
    if complete:
        mark_complete(folder, global_step=step, world_size=1)
    return folder


def test_save_total_limit_keeps_the_last_complete_checkpoint(tmp_path):
    """With save_total_limit=1 nothing is removed until the new checkpoint is marked;
    then older complete ones go, an interrupted older one goes with a warning, and an
    incomplete one newer than every complete one stays."""
    out = str(tmp_path)
    args = TrainingArguments(output_dir=out, save_total_limit=1, report_to=[], use_cpu=True)
    callback, control = CrashConsistentCheckpoints(), TrainerControl()
    callback.on_train_begin(args, TrainerState(), control)
    assert args.save_total_limit is None  # the Trainer's rotation, before the marker, is off
    _checkpoint(out, 10, complete=True)
    _checkpoint(out, 20, complete=False)  # a save that was killed
    _checkpoint(out, 30, complete=False)  # being written now
    _checkpoint(out, 40, complete=False)  # a later killed save, from another run
    state = TrainerState(global_step=30)
    callback.on_save(args, state, control)
    assert sorted(os.listdir(out)) == ["checkpoint-30", "checkpoint-40"]
    assert is_complete(os.path.join(out, "checkpoint-30"))
    callback.on_train_end(args, state, control)
    assert args.save_total_limit == 1


def test_a_folder_written_again_loses_its_marker(tmp_path):
    out = str(tmp_path)
    folder = _checkpoint(out, 10, complete=True)
    args = TrainingArguments(output_dir=out, report_to=[], use_cpu=True)
    control = TrainerControl(should_save=True)
    CrashConsistentCheckpoints().on_step_end(args, TrainerState(global_step=10), control)
    assert not os.path.exists(os.path.join(folder, COMPLETE_MARKER))


def test_resume_modes(tmp_path):
    out = str(tmp_path)
    assert resume_path(RESUME_OR_START, out) is None
    with pytest.raises(ValueError, match="no complete checkpoint"):
        resume_path(True, out)
    _checkpoint(out, 5, complete=True)
    _checkpoint(out, 9, complete=False)
    assert resume_path(RESUME_OR_START, out) == os.path.join(out, "checkpoint-5")
    assert resume_path(True, out) == os.path.join(out, "checkpoint-5")
    assert resume_path("elsewhere", out) == "elsewhere"


def test_a_second_signal_and_the_last_step():
    """A second signal changes nothing; a stop that would fall on the last step lets the
    run end as usual."""
    handler = PreemptionHandler(exit_code=None)
    args = TrainingArguments(output_dir="unused", report_to=[], use_cpu=True)
    control = TrainerControl()
    handler.on_train_begin(args, TrainerState(), control)
    try:
        for count in (1, 2):  # one at a time: a pending signal is not queued twice
            os.kill(os.getpid(), signal.SIGTERM)
            wait_for(lambda c=count: handler.watch.count == c, timeout=10)
        handler.on_step_end(args, TrainerState(global_step=8, max_steps=8), control)
        assert handler.stopped_at is None and not control.should_training_stop
        handler.on_step_end(args, TrainerState(global_step=3, max_steps=8), control)
        assert handler.stopped_at == 3 and control.should_save and control.should_training_stop
    finally:
        handler.on_train_end(args, TrainerState(), control)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
