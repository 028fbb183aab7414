"""``grpo.weight_sync:nccl``: weights to a CUDA vLLM server over NCCL, through
vLLM's own weight-transfer API.

vLLM (>= 0.32) ships both halves: the server's RL routes
(``/init_weight_transfer_engine``, ``/start_weight_update``,
``/update_weights``, ``/finish_weight_update``; served in dev mode, with
``--weight-transfer-config '{"backend": "nccl"}'``) and the trainer side,
``NCCLTrainerWeightTransferEngine``. This module only adapts them to grpo:

* the first sync opens the NCCL group: the trainer is rank 0, the servers'
  workers ranks 1..N (``[plugins.nccl] inference_world_size``; unset, what
  each server's ``/get_world_size`` answers, as TRL's client asks a
  ``trl vllm-serve``, else ``vllm.tensor_parallel_size x
  vllm.data_parallel_size``), rendezvous at
  ``master_address:master_port`` (the trainer's address as the server sees
  it; ``127.0.0.1`` for a server on this machine);
* every sync broadcasts the weights the engine needs (:func:`merged_weights`:
  all of them for full fine-tuning; for a LoRA the adapted modules as
  ``W + delta``, the frozen base never touched) in the engine's dtype, while
  the server receives them (vLLM runs ``update_weights`` concurrently with the
  broadcast), then finishes the update.

The control-plane requests go through the engine's
:meth:`~grpo_core.contract.types.InferenceEngine.control_endpoints` (the contract's
way to reach each server with its API key and socket) rather than vLLM's
bare ``HTTPVLLMWeightSyncClient``. With several servers (a pool:
``trl.vllm_server_base_urls`` or managed ``[vllm] data_parallel_size`` > 1)
every server joins the one NCCL group, each server's workers at the ranks
after the previous server's, and each request reaches all of them at once.

No step can hang the run: every step of the protocol (either side of the
handshake, each request to the servers, each broadcast round, the server's
``update_weights``) has ``[plugins.nccl] timeout`` seconds, after which the
sync fails with an error naming the step (:mod:`.nccl_watchdog`).

Needs CUDA on both sides: refused by ``grpo config check`` on a trainer
without CUDA. **Unverified on GPU**: the protocol sequence is unit-tested with
NCCL mocked (tests/unit/vllm/test_nccl_sync.py); ``benchmarks/gpu_check.sh`` is the
prepared check against a real CUDA vLLM server, not yet run.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

from grpo_core.plugin_api import (
    CONTROL_ENDPOINTS,
    WEIGHTS_OVER_NCCL,
    ConfigError,
    ControlEndpoint,
    EngineUnavailable,
    GrpoError,
    InferenceEngine,
    SyncResult,
    hookimpl,
    in_dtype,
    merged_weights,
)
from grpo_plugins.vllm.client import DEV_MODE_HINT, EndpointMissing
from grpo_plugins.vllm.nccl_watchdog import (
    ProtocolSteps,
    SyncStepTimeout,
    run_with_deadlines,
)
from grpo_plugins.vllm.settings import vllm_settings

if TYPE_CHECKING:
    from grpo_core.plugin_api import GRPOConfig, RunContext

REQUEST_GRACE_S = 5.0
"""A control request's HTTP timeout is ``[plugins.nccl] timeout`` plus this:
the watchdog, not the HTTP client, reports a late step."""

STEP_NAMES = {
    "/init_weight_transfer_engine": (
        "the handshake, server side: /init_weight_transfer_engine (the vLLM workers joining the NCCL group)"
    ),
    "/start_weight_update": "the server's /start_weight_update",
    "/update_weights": "the server's /update_weights (its workers receiving the broadcast)",
    "/finish_weight_update": "the server's /finish_weight_update (loading the received weights)",
    "/shutdown_weight_transfer_engine": "the server's /shutdown_weight_transfer_engine",
}

TRANSFER_DEVICE = "cuda"
"""Where the broadcast tensors live (NCCL sends from GPU memory; the mocked-NCCL test sets "cpu")."""


def nccl_problem(cuda: bool | None = None) -> str | None:
    """Why the NCCL sync cannot run on this trainer (``cuda`` defaults to
    this machine's), or ``None``."""
    if cuda is None:
        # heavy (torch): loaded on first use, not with this module
        import torch

        cuda = bool(torch.cuda.is_available())
    if not cuda:
        return (
            "weight sync 'nccl' broadcasts the weights from a CUDA GPU over NCCL, and this trainer has no CUDA device "
            "(the vLLM server needs CUDA GPUs too). Without GPUs use 'full_filesystem' (the default with a vLLM "
            "server), 'lora_filesystem' (trl.vllm_lora_sync = true) or 'vllm_in_memory' (trl.vllm_mode = 'colocate')."
        )
    try:
        from vllm.distributed.weight_transfer.nccl_engine import (
            NCCLTrainerWeightTransferEngine,  # noqa: F401
        )
    except ImportError as exc:
        return (
            "weight sync 'nccl' needs vLLM >= 0.32's weight-transfer API on the trainer (pip install 'grpo[vllm]'): "
            f"{exc}"
        )
    return None


class _ServersClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol over every server of the
    engine (:meth:`InferenceEngine.control_endpoints`: their own API key and
    socket, no retries).

    Each request goes to all servers at once and returns when all have
    answered: ``update_weights`` must, since every server's workers receive
    the same broadcast inside it. Server ``i``'s workers join the NCCL
    group at ranks ``rank_offsets[i]`` onwards (1 for the first: vLLM's
    trainer side assumes one server at rank offset 1)."""

    def __init__(
        self, endpoints: list[ControlEndpoint], rank_offsets: list[int], timeout: float, steps: ProtocolSteps
    ) -> None:
        self.endpoints, self.rank_offsets, self.steps = endpoints, rank_offsets, steps
        # The watchdog names a late step at `timeout`; the request's own
        # timeout, a little later, only frees its thread.
        self.timeout = timeout + REQUEST_GRACE_S
        self.update_key: int | None = None  # the running update_weights step, touched by each broadcast round

    def _post_all(self, path: str, bodies: list[dict[str, Any] | None]) -> None:
        with self.steps.step(STEP_NAMES.get(path, f"the servers' {path}")) as key:
            if path == "/update_weights":
                self.update_key = key
            self._send(path, bodies)

    def _send(self, path: str, bodies: list[dict[str, Any] | None]) -> None:
        if len(self.endpoints) == 1:
            self.endpoints[0].request("POST", path, bodies[0], timeout=self.timeout)
            return
        with ThreadPoolExecutor(max_workers=len(self.endpoints), thread_name_prefix="grpo-nccl-ctl") as pool:
            futures = [
                pool.submit(e.request, "POST", path, b, timeout=self.timeout) for e, b in zip(self.endpoints, bodies)
            ]
        for future in futures:
            future.result()  # the first server's error, if any

    def _post(self, path: str, body: dict[str, Any] | None = None) -> None:
        self._post_all(path, [body] * len(self.endpoints))

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._post_all(
            "/init_weight_transfer_engine",
            [{"init_info": {**init_info, "rank_offset": offset}} for offset in self.rank_offsets],
        )

    def shutdown_weight_transfer_engine(self) -> None:
        self._post("/shutdown_weight_transfer_engine")

    def start_weight_update(self) -> None:
        self._post("/start_weight_update")

    def update_weights(self, update_info: Any) -> None:
        self._post("/update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._post("/finish_weight_update", None if weight_version is None else {"weight_version": weight_version})


class _TimedCommunicator:
    """vLLM's NCCL communicator with each broadcast marked as a step of the
    protocol (and counted as progress of the server's ``update_weights``)."""

    def __init__(self, inner: Any, steps: ProtocolSteps, client: _ServersClient) -> None:
        self.inner, self.steps, self.client = inner, steps, client
        self.rounds = 0
        self.expected: int | None = None  # tensors of this sync, when sent one by one

    def broadcast(self, tensor: Any, src: int, stream: Any = None) -> None:
        self.rounds += 1
        of = f" of {self.expected}" if self.expected is not None else ""
        with self.steps.step(f"broadcast round {self.rounds}{of} (rank 0 to the vLLM workers)"):
            self.inner.broadcast(tensor, src=src, stream=stream)
        if self.client.update_key is not None:
            self.steps.touch(self.client.update_key)  # the server had this round: its clock restarts

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


_TIMED_TRANSFER: type | None = None


def _timed_transfer_class() -> type:
    """vLLM's trainer engine with its last wait (the broadcasts landing on the
    GPU stream) marked as a step; built on first use (vLLM is imported late)."""
    global _TIMED_TRANSFER
    if _TIMED_TRANSFER is None:
        # vLLM is optional and slow to import: only when this engine runs
        from vllm.distributed.weight_transfer.nccl_engine import (
            NCCLTrainerWeightTransferEngine,
        )

        class TimedTransfer(NCCLTrainerWeightTransferEngine):
            steps: ProtocolSteps | None = None

            def _post_send_sync(self) -> None:
                with (
                    self.steps.step("the broadcasts landing on the trainer's GPU (CUDA stream synchronize)")
                    if self.steps
                    else contextlib.nullcontext()
                ):
                    super()._post_send_sync()

        _TIMED_TRANSFER = TimedTransfer
    return _TIMED_TRANSFER


class _MergedWeights:
    """A ``WeightSource`` (vLLM's protocol: ``metadata()`` and a re-iterable
    stream, in the same order) over the weights of one sync."""

    def __init__(self) -> None:
        self.state: dict[str, Any] = {}

    def metadata(self) -> list[Any]:
        # vLLM is optional and slow to import: only when this engine runs
        from vllm.distributed.weight_transfer.base import ParamMeta

        return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self.state.items()]

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return iter(list(self.state.items()))


QUESTION_TIMEOUT_S = 30.0
"""How long the handshake's questions (``/get_world_size``, ``/server_info``) may take."""


def _reported_world_size(endpoint: ControlEndpoint) -> int | None:
    """The server's ``GET /get_world_size`` (its workers, TP x PP x DP), or
    ``None`` when it gives none. A server without the route has no dev
    mode, hence none of the weight-transfer routes either: refused here."""
    try:
        answer = endpoint.request("GET", "/get_world_size", timeout=QUESTION_TIMEOUT_S)
    except EndpointMissing:
        raise ConfigError(
            f"weight sync 'nccl': {endpoint.description} has no weight-transfer routes: {DEV_MODE_HINT}."
        ) from None
    except GrpoError:
        return None
    size = answer.get("world_size") if isinstance(answer, dict) else None
    return size if isinstance(size, int) and size > 0 else None


def _check_weight_transfer(endpoint: ControlEndpoint) -> None:
    """Refuse a server whose ``/server_info`` says it has no NCCL
    weight-transfer engine (started without ``--weight-transfer-config``),
    before anything waits on an NCCL rendezvous it would never join."""
    try:
        info = endpoint.request("GET", "/server_info?config_format=json", timeout=QUESTION_TIMEOUT_S)
    except GrpoError:
        return  # no /server_info: nothing to check here; /get_world_size decides about dev mode
    config = info.get("vllm_config") if isinstance(info, dict) else None
    if isinstance(config, dict) and "weight_transfer_config" in config:
        backend = (config.get("weight_transfer_config") or {}).get("backend")
        if backend != "nccl":
            raise ConfigError(
                f"weight sync 'nccl': {endpoint.description} has no NCCL weight-transfer engine "
                f"(backend {backend!r}): restart "
                'it with --weight-transfer-config \'{"backend": "nccl"}\' (`trl vllm-serve` passes it; grpo\'s own '
                "servers do with plugins.weight_sync = 'nccl')."
            )


class NcclSync:
    """Weights broadcast GPU to GPU over NCCL into vLLM servers, CUDA only.

    ``grpo.weight_sync:nccl``."""

    required_capabilities = frozenset({WEIGHTS_OVER_NCCL, CONTROL_ENDPOINTS})

    class Settings(BaseModel):
        master_address: str | None = Field(
            None,
            description="The trainer's address as the vLLM server reaches it (default 127.0.0.1: a server on this "
            "machine).",
        )
        master_port: int = Field(
            51216, ge=1, le=65535, description="TCP port of the NCCL rendezvous (free on the trainer)."
        )
        inference_world_size: int | None = Field(
            None,
            ge=1,
            description="GPU workers of all vLLM servers together, split evenly over them (default: "
            "vllm.tensor_parallel_size x vllm.data_parallel_size for one server; tensor_parallel_size per server for "
            "several).",
        )
        packed: bool = Field(
            True, description="Broadcast in packed buffers (vLLM's default) rather than tensor by tensor."
        )
        timeout: float = Field(
            300.0,
            gt=0,
            description="Seconds any one step of the sync may take: either side of the handshake, each request to the "
            "servers, each broadcast round, the server's update_weights after the last round. Past it the sync fails "
            "with an error naming the step instead of hanging (default 300: vLLM's own NCCL rendezvous timeout).",
        )

    def __init__(self, context: RunContext, settings: NcclSync.Settings | None = None) -> None:
        self.context = context
        self.settings = settings or NcclSync.Settings()
        self._transfer: Any = None
        self._source = _MergedWeights()
        self._lock = threading.Lock()
        self._steps = ProtocolSteps()

    @staticmethod
    def grpo_validate_config(config: GRPOConfig) -> list[str]:
        problem = nccl_problem()
        if problem is not None:
            raise ConfigError(problem)
        return []

    def _workers_per_server(self, endpoints: list[ControlEndpoint]) -> list[int]:
        """GPU workers of each server: ``inference_world_size`` split evenly
        over the servers; unset, what each server's ``/get_world_size``
        says (a server started by hand knows its own parallelism), else
        ``tensor_parallel_size`` per server (times vLLM's own
        ``data_parallel_size`` when there is one server)."""
        v, servers = vllm_settings(self.context.config), len(endpoints)
        if self.settings.inference_world_size is None:
            reported = [_reported_world_size(e) for e in endpoints]
            if all(size is not None for size in reported):
                return [int(size) for size in reported]  # type: ignore[arg-type]
            return [int(v.tensor_parallel_size) * (int(v.data_parallel_size) if servers == 1 else 1)] * servers
        per, rest = divmod(self.settings.inference_world_size, servers)
        if rest or not per:
            raise ConfigError(
                f"[plugins.nccl] inference_world_size = {self.settings.inference_world_size} does not split evenly "
                f"over the {servers} vLLM servers: set it to their GPU workers in all (each server's "
                "tensor_parallel_size, summed)."
            )
        return [per] * servers

    def _handshake(self, engine: InferenceEngine) -> Callable[[], Any]:
        """Check the engine and settings (here, in the caller's thread: a
        config error is immediate) and return the handshake to run under
        the deadlines: the servers' workers and the trainer (rank 0) open
        the NCCL group together."""
        # vLLM is optional and slow to import: only when this engine runs
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        if CONTROL_ENDPOINTS not in engine.capabilities:
            raise ConfigError(
                f"weight sync 'nccl' talks to a vLLM server's weight-transfer routes, but the engine "
                f"({engine.description}) takes no control requests: use the 'vllm' rollout (trl.use_vllm = true, "
                "server mode)."
            )
        endpoints = engine.control_endpoints()
        for endpoint in endpoints:
            _check_weight_transfer(endpoint)
        sizes = self._workers_per_server(endpoints)
        offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
        if self.settings.master_address is None and not engine.same_host:
            raise ConfigError(
                "weight sync 'nccl' with a vLLM server on another host: set [plugins.nccl] master_address to this "
                "trainer's address as that host reaches it (the NCCL rendezvous runs on the trainer)."
            )
        info = NCCLTrainerInitInfo(
            rank=0,  # the single sending trainer process
            master_address=self.settings.master_address or "127.0.0.1",
            master_port=self.settings.master_port,
            world_size=1 + sum(sizes),
            packed=self.settings.packed,
        )
        client = _ServersClient(endpoints, offsets, self.settings.timeout, self._steps)
        trainer_side = (
            f"the handshake, trainer side: joining the NCCL group at {info.master_address}:{info.master_port} "
            f"as rank 0 of {info.world_size}"
        )

        def open_group() -> Any:
            with self._steps.step(trainer_side):
                transfer = _timed_transfer_class().trainer_init(info, client=client, source=self._source)
            transfer.steps = self._steps
            transfer.model_update_group = _TimedCommunicator(transfer.model_update_group, self._steps, client)
            return transfer

        return open_group

    def _late(self, version: int | None) -> Callable[[str, float], str]:
        """The message of a step past ``[plugins.nccl] timeout``."""
        at = "" if version is None else f" at version {version}"

        def describe(step: str, age: float) -> str:
            return (
                f"weight sync 'nccl' timed out{at}: {step} did not complete within [plugins.nccl] timeout = "
                f"{self.settings.timeout:g} s (waited {age:.1f} s). The NCCL group is abandoned and the vLLM server's "
                "workers may be stuck in it: restart the server before resuming. If that step is only slow (a large "
                "model, a first handshake across nodes), raise [plugins.nccl] timeout."
            )

        return describe

    @hookimpl
    def grpo_sync_weights(self, model: Any, version: int, engine: InferenceEngine | None) -> SyncResult:
        if engine is None:
            raise ConfigError(
                "weight sync 'nccl' sends weights to a vLLM server, but the rollout has none: set trl.use_vllm = true."
            )
        with self._lock:
            start = time.perf_counter()
            if self._transfer is None:
                open_group = self._handshake(engine)
                try:
                    self._transfer = run_with_deadlines(
                        open_group, self._steps, self.settings.timeout, self._late(version)
                    )
                except SyncStepTimeout:
                    raise
                except Exception as exc:
                    raise self._failure(version, exc) from exc
            opened = time.perf_counter()
            weights = in_dtype(merged_weights(model, engine.fused_modules()), engine.weight_dtype)
            state = {name: value.to(TRANSFER_DEVICE).contiguous() for name, value in weights.items()}
            self._source.state = state
            group = self._transfer.model_update_group
            group.rounds, group.expected = 0, None if self.settings.packed else len(state)
            group.client.update_key = None
            try:
                run_with_deadlines(self._transfer.send_weights, self._steps, self.settings.timeout, self._late(version))
            except SyncStepTimeout:  # the NCCL group is unusable after a failed round; a stuck thread may hold it
                self._transfer = None
                raise
            except Exception as exc:
                self._transfer = None
                raise self._failure(version, exc) from exc
            finally:
                self._source.state = {}
            end = time.perf_counter()
        return SyncResult(
            version, end - start, f"nccl: {len(state)} tensors, init {opened - start:.2f}s, send {end - opened:.2f}s"
        )

    def _failure(self, version: int, exc: Exception) -> Exception:
        """A failed step as the run reports it (a grpo error passes as it is)."""
        if isinstance(exc, GrpoError):
            return exc
        where = f" in {self._steps.failed_in}" if self._steps.failed_in else ""
        return EngineUnavailable(f"weight sync 'nccl' failed at version {version}{where}: {type(exc).__name__}: {exc}")

    @hookimpl
    def grpo_train_end(self) -> None:
        with self._lock:
            transfer, self._transfer = self._transfer, None
            if transfer is None:
                return

            def close() -> None:
                try:
                    transfer.client.shutdown_weight_transfer_engine()
                except Exception:  # the server may be gone already
                    pass
                transfer.shutdown()

            try:
                run_with_deadlines(close, self._steps, self.settings.timeout, self._late(None))
            except SyncStepTimeout as exc:  # the run is over: say so, do not hang its exit
                self.context.log(f"warning: {exc}")
