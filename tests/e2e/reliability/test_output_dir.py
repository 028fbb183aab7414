"""One run, one output directory, one history, with real ``grpo run`` processes.

A second run in a live run's ``output_dir`` is refused, naming the holder;
the lock a ``kill -9`` leaves is taken over; the resumed run's logs hold each
step once and the killed run's later rows sit in ``abandoned/<its run id>/``;
a fresh start over checkpoints is refused, and ``--start-over`` moves the old
ones aside; ``--resume`` takes the newest checkpoint or a path, and with
nothing to resume says so (docs/reliability.md, "One run, one output
directory, one history").

On the tiny random model (tests/tiny_model.py) with LoRA and the
transformers rollout: this is plumbing, not learning (2-4 steps of well
under a second; most of each process's time is its start).
"""

from __future__ import annotations

import hashlib
import json
import signal
import socket
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from fault_harness import GRPO, GrpoProcess, Runner, assert_clean_failure, assert_no_model_loaded, metrics, populate

from grpo_core.checkpointing.checkpoint import list_checkpoints
from grpo_core.checkpointing.lineage import read_lineage
from grpo_core.interface.cli import main
from grpo_core.observability.report import build_report

HOLD_REWARDS = '''
"""A reward that holds the run inside a step (while HOLD_FILE exists, once
metrics.jsonl has a row of step HOLD_AFTER): a live run that does not end."""
import json
import os
import time
from pathlib import Path


def _logged(metrics):
    if not metrics.is_file():
        return 0
    return max((json.loads(line)["step"] for line in metrics.read_text().splitlines() if line.strip()), default=0)


def hold(completions, **kwargs):
    flag, metrics = Path(os.environ.get("HOLD_FILE", "/nonexistent")), Path(os.environ.get("HOLD_METRICS", "."))
    after = int(os.environ.get("HOLD_AFTER", "0"))
    while after and flag.exists() and _logged(metrics) >= after:
        flag.with_suffix(".holding").write_text(str(os.getpid()))
        time.sleep(0.05)
    return [float(len(str(c)) % 3) / 2.0 for c in completions]
'''


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_dir: str) -> str:
    return tiny_model_dir  # the session's (read only): these runs write in their own output_dir


@pytest.fixture()
def runner(tmp_path: Path, tiny_dir: str) -> Iterator[Runner]:
    workdir = populate(tmp_path / "work")
    (workdir / "hold_rewards.py").write_text(HOLD_REWARDS, encoding="utf-8")
    runs = Runner(workdir, tiny_dir)
    yield runs
    runs.close()


def grpo_run(runner: Runner, config: Path, *flags: str, env: dict[str, str] | None = None) -> GrpoProcess:
    return runner.start(config, env=env, argv=[GRPO, "run", str(config), *flags])


def steps(out: Path, log: str = "metrics.jsonl") -> list[int]:
    path = out / log
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.is_file() else []


def lines_of(path: Path, step: int) -> list[str]:
    return [line for line in path.read_text().splitlines() if json.loads(line)["step"] == step]


def tree_digest(path: Path) -> str:
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(file.relative_to(path).as_posix().encode())
        digest.update(file.read_bytes())
    return digest.hexdigest()


def test_a_live_runs_output_dir_is_refused_and_a_killed_ones_is_taken_over_with_one_history(runner: Runner) -> None:
    out = runner.workdir / "out"
    hold = runner.workdir / "hold"
    hold.write_text("")
    config = runner.config(
        max_steps=4, save_steps=2, trl={"reward_funcs": ["hold_rewards.hold"], "log_completions": True}
    )
    first = grpo_run(
        runner, config, env={"HOLD_FILE": str(hold), "HOLD_AFTER": "3", "HOLD_METRICS": str(out / "metrics.jsonl")}
    )
    # steps 1-3 logged (checkpoint-2 saved), then it holds inside step 4: alive, not ending
    first.wait_until(hold.with_suffix(".holding").is_file, "the first run holding in step 4")
    lock = json.loads((out / "run.lock").read_text())
    assert (lock["pid"], lock["host"], lock["config"]) == (first.pid, socket.gethostname(), str(config.resolve()))

    # the same command again (a requeued job, a second terminal): refused at start, naming the holder
    second = grpo_run(runner, config)
    assert_clean_failure(second.finish(), second.output)
    assert (
        f"error: output_dir {out} is in use by another run: run {lock['run']} (pid {first.pid} on host "
        f"{socket.gethostname()}, started {lock['started_at']}, config {config.resolve()}; last heartbeat"
    ) in second.output
    assert f"process {first.pid} is running on this host" in second.output
    assert_no_model_loaded(second.output)
    assert first.proc.poll() is None and steps(out) == [1, 2, 3]

    first.kill(signal.SIGKILL)
    assert first.finish() == -signal.SIGKILL
    assert list_checkpoints(out) == [out / "checkpoint-2"]  # step 3 was logged, never checkpointed
    killed_metrics = lines_of(out / "metrics.jsonl", 3)
    killed_completions = lines_of(out / "completions.jsonl", 3)
    assert len(killed_metrics) == 1 and len(killed_completions) == 4

    # the lock the kill left is taken over; the resumed run's logs hold each step once
    hold.unlink()
    resumed = grpo_run(runner, config, "--resume")
    assert resumed.finish() == 0, resumed.tail()
    output = resumed.output
    assert f"output_dir {out}: taking over the lock of run {lock['run']} (pid {first.pid} on host" in output
    assert f"no process {first.pid} runs on this host any more (it exited or was killed)" in output
    abandoned = out / "abandoned" / lock["run"]
    assert (
        f"resuming from {out / 'checkpoint-2'}: moved what run {lock['run']} wrote after step 2 (1 row(s) of "
        f"metrics.jsonl; 4 row(s) of completions.jsonl) to {abandoned} (nothing is deleted)"
    ) in output
    assert f"resumed from {out / 'checkpoint-2'} at step 2" in output
    assert steps(out) == [1, 2, 3, 4]
    assert Counter(steps(out, "completions.jsonl")) == {1: 4, 2: 4, 3: 4, 4: 4}
    # the killed run's step 3 is where the docs say, as it was written
    assert (abandoned / "metrics.jsonl").read_text().splitlines() == killed_metrics
    assert (abandoned / "completions.jsonl").read_text().splitlines() == killed_completions
    assert lines_of(out / "metrics.jsonl", 3) != killed_metrics  # the surviving run's own step 3
    (why,) = [json.loads(line) for line in (abandoned / "abandoned.jsonl").read_text().splitlines()]
    assert why["after_step"] == 2 and why["run"]["run"] == lock["run"] and why["run"]["pid"] == first.pid
    starts = [r for r in read_lineage(out) if r["event"] == "start"]
    ends = [r for r in read_lineage(out) if r["event"] == "end"]
    assert [(r["run"], r["start_step"]) for r in starts] == [(lock["run"], 0), (why["by_run"], 2)]
    assert [(r["run"], r["status"], r["step"]) for r in ends] == [(why["by_run"], "completed", 4)]
    assert not (out / "run.lock").exists()

    text, _ = build_report(out)  # grpo report: the one history, and what was set aside
    assert "4 logged steps, last step 4" in text and "left out" not in text
    assert f"{lock['run']}: 1 metrics rows (steps 3-3) in {abandoned}" in text


def test_a_fresh_start_over_checkpoints_is_refused_and_start_over_keeps_them(
    runner: Runner, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = runner.workdir / "out"
    config = runner.config(max_steps=2, save_steps=1)

    # --resume with nothing to resume: said, and the run starts from step 0
    first = grpo_run(runner, config, "--resume")
    assert first.finish() == 0, first.tail()
    assert (
        f'warning: resume_from_checkpoint = "latest": output_dir {out} holds no checkpoint yet, so the run starts '
        "from step 0." in first.output
    )
    assert steps(out) == [1, 2] and list_checkpoints(out) == [out / "checkpoint-1", out / "checkpoint-2"]
    before = {p.name: tree_digest(p) for p in list_checkpoints(out)}
    rows_before = (out / "metrics.jsonl").read_text()
    (first_run,) = {r["run"] for r in read_lineage(out)}

    monkeypatch.chdir(runner.workdir)  # where the config's reward module is found
    # the same config again, no resume: refused before the model loads, nothing touched
    again = grpo_run(runner, config)
    assert_clean_failure(again.finish(), again.output)
    refusal = (
        f"output_dir {out} holds 2 checkpoint(s) of an earlier run (newest: {out / 'checkpoint-2'}, step 2; it "
        "reached max_steps = 2); a fresh start would train from step 0 and overwrite them."
    )
    assert f"error: {refusal}" in again.output
    for way in ("`grpo run CONFIG --resume`", "a new output_dir", "`grpo run CONFIG --start-over`", "deletes nothing"):
        assert way in again.output
    assert_no_model_loaded(again.output)
    assert {p.name: tree_digest(p) for p in list_checkpoints(out)} == before
    assert (out / "metrics.jsonl").read_text() == rows_before

    assert main(["config", "check", str(config)]) == 2  # in process: the CLI path, without another start
    assert refusal in capsys.readouterr().err

    # --start-over: a new history from step 0; the old checkpoints and rows kept, moved aside
    over = grpo_run(runner, config, "--start-over")
    assert over.finish() == 0, over.tail()
    kept = out / "abandoned" / first_run
    assert (
        f"start_over: moved what run {first_run} wrote after step 0 (2 row(s) of metrics.jsonl; checkpoint-1, "
        f"checkpoint-2) to {kept} (nothing is deleted)"
    ) in over.output
    assert {name: tree_digest(kept / name) for name in before} == before
    assert (kept / "metrics.jsonl").read_text() == rows_before
    assert steps(out) == [1, 2] and list_checkpoints(out) == [out / "checkpoint-1", out / "checkpoint-2"]

    # --resume PATH: from checkpoint-1; the later checkpoint and row of the run it abandons move aside
    second_run = read_lineage(out)[-1]["run"]
    resumed = grpo_run(runner, config, "--resume", str(out / "checkpoint-1"))
    assert resumed.finish() == 0, resumed.tail()
    assert f"resumed from {out / 'checkpoint-1'} at step 1" in resumed.output
    assert steps(out) == [1, 2]
    assert steps(out / "abandoned" / second_run) == [2]
    assert (out / "abandoned" / second_run / "checkpoint-2" / "trainer_state.json").is_file()
    assert len(metrics(out)) == 2
