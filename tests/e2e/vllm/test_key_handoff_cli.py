"""The two-terminal workflow, for real: ``grpo vllm-serve config.toml`` in one
process, then ``grpo run config.toml`` in another (same user, same config,
no key configured or copied) trains against that server instead of starting
a second one; a key the server cannot prove is refused; the key file goes
when the server stops; the server answers nothing without its key, and
Ctrl-C stops it, engine core included. Slow (a real server start and a
real run), so marked ``slow`` besides ``vllm``. (SIGTERM is the server-host
test's stop: tests/e2e/vllm/test_server_host.py.)

The refusal is checked through the engine's own decision
(:func:`grpo_plugins.vllm.engine.server_to_adopt`), not a second ``grpo
run``: a refused run starts its own private server, and this machine holds
one test server at a time."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest
import requests
from helpers import GRPO, REPO, grpo, write_toml

from grpo_plugins.vllm import key_handoff
from grpo_plugins.vllm.addresses import free_port
from grpo_plugins.vllm.engine import server_to_adopt

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = REPO
ARITHMETIC = ROOT / "examples" / "arithmetic"


def _config(tmp: Path, model: str, port: int) -> Path:
    raw = {
        "base_model": model,
        "adapter": "lora",
        "lora_r": 8,
        "datasets": [{"path": str(ARITHMETIC / "data" / "train.jsonl")}],
        "sequence_len": 256,
        "micro_batch_size": 4,
        "gradient_accumulation_steps": 1,
        "max_steps": 1,
        "learning_rate": 1e-3,
        "lr_scheduler": "constant",
        "output_dir": str(tmp / "out"),
        "seed": 3,
        # No api_key: the point is that none is configured or copied.
        "vllm": {"host": "127.0.0.1", "port": port, "dtype": "float32", "max_model_len": 512, "cpu_kvcache_space": 1},
        "trl": {
            "use_vllm": True,
            "vllm_lora_sync": True,
            "vllm_server_port": port,
            "num_generations": 4,
            "max_completion_length": 8,
            "reward_funcs": ["last_number_match"],
            "vllm_server_timeout": 60,
        },
    }
    return write_toml(tmp / "config.toml", raw)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.mark.extended  # starts its own server with `grpo vllm-serve` (~60 s); tests/unit/test_key_handoff.py covers the
# handoff's rules
def test_grpo_run_uses_the_server_grpo_vllm_serve_started_and_refuses_a_key_it_cannot_prove(
    smollm2_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    runtime = tmp_path / "xdg-runtime"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))  # this test's key folder, for both commands and for us
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    config = _config(tmp_path, smollm2_dir, port)
    log = tmp_path / "serve.out"
    with open(log, "wb") as out:  # terminal 1
        serve = subprocess.Popen([GRPO, "vllm-serve", str(config)], stdout=out, stderr=subprocess.STDOUT, env=env)  # noqa: S603
    try:
        deadline = time.monotonic() + 600
        while "API key left for" not in log.read_text() and time.monotonic() < deadline:
            assert serve.poll() is None, log.read_text()[-3000:]
            time.sleep(1)
        text = log.read_text()
        assert f"ready at {url}" in text, text[-3000:]
        key = re.search(r"API key for this server \(made up now; none was configured\): (\S+)", text).group(1)
        server_pid = int(re.search(r"starting server \(pid (\d+)\)", text).group(1))
        # the made-up key is required on every path, the control ones too
        rpc = {"method": "reload_weights", "kwargs": {"weights_path": "/nonexistent"}}
        assert requests.post(f"{url}/collective_rpc", json=rpc, timeout=30).status_code == 401
        assert requests.get(f"{url}/v1/models", timeout=30).status_code == 401
        models = requests.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30)
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "base"
        file = runtime / key_handoff.DIR_NAME / f"127.0.0.1_{port}.key"
        assert f"API key left for `grpo run` of this user in {file} (mode 600" in text, text[-3000:]
        assert _mode(file) == 0o600 and _mode(file.parent) == 0o700
        assert json.loads(file.read_text()) == {"url": url, "key": key, "pid": serve.pid}

        # terminal 2: the same config, no key anywhere in it or in the environment
        run = grpo("run", str(config), env=env, timeout=900)
        output = run.stdout + run.stderr
        assert run.returncode == 0, output[-4000:]
        assert f"vLLM: found the API key this user's `grpo vllm-serve` left for {url} in {file}" in output, output[
            -4000:
        ]
        assert f"vLLM: using the server already answering at {url}" in output, output[-4000:]
        assert "starting server" not in output and "not using the server" not in output, output[-4000:]
        assert not (tmp_path / "out" / "vllm-server.log").exists()  # no private server was started
        assert len((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()) == 1
        assert re.search(
            r'"POST /v1/load_lora_adapter HTTP/1\.1" 200', log.read_text()
        )  # the run synced into *this* server

        # A key file the server cannot prove (a planted or stale key for this address) is refused,
        # exactly as the run decides it; the real key is adopted.
        assert server_to_adopt(url, key_handoff.handed_key(url)) == (key, None)
        key_handoff.leave_key(url, "not-this-servers-key", pid=serve.pid)
        adopted, refusal = server_to_adopt(url, key_handoff.handed_key(url))
        assert adopted is None and "HTTP 401 with a made-up key, 401 with ours" in refusal, refusal
        key_handoff.leave_key(url, key, pid=serve.pid)  # back, so the server's own withdrawal finds its key

        serve.send_signal(signal.SIGINT)  # Ctrl-C in terminal 1
        assert serve.wait(timeout=90) == 0, log.read_text()[-3000:]
        assert "vLLM server stopped." in log.read_text()
        assert not file.exists(), "the key file outlived its server"
        assert not _pid_alive(server_pid)  # the API server, and with it its engine core
        with pytest.raises(requests.exceptions.ConnectionError):
            requests.get(f"{url}/health", timeout=5)
    finally:
        if serve.poll() is None:
            serve.send_signal(signal.SIGTERM)
            try:
                serve.wait(timeout=60)
            except subprocess.TimeoutExpired:
                serve.kill()
