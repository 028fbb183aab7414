"""Owning a vLLM server as a subprocess.

:class:`ManagedServer` runs a :class:`~grpo_plugins.vllm.command_line.ServerSpec`
in its own process group, waits for ``/health`` and guarantees the whole
group (API server and engine core) goes away with us: ``stop()``, an
``atexit`` guard, and a parent-death signal. Its command line comes from
:mod:`grpo_plugins.vllm.command_line`, where it listens from
:mod:`grpo_plugins.vllm.addresses`, its temporary directory from
:mod:`grpo_plugins.vllm.server_temp`.
"""

from __future__ import annotations

import atexit
import functools
import os
import signal
import subprocess
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import IO

from grpo_core.plugin_api import (
    EngineUnavailable,
    in_lifelong_thread,
    make_scratch_dir,
    remove_scratch_dir,
    set_parent_death_signal,
)
from grpo_plugins.vllm.addresses import check_socket_path
from grpo_plugins.vllm.client import VLLMClient
from grpo_plugins.vllm.command_line import ServerSpec
from grpo_plugins.vllm.server_temp import (
    SERVER_TMP_PREFIX,
    server_temp_env,
    server_temp_parent,
)

LOG_NAME = "vllm-server.log"


def _prepare_child(cpus: frozenset[int] | None) -> None:
    """Runs in the server's process before vLLM starts: the parent-death
    signal, and the CPU affinity grpo itself started with (a restart after
    the trainer confined its own threads must not inherit that)."""
    set_parent_death_signal()
    if cpus:
        try:
            os.sched_setaffinity(0, cpus)
        except OSError:
            pass


_LIVE: weakref.WeakSet[ManagedServer] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        server.close()


class ManagedServer:
    """One vLLM server subprocess that this process owns.

    ``log_path=None`` lets the server write to our stdout/stderr (the
    foreground ``grpo vllm-serve``); otherwise its output goes to that file.
    """

    def __init__(self, spec: ServerSpec, log_path: Path | None = None, log: Callable[[str], None] = print) -> None:
        self.spec = spec
        self.log_path = log_path
        self.log = log
        self.process: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None
        self._temp_dir: Path | None = None  # the running process's TMPDIR (:func:`server_temp_env`)
        self._lock = threading.Lock()

    @property
    def base_url(self) -> str:
        return self.spec.base_url

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        """Launch the process (does not wait: see :meth:`wait_ready`)."""
        with self._lock:
            if self.alive():
                return
            if self._temp_dir is not None:  # a process that died without stop(): its files go now
                remove_scratch_dir(self._temp_dir)
            self._temp_dir = make_scratch_dir(SERVER_TMP_PREFIX, parent=server_temp_parent())
            env = {**os.environ, **self.spec.env, **server_temp_env(self._temp_dir)}
            if self.spec.uds:
                socket_file = Path(self.spec.uds)
                check_socket_path(socket_file)  # (re)creates a private directory for a restart
                socket_file.unlink(missing_ok=True)  # a socket left by a server that was killed
            if self.log_path is not None:
                self.log_path.parent.mkdir(parents=True, exist_ok=True)
                self._log_file = open(self.log_path, "ab")  # noqa: SIM115 - kept open for the child's life
                out: IO[bytes] | None = self._log_file
            else:
                out = None

            def launch() -> subprocess.Popen[bytes]:
                return subprocess.Popen(  # noqa: S603 - our own interpreter, args from config
                    self.spec.argv,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT if out is not None else None,
                    start_new_session=True,  # own process group: stop() reaches the engine core too
                    preexec_fn=functools.partial(_prepare_child, self.spec.spawn_cpus),
                )

            # The death signal is tied to the starting thread: the main thread
            # lives as long as the process; any other hands the start to one that does.
            in_main = threading.current_thread() is threading.main_thread()
            self.process = launch() if in_main else in_lifelong_thread(launch)  # type: ignore[assignment]
            _LIVE.add(self)
            where = f", log: {self.log_path}" if self.log_path else ""
            self.log(f"vLLM: starting server (pid {self.process.pid}) at {self.base_url}{where}")

    def log_tail(self, lines: int = 30) -> str:
        if self.log_path is None or not self.log_path.is_file():
            return ""
        with open(self.log_path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 20000))
            text = fh.read().decode("utf-8", "replace")
        return "\n".join(text.splitlines()[-lines:])

    def dead_reason(self) -> str | None:
        """Why the server cannot answer any more (it exited), else ``None``."""
        if self.process is None or self.process.poll() is None:
            return None
        return f"the managed vLLM server exited with code {self.process.returncode}" + self._tail_suffix()

    def _tail_suffix(self) -> str:
        tail = self.log_tail()
        return f"\n--- last lines of {self.log_path} ---\n{tail}" if tail else ""

    def wait_ready(self, timeout: float, cancel: threading.Event | None = None) -> None:
        """Block until ``/health`` answers 200 (or ``cancel`` is set); a
        clear error with the log's tail otherwise."""
        probe = VLLMClient(self.base_url, self.spec.api_key)
        deadline = time.monotonic() + timeout
        started = time.monotonic()
        while time.monotonic() < deadline:
            if cancel is not None and cancel.is_set():
                return
            reason = self.dead_reason()
            if reason:
                raise EngineUnavailable(f"vLLM server at {self.base_url} failed to start: {reason}")
            if probe.health(timeout=2):
                self.log(f"vLLM: server ready at {self.base_url} after {time.monotonic() - started:.0f} s")
                probe.close()
                return
            if cancel is not None:
                cancel.wait(0.5)
            else:
                time.sleep(0.5)
        self.stop()
        raise EngineUnavailable(
            f"vLLM server at {self.base_url} did not become healthy within {timeout:.0f} s; it was stopped. "
            "A big model on CPU can take minutes: raise trl.vllm_server_timeout, or check the log."
            + self._tail_suffix()
        )

    def stop(self, grace: float = 15.0) -> int | None:
        """Terminate the whole process group: SIGTERM, then SIGKILL after ``grace`` s."""
        with self._lock:
            proc = self.process
            if proc is None:
                return None
            if proc.poll() is None or group_alive(proc.pid):
                _signal_group(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=grace)
                except subprocess.TimeoutExpired:
                    pass
                # The engine core may outlive the API server for a moment.
                end = time.monotonic() + min(grace, 5.0)
                while group_alive(proc.pid) and time.monotonic() < end:
                    time.sleep(0.1)
                if group_alive(proc.pid):
                    _signal_group(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=5)
            self.process = None
            self._remove_socket()
            if self._temp_dir is not None:
                remove_scratch_dir(self._temp_dir)
                self._temp_dir = None
            if self._log_file is not None:
                self._log_file.close()
                self._log_file = None
            _LIVE.discard(self)
            return proc.returncode

    def _remove_socket(self) -> None:
        if self.spec.uds:
            Path(self.spec.uds).unlink(missing_ok=True)

    def close(self) -> None:
        """Stop for good: also delete the private socket directory grpo made
        (kept across :meth:`stop`/:meth:`start`, so a restart never has to
        re-create a name others have seen in /tmp)."""
        self.stop()
        self.spec.remove_private_socket_dir()

    def __enter__(self) -> ManagedServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def group_alive(pgid: int) -> bool:
    """Whether any process of group ``pgid`` (a server and its engine core) still runs."""
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False
