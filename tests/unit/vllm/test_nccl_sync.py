"""``grpo.weight_sync:nccl``: the protocol sequence, with NCCL mocked.

NCCL needs CUDA GPUs on both sides, which this machine does not have, so
the NCCL communicator (vLLM's ``trainer_init``, which would open the NCCL
group) is replaced by a recorder, tensors stay on the CPU, and the vLLM
server by a recording client. Everything else is real: vLLM's own
``NCCLTrainerWeightTransferEngine`` drives the handshake and the rounds,
grpo's sync builds the weights (:func:`merged_weights`) and the requests;
the bytes each broadcast must carry are worked out by hand from the model
(``W + scale * B @ A`` for a LoRA), not by the code under test.
What this does not prove: that a real CUDA vLLM server receives the bytes
(``benchmarks/gpu_check.sh`` does that, on a GPU; not yet run). The
engine is a stand-in holding only what the contract
(``grpo_core.contract.types.InferenceEngine``) lists, so a sync that reaches past it
fails here; the real engines' ``control_endpoints`` are tested against real
vLLM servers in test_vllm_multiserver.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import minimal_config
from tiny_model import random_llama

pytest.importorskip("vllm.distributed.weight_transfer.nccl_engine", reason="needs vLLM >= 0.32 (weight-transfer API)")

from grpo_core.config.loader import validate  # noqa: E402
from grpo_core.contract.context import RunContext  # noqa: E402
from grpo_core.contract.types import CONTROL_ENDPOINTS, WEIGHTS_OVER_NCCL  # noqa: E402


class RecordingEndpoint:
    """One vLLM server as the contract hands it to a sync
    (``grpo_core.contract.types.ControlEndpoint``): records each request."""

    def __init__(self, calls: list, url: str = "http://127.0.0.1:8000") -> None:
        self.calls, self.description = calls, f"vLLM server at {url}"

    def request(self, method: str, path: str, body: Any = None, *, timeout: float | None = None) -> None:
        self.calls.append(
            (method, path, body) if self.description.endswith(":8000") else (method, path, body, self.description)
        )


class FakeEngine:
    """An engine as the contract describes it; nothing beyond it (the sync
    must not reach past the protocol, e.g. for a ``client`` attribute)."""

    description = "vLLM server at http://127.0.0.1:8000"
    same_host = True
    weight_dtype = "bfloat16"
    capabilities = frozenset({WEIGHTS_OVER_NCCL, CONTROL_ENDPOINTS})

    def __init__(self, calls: list, servers: int = 1) -> None:
        self.endpoints = [RecordingEndpoint(calls, f"http://127.0.0.1:{8000 + i}") for i in range(servers)]

    def fused_modules(self) -> tuple[tuple[str, ...], ...]:
        return (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))

    def control_endpoints(self) -> list[RecordingEndpoint]:
        return list(self.endpoints)


class RecordingCommunicator:
    """Stands in for vLLM's PyNcclCommunicator (NCCL cannot run without CUDA)."""

    def __init__(self, calls: list) -> None:
        self.calls = calls

    def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
        self.calls.append(("broadcast", src, tensor.clone()))

    def destroy(self) -> None:
        self.calls.append(("destroy",))


def _tiny_llama(lora: bool) -> Any:

    model = random_llama(tie_word_embeddings=True)
    if not lora:
        return model
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.5)  # a non-zero delta, so W + delta differs from W
    return peft_model


def weights_vllm_should_receive(model: Any, lora: bool) -> dict[str, torch.Tensor]:
    """The HF-named float32 weights a sync of ``model`` must deliver, worked
    out here rather than by the code under test (:func:`merged_weights`):
    every weight for full fine-tuning; for the LoRA of :func:`_tiny_llama`
    (q_proj and v_proj adapted), q/k/v of its one layer (vLLM fuses them into
    one qkv_proj, so k_proj travels too), with ``W + (alpha / r) * B @ A``
    for the adapted two."""
    if not lora:
        return {k: v.detach().float() for k, v in model.state_dict().items()}
    peft_config = model.peft_config["default"]
    scale = peft_config.lora_alpha / peft_config.r
    attention = model.get_base_model().model.layers[0].self_attn
    out = {}
    with torch.no_grad():
        for proj in ("q_proj", "k_proj", "v_proj"):
            layer = getattr(attention, proj)
            if proj == "k_proj":
                weight = layer.weight.float()
            else:
                a, b = layer.lora_A["default"].weight.float(), layer.lora_B["default"].weight.float()
                weight = layer.base_layer.weight.float() + scale * (b @ a)
            out[f"model.layers.0.self_attn.{proj}.weight"] = weight
    return out


def assert_bf16_of(sent: torch.Tensor, want: torch.Tensor, name: str) -> None:
    """``sent`` is ``want`` rounded to bfloat16: within half a bf16 ulp
    (2**-8 relative) plus a float32 rounding's worth."""
    assert sent.dtype == torch.bfloat16 and sent.shape == want.shape, name
    gap = (sent.float() - want).abs()
    assert bool((gap <= want.abs() * 2**-8 + 1e-6).all()), f"{name}: off by up to {float(gap.max()):.3g}"


@pytest.fixture()
def mocked_nccl(monkeypatch: pytest.MonkeyPatch) -> list:
    import vllm.distributed.weight_transfer.nccl_engine as nccl_engine

    import grpo_plugins.vllm.nccl_sync as nccl_sync

    calls: list = []
    opened: list = []

    def open_endpoint(init_info: Any) -> RecordingCommunicator:
        opened.append(init_info)
        calls.append(("open_trainer_endpoint", init_info.master_address, init_info.master_port, init_info.world_size))
        return RecordingCommunicator(calls)

    monkeypatch.setattr(nccl_engine, "open_trainer_endpoint", open_endpoint)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: None)  # no CUDA streams here
    monkeypatch.setattr(nccl_sync, "TRANSFER_DEVICE", "cpu")
    return calls


def _sync(tmp_path: Path, data_parallel_size: int = 1, **settings: Any) -> Any:
    from grpo_plugins.vllm.nccl_sync import NcclSync

    cfg = validate(
        {
            "base_model": "org/model",  # a hub id: the config check does not look for it offline
            "datasets": [{"path": "x.jsonl"}],
            "micro_batch_size": 4,
            "vllm": {"tensor_parallel_size": 2, "data_parallel_size": data_parallel_size},
            "trl": {"num_generations": 4, "reward_funcs": ["last_number_match"], "use_vllm": True},
        }
    )
    return NcclSync(RunContext(config=cfg, output_dir=tmp_path), NcclSync.Settings(packed=False, **settings))


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_nccl_sync_runs_vllms_protocol_in_order(tmp_path: Path, mocked_nccl: list, lora: bool) -> None:
    calls = mocked_nccl
    model = _tiny_llama(lora)
    engine = FakeEngine(calls)
    sync = _sync(tmp_path, master_port=40123)
    expected = weights_vllm_should_receive(model, lora)  # by hand, not by merged_weights()
    if lora:  # the LoRA delta is large enough that leaving it out cannot pass for bf16 rounding
        base = model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight.float()
        gap = (expected["model.layers.0.self_attn.q_proj.weight"] - base).abs()
        assert bool((gap > base.abs() * 2**-6 + 1e-4).any())

    for version in (1, 2):
        result = sync.grpo_sync_weights(model=model, version=version, engine=engine)
        assert result.version == version and "nccl:" in result.detail
    sync.grpo_train_end()

    kinds = [c[0] if c[0] != "POST" else c[1] for c in calls]
    # Once: the handshake (the server joins at rank_offset 1 while the trainer opens rank 0).
    assert kinds.count("/init_weight_transfer_engine") == 1 and kinds.count("open_trainer_endpoint") == 1
    init = next(c[2] for c in calls if c[:2] == ("POST", "/init_weight_transfer_engine"))["init_info"]
    assert init["master_address"] == "127.0.0.1" and init["master_port"] == 40123
    assert init["rank_offset"] == 1 and init["world_size"] == 3  # trainer + tensor_parallel_size 2
    # Each version: start, update (names/dtypes/shapes), one broadcast per tensor from rank 0, finish.
    rounds = [i for i, k in enumerate(kinds) if k == "/start_weight_update"]
    assert len(rounds) == 2
    for start in rounds:
        update = calls[start + 1]
        assert update[1] == "/update_weights"
        info = update[2]["update_info"]
        assert info["names"] == list(expected)
        assert info["dtype_names"] == ["bfloat16"] * len(expected)
        assert info["shapes"] == [list(t.shape) for t in expected.values()]
        sent = calls[start + 2 : start + 2 + len(expected)]
        assert [c[0] for c in sent] == ["broadcast"] * len(expected) and all(c[1] == 0 for c in sent)
        for (_, _, tensor), (name, want) in zip(sent, expected.items(), strict=True):
            assert_bf16_of(tensor, want, name)  # the bytes vLLM would receive: W + delta for a LoRA
        assert kinds[start + 2 + len(expected)] == "/finish_weight_update"
    if lora:  # only the adapted modules (and their fused siblings) travel
        assert {n.rsplit(".", 2)[-2] for n in expected} == {"q_proj", "k_proj", "v_proj"}
    assert kinds[-2:] == ["/shutdown_weight_transfer_engine", "destroy"]


def test_nccl_sync_is_refused_without_cuda(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from grpo_core.contract.errors import ConfigError
    from grpo_core.validation.run_check import check_run_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # faked: whatever this machine has
    cfg = validate(minimal_config(plugins={"weight_sync": "nccl"}, trl={"use_vllm": True}))
    with pytest.raises(ConfigError, match=r"weight sync 'nccl'.*no CUDA device.*full_filesystem"):
        check_run_config(cfg)


def test_nccl_sync_needs_master_address_for_a_remote_server(tmp_path: Path, mocked_nccl: list) -> None:
    from grpo_core.contract.errors import ConfigError

    engine = FakeEngine(mocked_nccl)
    engine.same_host = False
    with pytest.raises(ConfigError, match=r"\[plugins.nccl\] master_address"):
        _sync(tmp_path).grpo_sync_weights(model=_tiny_llama(False), version=1, engine=engine)


def test_nccl_sync_brings_every_server_of_a_pool_into_one_group(tmp_path: Path, mocked_nccl: list) -> None:
    """Two servers (managed data_parallel_size = 2): each joins the group at
    its own ranks, and every round reaches both."""
    calls = mocked_nccl
    engine = FakeEngine(calls, servers=2)
    sync = _sync(tmp_path, data_parallel_size=2)
    sync.grpo_sync_weights(model=_tiny_llama(False), version=1, engine=engine)
    sync.grpo_train_end()

    second = "vLLM server at http://127.0.0.1:8001"
    opened = next(c for c in calls if c[0] == "open_trainer_endpoint")
    assert opened[3] == 5  # the trainer + 2 servers x tensor_parallel_size 2
    inits = [c for c in calls if c[:2] == ("POST", "/init_weight_transfer_engine")]
    assert sorted((c[2]["init_info"]["rank_offset"], c[2]["init_info"]["world_size"], c[3:]) for c in inits) == [
        (1, 5, ()),
        (3, 5, (second,)),
    ]
    for path in (
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
        "/shutdown_weight_transfer_engine",
    ):
        reached = [c[3:] for c in calls if c[:2] == ("POST", path)]
        assert sorted(reached) == [(), (second,)], path  # both servers, once each


def test_nccl_sync_refuses_an_uneven_world_size(tmp_path: Path, mocked_nccl: list) -> None:
    from grpo_core.contract.errors import ConfigError

    with pytest.raises(ConfigError, match=r"inference_world_size = 3 does not split evenly over the 2 vLLM servers"):
        _sync(tmp_path, inference_world_size=3).grpo_sync_weights(
            model=_tiny_llama(False), version=1, engine=FakeEngine(mocked_nccl, servers=2)
        )


def test_nccl_sync_refuses_an_engine_without_control_endpoints(tmp_path: Path, mocked_nccl: list) -> None:
    from grpo_core.contract.errors import ConfigError

    engine = FakeEngine(mocked_nccl)
    engine.capabilities = frozenset({WEIGHTS_OVER_NCCL})
    engine.control_endpoints = None  # type: ignore[assignment]  # must not be called
    with pytest.raises(ConfigError, match=r"takes no control requests"):
        _sync(tmp_path).grpo_sync_weights(model=_tiny_llama(False), version=1, engine=engine)
    assert mocked_nccl == []


def test_the_colocated_engine_refuses_control_requests(tmp_path: Path) -> None:
    from grpo_core.contract.types import InferenceEngine
    from grpo_plugins.vllm.colocate import ColocatedEngine

    cfg = validate(
        {
            "base_model": "org/model",  # a hub id: the config check does not look for it offline
            "datasets": [{"path": "x.jsonl"}],
            "micro_batch_size": 4,
            "trl": {
                "num_generations": 4,
                "reward_funcs": ["last_number_match"],
                "use_vllm": True,
                "vllm_mode": "colocate",
            },
        }
    )
    engine = ColocatedEngine(cfg)  # not started: control_endpoints must not need vLLM running
    assert isinstance(engine, InferenceEngine) and CONTROL_ENDPOINTS not in engine.capabilities
    with pytest.raises(NotImplementedError, match=r"no server.*weight sync 'nccl' needs a vLLM server.*vllm_in_memory"):
        engine.control_endpoints()


# ---------------------------------------------------------------- a step that never completes fails, named

STEP_TIMEOUT = 0.5  # [plugins.nccl] timeout in these tests
GUARD = pytest.mark.timeout(30, method="signal")  # a regression that hangs fails here instead of hanging CI


class Stuck:
    """A point of the protocol that never completes (until the test ends):
    a server that accepts a request and never answers, an NCCL call whose
    peer never arrives. Released at teardown so no thread outlives the test."""

    def __init__(self) -> None:
        import threading

        self.release = threading.Event()
        self.reached = threading.Event()

    def block(self) -> None:
        self.reached.set()
        self.release.wait()


@pytest.fixture()
def stuck() -> Any:
    point = Stuck()
    yield point
    point.release.set()


class StuckEndpoint(RecordingEndpoint):
    """Answers every request but ``path``, which it never answers (it also
    ignores the request's timeout, as a server trickling bytes would)."""

    def __init__(self, calls: list, path: str, point: Stuck) -> None:
        super().__init__(calls)
        self.path, self.point = path, point

    def request(self, method: str, path: str, body: Any = None, *, timeout: float | None = None) -> None:
        super().request(method, path, body, timeout=timeout)
        if path == self.path:
            self.point.block()


def _timed_out(sync: Any, model: Any, engine: Any, step: str) -> float:
    """Sync once; it must fail with a SyncStepTimeout naming ``step``, within
    the timeout plus a little. Returns the seconds it took."""
    import re
    import time

    from grpo_core.contract.errors import EngineUnavailable, GrpoError
    from grpo_plugins.vllm.nccl_watchdog import SyncStepTimeout

    started = time.monotonic()
    with pytest.raises(SyncStepTimeout) as caught:
        sync.grpo_sync_weights(model=model, version=1, engine=engine)
    took = time.monotonic() - started
    message = str(caught.value)
    assert isinstance(caught.value, EngineUnavailable) and isinstance(
        caught.value, GrpoError
    )  # the run stops with a checkpoint
    assert re.search(
        rf"weight sync 'nccl' timed out at version 1: {re.escape(step)} did not complete within "
        rf"\[plugins.nccl\] timeout = {STEP_TIMEOUT:g} s",
        message,
    ), message
    assert "restart the server" in message and "raise [plugins.nccl] timeout" in message
    assert STEP_TIMEOUT <= took < STEP_TIMEOUT + 2.0, took
    return took


SERVER_STEPS = {
    "/init_weight_transfer_engine": (
        "the handshake, server side: /init_weight_transfer_engine (the vLLM workers joining the NCCL group)"
    ),
    "/start_weight_update": "the server's /start_weight_update",
    "/finish_weight_update": "the server's /finish_weight_update (loading the received weights)",
}


@GUARD
@pytest.mark.parametrize("path", list(SERVER_STEPS), ids=lambda p: p.strip("/"))
def test_a_server_request_that_never_answers_fails_naming_it(
    tmp_path: Path, mocked_nccl: list, stuck: Stuck, path: str
) -> None:
    engine = FakeEngine(mocked_nccl)
    engine.endpoints = [StuckEndpoint(mocked_nccl, path, stuck)]
    _timed_out(_sync(tmp_path, timeout=STEP_TIMEOUT), _tiny_llama(False), engine, SERVER_STEPS[path])
    assert stuck.reached.is_set()


@GUARD
def test_the_trainers_side_of_the_handshake_that_never_completes_fails_naming_it(
    tmp_path: Path, mocked_nccl: list, stuck: Stuck, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server answered /init_weight_transfer_engine; the trainer's NCCL
    rendezvous (rank 0) never completes."""
    import vllm.distributed.weight_transfer.nccl_engine as nccl_engine

    def never_joins(init_info: Any) -> Any:
        stuck.block()

    monkeypatch.setattr(nccl_engine, "open_trainer_endpoint", never_joins)
    _timed_out(
        _sync(tmp_path, timeout=STEP_TIMEOUT, master_port=40200),
        _tiny_llama(False),
        FakeEngine(mocked_nccl),
        "the handshake, trainer side: joining the NCCL group at 127.0.0.1:40200 as rank 0 of 3",
    )


def _tensor_count(model: Any) -> int:
    return len(weights_vllm_should_receive(model, lora=False))


@GUARD
@pytest.mark.parametrize("stuck_round", [1, 6, -1], ids=["first", "middle", "last"])
def test_a_broadcast_round_that_never_completes_fails_naming_it(
    tmp_path: Path, mocked_nccl: list, stuck: Stuck, stuck_round: int
) -> None:
    """Every broadcast round has its own deadline (first, middle, last of the
    tiny model's tensors, sent one by one)."""
    model = _tiny_llama(False)
    rounds = _tensor_count(model)
    assert rounds > 6
    stuck_round = stuck_round % (rounds + 1)
    original = RecordingCommunicator.broadcast
    sent = []

    def broadcast(self: RecordingCommunicator, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
        sent.append(tensor)
        if len(sent) == stuck_round:
            stuck.block()
        original(self, tensor, src, stream)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(RecordingCommunicator, "broadcast", broadcast)
        _timed_out(
            _sync(tmp_path, timeout=STEP_TIMEOUT),
            model,
            FakeEngine(mocked_nccl),
            f"broadcast round {stuck_round} of {rounds} (rank 0 to the vLLM workers)",
        )
    assert len(sent) == stuck_round


class ReceivingEndpoint(RecordingEndpoint):
    """/update_weights answers like vLLM's: only once the workers received
    every broadcast round (``received`` is set by the communicator), then
    after ``then`` more: ``None`` never."""

    def __init__(self, calls: list, received: Any, then: Stuck | None) -> None:
        super().__init__(calls)
        self.received, self.then = received, then

    def request(self, method: str, path: str, body: Any = None, *, timeout: float | None = None) -> None:
        super().request(method, path, body, timeout=timeout)
        if path == "/update_weights":
            self.received.wait()
            if self.then is not None:
                self.then.block()


def _slow_rounds(patch: pytest.MonkeyPatch, seconds: float, rounds: int) -> Any:
    """The trainer takes ``seconds`` to produce each tensor before its round
    (as an FSDP gather or packing a buffer would); the returned event is set
    after the last round."""
    import threading
    import time

    from grpo_plugins.vllm import nccl_sync

    done, original, sent = threading.Event(), RecordingCommunicator.broadcast, []
    iterate = nccl_sync._MergedWeights.__iter__

    def slowly(self: Any) -> Any:
        for item in iterate(self):
            time.sleep(seconds)
            yield item

    def broadcast(self: RecordingCommunicator, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
        original(self, tensor, src, stream)
        sent.append(tensor)
        if len(sent) == rounds:
            done.set()

    patch.setattr(nccl_sync._MergedWeights, "__iter__", slowly)
    patch.setattr(RecordingCommunicator, "broadcast", broadcast)
    return done


@GUARD
def test_the_servers_update_call_that_never_answers_fails_naming_it(
    tmp_path: Path, mocked_nccl: list, stuck: Stuck
) -> None:
    """Every round was broadcast; the server's update_weights, which runs
    alongside them, never answers."""
    model = _tiny_llama(False)
    with pytest.MonkeyPatch.context() as patch:
        received = _slow_rounds(patch, 0.0, _tensor_count(model))
        engine = FakeEngine(mocked_nccl)
        engine.endpoints = [ReceivingEndpoint(mocked_nccl, received, stuck)]
        _timed_out(
            _sync(tmp_path, timeout=STEP_TIMEOUT),
            model,
            engine,
            "the server's /update_weights (its workers receiving the broadcast)",
        )
    assert received.is_set()


@GUARD
def test_a_sync_longer_than_the_timeout_whose_every_step_is_shorter_succeeds(tmp_path: Path, mocked_nccl: list) -> None:
    """The timeout bounds each step, not the sync: 12 rounds 0.12 s apart
    (1.4 s in all, against a 0.5 s timeout) while update_weights waits for
    them all. Each round the server receives restarts its clock."""
    import time

    model = _tiny_llama(False)
    with pytest.MonkeyPatch.context() as patch:
        received = _slow_rounds(patch, 0.12, _tensor_count(model))
        engine = FakeEngine(mocked_nccl)
        engine.endpoints = [ReceivingEndpoint(mocked_nccl, received, None)]
        sync = _sync(tmp_path, timeout=STEP_TIMEOUT)
        started = time.monotonic()
        result = sync.grpo_sync_weights(model=model, version=1, engine=engine)
        assert time.monotonic() - started > 2 * STEP_TIMEOUT
    assert result.version == 1 and [c[1] for c in mocked_nccl if c[0] == "POST"][-1] == "/finish_weight_update"


def test_a_step_that_fails_is_named(tmp_path: Path, mocked_nccl: list) -> None:
    from grpo_core.contract.errors import EngineUnavailable

    class Refusing(RecordingEndpoint):
        def request(self, method: str, path: str, body: Any = None, *, timeout: float | None = None) -> None:
            super().request(method, path, body, timeout=timeout)
            if path == "/start_weight_update":
                raise RuntimeError("HTTP 500")

    engine = FakeEngine(mocked_nccl)
    engine.endpoints = [Refusing(mocked_nccl)]
    with pytest.raises(
        EngineUnavailable, match=r"failed at version 1 in the server's /start_weight_update: RuntimeError: HTTP 500"
    ):
        _sync(tmp_path, timeout=STEP_TIMEOUT).grpo_sync_weights(model=_tiny_llama(False), version=1, engine=engine)


def test_the_timeout_defaults_to_vllms_rendezvous_timeout_and_must_be_positive() -> None:
    from pydantic import ValidationError

    from grpo_plugins.vllm.nccl_sync import NcclSync

    assert NcclSync.Settings().timeout == 300.0
    with pytest.raises(ValidationError):
        NcclSync.Settings(timeout=0)
