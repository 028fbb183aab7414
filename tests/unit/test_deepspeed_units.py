"""DeepSpeed checkpoints without a DeepSpeed engine: refused on another
process count or without DeepSpeed, and read with the restricted unpickler
before DeepSpeed reads them. The ZeRO runs are tests/e2e/test_deepspeed.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


def test_a_deepspeed_checkpoint_is_refused_on_another_process_count_or_without_deepspeed(tmp_path: Path) -> None:
    """ZeRO partitions are per rank: another process count (or no DeepSpeed) is refused with the fix, before
    DeepSpeed reads anything (light: no engine runs)."""
    from grpo_core.checkpointing.checkpoint import LoadedCheckpoint
    from grpo_core.contract.errors import GrpoError
    from grpo_core.parallel.deepspeed_zero import DeepSpeedBackend
    from grpo_core.parallel.replicated import ReplicatedBackend

    (tmp_path / "deepspeed").mkdir()
    loaded = LoadedCheckpoint(tmp_path, {"step": 2}, None, {}, {}, {"deepspeed_world_size": 2})
    alone = object.__new__(DeepSpeedBackend)  # the backend of a 1-process DeepSpeed run, before any engine
    alone.world, alone.step_driver = 1, None
    with pytest.raises(GrpoError, match="resume with --num-processes 2"):
        alone.resume(tmp_path, loaded)
    plain = LoadedCheckpoint(tmp_path / "x", {"step": 2}, {}, {}, {}, {})
    with pytest.raises(GrpoError, match="was not written with `deepspeed`"):
        alone.resume(tmp_path / "x", plain)
    without = object.__new__(ReplicatedBackend)  # one process or DDP (FSDP refuses it the same way)
    with pytest.raises(GrpoError, match="written with `deepspeed` .*resume it with the same `deepspeed`"):
        without.resume(tmp_path, loaded)


class _NotPlain:
    """Stands for anything DeepSpeed's full unpickler would rebuild by running code."""


def test_deepspeed_files_are_read_with_the_restricted_unpickler_before_deepspeed_reads_them(tmp_path: Path) -> None:
    from grpo_core.checkpointing.safe_load import UnsafeCheckpoint
    from grpo_core.parallel.zero import CHECKPOINT_TAG, check_files

    files = tmp_path / CHECKPOINT_TAG
    files.mkdir()
    torch.save({"module": {"w": torch.ones(2)}, "ds_version": "0.19.8"}, files / "mp_rank_00_model_states.pt")
    check_files(tmp_path)  # tensors and plain data pass
    torch.save({"optimizer_state_dict": _NotPlain()}, files / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    with pytest.raises(UnsafeCheckpoint, match="zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        check_files(tmp_path)
