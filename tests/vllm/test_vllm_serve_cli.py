"""`grpo vllm-serve CONFIG` starts a real server in the foreground and stops
it, engine core included, on SIGTERM. Slow (its own server start), so it is
marked `slow` besides `vllm`."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from grpo_plugins.vllm.server import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_vllm_serve_starts_and_stops_on_sigterm(smollm2_dir: str, tmp_path: Path):
    port = free_port()
    config = tmp_path / "serve.toml"
    config.write_text(
        f'base_model = "{smollm2_dir}"\n\n[vllm]\ndtype = "bfloat16"\nmax_model_len = 256\ncpu_kvcache_space = 1\n'
    )
    log = tmp_path / "serve.out"
    grpo = Path(sys.executable).with_name("grpo")
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(grpo), "vllm-serve", str(config), "--port", str(port)], stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while "server ready" not in log.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(1)
        text = log.read_text()
        assert f"ready at http://127.0.0.1:{port}" in text, text[-3000:]
        assert requests.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
        # No key configured: one was made up, printed once, and is required everywhere else.
        key = re.search(r"API key for this server \(made up now; none was configured\): (\S+)", text).group(1)
        rpc = {"method": "reload_weights", "kwargs": {"weights_path": "/nonexistent"}}
        assert requests.post(f"http://127.0.0.1:{port}/collective_rpc", json=rpc, timeout=30).status_code == 401
        assert requests.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).status_code == 401
        models = requests.get(f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30)
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "base"
        server_pid = int(re.search(r"starting server \(pid (\d+)\)", text).group(1))

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0, log.read_text()[-3000:]
        assert "vLLM server stopped." in log.read_text()
        assert not _pid_alive(server_pid)
        with pytest.raises(requests.exceptions.ConnectionError):
            requests.get(f"http://127.0.0.1:{port}/health", timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
