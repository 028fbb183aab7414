"""Starting vLLM's OpenAI server from a grpo config, and owning it as a
subprocess.

:func:`server_spec` turns the ``[vllm]`` table into a command line and an
environment; :class:`ManagedServer` runs it in its own process group, waits
for ``/health`` and guarantees the whole group (API server and engine core)
goes away with us: ``stop()``, an ``atexit`` guard, and a parent-death
signal. Nothing here imports vLLM: the server runs in another interpreter.

Who can reach the server (docs/security.md):

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
"""

from __future__ import annotations

import atexit
import functools
import getpass
import ipaddress
import os
import secrets
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Callable

from grpo_core.errors import ConfigError, EngineUnavailable
from grpo_core.types import ADAPTER_FROM_URL, ADAPTER_LOADS, WEIGHTS_OVER_NCCL
from grpo_core.lifelong_thread import in_lifelong_thread, set_parent_death_signal
from grpo_core.cpu_affinity import format_cpu_list, process_cpus
from grpo_core.scratch import make_scratch_dir, remove_scratch_dir
from grpo_plugins.vllm.cpus import plan_cpu_split
from grpo_plugins.vllm.idle_spin import CPU_IDLE_SPIN_S, IDLE_SPIN_ENV

if TYPE_CHECKING:
    from grpo_core.config.schema import GRPOConfig

SERVED_MODEL_NAME = "base"
LOG_NAME = "vllm-server.log"
SOCKET_NAME = "vllm.sock"
SOCKET_DIR_PREFIX = "grpo-vllm-"
SERVER_TMP_PREFIX = "grpo-vllmtmp-"  # the server's own temporary directory (:func:`server_temp_env`)
GUARD_MIDDLEWARE = "grpo_plugins.vllm.guard.RequireApiKey"
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


def unix_sockets_available() -> bool:
    return hasattr(socket, "AF_UNIX")


def configured_api_key(cfg: GRPOConfig) -> str | None:
    """``[vllm] api_key``, else ``VLLM_API_KEY`` from the environment (the
    variable vLLM itself reads), else ``None``."""
    return cfg.vllm.api_key or os.environ.get("VLLM_API_KEY") or None


def private_socket_dir() -> Path:
    """A fresh directory only this user can open (``mkdtemp`` makes it 0700),
    short enough for a socket path; removed by :meth:`ManagedServer.close`,
    or by a later run if this process is killed (:mod:`grpo_core.scratch`)."""
    return make_scratch_dir(SOCKET_DIR_PREFIX)


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
    raise ConfigError(f"the temporary directory {base} is too long for vLLM's engine sockets ({MAX_SOCKET_PATH} bytes "
                      "at most, with ~60 of its own): set TMPDIR to a shorter path.")  # fmt: skip


def check_socket_path(path: Path) -> None:
    """Refuse a socket path others could reach, or one too long for AF_UNIX.

    The socket's directory must belong to this user and give nobody else any
    access: vLLM creates the socket world-readable, so the directory is what
    keeps other users out."""
    if len(os.fsencode(str(path))) > MAX_SOCKET_PATH:
        raise ConfigError(f"Unix socket path {path} is longer than {MAX_SOCKET_PATH} bytes; choose a shorter one (e.g. under /tmp).")
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


def cpu_flags() -> str:
    """The ``flags`` line(s) of /proc/cpuinfo ('' where it cannot be read)."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_has_fast_bf16(flags: str | None = None) -> bool:
    """True when this x86 CPU computes bf16 natively (AVX512-BF16 or AMX).

    Without it vLLM's CPU backend emulates bf16 and generates several times
    slower than in float32 (21 vs 114 tokens/s for SmolLM2 on one core of an
    AVX2 machine; benchmarks/RESULTS.md). ``flags`` is the cpuinfo text to
    judge (tests pass a fake one); unset, this machine's."""
    words = set((cpu_flags() if flags is None else flags).split())
    return bool(words & {"avx512_bf16", "amx_bf16"})


def cuda_available() -> bool:
    """Whether this machine has a CUDA device, without importing torch."""
    return Path("/proc/driver/nvidia/version").exists() or bool(os.environ.get("CUDA_VISIBLE_DEVICES", "").strip("-1 "))


def resolve_dtype(dtype: str, flags: str | None = None, cuda: bool | None = None) -> str:
    """The dtype vLLM is started with; explicit dtypes pass through.

    ``auto`` on a GPU is left to vLLM. On a CPU it is decided here, never
    left to vLLM (whose CPU backend picks bf16 for a fp32 checkpoint where
    bf16 is native, so the same config would compute differently on two
    machines without saying so):

    - AVX2 only, or AVX512 without AVX512-BF16/AMX: ``float32`` (no native
      bf16 arithmetic: measured 21 vs 114 tokens/s on an AVX2 core);
    - AVX512-BF16 or AMX: ``bfloat16`` (native; the arithmetic example's
      4x8x48-token batch in ~2 s, /work/shared/ENVIRONMENT.md). The trainer
      keeps its own precision (``bf16``); the gap between the two is what
      the importance-sampling correction is for. Set ``[vllm] dtype =
      "float32"`` to sample at the trainer's float32 precision.

    ``flags`` / ``cuda`` stand for this machine's when unset (tests fake them)."""
    if dtype != "auto":
        return dtype
    if cuda_available() if cuda is None else cuda:
        return dtype
    return "bfloat16" if cpu_has_fast_bf16(flags) else "float32"


def max_model_len(cfg: GRPOConfig) -> int:
    """The engine's context length: ``[vllm] max_model_len``, else room for
    the longest prompt plus completion the config allows."""
    trl = cfg.trl
    return cfg.vllm.max_model_len or max(cfg.sequence_len, (trl.max_prompt_length or 0) + (trl.max_completion_length or 0))


def enforce_eager(cfg: GRPOConfig) -> bool:
    """``[vllm] enforce_eager``; unset, true on CPU: vLLM's graph compilation
    there costs 89 s of engine start to generate 7% faster (4.7 s vs 94 s,
    223 vs 239 tokens/s; benchmarks/RESULTS.md), a loss for any run under
    ~170 steps of the arithmetic example. On a GPU vLLM's default (CUDA
    graphs) stands."""
    if cfg.vllm.enforce_eager is not None:
        return cfg.vllm.enforce_eager
    return not cuda_available()


DEFAULT_CPU_KVCACHE_GIB = 2


def cpu_kvcache_gib(cfg: GRPOConfig) -> int | None:
    """GiB of KV cache for vLLM on CPU (``VLLM_CPU_KVCACHE_SPACE``), or
    ``None`` to leave it to vLLM (on a GPU, or when the environment sets it).

    Unset, vLLM's CPU backend sizes its cache to ``gpu_memory_utilization``
    of *host* memory (85%), which leaves nothing for a trainer on the same
    machine; grpo asks for a fixed 2 GiB instead unless told otherwise."""
    if cfg.vllm.cpu_kvcache_space is not None:
        return cfg.vllm.cpu_kvcache_space
    if cuda_available() or "VLLM_CPU_KVCACHE_SPACE" in os.environ:
        return None
    return DEFAULT_CPU_KVCACHE_GIB


def cpu_whole_prefill_args(max_len: int) -> list[str]:
    """vLLM 0.32's CPU backend kills its engine ("CPU Generator does not use
    offset") when a request with a ``seed`` is only partly prefilled in a
    step: chunked prefill rewinds the request's generator, which CPU
    generators cannot do. Many long prompts at once (multi-turn episodes)
    make that happen. Prefilling whole prompts avoids it; the step budget
    must then hold the longest prompt."""
    return ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(max_len, 2048))]


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
    from grpo_core.model_files import resolve_model_dir

    v = cfg.vllm
    host = host or v.host
    port = v.port if port is None else port
    if uds is None and port == 0:
        port = free_port(host)
    model_dir = resolve_model_dir(cfg.base_model)
    max_len = max_model_len(cfg)
    where = ["--uds", str(uds)] if uds is not None else ["--host", host, "--port", str(port)]
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model_dir,
        "--served-model-name", SERVED_MODEL_NAME,
        *where,
        "--dtype", resolve_dtype(v.dtype),
        "--max-model-len", str(max_len),
        "--gpu-memory-utilization", str(v.gpu_memory_utilization),
        "--tensor-parallel-size", str(v.tensor_parallel_size),
        "--data-parallel-size", str(v.data_parallel_size if replica is None else 1),
        # grpo's worker methods for /collective_rpc: pull weights over HTTP (full_http), re-tie a tied LM head.
        "--worker-extension-cls", WORKER_EXTENSION,
        # Sampler log-probs after temperature/top-k/top-p, the distribution the
        # trainer reproduces by dividing its logits by the temperature.
        "--logprobs-mode", "processed_logprobs",
    ]  # fmt: skip
    if cfg.trust_remote_code:
        argv.append("--trust-remote-code")
    if weight_transfer:  # vLLM's NCCL weight-transfer engine
        argv += ["--weight-transfer-config", '{"backend": "nccl"}']
    if v.enable_prefix_caching is not None:
        argv.append("--enable-prefix-caching" if v.enable_prefix_caching else "--no-enable-prefix-caching")
    if enforce_eager(cfg):
        argv.append("--enforce-eager")
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    if not cuda_available():
        argv += cpu_whole_prefill_args(max_len)
        # The worker must not busy-wait a second after each request on cores the trainer shares (idle_spin.py)
        env[IDLE_SPIN_ENV] = CPU_IDLE_SPIN_S
    if lora:
        # Only for adapter sync: serving through LoRA layers is slow on CPU
        # (3.9x here, benchmarks/RESULTS.md), so merged-weight runs skip it.
        argv += ["--enable-lora", "--max-lora-rank", str(_lora_rank_bucket(cfg.lora_r))]
    if not cuda_available() and not cfg.trl.async_prefetch:
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
            "sync a LoRA adapter instead (adapter = 'lora', which needs no dev endpoints), or accept the risk by name "
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
        )  # fmt: skip
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
    return ServerSpec(argv, env, host, port, api_key, dev_mode, warnings, str(uds) if uds is not None else None, generated)


def engine_flags(needs: frozenset[str]) -> dict[str, bool]:
    """:func:`server_spec`'s keywords for what the weight sync needs of the
    engine (``needs``: :attr:`RunContext.engine_requirements`)."""
    return {"lora": bool(ADAPTER_LOADS & needs), "weight_transfer": WEIGHTS_OVER_NCCL in needs,
            "adapter_over_http": ADAPTER_FROM_URL in needs}  # fmt: skip


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
    transport = cfg.vllm.transport or ("unix" if unix_sockets_available() else "tcp")
    flags = engine_flags(needs)
    if transport == "unix":
        if not unix_sockets_available():
            raise ConfigError("[vllm] transport = 'unix', but this platform has no Unix domain sockets: use 'tcp'.")
        spec = server_spec(cfg, **flags, uds=private_socket_dir() / SOCKET_NAME, replica=replica)
    else:
        port = 0 if replica else None  # replicas after the first never collide on the configured port
        spec = server_spec(cfg, port=port, **flags, generate_key=True, replica=replica)
    usable = process_cpus()
    split = plan_cpu_split(cfg, usable, cuda_available())
    spec.spawn_cpus = usable
    if split is not None:  # every replica computes on the engine's share (they take turns with each other)
        spec.env["VLLM_CPU_OMP_THREADS_BIND"] = format_cpu_list(split.engine)
        spec.env.pop("VLLM_CPU_NUM_OF_RESERVED_CPU", None)  # an explicit binding reserves nothing
        spec.engine_cpus = split.engine
    return spec


# ---------------------------------------------------------------------- GPU placement

WORKER_EXTENSION = "grpo_plugins.vllm.worker_ext.GrpoWorkerExtension"
TRAINER_SHARE_MAX = 0.5
"""A GPU the trainer shares with vLLM may give vLLM at most this fraction of
its memory (``gpu_memory_utilization``): the trainer needs the rest for the
model, its gradients, optimizer state and activations."""
SERVERS_SHARE_MAX = 0.95
"""Servers sharing a GPU may claim at most this much of it together (the
CUDA context and fragmentation need the rest)."""


def placement(cfg: GRPOConfig) -> list[list[int]] | None:
    """The GPU indices of each managed server (``[vllm] devices`` cut into
    ``tensor_parallel_size`` pieces, one per server), or ``None`` when
    ``devices`` is unset."""
    v = cfg.vllm
    if v.devices is None:
        return None
    per = v.tensor_parallel_size
    return [list(v.devices[i * per : (i + 1) * per]) for i in range(v.data_parallel_size)]


def placement_problems(cfg: GRPOConfig) -> list[str]:
    """Why ``[vllm] devices`` / ``trainer_devices`` would not fit (each
    message names the keys and the fix); empty when they do."""
    v = cfg.vllm
    problems: list[str] = []
    if v.devices is None and v.trainer_devices is None:
        return problems
    if any(d < 0 for d in (v.devices or []) + (v.trainer_devices or [])):
        problems.append("[vllm] devices and trainer_devices are GPU indices (0, 1, ...); negative ones mean nothing.")
    if v.trainer_devices is not None and (not v.trainer_devices or len(set(v.trainer_devices)) != len(v.trainer_devices)):
        problems.append("[vllm] trainer_devices must list at least one GPU, each once.")
    if v.trainer_devices is not None and v.devices is None:
        problems.append(
            "[vllm] trainer_devices is set without [vllm] devices: set devices too (the GPUs the managed servers get), "
            "so the servers are not left on the trainer's GPUs."
        )
    servers = placement(cfg) or []
    if v.devices is not None:
        need = v.data_parallel_size * v.tensor_parallel_size
        if len(v.devices) != need:
            problems.append(
                f"[vllm] devices lists {len(v.devices)} GPU(s), but data_parallel_size x tensor_parallel_size = "
                f"{v.data_parallel_size} x {v.tensor_parallel_size} = {need} are needed (server i takes the i-th "
                f"{v.tensor_parallel_size}); list exactly {need}."
            )
            return problems
        for i, own in enumerate(servers):
            if len(set(own)) != len(own):
                problems.append(f"[vllm] devices gives server {i} the GPUs {own}: tensor parallelism needs distinct GPUs.")
    claims: dict[int, float] = {}
    for own in servers:
        for device in own:
            claims[device] = claims.get(device, 0.0) + v.gpu_memory_utilization
    for device, claimed in sorted(claims.items()):
        if claimed > SERVERS_SHARE_MAX:
            problems.append(
                f"[vllm] devices puts {round(claimed / v.gpu_memory_utilization)} servers on GPU {device}, "
                f"claiming {claimed:.0%} of its memory together (gpu_memory_utilization = {v.gpu_memory_utilization}): "
                f"give each server its own GPU, or lower [vllm] gpu_memory_utilization to at most "
                f"{SERVERS_SHARE_MAX / round(claimed / v.gpu_memory_utilization):.2f}."
            )
    trainer = v.trainer_devices if v.trainer_devices is not None else [0]
    shared = sorted(set(trainer) & set(claims))
    if shared and v.devices is not None:
        worst = max(claims[d] for d in shared)
        if worst > TRAINER_SHARE_MAX:
            whose = "[vllm] trainer_devices" if v.trainer_devices is not None else "the trainer's default GPU (index 0; set [vllm] trainer_devices)"
            problems.append(
                f"[vllm] devices and {whose} share GPU {', '.join(map(str, shared))}, where vLLM would claim {worst:.0%} "
                f"of the memory (gpu_memory_utilization = {v.gpu_memory_utilization}) and the trainer would run out. "
                f"Give them different GPUs (e.g. devices = [0], trainer_devices = [1]), or lower "
                f"[vllm] gpu_memory_utilization to at most {TRAINER_SHARE_MAX} to share one."
            )
    return problems


def physical_devices(indices: list[int], visible: str | None = None) -> str:
    """``CUDA_VISIBLE_DEVICES`` for ``indices`` counted among the GPUs this
    process sees: with ``CUDA_VISIBLE_DEVICES=2,3`` set, index 0 is GPU 2.
    ``visible``: that variable's value (unset: this process's)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    seen = [d.strip() for d in visible.split(",") if d.strip()] if visible else None
    out = []
    for i in indices:
        if seen is None:
            out.append(str(i))
        elif i < len(seen):
            out.append(seen[i])
        else:
            raise ConfigError(f"[vllm] device index {i}, but CUDA_VISIBLE_DEVICES={visible} shows only {len(seen)} GPU(s).")
    return ",".join(out)


def server_devices(cfg: GRPOConfig, replica: int | None) -> str | None:
    """``CUDA_VISIBLE_DEVICES`` of a server (replica ``replica``, or the one
    server when ``None``), or ``None`` when ``[vllm] devices`` is unset."""
    servers = placement(cfg)
    if servers is None:
        return None
    own = [d for s in servers for d in s] if replica is None else servers[replica]
    return physical_devices(own)


def narrow_trainer_devices(cfg: GRPOConfig) -> str | None:
    """Make this (trainer) process see only ``[vllm] trainer_devices``,
    before CUDA starts; returns the new ``CUDA_VISIBLE_DEVICES`` (``None``
    when unset). Server environments are computed before this, from the
    devices the process saw at start."""
    wanted = cfg.vllm.trainer_devices
    if wanted is None:
        return None
    value = physical_devices(wanted)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized() and os.environ.get("CUDA_VISIBLE_DEVICES") != value:
        raise ConfigError(
            "[vllm] trainer_devices can only narrow the GPUs before CUDA starts, and it has started in this process; "
            f"set CUDA_VISIBLE_DEVICES={value} in the environment of the trainer instead."
        )
    os.environ["CUDA_VISIBLE_DEVICES"] = value
    return value


def _lora_rank_bucket(rank: int) -> int:
    """vLLM only accepts these --max-lora-rank values; round up."""
    allowed = (1, 8, 16, 32, 64, 128, 256, 320, 512)
    for value in allowed:
        if rank <= value:
            return value
    raise ConfigError(f"lora_r = {rank} is larger than vLLM's largest supported LoRA rank ({allowed[-1]})")


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
        from grpo_plugins.vllm.client import VLLMClient

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
