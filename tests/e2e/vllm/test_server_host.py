"""The inference server on its own host, with no filesystem in common.

Two "hosts" (network namespaces, tests/netns.py): the trainer on host0, and
``grpo vllm-serve`` on host1 bound to host1's address with an API key,
started inside a private mount namespace in which the trainer's folder is an
empty tmpfs: the server cannot read a file the trainer writes. The run
trains a LoRA and syncs it with ``lora_http`` (the adapter over HTTP, into a
folder on the server's side); every sync is verified (``verify_weight_sync``:
the server's log-probs of a probe against the trainer's), so a sync that did
not reach the server fails the run. Then, against the same server: a wrong
key is refused with one clear error; the server goes away and comes back on
the same address mid-run (the run waits, re-applies its last sync, goes on);
the trainer is killed with SIGKILL mid-run, and a new trainer resumes from
its checkpoint against the server that is still up. Last, a ``full_http``
run (merged weights over HTTP) against the same server.

One trainer host stands for the two of tests/e2e/test_multinode.py: only rank 0
talks to inference, so a second trainer host adds no path to the server.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import GRPO, no_traceback, run_workdir, write_toml
from netns import Hosts, opened_hosts

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

KEY = "server-host-key"
SERVER_PORT = 8000  # free in a fresh namespace
WEIGHTS_PORT = 8100  # the trainer's weight server, on host0's address
# grpo vllm-serve's line, once per start (the managed server's own "vLLM: server ready" differs)
READY = "vLLM server ready at"
REWARDS = """
def varied(completions, **kwargs):
    return [float(len(c[0]["content"]) % 3) / 2.0 for c in completions]
"""


@pytest.fixture(scope="module")
def hosts():
    yield from opened_hosts(2)


def trainer_config(folder: Path, model_dir: str, hosts: Hosts, name: str, key: str = KEY, **top: object) -> Path:
    rows = [{"prompt": [{"role": "user", "content": f"What is {a} + {a}?"}]} for a in range(8)]
    run_workdir(folder, rows, {"host_rewards": REWARDS})
    config = {
        "base_model": model_dir,
        "adapter": "lora",
        "lora_r": 4,
        "sequence_len": 256,
        "micro_batch_size": 4,
        "gradient_accumulation_steps": 1,
        "max_steps": 4,
        "learning_rate": 1e-4,
        "lr_scheduler": "constant",
        "datasets": [{"path": str(folder / "train.jsonl")}],
        "output_dir": str(folder / name),
        "seed": 5,
        # the server binds host1's address; lora_http's fetch goes through /collective_rpc, a dev endpoint
        "vllm": {
            "host": hosts.address(1),
            "port": SERVER_PORT,
            "api_key": key,
            "dtype": "float32",
            "max_model_len": 256,
            "cpu_kvcache_space": 1,
            "expose_dev_endpoints": True,
        },
        "trl": {
            "use_vllm": True,
            "vllm_managed": False,
            "vllm_server_base_url": f"http://{hosts.address(1)}:{SERVER_PORT}",
            "vllm_server_timeout": 900,
            "num_generations": 2,
            "max_completion_length": 8,
            "reward_funcs": ["host_rewards.varied"],
        },
        "plugins": {"weight_sync": "lora_http", "lora_http": {"host": hosts.address(0), "port": WEIGHTS_PORT}},
        **top,
    }
    return write_toml(folder / f"{name}.toml", config)


class Server:
    """``grpo vllm-serve`` on host1, in a mount namespace where ``hidden`` (the trainer's folder) is empty."""

    def __init__(self, hosts: Hosts, config: Path, hidden: Path, log: Path) -> None:
        self.hosts, self.config, self.hidden, self.log = hosts, config, hidden, log
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        script = f'mount -t tmpfs tmpfs {self.hidden} && exec "$@"'
        argv = [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            script,
            "sh",
            GRPO,
            "vllm-serve",
            str(self.config),
            "--host",
            self.hosts.address(1),
            "--port",
            str(SERVER_PORT),
        ]
        with open(self.log, "ab") as out:
            self.proc = self.hosts.start(
                1, argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"}
            )
        deadline = time.monotonic() + 600
        while self.log.read_text(errors="replace").count(READY) < self.starts and time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text(errors="replace")[-4000:]
            time.sleep(1)
        assert self.log.read_text(errors="replace").count(READY) >= self.starts, self.log.read_text()[-4000:]

    @property
    def starts(self) -> int:
        return 1 + self.log.read_text(errors="replace").count("vLLM server stopped.") if self.log.exists() else 1

    def stop(self) -> None:
        """SIGTERM, as a process manager stops it: exit 0, engine core included (nothing left on host1)."""
        assert self.proc is not None
        stopped = self.log.read_text(errors="replace").count("vLLM server stopped.")
        self.proc.send_signal(signal.SIGTERM)  # `ip netns exec`, unshare and sh exec: this is grpo vllm-serve
        assert self.proc.wait(timeout=120) == 0, self.log.read_text(errors="replace")[-3000:]
        assert self.log.read_text(errors="replace").count("vLLM server stopped.") == stopped + 1
        deadline = time.monotonic() + 30
        while self.hosts.pids(1) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert self.hosts.pids(1) == [], "a server process outlived SIGTERM"


def run_trainer(hosts: Hosts, folder: Path, config: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(folder)}
    with open(log, "ab") as out:
        return hosts.start(0, [GRPO, "run", str(config)], cwd=folder, stdout=out, stderr=subprocess.STDOUT, env=env)


def records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for(condition, what: str, proc: subprocess.Popen, log: Path, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"exited before {what}:\n{log.read_text(errors='replace')[-4000:]}"
        assert time.monotonic() < deadline, f"no {what} in {timeout:.0f} s:\n{log.read_text(errors='replace')[-4000:]}"
        time.sleep(0.5)


@pytest.mark.extended  # its own server start in a namespace, a restart, three trainer runs (~145 s)
def test_a_server_on_its_own_host_trains_over_tcp_with_lora_http_and_survives_its_faults(
    hosts: Hosts, smollm2_dir: str, tmp_path: Path
) -> None:
    trainer_dir = tmp_path / "trainer"
    trainer_dir.mkdir()
    server_dir = tmp_path / "server"
    server_dir.mkdir()
    serve_config = trainer_config(server_dir, smollm2_dir, hosts, "serve")  # the same settings, in the server's folder
    server = Server(hosts, serve_config, hidden=trainer_dir, log=server_dir / "serve.log")
    server.start()
    served = server.log.read_text()
    assert f"ready at http://{hosts.address(1)}:{SERVER_PORT}" in served, served[-3000:]

    # A wrong key: one clear error, before anything trains.
    wrong = trainer_config(trainer_dir, smollm2_dir, hosts, "wrong", key="not-the-key")
    log = trainer_dir / "wrong.log"
    proc = run_trainer(hosts, trainer_dir, wrong, log)
    assert proc.wait(timeout=600) != 0
    text = log.read_text(errors="replace")
    no_traceback(text)
    assert "error: " in text and "key" in text.lower(), text[-3000:]

    # The run: the server goes away after step 1 and comes back on the same address.
    config = trainer_config(trainer_dir, smollm2_dir, hosts, "out", save_steps=2, max_steps=6)
    log = trainer_dir / "run.log"
    proc = run_trainer(hosts, trainer_dir, config, log)
    wait_for(lambda: len(records(trainer_dir / "out")) >= 1, "step 1", proc, log)
    server.stop()
    server.start()
    wait_for(lambda: len(records(trainer_dir / "out")) >= 3, "step 3 after the server came back", proc, log)
    os.kill(proc.pid, signal.SIGKILL)  # `ip netns exec` execs: this is the trainer itself
    proc.wait(timeout=60)
    text = log.read_text(errors="replace")
    assert "re-applying" in text, text[-4000:]  # the restarted server got the last adapter again
    # Every sync was verified (a failed check repeats the sync once, then stops the run): the records
    # show the checks that ran, none of them failed.
    steps = records(trainer_dir / "out")
    assert sum(r["sync/verified"] for r in steps) >= 1 and all(r["sync/retries"] == 0 for r in steps), steps

    # The trainer host is gone; the server is not: a new trainer resumes from the checkpoint.
    assert (trainer_dir / "out" / "checkpoint-2").is_dir()
    resume = trainer_config(
        trainer_dir, smollm2_dir, hosts, "out", save_steps=2, max_steps=6, resume_from_checkpoint="latest"
    )
    log = trainer_dir / "resume.log"
    proc = run_trainer(hosts, trainer_dir, resume, log)
    assert proc.wait(timeout=900) == 0, log.read_text(errors="replace")[-4000:]
    no_traceback(log.read_text(errors="replace"))
    assert [r["step"] for r in records(trainer_dir / "out")][-1] == 6
    assert (trainer_dir / "out" / "adapter_model.safetensors").is_file() or (
        trainer_dir / "out" / "adapter_config.json"
    ).is_file()
    # the adapter reached the server by its worker's fetch, then a load from the server's own folder
    served = server.log.read_text(errors="replace")
    assert re.search(r'"POST /collective_rpc HTTP/1\.1" 200', served) and re.search(
        r'"POST /v1/load_lora_adapter HTTP/1\.1" 200', served
    )

    # full_http against the same server: the merged weights pulled over HTTP by its workers and
    # loaded in place, nothing written on either side; every sync verified as above.
    full = trainer_config(
        trainer_dir,
        smollm2_dir,
        hosts,
        "full",
        max_steps=2,
        plugins={"weight_sync": "full_http", "full_http": {"host": hosts.address(0), "port": WEIGHTS_PORT}},
    )
    log = trainer_dir / "full.log"
    proc = run_trainer(hosts, trainer_dir, full, log)
    assert proc.wait(timeout=900) == 0, log.read_text(errors="replace")[-4000:]
    text = log.read_text(errors="replace")
    no_traceback(text)
    assert "weight sync verified" in text, text[-4000:]
    steps = records(trainer_dir / "full")
    assert [r["step"] for r in steps] == [1, 2] and all(r.get("sync/retries", 0) == 0 for r in steps), steps
    assert not list((trainer_dir / "full").glob("vllm-*")), "full_http wrote weight files"
    server.stop()
