"""The API key file ``grpo vllm-serve`` leaves for a later ``grpo run``
(plugins/vllm/key_handoff.py): private to this user, named by the server's
address, trusted only when nobody else could have written or read it.
No server here; tests/e2e/vllm/test_key_handoff_cli.py runs both commands for real."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_plugins.vllm import key_handoff as kh

URL = "http://127.0.0.1:8123"


@pytest.fixture(autouse=True)
def runtime_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(run))
    return run


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_named_by_address_with_local_binds_named_as_a_client_reaches_them() -> None:
    assert kh.address_name("http://127.0.0.1:8000") == "127.0.0.1_8000"
    assert kh.address_name("http://0.0.0.0:8000/") == kh.address_name("http://localhost:8000") == "127.0.0.1_8000"
    assert kh.address_name("http://[::1]:9000") == "__1_9000"
    assert kh.address_name("http://10.0.0.5:8000") != kh.address_name("http://10.0.0.5:8001")
    assert kh.address_name("unix:/tmp/x/vllm.sock") is None


def test_left_key_is_0600_in_a_0700_folder_and_read_back(runtime_dir: Path) -> None:
    path, why_not = kh.leave_key(URL, "secret-1")
    assert why_not is None and path == runtime_dir / kh.DIR_NAME / "127.0.0.1_8123.key"
    assert _mode(path) == 0o600 and _mode(path.parent) == 0o700
    assert json.loads(path.read_text()) == {"url": URL, "key": "secret-1", "pid": os.getpid()}
    assert kh.handed_key(URL) == "secret-1"
    assert kh.handed_key("http://127.0.0.1:8124") is None  # another address, another file


def test_without_a_runtime_dir_the_folder_is_under_the_grpo_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    monkeypatch.setenv("GRPO_CACHE_DIR", str(tmp_path / "cache"))
    path, _ = kh.leave_key(URL, "k")
    assert path == tmp_path / "cache" / "vllm-keys" / "127.0.0.1_8123.key" and _mode(path.parent) == 0o700


def test_a_folder_others_can_open_is_made_private_before_the_key_goes_in(runtime_dir: Path) -> None:
    folder = runtime_dir / kh.DIR_NAME
    folder.mkdir(mode=0o755)
    os.chmod(folder, 0o755)
    path, why_not = kh.leave_key(URL, "k")
    assert why_not is None and _mode(folder) == 0o700 and _mode(path) == 0o600


@pytest.mark.parametrize("loosen", ["file", "folder"])
def test_a_key_others_could_read_or_write_is_ignored_and_said_so(loosen: str) -> None:
    path, _ = kh.leave_key(URL, "k")
    os.chmod(path if loosen == "file" else path.parent, 0o644 if loosen == "file" else 0o755)
    said: list[str] = []
    assert kh.handed_key(URL, said.append) is None
    assert said and "ignoring the API key file" in said[0] and "readable or writable by others" in said[0], said


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root (CI runs as root)")
def test_a_key_file_of_another_user_is_ignored() -> None:
    path, _ = kh.leave_key(URL, "k")
    os.chown(path, 65534, 65534)
    said: list[str] = []
    assert kh.handed_key(URL, said.append) is None
    assert "belongs to uid 65534" in said[0], said


def test_a_symlinked_key_file_is_ignored(runtime_dir: Path) -> None:
    path, _ = kh.leave_key(URL, "k")
    target = runtime_dir / "elsewhere.key"
    os.replace(path, target)
    path.symlink_to(target)
    said: list[str] = []
    assert kh.handed_key(URL, said.append) is None and "symbolic link" in said[0]


def test_the_key_of_a_killed_server_is_dropped() -> None:
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    ).stdout
    path, _ = kh.leave_key(URL, "stale", pid=int(gone))
    assert kh.handed_key(URL) is None
    assert not path.exists()


def test_a_live_servers_key_is_not_overwritten_by_another() -> None:
    kh.leave_key(URL, "first")  # this process: alive
    path, why_not = kh.leave_key(URL, "second", pid=os.getpid() + 10**6)
    assert path is None and "another live server" in why_not
    assert kh.handed_key(URL) == "first"


def test_withdraw_removes_only_its_own_key() -> None:
    path, _ = kh.leave_key(URL, "mine")
    kh.withdraw_key(URL, "not-mine")
    assert path.exists()
    kh.withdraw_key(URL, "mine")
    assert not path.exists()
    kh.withdraw_key(URL, "mine")  # gone already: nothing to do


def test_a_unix_socket_gets_no_file() -> None:
    assert kh.leave_key("unix:/tmp/d/vllm.sock", "k") == (None, "a Unix socket needs no key")
    assert kh.handed_key("unix:/tmp/d/vllm.sock") is None


class _StandIn:
    """An HTTP server on a free loopback port standing in for a vLLM server:
    ``checks_key``: 401 unless the request bears ``key`` (as grpo's guard
    does), else 200 to everything (someone else's server, proving nothing)."""

    def __init__(self, key: str | None) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                ok = self.path == "/health" or key is None or self.headers.get("Authorization") == f"Bearer {key}"
                self.send_response(200 if ok else 401)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(b'{"data": [{"id": "base"}]}' if ok else b"{}")

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_the_engine_adopts_a_server_with_the_key_left_for_its_address(smollm2_dir: str, tmp_path: Path) -> None:
    """What `grpo run` does with no key configured: it reads the left key and
    the server proves it holds it, so no server is started."""
    from grpo_core.config.loader import validate
    from grpo_core.contract.context import RunContext
    from grpo_plugins.vllm.engine import VLLMServerEngine

    stand_in = _StandIn("left-key")
    try:
        port = int(stand_in.url.rsplit(":", 1)[1])
        kh.leave_key(stand_in.url, "left-key")
        cfg = validate(
            {
                "base_model": smollm2_dir,
                "output_dir": str(tmp_path / "out"),
                "trl": {"use_vllm": True, "vllm_server_host": "127.0.0.1", "vllm_server_port": port},
            }
        )
        logs: list[str] = []
        engine = VLLMServerEngine(RunContext(config=cfg, output_dir=tmp_path / "out", log=logs.append))
        try:
            assert engine.server is None, logs  # adopted, nothing started
            assert engine.client.api_key == "left-key"
            assert f"vLLM: using the server already answering at {stand_in.url}" in logs
            assert any(
                line.startswith(f"vLLM: found the API key this user's `grpo vllm-serve` left for {stand_in.url}")
                for line in logs
            )
        finally:
            if engine.server is not None:
                engine.server.close()
    finally:
        stand_in.close()


def test_a_left_key_does_not_make_a_server_that_checks_no_key_adoptable() -> None:
    from grpo_plugins.vllm.engine import server_to_adopt

    stand_in = _StandIn(None)
    try:
        kh.leave_key(stand_in.url, "left-key")
        key, refusal = server_to_adopt(stand_in.url, kh.handed_key(stand_in.url))
        assert key is None and "HTTP 200 with a made-up key, 200 with ours" in refusal
    finally:
        stand_in.close()
