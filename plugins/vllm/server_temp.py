"""A managed server's own temporary directory: vLLM leaves files in the
system's at every start and never removes them, so each server gets one
that goes away with it."""

from __future__ import annotations

import getpass
import os
import tempfile
from pathlib import Path

from grpo_core.plugin_api import ConfigError
from grpo_plugins.vllm.addresses import MAX_SOCKET_PATH

SERVER_TMP_PREFIX = "grpo-vllmtmp-"


def server_temp_env(temp_dir: Path) -> dict[str, str]:
    """Environment that keeps a server's temporary files in ``temp_dir``.

    vLLM leaves files in the system temporary directory at every start (a
    ``vllm_dist_*`` rendezvous file and the engine's ZMQ sockets) and never
    removes them: a run whose server restarts, or a test suite, piles up
    thousands in /tmp. A directory of the server's own is deleted with it.
    torch's compile cache stays where it was, so a restart reuses it."""
    default_cache = Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}"
    return {
        "TMPDIR": str(temp_dir),
        "VLLM_RPC_BASE_PATH": str(temp_dir),
        "TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR", str(default_cache)),
    }


ENGINE_SOCKET_NAME_LEN = 36  # vLLM names each engine ZMQ socket by a uuid4, inside VLLM_RPC_BASE_PATH


def server_temp_parent() -> str | None:
    """Where a managed server's temporary directory goes: the system's
    (``TMPDIR``), unless vLLM's engine sockets would not fit there (their
    paths must stay within AF_UNIX's 107 bytes: a long ``TMPDIR`` crashed the
    engine at start with a ZMQ error), then ``/tmp``."""
    base = tempfile.gettempdir()
    longest = len(os.fsencode(base)) + 1 + len(SERVER_TMP_PREFIX) + 8 + 1 + ENGINE_SOCKET_NAME_LEN
    if longest <= MAX_SOCKET_PATH:
        return None
    if os.path.isdir("/tmp") and os.access("/tmp", os.W_OK):
        return "/tmp"
    raise ConfigError(
        f"the temporary directory {base} is too long for vLLM's engine sockets ({MAX_SOCKET_PATH} bytes "
        "at most, with ~60 of its own): set TMPDIR to a shorter path."
    )
