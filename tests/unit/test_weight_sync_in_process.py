"""The in-process weight sync: records the version, copies nothing."""

from __future__ import annotations

import torch

from grpo_core.config.loader import validate
from grpo_core.contract.context import RunContext
from grpo_core.contract.types import SyncResult
from grpo_core.host.plugin_host import PluginHost
from grpo_plugins.weight_sync_in_process import InProcessSync


def make_context(tmp_path, model) -> RunContext:
    return RunContext(config=validate({"base_model": "unused"}), output_dir=tmp_path, get_model=lambda: model)


def test_sync_records_version_and_leaves_weights_alone(tmp_path):
    model = torch.nn.Linear(3, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sync = InProcessSync(make_context(tmp_path, model))
    assert sync.version is None

    first = sync.grpo_sync_weights(model=model, version=0, engine=None)
    second = sync.grpo_sync_weights(model=model, version=3, engine=None)

    assert first == SyncResult(version=0, seconds=first.seconds, detail="in-process")
    assert second.version == 3 and second.detail == "in-process"
    assert 0 <= second.seconds < 0.01
    assert sync.version == 3 and sync.syncs == 2
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key])


def test_loads_through_the_entry_point(tmp_path):
    model = torch.nn.Linear(3, 2)
    host = PluginHost()
    obj = host.load_implementation("weight_sync", "in_process", make_context(tmp_path, model))
    result = host.hook.grpo_sync_weights(model=model, version=7, engine=None)
    assert isinstance(obj, InProcessSync)
    assert result.version == 7 and obj.version == 7
