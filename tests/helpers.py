"""What many tests share, in one place: running the ``grpo`` command as a user
does, the no-traceback assertion, a run's working directory and config file,
and reading back what a run wrote.

The model fixtures are in ``conftest.py``: ``smollm2_dir`` (the real
SmolLM2-135M-Instruct, for tests about what a model learns or samples) and
``tiny_model_dir`` (a 1-layer random Llama over SmolLM2's tokenizer,
``tiny_model.py``, for tests of plumbing). Import this module as
``from helpers import ...``: ``tests/`` is on ``sys.path`` (pytest's default
``prepend`` import mode puts the directory of the root ``conftest.py`` there).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"
HUB_OFFLINE = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
"""tests/conftest.py sets them for the whole session; a child without them checks a config as where the hub is
reachable (a hub dataset not cached here is then a warning that it is fetched at run time, not an error)."""
# The console script installed beside this interpreter, as a user runs it.
GRPO = str(Path(sys.executable).with_name("grpo"))


def grpo(
    *args: str,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 120,
    pythonpath: Path | None = None,
    plugins_from: Iterable[Path] | None = None,
    unset: Iterable[str] = (),
) -> subprocess.CompletedProcess[str]:
    """Run ``grpo ARGS`` in a child process and capture its output as text.

    The child gets this process's environment without the ``unset`` names,
    then ``env``; ``pythonpath`` replaces ``PYTHONPATH`` (a plugin installed
    into a folder of its own). With ``plugins_from``, the child sees only
    grpo's own plugins and those installed in these folders, whatever else
    the venv holds (tests that count plugins; ``plugin_set.py``)."""
    drop = set(unset)
    full_env = {key: value for key, value in os.environ.items() if key not in drop}
    full_env.update(env or {})
    if pythonpath is not None:
        full_env["PYTHONPATH"] = str(pythonpath)
    command = [GRPO, *args]
    if plugins_from is not None:
        from plugin_set import SITES_ENV, subprocess_command

        full_env[SITES_ENV] = os.pathsep.join(str(site) for site in plugins_from)
        command = subprocess_command(args)
    return run_group(command, cwd=cwd, env=full_env, timeout=timeout)


class Finished(subprocess.CompletedProcess):
    """A finished command, with the pid it had (tests that count the processes a command started)."""

    def __init__(self, command: list[str], returncode: int, stdout: str, stderr: str, pid: int) -> None:
        super().__init__(command, returncode, stdout, stderr)
        self.pid = pid


def run_group(command: list[str], timeout: float, **popen: Any) -> Finished:
    """``subprocess.run(command, capture_output=True, text=True)`` in a
    process group of its own, killed whole when ``timeout`` passes: a
    launcher's training processes must not outlive a test that gave up on
    them (they would hold locks and CPUs through the rest of the suite)."""
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, **popen
    ) as process:
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as expired:
            os.killpg(process.pid, signal.SIGKILL)
            out, err = process.communicate()
            raise subprocess.TimeoutExpired(command, timeout, out, err) from expired
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # what the finished command left running
    return Finished(command, process.returncode, out, err, process.pid)


def no_traceback(output: str | subprocess.CompletedProcess[str]) -> None:
    """Assert that a command (its stdout and stderr) or a log printed no
    Python traceback: a user's mistake is one clear line, never a dump."""
    if isinstance(output, subprocess.CompletedProcess):
        output = (output.stdout or "") + (output.stderr or "")
    assert "Traceback" not in output, output[-6000:]


def write_rows(path: Path, rows: Iterable[Mapping[str, Any]]) -> Path:
    """A JSON-lines dataset: one row per line, as ``datasets`` reads it."""
    path.write_text("\n".join(json.dumps(row) for row in rows))
    return path


def run_workdir(
    path: Path,
    rows: Iterable[Mapping[str, Any]],
    modules: Mapping[str, str] | None = None,
    monkeypatch: pytest.MonkeyPatch | None = None,
) -> Path:
    """A run's working directory: ``train.jsonl`` holding ``rows`` and a
    Python module per ``modules`` entry (name -> source: the rewards, a
    rollout function, an environment), importable in this process when
    ``monkeypatch`` is given (undone after the test). Returns ``path``."""
    path.mkdir(parents=True, exist_ok=True)
    for name, source in (modules or {}).items():
        (path / f"{name}.py").write_text(source)
    write_rows(path / "train.jsonl", rows)
    if monkeypatch is not None:
        monkeypatch.syspath_prepend(str(path))
    return path


def raw_config(
    model: str, workdir: Path, *, out: str = "out", dataset: str = "train.jsonl", **keys: Any
) -> dict[str, Any]:
    """The raw config of a run in ``workdir``: ``model`` as the base model,
    ``workdir/dataset`` as its one dataset, ``workdir/out`` as its output
    directory, and every other key as given (``trl={...}`` included): the
    caller states each setting its test depends on; nothing else is assumed."""
    return {
        "base_model": model,
        "datasets": [{"path": str(workdir / dataset)}],
        "output_dir": str(workdir / out),
        **keys,
    }


def minimal_config(**keys: Any) -> dict[str, Any]:
    """The smallest raw config every check accepts with nothing on disk: a hub model id (never loaded),
    one of conftest.py's placeholder hub datasets, 4 completions per prompt scored by the built-in
    ``last_number_match``; ``keys`` as ``merged`` takes them (``trl={...}`` adds to the trl table).
    For tests of the config and its checks; a run that trains uses ``raw_config``."""
    return merged(
        {
            "base_model": "some/model",
            "datasets": [{"path": "my-org/arith"}],
            "micro_batch_size": 4,
            "trl": {"num_generations": 4, "reward_funcs": ["last_number_match"]},
        },
        **keys,
    )


def merged(raw: Mapping[str, Any], **overrides: Any) -> dict[str, Any]:
    """``raw`` with ``overrides``; a table (``trl = {...}``, ``vllm``,
    ``plugins``) given in both is merged key by key, anything else replaced."""
    out = dict(raw)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def write_toml(path: Path, raw: Mapping[str, Any]) -> Path:
    """Write ``raw`` as the TOML config file ``path`` (``None`` values are
    left out, which is what a null means to grpo: the default) and check
    that it reads back as written."""
    from grpo_core.config.convert import to_toml_text

    text = to_toml_text(dict(raw))
    assert tomllib.loads(text) == _without_none(raw), f"{path.name} does not read back as written"
    path.write_text(text, encoding="utf-8")
    return path


def _without_none(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [_without_none(v) for v in value]
    return value


def metrics(out: Path) -> list[dict[str, Any]]:
    """The records of a run's ``metrics.jsonl`` (output directory ``out``)."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def weights(out: Path, name: str = "model.safetensors") -> dict[str, Any]:
    """The tensors of the safetensors file ``name`` a run saved in ``out``."""
    from safetensors.torch import load_file

    return load_file(str(out / name))
