"""A managed server is never orphaned when the process that owns it is
killed with SIGKILL, whichever thread started it (docs/reliability.md).

Real processes, no vLLM: ``ManagedServer`` runs a sleeping Python process
as its "server", inside a driver process that the test then SIGKILLs. The
start from a short-lived thread is the case of a dead server restarted by
the prefetch thread; the server must outlive that thread and die with its
owner.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

DRIVER = """
import sys, threading, time
from pathlib import Path
from grpo_plugins.vllm.command_line import ServerSpec
from grpo_plugins.vllm.server import ManagedServer

spec = ServerSpec(argv=[sys.executable, "-c", "import time; time.sleep(600)"], env={}, host="127.0.0.1", port=1)
server = ManagedServer(spec, log=lambda _m: None)
if sys.argv[2] == "thread":
    starter = threading.Thread(target=server.start)
    starter.start()
    starter.join()  # the thread that started it is gone
else:
    server.start()
time.sleep(1.0)
Path(sys.argv[1]).write_text(str(server.process.pid))
time.sleep(600)
"""


def gone(pid: int) -> bool:
    try:
        return "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("starter", ["main", "thread"])
def test_server_dies_with_its_sigkilled_owner(tmp_path: Path, starter: str) -> None:
    pidfile = tmp_path / "server.pid"
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(pidfile), starter])
    try:
        deadline = time.monotonic() + 60
        while not pidfile.is_file() and time.monotonic() < deadline:
            assert driver.poll() is None, "the driver exited early"
            time.sleep(0.1)
        server = int(pidfile.read_text())
        assert not gone(server), "the server died with the thread that started it"
        driver.send_signal(signal.SIGKILL)
        driver.wait(10)
        deadline = time.monotonic() + 10
        while not gone(server) and time.monotonic() < deadline:
            time.sleep(0.1)
        orphaned = not gone(server)
    finally:
        if driver.poll() is None:
            driver.kill()
        if pidfile.is_file() and not gone(int(pidfile.read_text())):
            os.kill(int(pidfile.read_text()), signal.SIGKILL)  # the one process this test started
    assert not orphaned, f"server {server} outlived its SIGKILLed owner (started from the {starter} thread)"


def process_environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_text()
    return dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)


def test_server_temporary_files_live_and_die_with_it() -> None:
    """vLLM writes rendezvous files and ZMQ sockets to the temporary directory
    at every start and never removes them: the managed server gets one of its
    own, gone when it stops, fresh on a restart."""
    from grpo_plugins.vllm.command_line import ServerSpec
    from grpo_plugins.vllm.server import ManagedServer
    from grpo_plugins.vllm.server_temp import SERVER_TMP_PREFIX

    writer = (
        "import os, tempfile, time; open(os.path.join(tempfile.gettempdir(), 'vllm_dist_x'), 'w').close(); "
        "time.sleep(600)"
    )
    server = ManagedServer(
        ServerSpec(argv=[sys.executable, "-c", writer], env={}, host="127.0.0.1", port=1), log=lambda _m: None
    )
    server.start()
    try:
        env = process_environ(server.process.pid)
        first = Path(env["TMPDIR"])
        assert first.name.startswith(SERVER_TMP_PREFIX) and env["VLLM_RPC_BASE_PATH"] == str(first)
        deadline = time.monotonic() + 30
        while not (first / "vllm_dist_x").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (first / "vllm_dist_x").exists(), "the server's file did not land in its own directory"
        server.stop()
        assert not first.exists(), "the server's temporary directory outlived it"
        server.start()  # a restart gets a fresh directory
        second = Path(process_environ(server.process.pid)["TMPDIR"])
        assert second != first and second.is_dir()
    finally:
        server.close()
    assert not second.exists()


def test_a_long_tmpdir_moves_the_servers_temporary_directory_where_its_sockets_fit(tmp_path: Path, monkeypatch) -> None:
    """vLLM's engine sockets live in the server's temporary directory and must
    fit AF_UNIX's 107 bytes: under a long TMPDIR the engine crashed at start
    (found by the soak benchmark); grpo then puts the directory in /tmp."""
    import tempfile

    from grpo_plugins.vllm.addresses import MAX_SOCKET_PATH
    from grpo_plugins.vllm.server_temp import ENGINE_SOCKET_NAME_LEN, SERVER_TMP_PREFIX, server_temp_parent

    monkeypatch.setattr(tempfile, "tempdir", "/tmp")
    assert server_temp_parent() is None  # fits: the system's own
    long = tmp_path / ("d" * 60)
    long.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long))
    assert len(str(long)) + 1 + len(SERVER_TMP_PREFIX) + 9 + ENGINE_SOCKET_NAME_LEN > MAX_SOCKET_PATH
    assert server_temp_parent() == "/tmp"
