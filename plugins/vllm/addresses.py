"""Where a managed vLLM server listens, and who may call it.

* A managed server (``grpo run`` starts it) listens on a Unix domain socket
  in a fresh directory only this user can open (mode 0700), and on no TCP
  port: other users of the machine cannot call it at all.
* Over TCP (``[vllm] transport = "tcp"``, a platform without Unix sockets,
  or ``grpo vllm-serve``) every request but ``/health`` needs an API key
  (``[vllm] api_key``, ``VLLM_API_KEY``, else one generated per server),
  checked by :mod:`grpo_plugins.vllm.guard` on *all* paths, the dev-mode ones
  included (vLLM's own ``--api-key`` skips them). The key travels in the
  server's environment, never on its command line.
* A non-loopback bind serves the dev-mode endpoints only when the config
  opts in by name (``[vllm] expose_dev_endpoints = true``).

docs/security.md has the whole picture.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import stat
from pathlib import Path
from typing import TYPE_CHECKING

from grpo_core.plugin_api import ConfigError, make_scratch_dir
from grpo_plugins.vllm.settings import vllm_settings

if TYPE_CHECKING:
    from grpo_core.plugin_api import GRPOConfig

SOCKET_NAME = "vllm.sock"
SOCKET_DIR_PREFIX = "grpo-vllm-"
MAX_SOCKET_PATH = 107  # sun_path is 108 bytes on Linux, NUL included


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (tiny race, acceptable locally)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host if host not in ("0.0.0.0", "") else "127.0.0.1", 0))
        return int(sock.getsockname()[1])


def client_host(host: str) -> str:
    """Where a local client connects to reach a server bound to ``host``."""
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


def unix_sockets_available() -> bool:
    return hasattr(socket, "AF_UNIX")


def configured_api_key(cfg: GRPOConfig) -> str | None:
    """``[vllm] api_key``, else ``VLLM_API_KEY`` from the environment (the
    variable vLLM itself reads), else ``None``."""
    return vllm_settings(cfg).api_key or os.environ.get("VLLM_API_KEY") or None


def private_socket_dir() -> Path:
    """A fresh directory only this user can open (``mkdtemp`` makes it 0700),
    short enough for a socket path; removed by :meth:`ManagedServer.close`,
    or by a later run if this process is killed (:mod:`grpo_core.runtime.scratch`)."""
    return make_scratch_dir(SOCKET_DIR_PREFIX)


def check_socket_path(path: Path) -> None:
    """Refuse a socket path others could reach, or one too long for AF_UNIX.

    The socket's directory must belong to this user and give nobody else any
    access: vLLM creates the socket world-readable, so the directory is what
    keeps other users out."""
    if len(os.fsencode(str(path))) > MAX_SOCKET_PATH:
        raise ConfigError(
            f"Unix socket path {path} is longer than {MAX_SOCKET_PATH} bytes; choose a shorter one (e.g. under /tmp)."
        )
    parent = path.parent
    try:
        info = parent.stat()
    except FileNotFoundError:
        parent.mkdir(mode=0o700, parents=True)
        info = parent.stat()
    if info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o077:
        raise ConfigError(
            f"the directory of the Unix socket {path} must belong to you and be closed to others "
            f"(it is mode {stat.S_IMODE(info.st_mode):o}, owner uid {info.st_uid}): `chmod 700 {parent}`, or pick "
            "a directory of your own; otherwise other users could talk to the server."
        )
