"""The parts of the vLLM plugin that need no running server: the command
line built from a config, import hygiene, refusals. Fast."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_core.contract.context import RunContext
from grpo_core.contract.errors import ConfigError
from grpo_plugins.vllm.command_line import server_spec
from grpo_plugins.vllm.engine_settings import resolve_dtype
from grpo_plugins.vllm.machine import cpu_has_fast_bf16, cuda_available


def _arg(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_server_spec_from_config(smollm2_dir, tmp_path, config_for):
    cfg = config_for(smollm2_dir, tmp_path)
    cfg.vllm.extra_args = ["--seed", "5"]
    cfg.lora_r = 12
    spec = server_spec(cfg, lora=True)
    argv = spec.argv
    assert argv[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    assert _arg(argv, "--model") == smollm2_dir and _arg(argv, "--served-model-name") == "base"
    assert _arg(argv, "--max-lora-rank") == "16" and "--enable-lora" in argv  # rounded up to a rank vLLM accepts
    assert _arg(argv, "--logprobs-mode") == "processed_logprobs"
    assert _arg(argv, "--dtype") == "float32"
    # The key travels in the environment (ps shows every user the command line) and guards every path.
    assert (
        "--api-key" not in argv and "test-key-123" not in " ".join(argv) and spec.env["VLLM_API_KEY"] == "test-key-123"
    )
    assert _arg(argv, "--middleware") == "grpo_plugins.vllm.guard.RequireApiKey"
    assert spec.port > 0 and _arg(argv, "--port") == str(spec.port)  # port 0 -> a free port
    assert argv[-2:] == ["--seed", "5"]  # extra_args last
    assert spec.env["VLLM_CPU_KVCACHE_SPACE"] == "1" and spec.env["VLLM_SERVER_DEV_MODE"] == "1"
    assert spec.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True" and not spec.warnings


def test_enforce_eager_defaults_to_cpu_only(smollm2_dir, tmp_path, config_for):
    """On CPU graph compilation costs far more start-up than it saves."""
    cfg = config_for(smollm2_dir, tmp_path)
    assert ("--enforce-eager" in server_spec(cfg).argv) == (not cuda_available())
    cfg.vllm.enforce_eager = False
    assert "--enforce-eager" not in server_spec(cfg).argv
    cfg.vllm.enforce_eager = True
    assert "--enforce-eager" in server_spec(cfg).argv


def test_kv_block_size_is_32_on_cpu_and_vllms_own_on_a_gpu(smollm2_dir, tmp_path, config_for, monkeypatch):
    """vLLM's CPU default of 128-token blocks shares no prefill between the
    samples of a prompt shorter than 128 tokens (prefix caching shares whole
    blocks); 32 is the smallest its CPU attention takes."""
    from grpo_plugins.vllm import machine

    cfg = config_for(smollm2_dir, tmp_path)
    monkeypatch.setattr(machine, "cuda_available", lambda: False)
    assert _arg(server_spec(cfg).argv, "--block-size") == "32"
    monkeypatch.setattr(machine, "cuda_available", lambda: True)  # faked: no GPU here
    assert "--block-size" not in server_spec(cfg).argv
    cfg.vllm.block_size = 64
    assert _arg(server_spec(cfg).argv, "--block-size") == "64"


# /proc/cpuinfo flag lines of each x86-64 CPU class a user may have (trimmed).
CPU_CLASSES = {
    "avx2": ("flags : fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma avx2 bmi2", "float32"),
    "avx512": ("flags : fpu sse2 avx avx2 fma avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni", "float32"),
    "avx512_bf16": ("flags : fpu sse2 avx avx2 avx512f avx512bw avx512vl avx512_vnni avx512_bf16", "bfloat16"),
    "amx": ("flags : fpu avx2 avx512f avx512bw avx512_vnni amx_bf16 amx_tile amx_int8", "bfloat16"),
}


@pytest.mark.parametrize("cpu", sorted(CPU_CLASSES))
def test_auto_dtype_per_cpu_class(cpu: str) -> None:
    """dtype=auto on CPU: float32 where bf16 is emulated (AVX2, plain
    AVX512), bfloat16 where it is native (AVX512-BF16, AMX). The flags are
    faked: this machine's are never consulted."""
    flags, expected = CPU_CLASSES[cpu]
    assert resolve_dtype("auto", flags=flags, cuda=False) == expected
    assert cpu_has_fast_bf16(flags) == (expected == "bfloat16")
    assert resolve_dtype("auto", flags=flags, cuda=True) == "auto"  # a GPU: vLLM decides
    for explicit in ("float32", "bfloat16", "float16"):
        assert resolve_dtype(explicit, flags=flags, cuda=False) == explicit


def test_auto_dtype_reaches_the_server_command(smollm2_dir, tmp_path, config_for, monkeypatch) -> None:
    """The server is started with the dtype its CPU class resolves to."""
    from grpo_plugins.vllm import machine

    monkeypatch.setattr(machine, "cuda_available", lambda: False)
    cfg = config_for(smollm2_dir, tmp_path)
    cfg.vllm.dtype = "auto"  # the shared test config states float32
    for flags, expected in CPU_CLASSES.values():
        monkeypatch.setattr(machine, "cpu_flags", lambda flags=flags: flags)
        assert _arg(server_spec(cfg).argv, "--dtype") == expected


def test_cpu_core_defaults(smollm2_dir, tmp_path, config_for):
    """Synchronous CPU runs give vLLM every core; prefetching runs leave the trainer one."""
    if not cuda_available():
        assert server_spec(config_for(smollm2_dir, tmp_path)).env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
        prefetching = config_for(smollm2_dir, tmp_path, async_prefetch=True, use_data_producer=True)
        assert "VLLM_CPU_NUM_OF_RESERVED_CPU" not in server_spec(prefetching).env  # the trainer keeps a core


def test_merged_weight_runs_serve_without_lora_layers(smollm2_dir, tmp_path, config_for):
    """The managed server gets LoRA layers only when the chosen weight sync
    declares it loads adapters."""
    from grpo_core.contract.types import ADAPTER_FROM_PATH, WEIGHTS_FROM_PATH
    from grpo_core.host.plugin_host import PluginHost

    merged = config_for(smollm2_dir, tmp_path, vllm_lora_sync=False)
    adapter = config_for(smollm2_dir, tmp_path, vllm_lora_sync=True)
    assert PluginHost().engine_requirements(merged) == {WEIGHTS_FROM_PATH}
    assert PluginHost().engine_requirements(adapter) == {ADAPTER_FROM_PATH}
    assert "--enable-lora" not in server_spec(merged, lora=False).argv
    assert "--enable-lora" in server_spec(adapter, lora=True).argv


def test_the_server_opens_what_the_chosen_sync_declares_it_needs(smollm2_dir, tmp_path, config_for):
    """LoRA layers and vLLM's NCCL weight-transfer engine follow the sync's
    declared ``required_capabilities``, not its name."""
    from grpo_core.host.plugin_host import PluginHost
    from grpo_plugins.vllm.command_line import managed_spec

    nccl = config_for(smollm2_dir, tmp_path, vllm_lora_sync=False)
    nccl.plugins.weight_sync = "nccl"
    for cfg, transfer, lora in (
        (nccl, True, False),
        (config_for(smollm2_dir, tmp_path, vllm_lora_sync=True), False, True),
    ):
        spec = managed_spec(cfg, PluginHost().engine_requirements(cfg))
        try:
            assert ("--weight-transfer-config" in spec.argv) == transfer
            assert ("--enable-lora" in spec.argv) == lora
        finally:
            spec.remove_private_socket_dir()


def test_public_bind_warns_and_drops_unguarded_dev_mode(smollm2_dir, tmp_path, config_for):
    cfg = config_for(smollm2_dir, tmp_path)
    spec = server_spec(cfg, host="0.0.0.0", port=8123, lora=True)
    assert "VLLM_SERVER_DEV_MODE" not in spec.env  # LoRA sync does not need it
    assert spec.warnings and "0.0.0.0" in spec.warnings[0]
    cfg.adapter = None  # full fine-tuning: reload_weights needs dev mode, refused on the network unless named
    with pytest.raises(ConfigError, match="expose_dev_endpoints = true"):
        server_spec(cfg, host="0.0.0.0", port=8123)
    cfg.vllm.expose_dev_endpoints = True
    full = server_spec(cfg, host="0.0.0.0", port=8123)
    assert full.env["VLLM_SERVER_DEV_MODE"] == "1" and "--enable-lora" not in full.argv
    assert "/collective_rpc" in full.warnings[0]


def test_managed_server_is_a_private_socket_and_tcp_gets_a_key(smollm2_dir, tmp_path, config_for, monkeypatch):
    from grpo_plugins.vllm.command_line import managed_spec

    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    cfg = config_for(smollm2_dir, tmp_path)
    cfg.vllm.api_key = None
    spec = managed_spec(cfg)
    socket_dir = Path(spec.uds).parent
    try:
        assert spec.base_url == f"unix:{spec.uds}" and "--host" not in spec.argv and "--port" not in spec.argv
        assert _arg(spec.argv, "--uds") == spec.uds and spec.env["VLLM_SERVER_DEV_MODE"] == "1"
        assert stat.S_IMODE(socket_dir.stat().st_mode) == 0o700 and socket_dir.stat().st_uid == os.getuid()
    finally:
        spec.remove_private_socket_dir()
    assert not socket_dir.exists()
    cfg.vllm.transport = "tcp"
    first, second = managed_spec(cfg), managed_spec(cfg)
    assert first.key_generated and len(first.api_key) >= 40 and first.api_key != second.api_key  # one per run
    assert first.env["VLLM_API_KEY"] == first.api_key and first.api_key not in " ".join(first.argv)
    assert "--middleware" in first.argv and not first.warnings


def test_a_socket_directory_others_can_open_is_refused(tmp_path):
    from grpo_plugins.vllm.addresses import check_socket_path

    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    with pytest.raises(ConfigError, match="chmod 700"):
        check_socket_path(shared / "vllm.sock")
    check_socket_path(tmp_path / "new" / "vllm.sock")  # created private
    assert stat.S_IMODE((tmp_path / "new").stat().st_mode) == 0o700
    with pytest.raises(ConfigError, match="longer than"):
        check_socket_path(tmp_path / ("x" * 120) / "vllm.sock")


def test_rank_beyond_vllm_limit_is_a_config_error(smollm2_dir, tmp_path, config_for):
    cfg = config_for(smollm2_dir, tmp_path)
    cfg.lora_r = 1024
    with pytest.raises(ConfigError, match="lora_r"):
        server_spec(cfg, lora=True)


def test_commands_module_does_not_import_vllm():
    code = (
        "import sys, grpo_plugins.vllm.commands, grpo_plugins.vllm.rollout, grpo_plugins.weight_sync_files; "
        "bad = [m for m in ('vllm', 'torch') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_colocate_mode_picks_the_in_process_engine(smollm2_dir, tmp_path, config_for):
    from grpo_core.config.implementations import chosen_implementations
    from grpo_core.host.plugin_host import PluginHost

    cfg = config_for(smollm2_dir, tmp_path, vllm_mode="colocate")
    chosen = chosen_implementations(cfg)
    assert (chosen["rollout"], chosen["weight_sync"]) == ("vllm_colocate", "vllm_in_memory")
    # Each implementation validates the config before it is built.
    with pytest.raises(ConfigError, match="vllm_colocate"):  # the server rollout forced onto a colocate config
        PluginHost().load_implementation("rollout", "vllm", RunContext(config=cfg, output_dir=tmp_path))
    cfg.trl.vllm_enable_sleep_mode = True
    with pytest.raises(ConfigError, match="CUDA GPUs only"):  # vLLM refuses sleep mode on CPU
        PluginHost().load_implementation("rollout", "vllm_colocate", RunContext(config=cfg, output_dir=tmp_path))


def test_nccl_sync_is_refused_without_cuda_with_the_alternatives(smollm2_dir, tmp_path, config_for, monkeypatch):
    import torch

    from grpo_core.host.plugin_host import PluginHost

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # faked, whatever this machine has
    cfg = config_for(smollm2_dir, tmp_path, vllm_lora_sync=False)
    with pytest.raises(ConfigError) as info:
        PluginHost().load_implementation("weight_sync", "nccl", RunContext(config=cfg, output_dir=tmp_path))
    message = str(info.value)
    assert "no CUDA device" in message and "lora_filesystem" in message and "vllm_in_memory" in message


def test_a_server_that_accepts_any_key_is_not_adopted():
    """A stand-in for someone else's server on the default port: it answers
    200 to everything, so it proves nothing about our key."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from grpo_plugins.vllm.client import NOTHING_ANSWERS, adoption_refusal

    class AnswersEverything(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"data": [{"id": "base"}]}')

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), AnswersEverything)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert "HTTP 200 with a made-up key, 200 with ours" in adoption_refusal(url, "our-key")
        assert "no API key is configured" in adoption_refusal(url, None)
    finally:
        server.shutdown()
        server.server_close()
    assert adoption_refusal(url, "our-key") == NOTHING_ANSWERS


def test_cpu_servers_are_told_not_to_busy_wait_and_gpu_servers_keep_vllms_default(
    smollm2_dir, tmp_path, config_for, monkeypatch
):
    from grpo_plugins.vllm import machine
    from grpo_plugins.vllm.idle_spin import CPU_IDLE_SPIN_S, IDLE_SPIN_ENV

    cfg = config_for(smollm2_dir, tmp_path)
    monkeypatch.setattr(machine, "cuda_available", lambda: False)
    assert server_spec(cfg).env[IDLE_SPIN_ENV] == CPU_IDLE_SPIN_S
    monkeypatch.setattr(machine, "cuda_available", lambda: True)  # faked: no GPU here
    assert IDLE_SPIN_ENV not in server_spec(cfg).env


def test_the_idle_spin_plugin_shortens_vllms_reader_wait_only_when_asked(monkeypatch):
    """vLLM's real queue class: a reader made after ``register()`` sleeps at
    once; without the variable, register() leaves vLLM's one-second spin."""
    import zmq
    from vllm.distributed.device_communicators import shm_broadcast

    from grpo_plugins.vllm import idle_spin

    original_init = shm_broadcast.SpinCondition.__init__
    context = zmq.Context()

    def reader_spin() -> float:
        address = f"inproc://spin-{os.urandom(4).hex()}"
        writer = shm_broadcast.SpinCondition(False, context, address)  # binds what the reader connects to
        reader = shm_broadcast.SpinCondition(True, context, address)
        for socket in (
            reader.local_notify_socket,
            reader.write_cancel_socket,
            reader.read_cancel_socket,
            writer.local_notify_socket,
        ):
            socket.close(linger=0)
        return reader.busy_loop_s

    try:
        monkeypatch.delenv(idle_spin.IDLE_SPIN_ENV, raising=False)
        idle_spin.register()
        assert reader_spin() == 1  # vLLM's own default
        monkeypatch.setenv(idle_spin.IDLE_SPIN_ENV, "0")
        idle_spin.register()
        assert reader_spin() == 0.0
        monkeypatch.setenv(idle_spin.IDLE_SPIN_ENV, "0.25")
        idle_spin.register()  # registering again (vLLM loads plugins once per process; a test may not) updates it
        assert reader_spin() == 0.25
    finally:
        shm_broadcast.SpinCondition.__init__ = original_init
        if hasattr(shm_broadcast.SpinCondition, "_grpo_idle_spin"):
            del shm_broadcast.SpinCondition._grpo_idle_spin
        context.term()


def test_fetched_adapter_folders_outlive_the_load_after_them():
    """vLLM re-reads an in-place adapter from its folder at every engine
    step, so the server-side folders of ``lora_http`` go only once ``keep``
    newer ones exist (never fewer than two: the new one and the one served
    until it loads)."""
    import shutil

    import torch
    from safetensors.torch import save

    from grpo_core.modeling.engine_weights import ADAPTER_CONFIG_KEY
    from grpo_plugins.vllm.worker_ext import write_adapter

    body = save({"w": torch.zeros(2)}, metadata={"format": "pt", ADAPTER_CONFIG_KEY: '{"r": 4}'})
    kept: list[str] = []
    try:
        made = [write_adapter(body, kept, keep=3) for _ in range(5)]
        assert kept == made[-3:] and [Path(p).exists() for p in made] == [False, False, True, True, True]
        assert (Path(made[-1]) / "adapter_config.json").read_text() == '{"r": 4}'
        made.append(write_adapter(body, kept, keep=1))  # asked for fewer: the served one still stays
        assert kept == made[-2:]
        with pytest.raises(ValueError, match="adapter_config"):
            write_adapter(save({"w": torch.zeros(2)}), kept, keep=2)
    finally:
        for path in kept:
            shutil.rmtree(path, ignore_errors=True)
