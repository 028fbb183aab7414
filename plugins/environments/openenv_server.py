"""An OpenEnv server process that grpo starts, waits for and stops.

OpenEnv environments ship as FastAPI apps (``server/app.py`` with
``app = create_app(...)``) that a command such as ``uvicorn pkg.server.app:app
--host H --port P`` serves. grpo runs that command on a free loopback port,
waits until ``GET /health`` answers, and stops the whole process group when
the run ends (or, through the parent-death signal, when grpo dies).
:meth:`ManagedEnvServer.restart` replaces a server that died with a new
process on a new free port (the adapter decides when, and how often).
"""

from __future__ import annotations

import atexit
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import IO

import httpx

from grpo_core.plugin_api import in_lifelong_thread, set_parent_death_signal
from grpo_plugins.environments.openenv_session import OpenEnvUnavailable

_LIVE: weakref.WeakSet[ManagedEnvServer] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        server.stop()


def free_loopback_port() -> int:
    """A port nothing listens on right now on 127.0.0.1 (tiny race, acceptable locally)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def command_argv(command: str | list[str], host: str, port: int) -> list[str]:
    """The command with ``{host}``, ``{port}`` and ``{python}`` (this
    interpreter) filled in; a string is split like a shell would."""
    words = shlex.split(command) if isinstance(command, str) else list(command)
    return [w.replace("{host}", host).replace("{port}", str(port)).replace("{python}", sys.executable) for w in words]


class ManagedEnvServer:
    """One OpenEnv server subprocess that this process owns, on 127.0.0.1."""

    def __init__(self, command: str | list[str], *, env: dict[str, str], log_path: Path, port: int = 0) -> None:
        self.host = "127.0.0.1"
        self.command = command
        self.port = port or free_loopback_port()
        self.argv = command_argv(command, self.host, self.port)
        self.env = env
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._lock = threading.Lock()

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        """Launch the command (does not wait: see :meth:`wait_ready`)."""
        with self._lock:
            if self.process is not None:
                return
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_path, "ab")  # noqa: SIM115 - kept open for the child's life
            log = self._log

            def launch() -> subprocess.Popen[bytes]:
                return subprocess.Popen(  # noqa: S603 - the command the config names
                    self.argv,
                    env={**os.environ, **self.env},
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own process group: stop() reaches its workers too
                    preexec_fn=set_parent_death_signal,
                )

            try:
                # The death signal follows the *thread* that starts the child: the main
                # thread lives as long as the process; any other (a restart from an
                # episode's thread) hands the start to one that does.
                in_main = threading.current_thread() is threading.main_thread()
                self.process = launch() if in_main else in_lifelong_thread(launch)  # type: ignore[assignment]
            except OSError as exc:
                self._log.close()
                self._log = None
                raise OpenEnvUnavailable(
                    f"OpenEnv server: could not run plugins.openenv.command {shlex.join(self.argv)!r}: {exc}. "
                    "Give the full path of the program, or '{python} -m uvicorn ...' for this interpreter."
                ) from None
            _LIVE.add(self)

    @property
    def pid(self) -> int | None:
        proc = self.process
        return None if proc is None else proc.pid

    def exit_code(self) -> int | None:
        """The process's exit code once it has exited; ``None`` while it runs (or was never started)."""
        proc = self.process
        return None if proc is None else proc.poll()

    def restart(self, note: str) -> None:
        """Stop what is left of the server (its whole process group) and
        start the command again on a new free port; ``note`` goes into the
        log first, so its tail shows the new process's own lines. A new port,
        not the old one: a dying server's workers may still hold it."""
        self.stop(grace=5.0)
        self.port = free_loopback_port()
        self.argv = command_argv(self.command, self.host, self.port)
        try:
            with open(self.log_path, "ab") as fh:
                fh.write(f"\n--- grpo: {note} ---\n".encode())
        except OSError:
            pass
        self.start()

    def log_tail(self, lines: int = 15) -> str:
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(0, os.SEEK_END)
                fh.seek(max(0, fh.tell() - 8000))
                text = fh.read().decode("utf-8", "replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def problem(self) -> str | None:
        """Why the server cannot answer (it exited or was never started), else ``None``."""
        proc = self.process
        if proc is None:
            return "the managed server is not running"
        if proc.poll() is None:
            return None
        tail = self.log_tail()
        return f"the managed server ({shlex.join(self.argv)}) exited with code {proc.returncode}" + (
            f"; last lines of {self.log_path}:\n{tail}" if tail else f"; its log: {self.log_path}"
        )

    def wait_ready(self, timeout: float) -> None:
        """Block until ``GET /health`` answers 200; a clear error (and the
        server stopped) when it exits or does not within ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            problem = self.problem()
            if problem:
                raise OpenEnvUnavailable(f"OpenEnv server at {self.base_url} failed to start: {problem.rstrip('.')}.")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2.0, trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                tail = self.log_tail()
                raise OpenEnvUnavailable(
                    f"OpenEnv server at {self.base_url} did not answer /health within {timeout:g} s; it was stopped. "
                    "Raise plugins.openenv.startup_timeout, or check the command"
                    + (f". Last lines of {self.log_path}:\n{tail}" if tail else f" and its log {self.log_path}.")
                )
            time.sleep(0.2)

    def stop(self, grace: float = 10.0) -> int | None:
        """SIGTERM the process group, SIGKILL after ``grace`` s; idempotent."""
        with self._lock:
            proc, self.process = self.process, None
            if proc is not None:
                for sig in (signal.SIGTERM, signal.SIGKILL):
                    try:
                        os.killpg(proc.pid, sig)
                    except (ProcessLookupError, PermissionError):
                        break
                    try:
                        proc.wait(timeout=grace)
                        break
                    except subprocess.TimeoutExpired:
                        continue
            if self._log is not None:
                self._log.close()
                self._log = None
            _LIVE.discard(self)
            return None if proc is None else proc.returncode
