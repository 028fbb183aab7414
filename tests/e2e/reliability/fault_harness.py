"""The harness of the reliability tests: real faults injected into real
``grpo run`` processes.

Every test here starts the installed ``grpo`` console script (or a small
driver around :func:`grpo_core.interface.cli.main`) as a subprocess on the real
SmolLM2-135M-Instruct with tiny settings (2 short prompts x 2 completions of
8 tokens, LoRA r=4, a few steps, about 2.5 s a step on one core), injects one fault (a bad file, a failing
reward function, a signal, ``kill -9``, a file-size limit, a broken server)
and checks what the user sees and what is left on disk.

Synchronisation is by polling files and output with a deadline (never a
fixed sleep). Child processes run with one intra-op thread: on a loaded
2-core machine torch's default thread pool spins against other processes and
a step takes 20x longer (75 s instead of 4 s, measured here).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import GRPO, merged, no_traceback, raw_config, write_toml
from vllm_session import SERVER_TABLE

MODEL_LOADING = "loading model from"  # grpo_core.training.run logs it right before the weights load
RUN_TIMEOUT_S = 600.0  # one tiny run takes 10-40 s; generous for a loaded machine

REWARDS = '''
"""Reward functions for the reliability tests.

``good`` needs the dataset's ``answer`` column. Each ``reward_<kind>``
returns valid values except on the call number given by the environment
variable ``FAULT_AT_<KIND>``, where it injects its fault. Calls are counted
in files under ``FAULT_COUNTER_DIR``, so the count survives a reward worker
being killed and replaced.
"""
import math
import os
import time
from pathlib import Path


def _values(completions):
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [float(len(t) % 3) / 2.0 for t in texts]


def _due(kind):
    at = int(os.environ.get(f"FAULT_AT_{kind.upper()}", "0"))
    if not at:
        return False
    counter = Path(os.environ["FAULT_COUNTER_DIR"]) / f"calls-{kind}"
    calls = int(counter.read_text()) + 1 if counter.exists() else 1
    counter.write_text(str(calls))
    return calls == at


def good(completions, answer, **kwargs):
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [(1.0 if str(a) in t else 0.0) + (len(t) % 2) * 0.5 for t, a in zip(texts, answer)]


def reward_raises(completions, **kwargs):
    if _due("raises"):
        raise ValueError("injected failure")
    return _values(completions)


def reward_hangs(completions, **kwargs):
    if _due("hangs"):
        time.sleep(3600)
    return _values(completions)


def reward_exits(completions, **kwargs):
    if _due("exits"):
        os._exit(17)
    return _values(completions)


def reward_waits(completions, **kwargs):
    """On the due call: say so (file ``waiting``) and hold until file ``go`` exists in ``FAULT_COUNTER_DIR``'s
    parent, so a test can change the world at a known point of the run."""
    if _due("waits"):
        gate = Path(os.environ["FAULT_COUNTER_DIR"]).parent
        (gate / "waiting").touch()
        deadline = time.monotonic() + 600
        while not (gate / "go").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    return _values(completions)


def reward_nan(completions, **kwargs):
    values = _values(completions)
    if _due("nan"):
        values[1] = math.nan
    return values


def reward_short(completions, **kwargs):
    values = _values(completions)
    return values[:-1] if _due("short") else values


def reward_string(completions, **kwargs):
    values = _values(completions)
    if _due("string"):
        values[0] = "high"
    return values
'''


def write_dataset(path: Path, rows: int = 8, long_rows: int = 0, with_answer: bool = True) -> Path:
    """Plain-text prompts 'Q: What is a + b?\\nA:' (about 15 tokens: a step
    costs a third less than with chat messages and SmolLM2's system prompt);
    ``long_rows`` extra prompts of about 900 tokens, over sequence_len = 128."""
    records = []
    for a in range(1, rows + 1):
        record: dict[str, Any] = {"prompt": f"Q: What is {a} + {a + 1}?\nA:"}
        if with_answer:
            record["answer"] = str(2 * a + 1)
        records.append(record)
    for i in range(long_rows):
        record = {"prompt": "Q: Add these numbers: " + " + ".join(str(n) for n in range(i, i + 200)) + "\nA:"}
        if with_answer:
            record["answer"] = "0"
        records.append(record)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def populate(workdir: Path) -> Path:
    """A run's working directory: the reward module and the dataset."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "faulty_rewards.py").write_text(REWARDS, encoding="utf-8")
    write_dataset(workdir / "train.jsonl")
    return workdir


def base_config(workdir: Path, model_dir: str) -> dict[str, Any]:
    return raw_config(
        model_dir,
        workdir,
        adapter="lora",
        lora_r=4,
        lora_alpha=8,
        sequence_len=128,
        micro_batch_size=4,  # 2 prompts x 2 completions per step
        gradient_accumulation_steps=1,
        max_steps=2,
        learning_rate=1e-3,
        lr_scheduler="constant",
        seed=7,
        trl={
            "num_generations": 2,
            "max_completion_length": 8,
            "temperature": 1.0,
            "reward_funcs": ["faulty_rewards.good"],
        },
    )


def write_config(workdir: Path, model_dir: str, name: str = "config.toml", **overrides: Any) -> Path:
    """``base_config`` with ``overrides`` (``trl`` and ``vllm`` are merged key by key)."""
    return write_toml(workdir / name, merged(base_config(workdir, model_dir), **overrides))


def child_env(workdir: Path, **extra: str) -> dict[str, str]:
    counters = workdir / f"counters-{time.monotonic_ns()}"  # fresh per process: call counts start at 0
    counters.mkdir()
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "FAULT_COUNTER_DIR": str(counters),
    }
    env.update(extra)
    return env


class GrpoProcess:
    """A running ``grpo`` (or driver) process; stdout and stderr are merged
    and collected by a thread, so its output can be polled while it runs."""

    def __init__(
        self, argv: list[str], cwd: Path, env: dict[str, str], preexec_fn: Callable[[], None] | None = None
    ) -> None:
        self.argv = argv
        self.started = time.monotonic()
        self.proc = subprocess.Popen(  # noqa: S603 - our own console script
            argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            preexec_fn=preexec_fn,
        )
        self._chunks: list[bytes] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.seconds = 0.0

    def _read(self) -> None:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while chunk := os.read(fd, 65536):
            self._chunks.append(chunk)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def output(self) -> str:
        return b"".join(self._chunks).decode("utf-8", "replace")

    def tail(self, chars: int = 6000) -> str:
        return self.output[-chars:]

    def wait_until(self, condition: Callable[[], Any], what: str, timeout: float = RUN_TIMEOUT_S) -> Any:
        """Poll ``condition`` until it is truthy; fail if the process ends
        first or the deadline passes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = condition()
            if value:
                return value
            if self.proc.poll() is not None:
                value = condition()
                if value:
                    return value
                pytest.fail(f"{what}: the process exited ({self.proc.returncode}) first.\n{self.tail()}")
            time.sleep(0.2)
        pytest.fail(f"{what}: not within {timeout:.0f} s.\n{self.tail()}")

    def finish(self, timeout: float = RUN_TIMEOUT_S) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"{' '.join(self.argv)} did not finish within {timeout:.0f} s.\n{self.tail()}")
        self._reader.join(timeout=30)
        self.seconds = time.monotonic() - self.started
        return code

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)


class Runner:
    """Starts ``grpo run CONFIG`` processes in one working directory and
    kills whatever is still running when the test ends."""

    def __init__(self, workdir: Path, model_dir: str) -> None:
        self.workdir = workdir
        self.model_dir = model_dir
        self.processes: list[GrpoProcess] = []

    def config(self, name: str = "config.toml", **overrides: Any) -> Path:
        return write_config(self.workdir, self.model_dir, name, **overrides)

    def start(
        self,
        config: Path,
        *sets: str,
        env: dict[str, str] | None = None,
        preexec_fn: Callable[[], None] | None = None,
        argv: list[str] | None = None,
    ) -> GrpoProcess:
        command = argv or [GRPO, "run", str(config), *(a for s in sets for a in ("--set", s))]
        process = GrpoProcess(command, self.workdir, child_env(self.workdir, **(env or {})), preexec_fn)
        self.processes.append(process)
        return process

    def run(
        self,
        config: Path,
        *sets: str,
        env: dict[str, str] | None = None,
        timeout: float = RUN_TIMEOUT_S,
        preexec_fn: Callable[[], None] | None = None,
    ) -> tuple[int, str]:
        """Run to the end; (exit code, merged output)."""
        process = self.start(config, *sets, env=env, preexec_fn=preexec_fn)
        code = process.finish(timeout)
        return code, process.output

    def close(self) -> None:
        for process in self.processes:
            process.kill()
            try:
                process.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass


# ----------------------------------------------------------------------------- checks


def assert_clean_failure(code: int, output: str, expected_code: int = 2) -> None:
    """A user-facing failure: the expected exit code, one ``error:`` line, no traceback."""
    assert code == expected_code, f"exit code {code}, expected {expected_code}:\n{output[-6000:]}"
    no_traceback(output)
    assert "error: " in output, output[-6000:]


def assert_no_model_loaded(output: str) -> None:
    assert MODEL_LOADING not in output, f"the model was loaded before the fault was reported:\n{output[-4000:]}"


def metrics(output_dir: Path) -> list[dict[str, Any]]:
    path = output_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def last_per_step(output_dir: Path) -> dict[int, dict[str, Any]]:
    """The last record of every step (a resumed run logs the steps after
    its checkpoint again)."""
    return {int(r["step"]): r for r in metrics(output_dir)}


def resume_hint(output: str) -> str:
    """The checkpoint the error message tells the user to resume from."""
    found = re.findall(r'resume_from_checkpoint = "([^"]+)"', output)
    assert found, f"no resume hint in the output:\n{output[-4000:]}"
    return found[-1]


def checkpoint_step(path: Path) -> int:
    return int(json.loads((path / "trainer_state.json").read_text())["step"])


def complete_checkpoint(output_dir: Path, step: int) -> Callable[[], bool]:
    return lambda: (output_dir / f"checkpoint-{step}" / "trainer_state.json").is_file()


def async_server_settings(url: str, max_steps: int, **trl: Any) -> dict[str, Any]:
    """The overrides of an async run against the session's vLLM server at
    ``url`` that checkpoints every step and logs every completion (what the
    kill -9 resume tests read), with ``trl`` added to its ``[trl]`` table."""
    return {
        "max_steps": max_steps,
        "save_steps": 1,
        "logging_steps": 1,
        "vllm": dict(SERVER_TABLE),
        "trl": {
            "use_vllm": True,
            "vllm_lora_sync": True,
            "vllm_managed": False,
            "vllm_server_base_url": url,
            "vllm_server_timeout": 120,
            "async_prefetch": True,
            "prefetch_depth": 1,
            "log_completions": True,
            **trl,
        },
    }
