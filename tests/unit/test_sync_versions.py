"""Which weight versions a filesystem sync keeps on disk.

With ``async_prefetch`` a request the prefetch thread made under an older
version may be scheduled by vLLM after the next sync, and vLLM reads a LoRA
adapter from its path only then: deleting that directory killed the real
server's engine in tests/e2e/reliability/test_async_resume.py (FileNotFoundError
for adapter_config.json). The retention is checked here on real directories.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from grpo_core.config.loader import validate
from grpo_core.contract.context import RunContext


def _sync(tmp_path: Path, **trl: object):
    from grpo_plugins.weight_sync_files import LoraFilesystemSync

    cfg = validate(
        {
            "base_model": "org/model",  # a hub id: the config check does not look for it offline
            "datasets": [{"path": "x.jsonl"}],
            "micro_batch_size": 4,
            "trl": {
                "num_generations": 4,
                "reward_funcs": ["last_number_match"],
                "use_vllm": True,
                "vllm_lora_sync": True,
                **trl,
            },
        }
    )
    return LoraFilesystemSync(RunContext(config=cfg, output_dir=tmp_path))


@pytest.mark.parametrize(
    ("trl", "kept"),
    [
        ({}, ["v12"]),
        ({"async_prefetch": True}, ["v11", "v12"]),
        ({"async_prefetch": True, "prefetch_depth": 2}, ["v10", "v11", "v12"]),
    ],
    ids=["synchronous", "async-depth-1", "async-depth-2"],
)
def test_older_versions_a_prefetched_request_may_still_use_are_kept(tmp_path: Path, trl: dict, kept: list[str]) -> None:
    root = tmp_path / "adapters"
    for version in (2, 9, 10, 11, 12):  # numeric order, not the names' (v9 < v10)
        (root / f"v{version}").mkdir(parents=True)
        (root / f"v{version}" / "adapter_config.json").write_text("{}")
    _sync(tmp_path, **trl)._prune(root / "v12")
    assert sorted(p.name for p in root.iterdir()) == sorted(kept)
