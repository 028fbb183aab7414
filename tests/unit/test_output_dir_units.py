"""One run, one output_dir, one history: the pieces, in process.

The lock (:mod:`grpo_core.runtime.output_lock`) against real processes (a
child that exited is a dead holder) and lock files written as another host
would; setting a killed run's rows and checkpoints aside
(:mod:`grpo_core.checkpointing.lineage`); the config check's rules about
what output_dir holds; ``grpo report`` on a log with two histories; the
``--resume`` flag's parsing; the trackers continuing their runs. The same
paths with real ``grpo run`` processes: tests/e2e/reliability/test_output_dir.py.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import minimal_config

from grpo_core.checkpointing import lineage
from grpo_core.config.loader import validate
from grpo_core.contract.context import RunContext
from grpo_core.contract.errors import ConfigError
from grpo_core.interface.cli import bare_resume_as_latest, launch_overrides
from grpo_core.observability.history import split_log, surviving_rows
from grpo_core.observability.report import build_report
from grpo_core.runtime import output_lock
from grpo_core.runtime.output_lock import LOCK_FILE, Holder, OutputDirInUse, OutputLock, judge
from grpo_core.validation.run_check import check_run_config


def minimal(out: Path, **top: Any) -> dict[str, Any]:
    return minimal_config(**{"gradient_accumulation_steps": 2, "output_dir": str(out), **top})


def fake_checkpoint(out: Path, step: int) -> Path:
    path = out / f"checkpoint-{step}"
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text(json.dumps({"step": step}))
    return path


def rows(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def write_rows(path: Path, steps: list[int], tail: str = "") -> None:
    path.write_text("".join(json.dumps({"step": s, "loss": s / 10}) + "\n" for s in steps) + tail)


# ---------------------------------------------------------------- the lock


def test_a_live_holder_is_refused_by_name_and_released_at_the_end(tmp_path: Path) -> None:
    lines: list[str] = []
    with OutputLock(tmp_path, "run-a", "/configs/a.toml", lines.append) as lock:
        holder = Holder.from_text((tmp_path / LOCK_FILE).read_text())
        assert holder is not None
        assert (holder.pid, holder.host, holder.config) == (os.getpid(), socket.gethostname(), "/configs/a.toml")
        with pytest.raises(OutputDirInUse) as refused:
            OutputLock(tmp_path, "run-b").acquire()
        message = str(refused.value)
        assert f"in use by another run: run run-a (pid {os.getpid()} on host {socket.gethostname()}" in message
        assert "config /configs/a.toml" in message and "choose another output_dir" in message
        assert lock.held
    assert not (tmp_path / LOCK_FILE).exists()
    assert not lines and not list(tmp_path.iterdir())  # no line, no file left


def test_a_lock_whose_process_died_is_taken_over_with_a_line(tmp_path: Path) -> None:
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = Holder.of_this_process("run-dead", "/c.toml")
    dead.pid = int(child.stdout)  # a real process of this host, now gone
    (tmp_path / LOCK_FILE).write_text(dead.to_text())
    assert judge(dead) == (False, f"no process {dead.pid} runs on this host any more (it exited or was killed)")

    lines: list[str] = []
    with OutputLock(tmp_path, "run-new", log=lines.append):
        assert Holder.from_text((tmp_path / LOCK_FILE).read_text()).run == "run-new"
    assert len(lines) == 1
    assert lines[0].startswith(f"output_dir {tmp_path}: taking over the lock of run run-dead (pid {dead.pid} on host")
    assert "it exited or was killed" in lines[0] and "This run is run-new." in lines[0]


def test_a_reused_pid_does_not_keep_a_dead_holders_lock(tmp_path: Path) -> None:
    holder = Holder.of_this_process("run-old", None)
    holder.process_start = "1"  # this pid is alive, but its process started at another time
    live, why = judge(holder)
    assert not live and "reused" in why


def test_another_hosts_lock_is_live_while_its_heartbeat_is_fresh(tmp_path: Path) -> None:
    remote = Holder.of_this_process("run-remote", "/c.toml")
    remote.host, remote.pid = "node-7", 1
    (tmp_path / LOCK_FILE).write_text(remote.to_text())
    with pytest.raises(OutputDirInUse, match="it runs on host node-7, whose heartbeat was"):
        OutputLock(tmp_path, "run-here").acquire()

    remote.heartbeat = time.time() - output_lock.STALE_AFTER_S - 5
    (tmp_path / LOCK_FILE).write_text(remote.to_text())
    lines: list[str] = []
    with OutputLock(tmp_path, "run-here", log=lines.append):
        pass
    assert "taking over the lock of run run-remote" in lines[0]
    assert "it ran on another host (node-7) and its heartbeat stopped" in lines[0]


def test_the_heartbeat_is_refreshed_and_a_lock_lost_to_another_run_is_not_overwritten(tmp_path: Path) -> None:
    lines: list[str] = []
    lock = OutputLock(tmp_path, "run-a", log=lines.append)
    lock.acquire()
    try:
        before = Holder.from_text((tmp_path / LOCK_FILE).read_text()).heartbeat
        time.sleep(0.01)
        assert lock.refresh()
        assert Holder.from_text((tmp_path / LOCK_FILE).read_text()).heartbeat > before
        # another host judged this run stale and took over: the heartbeat stops, the lock is left alone
        other = Holder.of_this_process("run-b", None)
        other.host = "node-2"
        (tmp_path / LOCK_FILE).write_text(other.to_text())
        assert not lock.refresh()
        assert "is no longer this run's (now: run run-b" in lines[-1]
    finally:
        lock.release()
    assert Holder.from_text((tmp_path / LOCK_FILE).read_text()).run == "run-b"


def test_only_the_writing_process_takes_the_lock(tmp_path: Path, monkeypatch) -> None:
    """Rank 0 of a multi-process run holds it; the config check of the other
    ranks does not count it against them."""
    from grpo_core.training.run import _lock_output

    with OutputLock(tmp_path, "rank0"):
        monkeypatch.setenv("RANK", "1")
        assert _lock_output(RunContext(config=None, output_dir=tmp_path), None) is None  # type: ignore[arg-type]
        check_run_config(validate(minimal(tmp_path)))
        monkeypatch.setenv("RANK", "0")
        with pytest.raises(ConfigError, match="is in use by another run: run rank0"):
            check_run_config(validate(minimal(tmp_path)))


# ---------------------------------------------------------------- one history


def test_rows_after_the_step_move_out_and_a_cut_line_with_them(tmp_path: Path) -> None:
    log = tmp_path / "metrics.jsonl"
    write_rows(log, [1, 2, 3, 4], tail='{"step": 5, "lo')  # kill -9 while writing step 5
    moved: list[tuple[int | None, bytes]] = []
    assert split_log(log, 2, moved.extend) == 3
    assert rows(log) == [1, 2]
    assert [s for s, _ in moved] == [3, 4, None] and moved[-1][1] == b'{"step": 5, "lo\n'
    before = log.read_bytes()
    assert split_log(log, 2, moved.extend) == 0 and log.read_bytes() == before  # nothing after step 2: untouched


def test_set_aside_names_the_run_that_wrote_each_row_and_checkpoint(tmp_path: Path) -> None:
    """Run A trained to step 5 (checkpoints 2 and 4), was killed; B resumed
    from 4, trained 5 and 6, was killed; C resumes from checkpoint-2."""
    out = tmp_path / "out"
    out.mkdir()
    lineage.record_start(out, "A", 0, None, "c.toml")
    for step in (2, 4):
        fake_checkpoint(out, step)
    write_rows(out / "metrics.jsonl", [1, 2, 3, 4, 5])
    assert lineage.set_aside(out, 4, "B", "resuming from checkpoint-4") == [
        f"resuming from checkpoint-4: moved what run A wrote after step 4 (1 row(s) of metrics.jsonl) to "
        f"{out / 'abandoned' / 'A'} (nothing is deleted)"
    ]
    lineage.record_start(out, "B", 4, out / "checkpoint-4", "c.toml")
    with open(out / "metrics.jsonl", "a") as handle:
        handle.write("".join(json.dumps({"step": s}) + "\n" for s in (5, 6)))
    fake_checkpoint(out, 6)

    lines = lineage.set_aside(out, 2, "C", "resuming from checkpoint-2")
    assert rows(out / "metrics.jsonl") == [1, 2]
    assert [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-2"]
    assert rows(out / "abandoned" / "A" / "metrics.jsonl") == [5, 3, 4]  # A's 5 (set aside by B), then 3 and 4
    assert rows(out / "abandoned" / "B" / "metrics.jsonl") == [5, 6]
    assert (out / "abandoned" / "A" / "checkpoint-4" / "trainer_state.json").is_file()
    assert (out / "abandoned" / "B" / "checkpoint-6" / "trainer_state.json").is_file()
    assert len(lines) == 2 and "run A" in lines[0] and "checkpoint-4" in lines[0] and "run B" in lines[1]
    why = [json.loads(x) for x in (out / "abandoned" / "B" / "abandoned.jsonl").read_text().splitlines()]
    assert why == [
        {
            "at": why[0]["at"],
            "by_run": "C",
            "after_step": 2,
            "why": "resuming from checkpoint-2",
            "rows": {"metrics.jsonl": 2},
            "checkpoints": ["checkpoint-6"],
            "run": lineage.read_lineage(out)[1],
        }
    ]


def test_report_reads_one_history(tmp_path: Path) -> None:
    """A log written before rows were set aside holds [1, 2, 3, 3, 4]: the
    report plots the resumed run's step 3, and lists what sits in abandoned/."""
    records = [{"step": s, "reward": r} for s, r in [(1, 0.1), (2, 0.2), (3, 9.0), (3, 0.3), (4, 0.4)]]
    kept, dropped = surviving_rows(records)
    assert [(r["step"], r["reward"]) for r in kept] == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4)] and dropped == 1
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "abandoned" / "run-x").mkdir(parents=True)
    write_rows(tmp_path / "abandoned" / "run-x" / "metrics.jsonl", [5, 6])
    text, _ = build_report(tmp_path)
    assert "4 logged steps, last step 4" in text
    assert "9" not in text.split("\n")[2]  # reward row: first 0.1, last 0.4, best 0.4 @ 4
    assert "left out: 1 metrics row(s) superseded by a resumed run" in text
    assert f"run-x: 2 metrics rows (steps 5-6) in {tmp_path / 'abandoned' / 'run-x'}" in text


# ---------------------------------------------------------------- the config check


def test_config_check_refuses_a_fresh_start_over_checkpoints_and_says_the_ways_on(tmp_path: Path) -> None:
    out = tmp_path / "out"
    fake_checkpoint(out, 2)
    newest = fake_checkpoint(out, 10)
    with pytest.raises(ConfigError) as refused:
        check_run_config(validate(minimal(out, max_steps=50)))
    message = str(refused.value)
    assert f"holds 2 checkpoint(s) of an earlier run (newest: {newest}, step 10)" in message
    assert "--resume" in message and "new output_dir" in message and "--start-over" in message
    assert "deletes nothing" in message
    assert check_run_config(validate(minimal(out, resume_from_checkpoint="latest"))) == []
    assert check_run_config(validate(minimal(out)), trains=False) == []  # grpo eval, grpo rewards test
    (note,) = check_run_config(validate(minimal(out, start_over=True)))
    assert note.startswith("start_over = true: the run starts from step 0 and first moves 2 checkpoint(s)")
    with pytest.raises(ConfigError, match="start_over and resume_from_checkpoint are both set"):
        check_run_config(validate(minimal(out, start_over=True, resume_from_checkpoint="latest")))
    with pytest.raises(ConfigError, match="is not a complete grpo checkpoint"):
        check_run_config(validate(minimal(out, resume_from_checkpoint=str(out / "checkpoint-7"))))


def test_latest_with_nothing_to_resume_says_so(tmp_path: Path) -> None:
    (warning,) = check_run_config(validate(minimal(tmp_path / "new", resume_from_checkpoint="latest")))
    assert warning == (
        f'resume_from_checkpoint = "latest": output_dir {tmp_path / "new"} holds no checkpoint yet, so the run '
        "starts from step 0."
    )


# ---------------------------------------------------------------- grpo run --resume


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["run", "c.toml", "--resume"], ["run", "c.toml", "--resume", "latest"]),
        (["run", "--resume", "c.toml"], ["run", "--resume", "latest", "c.toml"]),
        (["run", "c.toml", "--resume", "--set", "a=1"], ["run", "c.toml", "--resume", "latest", "--set", "a=1"]),
        (["run", "c.toml", "--resume", "out/checkpoint-4"], ["run", "c.toml", "--resume", "out/checkpoint-4"]),
        (["config", "check", "--resume"], ["config", "check", "--resume"]),  # only `run` has the flag
    ],
)
def test_a_bare_resume_means_latest(argv: list[str], expected: list[str]) -> None:
    assert bare_resume_as_latest(argv) == expected


def test_the_flags_become_the_config_keys_they_stand_for() -> None:
    assert launch_overrides("latest", False) == ['resume_from_checkpoint="latest"']
    assert launch_overrides("/a b/checkpoint-2", True) == [
        'resume_from_checkpoint="/a b/checkpoint-2"',
        "start_over=true",
    ]


# ---------------------------------------------------------------- trackers


def _context(out: Path, start_step: int, lines: list[str]) -> RunContext:
    return RunContext(config=validate(minimal(out)), output_dir=out, log=lines.append, start_step=start_step)


def test_tensorboard_rewinds_to_the_resumed_step(tmp_path: Path) -> None:
    """TensorBoard's purge_step: what the killed run logged after the
    checkpoint is hidden, the resumed run's values take its place."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from grpo_plugins.trackers import TensorBoardTracker

    killed = TensorBoardTracker(_context(tmp_path, 0, []))
    for step in (1, 2, 3, 4):
        killed.log({"reward": float(step)}, step)
    killed.close()
    time.sleep(1.1)  # event files are named by the second they were opened in
    resumed = TensorBoardTracker(_context(tmp_path, 2, []))
    for step in (3, 4, 5):
        resumed.log({"reward": 10.0 * step}, step)
    resumed.close()
    events = EventAccumulator(str(tmp_path / "runs"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward")] == [
        (1, 1.0),
        (2, 2.0),
        (3, 30.0),
        (4, 40.0),
        (5, 50.0),
    ]


@pytest.mark.parametrize("tracker", ["wandb", "mlflow"])
def test_a_resumed_run_continues_its_tracker_run(tmp_path: Path, tracker: str, monkeypatch) -> None:
    """W&B (offline) and MLflow (a file store in output_dir) continue the run
    a fresh start made; each says it cannot drop what the killed run logged
    after the checkpoint. A fresh start makes a new run."""
    from grpo_plugins.trackers import MlflowTracker, WandbTracker

    monkeypatch.setenv("WANDB_SILENT", "true")
    make = {"wandb": WandbTracker, "mlflow": MlflowTracker}[tracker]

    def run_id(t: Any) -> str:
        return t.run.id if tracker == "wandb" else t.run.info.run_id

    first = make(_context(tmp_path, 0, []))
    for step in (1, 2, 3):
        first.log({"reward": float(step)}, step)
    first_id = run_id(first)
    first.close()
    assert json.loads((tmp_path / f"{tracker}-run.json").read_text()) == {"id": first_id, "last_step": 3}

    lines: list[str] = []
    resumed = make(_context(tmp_path, 2, lines))
    assert run_id(resumed) == first_id
    resumed.log({"reward": 30.0}, 3)
    resumed.close()
    assert lines[0] == f"{tracker}: continuing run {first_id} from step 2"
    assert "holds what the interrupted run logged for steps 3-3" in lines[1]

    fresh = make(_context(tmp_path, 0, []))
    assert run_id(fresh) != first_id
    fresh.close()
