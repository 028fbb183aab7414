"""Several managed servers and their GPU placement, without vLLM running.

This machine has no GPU: what is checked is the config validation and the
environment (CUDA_VISIBLE_DEVICES) each server process is started with.
The process started in place of vLLM is a stand-in that prints its
environment (vLLM itself on two managed servers is too slow to start for a
test on 2 cores; the real two-server behaviour is tested against two real
servers in test_vllm_multiserver.py).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from helpers import REPO

from grpo_core.config.loader import validate
from grpo_core.contract.context import RunContext
from grpo_core.contract.errors import ConfigError
from grpo_plugins.vllm import command_line, placement
from grpo_plugins.vllm.pool import VLLMEnginePool
from grpo_plugins.vllm.rollout import VLLMRollout

ARITHMETIC = REPO / "examples" / "arithmetic" / "data" / "train.jsonl"


@pytest.fixture
def model_dir(tmp_path: Path) -> str:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")  # enough for the command line; no model is loaded here
    return str(d)


def config(model_dir: str, tmp_path: Path, vllm: dict | None = None, **trl: object):
    return validate(
        {
            "base_model": model_dir,
            "adapter": "lora",
            "lora_r": 8,
            "output_dir": str(tmp_path / "out"),
            "datasets": [{"path": str(ARITHMETIC)}],
            "micro_batch_size": 2,
            "vllm": {"dtype": "float32", "max_model_len": 256, **(vllm or {})},
            "trl": {"use_vllm": True, "num_generations": 2, "reward_funcs": ["last_number_match"], **trl},
        }
    )


def problems(model_dir: str, tmp_path: Path, **vllm: object) -> str:
    """How the placement fits together, judged as on a machine without GPUs
    (gpus=0: indices are not compared with a GPU count, so the answer is the
    same on every machine; test_config_check.py fakes a count)."""
    return " ".join(placement.placement_problems(config(model_dir, tmp_path, vllm), gpus=0))


def test_placement_refuses_overlaps_that_would_run_out_of_memory(model_dir, tmp_path) -> None:
    # The reference's layout: GPU 0 for vLLM, GPU 1 for training.
    assert problems(model_dir, tmp_path, devices=[0], trainer_devices=[1]) == ""
    # vLLM on the trainer's default GPU 0 with 85% of its memory: refused, naming the keys and the fix.
    msg = problems(model_dir, tmp_path, devices=[0])
    assert "trainer's default GPU" in msg and "trainer_devices" in msg and "gpu_memory_utilization" in msg
    assert "share GPU 1," in problems(model_dir, tmp_path, devices=[0, 1], trainer_devices=[1, 2], data_parallel_size=2)
    # Sharing one GPU is allowed when vLLM leaves the trainer at least half of it.
    assert problems(model_dir, tmp_path, devices=[0], trainer_devices=[0], gpu_memory_utilization=0.4) == ""
    # Two servers on one GPU claiming 170% of it; fine at 40% each.
    msg = problems(model_dir, tmp_path, devices=[2, 2], trainer_devices=[0], data_parallel_size=2)
    assert "2 servers on GPU 2" in msg and "0.47" in msg
    assert (
        problems(
            model_dir, tmp_path, devices=[2, 2], trainer_devices=[0], data_parallel_size=2, gpu_memory_utilization=0.4
        )
        == ""
    )
    # Counts: data_parallel_size x tensor_parallel_size GPUs, distinct within a server.
    assert "4 are needed" in problems(model_dir, tmp_path, devices=[0, 1], data_parallel_size=2, tensor_parallel_size=2)
    assert "distinct GPUs" in problems(model_dir, tmp_path, devices=[1, 1], tensor_parallel_size=2, trainer_devices=[0])
    assert "set devices too" in problems(model_dir, tmp_path, trainer_devices=[1])


def test_config_check_refuses_a_bad_placement_with_the_keys(model_dir, tmp_path) -> None:
    from grpo_core.host.plugin_host import PluginHost
    from grpo_core.validation.run_check import check_run_config

    host = PluginHost()
    host.load_always_on()
    with pytest.raises(ConfigError, match=r"\[vllm\] devices and the trainer's default GPU"):
        check_run_config(config(model_dir, tmp_path, {"devices": [0]}), host)
    with pytest.raises(ConfigError, match="external servers"):
        check_run_config(
            config(
                model_dir,
                tmp_path,
                {"devices": [0], "trainer_devices": [1]},
                vllm_server_base_urls=["http://127.0.0.1:1"],
            ),
            host,
        )
    with pytest.raises(ConfigError, match="both set"):
        check_run_config(
            config(model_dir, tmp_path, vllm_server_base_urls=["http://a:1"], vllm_server_base_url="http://b:1"), host
        )
    check_run_config(
        config(model_dir, tmp_path, {"devices": [0], "trainer_devices": [1]}), host
    )  # the reference's layout passes


def test_device_indices_count_among_the_visible_gpus() -> None:
    assert placement.physical_devices([0, 1], visible="") == "0,1"
    assert placement.physical_devices([1], visible="4,5") == "5"
    with pytest.raises(ConfigError, match="shows only 2"):
        placement.physical_devices([2], visible="4,5")


def test_trainer_devices_narrow_this_process(model_dir, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6,7")
    cfg = config(model_dir, tmp_path, {"devices": [0], "trainer_devices": [1]})
    assert placement.server_devices(cfg, None) == "6"  # computed before the trainer narrows its own view
    assert placement.narrow_trainer_devices(cfg) == "7"
    import os

    assert os.environ["CUDA_VISIBLE_DEVICES"] == "7"


STAND_IN = (
    "import os, sys, time; print('CUDA_VISIBLE_DEVICES=' + os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>'), "
    "flush=True); time.sleep(60)"
)


def test_managed_data_parallel_starts_separate_servers_on_their_gpus(model_dir, tmp_path, monkeypatch) -> None:
    """data_parallel_size = 2 with devices [1, 2]: two processes, each its
    own private socket and log, vLLM's own data parallelism off, and
    CUDA_VISIBLE_DEVICES 1 and 2 in their environments (no GPU here: the
    stand-in prints what it got); the trainer keeps GPU 0."""
    # Empty, not deleted: monkeypatch then restores it after the pool narrowed it to "0"
    # (a leaked CUDA_VISIBLE_DEVICES would make later tests believe there is a GPU).
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    real_specs = []
    real_managed_spec = command_line.managed_spec

    def stand_in_spec(*args, **kwargs):
        spec = real_managed_spec(*args, **kwargs)
        real_specs.append(list(spec.argv))
        spec.argv = [sys.executable, "-c", STAND_IN]
        return spec

    monkeypatch.setattr("grpo_plugins.vllm.engine.managed_spec", stand_in_spec)
    cfg = config(
        model_dir, tmp_path, {"devices": [1, 2], "trainer_devices": [0], "data_parallel_size": 2}, vllm_managed=True
    )
    VLLMRollout.grpo_validate_config(cfg)
    logs: list[str] = []
    pool = VLLMEnginePool(RunContext(config=cfg, output_dir=tmp_path / "out", log=logs.append))
    try:
        assert len(pool.members) == 2
        sockets = [m.server.spec.uds for m in pool.members]
        assert len(set(sockets)) == 2 and all(s and Path(s).parent.stat().st_mode & 0o777 == 0o700 for s in sockets)
        for argv in real_specs:
            assert argv[argv.index("--data-parallel-size") + 1] == "1"
            assert argv[argv.index("--worker-extension-cls") + 1] == command_line.WORKER_EXTENSION
        seen = []
        for i, _member in enumerate(pool.members):
            log = tmp_path / "out" / f"vllm-server-{i}.log"
            deadline = time.monotonic() + 30
            while (
                "CUDA_VISIBLE_DEVICES=" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline
            ):
                time.sleep(0.1)
            seen.append(log.read_text().strip())
        assert seen == ["CUDA_VISIBLE_DEVICES=1", "CUDA_VISIBLE_DEVICES=2"]
        import os

        assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"  # the trainer kept GPU 0
        # A restart starts the same server with the same devices (not the trainer's narrowed view).
        assert pool.members[1].server.spec.env["CUDA_VISIBLE_DEVICES"] == "2"
    finally:
        pool.shutdown()
    assert all(not m.server.alive() for m in pool.members)


def test_shares_keep_groups_whole_and_spread_them(model_dir, tmp_path) -> None:
    class Member:  # only what shares() reads: a list position (and, at construction, that it is managed)
        server = "managed"

    a, b, c = Member(), Member(), Member()
    pool = VLLMEnginePool(
        RunContext(config=config(model_dir, tmp_path), output_dir=tmp_path, log=print), members=[a, b, c]
    )  # type: ignore[list-item]
    assert [(m, list(r)) for m, r in pool.shares(7)] == [(a, [0, 1, 2]), (b, [3, 4]), (c, [5, 6])]
    assert [(m, list(r)) for m, r in pool.shares(2)] == [(a, [0]), (b, [1])]
    # An even split keeps its order whatever the call; an uneven one rotates the larger shares with the call
    # number, so a stream of one-group calls (trl.streaming_partial_batch) reaches every server, not the first only.
    assert [(m, list(r)) for m, r in pool.shares(6, 1)] == [(a, [0, 1]), (b, [2, 3]), (c, [4, 5])]
    assert [[m for m, _ in pool.shares(1, turn)] for turn in range(4)] == [[a], [b], [c], [a]]
    assert [(m, list(r)) for m, r in pool.shares(4, 2)] == [(c, [0, 1]), (a, [2]), (b, [3])]


def test_when_every_server_is_gone_the_last_error_is_reported(model_dir, tmp_path) -> None:
    """Two external servers, nothing listening at either (real sockets, no
    vLLM): the first to fail is dropped with a warning, the last one's
    EngineUnavailable (after trl.vllm_server_timeout) is what the run reports."""
    from grpo_core.contract.errors import EngineUnavailable
    from grpo_core.contract.types import Prompt, SamplingSettings
    from grpo_plugins.vllm.addresses import free_port

    urls = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"]
    cfg = config(model_dir, tmp_path, vllm_managed=False, vllm_server_base_urls=urls, vllm_server_timeout=2)
    logs: list[str] = []
    rollout = VLLMRollout(RunContext(config=cfg, output_dir=tmp_path / "out", log=logs.append))
    start = time.monotonic()
    with pytest.raises(EngineUnavailable, match="did not answer /health") as info:
        rollout.grpo_rollout_generate([Prompt("hi", [1, 2])], 2, SamplingSettings(max_tokens=2), 0)
    assert time.monotonic() - start < 20
    assert any(u in str(info.value) for u in urls)
    dropped = [line for line in logs if "dropped" in line]
    assert len(dropped) == 1 and "carrying on with 1 server(s)" in dropped[0], logs
    assert len(rollout.engine.live()) == 1


def test_full_http_is_a_weight_sync_the_server_rollout_accepts(model_dir, tmp_path) -> None:
    """Chosen by name through the entry points, with its settings table
    validated; refused with colocated vLLM (no server to pull anything)."""
    from grpo_core.host.plugin_host import PluginHost
    from grpo_core.validation.run_check import check_run_config

    host = PluginHost()
    host.load_always_on()

    def with_sync(settings: dict, **trl: object):
        cfg = config(model_dir, tmp_path, **trl)
        return validate({**cfg.model_dump(exclude_unset=True), "plugins": {"weight_sync": "full_http", **settings}})

    check_run_config(with_sync({"full_http": {"host": "0.0.0.0", "advertise_host": "trainer.example"}}), host)
    with pytest.raises(ConfigError, match="plugins.full_http.hots"):
        check_run_config(with_sync({"full_http": {"hots": "x"}}), host)
    with pytest.raises(ConfigError, match="vllm_in_memory"):
        check_run_config(with_sync({}, vllm_mode="colocate"), host)
