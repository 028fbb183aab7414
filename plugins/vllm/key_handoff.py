"""Handing a server's API key from ``grpo vllm-serve`` to a later ``grpo run``
of the same user, so the two-terminal workflow needs no copied key.

``grpo vllm-serve`` (TCP) leaves its key in a file named by the server's
address, in a folder only this user can open, and removes it when the
server stops. ``grpo run`` with no key configured reads the file for the
address it would use. The key is only a claim: the run still adopts the
server only if it proves it holds the key (refuses a made-up key, accepts
this one: :func:`grpo_plugins.vllm.client.adoption_refusal`). So a stale
file, or one for a server another user now runs on that port, only makes
the run start its own server, as it would without a file.

Where: ``$XDG_RUNTIME_DIR/grpo-vllm-keys`` (a per-user memory-backed folder
where the session has one), else ``<grpo cache>/vllm-keys``; the folder is
0700 and each file 0600, both owned by this user. A file or folder that is
not is ignored, never trusted.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

from grpo_core.plugin_api import cache_root

DIR_NAME = "grpo-vllm-keys"


def key_dir() -> Path:
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and Path(runtime).is_dir():
        return Path(runtime) / DIR_NAME
    return cache_root() / "vllm-keys"


def address_name(base_url: str) -> str | None:
    """``http://127.0.0.1:8000`` -> ``127.0.0.1_8000``: the file's name; the
    wildcard and ``localhost`` binds are named by where a local client
    connects (127.0.0.1). ``None`` for a Unix socket (its private folder is
    the access check; no key is needed)."""
    if base_url.startswith("unix:"):
        return None
    parts = urlsplit(base_url if "://" in base_url else f"http://{base_url}")
    host = parts.hostname or ""
    if host in ("", "0.0.0.0", "::", "localhost"):
        host = "127.0.0.1"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return re.sub(r"[^A-Za-z0-9.-]", "_", f"{host}_{port}")


def key_file(base_url: str) -> Path | None:
    name = address_name(base_url)
    return None if name is None else key_dir() / f"{name}.key"


def _private_problem(path: Path, mode: int) -> str | None:
    """Why ``path`` is not this user's alone (``mode``: the most it may allow), else ``None``."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "it does not exist"
    if stat.S_ISLNK(st.st_mode):
        return "it is a symbolic link"
    if st.st_uid != os.getuid():
        return f"it belongs to uid {st.st_uid}, not this user ({os.getuid()})"
    if stat.S_IMODE(st.st_mode) & ~mode:
        return f"its mode is {stat.S_IMODE(st.st_mode):o}, readable or writable by others (expected {mode:o})"
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read(path: Path) -> dict | None:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    with os.fdopen(fd) as fh:
        try:
            data = json.load(fh)
        except ValueError:
            return None
    return data if isinstance(data, dict) and isinstance(data.get("key"), str) else None


def leave_key(base_url: str, key: str, pid: int | None = None) -> tuple[Path | None, str | None]:
    """Write ``key`` for ``base_url`` (0600 in a 0700 folder); returns the
    file, or ``None`` and why not (a live server of this user already left
    one for that address, or the folder is not private)."""
    path = key_file(base_url)
    if path is None:
        return None, "a Unix socket needs no key"
    pid = os.getpid() if pid is None else pid
    folder = path.parent
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    problem = _private_problem(folder, 0o700)
    if problem is not None and "mode" in problem:
        os.chmod(folder, 0o700)  # ours: make it private before anything goes in
        problem = _private_problem(folder, 0o700)
    if problem is not None:
        return None, f"{folder}: {problem}"
    existing = _read(path)
    if existing is not None and existing.get("pid") != pid and _pid_alive(int(existing.get("pid", 0))):
        return None, f"{path} already holds the key of another live server (pid {existing['pid']})"
    tmp = folder / f".{path.name}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump({"url": base_url, "key": key, "pid": pid}, fh)
    os.replace(tmp, path)
    return path, None


def handed_key(base_url: str, log: Callable[[str], None] | None = None) -> str | None:
    """The key ``grpo vllm-serve`` of this user left for ``base_url``, or
    ``None``: no file, a file others could read or write (ignored, said in
    ``log``), or one left by a process that is gone (removed)."""
    path = key_file(base_url)
    if path is None or not path.exists():
        return None
    for where, mode in ((path.parent, 0o700), (path, 0o600)):
        problem = _private_problem(where, mode)
        if problem is not None:
            if log is not None:
                log(f"vLLM: ignoring the API key file {path}: {where}: {problem}")
            return None
    data = _read(path)
    if data is None:
        return None
    pid = data.get("pid")
    if not isinstance(pid, int) or not _pid_alive(pid):
        path.unlink(missing_ok=True)  # its `grpo vllm-serve` was killed before it could remove it
        return None
    if log is not None:
        log(f"vLLM: found the API key this user's `grpo vllm-serve` left for {base_url} in {path}")
    return data["key"]


def withdraw_key(base_url: str, key: str) -> None:
    """Remove the file for ``base_url`` if it still holds ``key`` (not one a
    later server of this user left there)."""
    path = key_file(base_url)
    if path is None:
        return
    data = _read(path)
    if data is not None and data.get("key") == key:
        path.unlink(missing_ok=True)
