"""A step's record is never lost: when the weight sync after step N raises,
step N has trained (its optimizer step is done), so its metrics are in
metrics.jsonl before the run stops with a checkpoint.

The failing sync is a real plugin distribution (a ``.dist-info`` with
``entry_points.txt`` next to its module, as pip installs one) found by
entry point, in a real run of the tiny model through the transformers rollout.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import metrics, raw_config, run_workdir
from plugin_set import failing_sync_source, write_distribution

from grpo_core.config.loader import validate
from grpo_core.contract.errors import PluginError
from grpo_core.host import plugin_host
from grpo_core.training.run import run_training

REWARDS = (
    "def even(completion_ids, **kwargs):\n"
    "    return [sum(t % 2 == 0 for t in ids) / max(1, len(ids)) for ids in completion_ids]\n"
)


@pytest.fixture
def failing_sync_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    site = write_distribution(
        tmp_path / "site",
        "grpo_failing_sync",
        failing_sync_source(2),
        "grpo-failing-sync",
        "[grpo.weight_sync]\nfails_at_2 = grpo_failing_sync:FailsAt\n",
    )
    monkeypatch.syspath_prepend(str(site))
    plugin_host.rescan()
    yield site
    plugin_host.rescan()


def test_a_failed_sync_after_step_2_keeps_step_2s_metrics(
    tiny_model_dir: str, tmp_path: Path, monkeypatch, failing_sync_site: Path
) -> None:
    run_workdir(tmp_path, [{"prompt": f"Item {i}:"} for i in range(8)], {"record_rewards": REWARDS}, monkeypatch)
    model = tiny_model_dir
    out = tmp_path / "out"
    cfg = validate(
        raw_config(
            model,
            tmp_path,
            sequence_len=64,
            micro_batch_size=8,
            max_steps=4,
            learning_rate=1e-3,
            seed=1,
            plugins={"weight_sync": "fails_at_2"},
            trl={
                "num_generations": 4,
                "max_completion_length": 4,
                "reward_funcs": ["record_rewards.even"],
                "temperature": 1.0,
            },
        )
    )

    with pytest.raises(PluginError, match="(?s)version 2.*stopped at step 2; checkpoint saved") as info:
        run_training(cfg)
    assert "fails_at_2" in str(info.value)  # the message names the plugin that raised
    records = metrics(out)
    assert [r["step"] for r in records] == [1, 2]
    step2 = records[1]
    assert (
        "loss" in step2 and "reward" in step2 and step2["policy_version"] == 1.0
    )  # a full record, trained on version 1's batch
    assert step2["step_time"] >= step2["time/weight_sync"] >= 0.0  # the failed sync's time is in it too
    assert (out / "checkpoint-2").is_dir()
