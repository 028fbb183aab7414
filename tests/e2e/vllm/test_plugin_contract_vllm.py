"""A plugin package written only against grpo_core's public contract, in a
real `grpo run` against the real vLLM server.

``tests/plugin_packages/grpo-contract-test`` publishes a weight sync
(``timed_full``: writes safetensors, loads them through the engine handle it
receives) and a configurable advantage aggregation (``scaled_group``). It is
pip-installed into a private folder, chosen by a TOML config with
``[plugins.<name>]`` settings, and must drive the server grpo talks to.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import REPO, grpo, no_traceback, write_toml
from pip_target import install_into_target
from vllm_session import server_run

pytestmark = pytest.mark.vllm

ROOT = REPO
PACKAGE = ROOT / "tests" / "plugin_packages" / "grpo-contract-test"
RUN_ENV = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def contract_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return install_into_target(PACKAGE, tmp_path_factory.mktemp("contract"))


def write_config(tmp_path: Path, smollm2_dir: str, base_url: str, **aggregation: object) -> Path:
    cfg = server_run(
        smollm2_dir,
        tmp_path,
        base_url,
        ROOT / "examples" / "arithmetic" / "data" / "train.jsonl",
        sequence_len=256,
        micro_batch_size=8,
        max_steps=2,
        learning_rate=1e-3,
        lr_scheduler="constant",
        seed=5,
        trl={"num_generations": 4, "max_completion_length": 12, "reward_funcs": ["alternating_rewards.alternating"]},
        plugins={
            "weight_sync": "timed_full",
            "advantage_aggregation": "scaled_group",
            "timed_full": {"folder": "my-weights"},
            "scaled_group": {"scale": 0.5, **aggregation},
        },
    )
    # a reward that varies within every group (0, 1, 0, 1), so every step trains and syncs
    (tmp_path / "alternating_rewards.py").write_text(
        "def alternating(completion_ids, **kwargs):\n    return [float(i % 2) for i in range(len(completion_ids))]\n"
    )
    return write_toml(tmp_path / "config.toml", cfg)


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_third_party_sync_and_aggregation_drive_a_real_run(
    vllm_server, smollm2_dir: str, contract_site: Path, tmp_path: Path
) -> None:
    from grpo_plugins.vllm.client import VLLMClient

    config = write_config(tmp_path, smollm2_dir, vllm_server.base_url)
    check = grpo("config", "check", str(config), cwd=tmp_path, pythonpath=contract_site, env=RUN_ENV, timeout=900)
    assert check.returncode == 0, check.stderr
    assert "weight_sync=timed_full" in check.stdout and "advantage_aggregation=scaled_group" in check.stdout

    result = grpo("run", str(config), cwd=tmp_path, pythonpath=contract_site, env=RUN_ENV, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "out"
    syncs = records(out / "timed_full_syncs.jsonl")
    assert [s["version"] for s in syncs] == [0, 1, 2]  # the initial weights, then after each step
    labels = [s["label_after"] for s in syncs]
    assert len(set(labels)) == 3 and all(s["label_before"] != s["label_after"] for s in syncs)
    assert all(s["served_model"] == "base" and vllm_server.base_url in s["engine"] for s in syncs)
    # the server holds the weights of the last sync, loaded from the plugin's own folder
    client = VLLMClient(vllm_server.base_url, "test-key-123")
    assert client.weight_version() == labels[-1]
    assert sorted(p.name for p in (out / "my-weights").iterdir()) == ["v2"]
    calls = records(out / "scaled_group_calls.jsonl")
    assert len(calls) == 2 and all(c["scale"] == 0.5 for c in calls)  # [plugins.scaled_group] reached the factory


# extended: a second real run of this file through the server (17 s emulating an AVX2-only machine) whose path, a
# third-party distribution's hook raising (one error line naming the hook, implementation and distribution, the
# traceback in grpo-error.log, a checkpoint), the default tier runs on the tiny model
# (tests/e2e/reliability/test_safety_net.py::test_a_plugin_hook_that_raises and ::test_a_weight_sync_that_raises)
@pytest.mark.extended
def test_a_raising_plugin_hook_stops_with_one_error_and_a_checkpoint(
    vllm_server, smollm2_dir: str, contract_site: Path, tmp_path: Path
) -> None:
    config = write_config(tmp_path, smollm2_dir, vllm_server.base_url, fail_on_call=2)
    result = grpo("run", str(config), cwd=tmp_path, pythonpath=contract_site, env=RUN_ENV, timeout=900)
    out = tmp_path / "out"
    assert result.returncode == 2, result.stderr[-3000:]
    no_traceback(result)
    error = result.stderr
    assert "hook grpo_aggregate_advantages of advantage_aggregation implementation 'scaled_group'" in error
    assert "distribution 'grpo-contract-test'" in error and "ZeroDivisionError: injected failure on call 2" in error
    assert f"The traceback is in {out / 'grpo-error.log'}" in error
    assert "Training stopped at step 1; checkpoint saved to" in error
    assert (out / "checkpoint-1" / "trainer_state.json").is_file()
    log = (out / "grpo-error.log").read_text(encoding="utf-8")
    assert "Traceback" in log and "aggregation.py" in log
