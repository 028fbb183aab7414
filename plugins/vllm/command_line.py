"""A vLLM server's command line and environment from a grpo config.

:func:`server_spec` turns the ``[vllm]`` table into the ``api_server``
command and its environment; :func:`managed_spec` is the one ``grpo run``
starts for itself (private socket or generated key, CPU split). Nothing
here imports vLLM: the server runs in another interpreter.
"""

from __future__ import annotations

import json
import secrets
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from grpo_core.plugin_api import (
    ADAPTER_FROM_URL,
    ADAPTER_LOADS,
    WEIGHTS_OVER_NCCL,
    ConfigError,
    format_cpu_list,
    process_cpus,
    remove_scratch_dir,
    resolve_model_dir,
)
from grpo_plugins.vllm import machine
from grpo_plugins.vllm.addresses import (
    SOCKET_DIR_PREFIX,
    SOCKET_NAME,
    client_host,
    configured_api_key,
    free_port,
    is_loopback,
    private_socket_dir,
    unix_sockets_available,
)
from grpo_plugins.vllm.cpu_kernels import CPU_KERNELS_ENV
from grpo_plugins.vllm.cpus import plan_cpu_split
from grpo_plugins.vllm.engine_settings import (
    block_size,
    cpu_kernels,
    cpu_kvcache_gib,
    cpu_whole_prefill_args,
    enforce_eager,
    ir_op_priority,
    max_model_len,
    resolve_dtype,
)
from grpo_plugins.vllm.idle_spin import CPU_IDLE_SPIN_S, IDLE_SPIN_ENV
from grpo_plugins.vllm.placement import server_devices
from grpo_plugins.vllm.settings import vllm_settings

if TYPE_CHECKING:
    from grpo_core.plugin_api import GRPOConfig

SERVED_MODEL_NAME = "base"
GUARD_MIDDLEWARE = "grpo_plugins.vllm.guard.RequireApiKey"
WORKER_EXTENSION = "grpo_plugins.vllm.worker_ext.GrpoWorkerExtension"


@dataclass
class ServerSpec:
    """Everything needed to start one vLLM server process."""

    argv: list[str]
    env: dict[str, str]
    host: str
    port: int
    api_key: str | None = None
    dev_mode: bool = False
    warnings: list[str] = field(default_factory=list)
    uds: str | None = None  # the Unix socket it listens on instead of host:port
    key_generated: bool = False  # api_key was made up for this server (no key configured)
    engine_cpus: frozenset[int] | None = None  # the cores its engine is pinned to (plugins/vllm/cpus.py)
    spawn_cpus: frozenset[int] | None = None  # the affinity it starts with, whatever the trainer's is by then

    @property
    def base_url(self) -> str:
        if self.uds:
            return f"unix:{self.uds}"
        return f"http://{client_host(self.host)}:{self.port}"

    def remove_private_socket_dir(self) -> None:
        """Delete the socket directory grpo made for this server
        (:func:`private_socket_dir`); a socket path the config gave is left alone."""
        if self.uds and Path(self.uds).parent.name.startswith(SOCKET_DIR_PREFIX):
            remove_scratch_dir(Path(self.uds).parent)


def server_spec(
    cfg: GRPOConfig,
    host: str | None = None,
    port: int | None = None,
    lora: bool = False,
    *,
    weight_transfer: bool = False,
    adapter_over_http: bool = False,
    uds: Path | None = None,
    generate_key: bool = False,
    replica: int | None = None,
) -> ServerSpec:
    """The ``python -m vllm.entrypoints.openai.api_server`` command for ``cfg``;
    ``lora``: the weight sync loads adapters, so the server needs LoRA layers;
    ``weight_transfer``: it broadcasts weights over NCCL, so the server opens
    vLLM's weight-transfer engine; ``adapter_over_http``: the server's worker
    fetches the adapter (``lora_http``) through ``/collective_rpc``. All come
    from the sync's declared ``required_capabilities``
    (:attr:`RunContext.engine_requirements`, through :func:`engine_flags`),
    never from its name.

    ``uds``: listen on that Unix socket (no TCP port at all), else on
    ``host:port``. Over TCP the API key (configured, or made up when
    ``generate_key``) guards every path but ``/health``.

    Dev mode (``/collective_rpc``, ``/reset_prefix_cache``, ``/weight_info``)
    is needed for full-weight reload, an adapter fetched over HTTP and
    server hygiene. It is on for a socket and a loopback bind; a
    non-loopback bind gets it only with ``[vllm] expose_dev_endpoints =
    true``, and a run that needs it is refused without (an adapter loaded
    from a path works without dev mode).

    ``replica``: this is server ``replica`` of the ``data_parallel_size``
    separate servers a managed run starts (vLLM's own data parallelism off,
    its share of ``[vllm] devices``); ``None``: one server, given every
    device in ``[vllm] devices`` and vLLM's ``--data-parallel-size``.
    """
    v = vllm_settings(cfg)
    host = host or v.host
    port = v.port if port is None else port
    if uds is None and port == 0:
        port = free_port(host)
    model_dir = resolve_model_dir(cfg.base_model)
    max_len = max_model_len(cfg)
    where = ["--uds", str(uds)] if uds is not None else ["--host", host, "--port", str(port)]
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model_dir,
        "--served-model-name",
        SERVED_MODEL_NAME,
        *where,
        "--dtype",
        resolve_dtype(v.dtype),
        "--max-model-len",
        str(max_len),
        "--gpu-memory-utilization",
        str(v.gpu_memory_utilization),
        "--tensor-parallel-size",
        str(v.tensor_parallel_size),
        "--data-parallel-size",
        str(v.data_parallel_size if replica is None else 1),
        # grpo's worker methods for /collective_rpc: pull weights over HTTP (full_http), re-tie a tied LM head.
        "--worker-extension-cls",
        WORKER_EXTENSION,
        # Sampler log-probs after temperature/top-k/top-p, the distribution the
        # trainer reproduces by dividing its logits by the temperature.
        "--logprobs-mode",
        "processed_logprobs",
    ]
    if cfg.trust_remote_code:
        argv.append("--trust-remote-code")
    if weight_transfer:  # vLLM's NCCL weight-transfer engine
        argv += ["--weight-transfer-config", '{"backend": "nccl"}']
    if v.enable_prefix_caching is not None:
        argv.append("--enable-prefix-caching" if v.enable_prefix_caching else "--no-enable-prefix-caching")
    if enforce_eager(cfg):
        argv.append("--enforce-eager")
    blocks = block_size(cfg)
    if blocks is not None:
        argv += ["--block-size", str(blocks)]
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    if cpu_kernels(cfg):  # grpo's CPU kernels, installed by vLLM's plugin loader in its processes (cpu_kernels.py)
        env[CPU_KERNELS_ENV] = "1"
        priority = ir_op_priority(cfg)
        if priority is not None:
            argv += ["--ir-op-priority", json.dumps(priority)]
    if not machine.cuda_available():
        argv += cpu_whole_prefill_args(max_len)
        # The worker must not busy-wait a second after each request on cores the trainer shares (idle_spin.py)
        env[IDLE_SPIN_ENV] = CPU_IDLE_SPIN_S
    if lora:
        # Only for adapter sync: serving through LoRA layers is slow on CPU
        # (3.9x here, benchmarks/RESULTS.md), so merged-weight runs skip it.
        argv += ["--enable-lora", "--max-lora-rank", str(_lora_rank_bucket(cfg.lora_r))]
    if not machine.cuda_available() and not cfg.trl.async_prefetch:
        # vLLM's CPU backend keeps one core for the API server by default; in
        # a synchronous run the trainer idles while vLLM generates, so let the
        # engine use every core (1.6x faster generation on 2 cores here).
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    warnings: list[str] = []
    network = uds is None and not is_loopback(host)
    if network and (not lora or adapter_over_http) and not v.expose_dev_endpoints:
        what = "fetches its adapter (lora_http)" if adapter_over_http else "syncs full weights"
        raise ConfigError(
            f"vLLM would bind {host}, reachable from the network, and this run {what} through vLLM's "
            "dev-mode endpoint /collective_rpc (which makes the server load weights from any path it can read). "
            "Bind [vllm] host = '127.0.0.1' (reach it across hosts through an SSH tunnel, docs/security.md), "
            "sync a LoRA adapter from a path instead (adapter = 'lora' with trl.vllm_lora_sync = true: "
            "lora_filesystem, the one sync that needs no dev endpoints), or accept the risk by name "
            "with [vllm] expose_dev_endpoints = true."
        )
    dev_mode = not network or v.expose_dev_endpoints
    if dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    if network:
        warnings.append(
            f"vLLM binds {host}: anyone who reaches this port and has the API key can make the server load adapters "
            "and weights from its own filesystem"
            + (" and call its dev endpoints (/collective_rpc, /reset_prefix_cache)" if dev_mode else "")
            + ". Prefer [vllm] host = '127.0.0.1' unless the trainer runs on another machine."
        )
    api_key = configured_api_key(cfg)
    generated = False
    if api_key is None and uds is None and generate_key:
        api_key, generated = secrets.token_urlsafe(32), True
    if api_key:
        env["VLLM_API_KEY"] = api_key  # vLLM's own check on /v1; the guard reads it too
        if uds is None:
            argv += ["--middleware", GUARD_MIDDLEWARE]
    elif uds is None:
        warnings.append(
            f"vLLM serves {host}:{port} without an API key: any process that reaches the port (every user of this "
            "machine, at least) can generate with it, load adapters and, in dev mode, reload its weights. Set "
            "[vllm] api_key, or serve on a Unix socket (--uds)."
        )
    devices = server_devices(cfg, replica)
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = devices
    kvcache = cpu_kvcache_gib(cfg)
    if kvcache is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kvcache)
    argv += list(v.extra_args)
    return ServerSpec(
        argv, env, host, port, api_key, dev_mode, warnings, str(uds) if uds is not None else None, generated
    )


def engine_flags(needs: frozenset[str]) -> dict[str, bool]:
    """:func:`server_spec`'s keywords for what the weight sync needs of the
    engine (``needs``: :attr:`RunContext.engine_requirements`)."""
    return {
        "lora": bool(ADAPTER_LOADS & needs),
        "weight_transfer": WEIGHTS_OVER_NCCL in needs,
        "adapter_over_http": ADAPTER_FROM_URL in needs,
    }


def managed_spec(cfg: GRPOConfig, needs: frozenset[str] = frozenset(), replica: int | None = None) -> ServerSpec:
    """The server ``grpo run`` starts for itself: on a Unix socket in a
    private directory (``[vllm] transport`` unset or ``"unix"``), or over TCP
    with a key made up for this run (``"tcp"``, or no Unix sockets here).
    ``needs``: what the weight sync requires of the engine
    (:attr:`RunContext.engine_requirements`): LoRA layers for adapter loads,
    the weight-transfer engine for NCCL broadcasts.
    ``replica`` (0, 1, ...): one of ``data_parallel_size`` separate servers,
    each with its own socket directory (or, over TCP, its own free port
    after the first)."""
    transport = vllm_settings(cfg).transport or ("unix" if unix_sockets_available() else "tcp")
    flags = engine_flags(needs)
    if transport == "unix":
        if not unix_sockets_available():
            raise ConfigError("[vllm] transport = 'unix', but this platform has no Unix domain sockets: use 'tcp'.")
        spec = server_spec(cfg, **flags, uds=private_socket_dir() / SOCKET_NAME, replica=replica)
    else:
        port = 0 if replica else None  # replicas after the first never collide on the configured port
        spec = server_spec(cfg, port=port, **flags, generate_key=True, replica=replica)
    usable = process_cpus()
    split = plan_cpu_split(cfg, usable, machine.cuda_available())
    spec.spawn_cpus = usable
    if split is not None:  # every replica computes on the engine's share (they take turns with each other)
        spec.env["VLLM_CPU_OMP_THREADS_BIND"] = format_cpu_list(split.engine)
        spec.env.pop("VLLM_CPU_NUM_OF_RESERVED_CPU", None)  # an explicit binding reserves nothing
        spec.engine_cpus = split.engine
    return spec


def _lora_rank_bucket(rank: int) -> int:
    """vLLM only accepts these --max-lora-rank values; round up."""
    allowed = (1, 8, 16, 32, 64, 128, 256, 320, 512)
    for value in allowed:
        if rank <= value:
            return value
    raise ConfigError(f"lora_r = {rank} is larger than vLLM's largest supported LoRA rank ({allowed[-1]})")
