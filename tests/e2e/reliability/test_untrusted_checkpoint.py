"""A checkpoint someone else wrote cannot run code through ``grpo run``.

One real run on the tiny model (tests/tiny_model.py) writes a checkpoint in the middle of a batch
(``num_iterations = 2``, saved after step 1, so the pending batch of grpo
dataclasses is in it). Resuming it works; the same checkpoint with a state
file replaced by a pickle that would write a marker file is refused with
exit 2, a message naming the file and no traceback, before the model loads,
and the marker is never written. (Each state file is tampered with in turn,
without a model, in ``tests/unit/test_checkpoint_safety.py``.)
"""

from __future__ import annotations

import builtins
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fault_harness import Runner, assert_clean_failure, assert_no_model_loaded, last_per_step, populate
from safetensors.torch import load_file

from grpo_core.checkpointing.safe_load import safe_load

SETTINGS: dict[str, Any] = {"max_steps": 1, "save_steps": 1, "trl": {"num_iterations": 2}}


class WritesMarker:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (builtins.exec, (f"open({str(self.marker)!r}, 'w').write('code ran')",))


@pytest.fixture(scope="module")
def mid_batch_checkpoint(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: str
) -> Iterator[tuple[Runner, Path]]:
    runner = Runner(populate(tmp_path_factory.mktemp("untrusted") / "work"), tiny_model_dir)
    try:
        code, output = runner.run(runner.config(**SETTINGS))
        assert code == 0, output[-6000:]
        yield runner, runner.workdir / "out" / "checkpoint-1"
    finally:
        runner.close()


@pytest.mark.extended  # ~70 s; test_resume_exact's split runs (a resumed run equals a straight one) run in the default
# tier
def test_a_checkpoint_saved_mid_batch_resumes_exactly(mid_batch_checkpoint: tuple[Runner, Path]) -> None:
    """The pending batch (grpo dataclasses) reads back under the safe rules,
    and the resumed step 2 matches a run that was never stopped."""
    runner, checkpoint = mid_batch_checkpoint
    extra = safe_load(checkpoint / "extra_state.pt")
    assert extra["pending_batch"] is not None and extra["pending_batch"].groups
    straight = runner.workdir / "straight"
    code, output = runner.run(
        runner.config("straight.toml", **{**SETTINGS, "max_steps": 2, "output_dir": str(straight)})
    )
    assert code == 0, output[-6000:]

    config = runner.config("resume.toml", **{**SETTINGS, "max_steps": 2, "resume_from_checkpoint": str(checkpoint)})
    code, output = runner.run(config)
    assert code == 0, output[-6000:]
    assert f"resumed from {checkpoint} at step 1" in output
    resumed, reference = last_per_step(runner.workdir / "out")[2], last_per_step(straight)[2]
    assert resumed.keys() == reference.keys() and "loss" in reference
    for key in reference.keys() - {"step_time"} - {k for k in reference if k.startswith("time/")}:
        assert resumed[key] == pytest.approx(reference[key], rel=1e-4, abs=1e-6), key
    final, expected = (
        load_file(str(runner.workdir / "out" / "adapter_model.safetensors")),
        load_file(str(straight / "adapter_model.safetensors")),
    )
    assert final.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(final[key], expected[key], rtol=1e-4, atol=1e-6)


def test_a_checkpoint_that_would_run_code_is_refused(mid_batch_checkpoint: tuple[Runner, Path], tmp_path: Path) -> None:
    runner, checkpoint = mid_batch_checkpoint
    hostile = tmp_path / "downloaded" / "checkpoint-1"
    shutil.copytree(checkpoint, hostile)
    marker = tmp_path / "marker"
    torch.save({"pending_batch": WritesMarker(marker)}, hostile / "extra_state.pt")

    config = runner.config("hostile.toml", **{**SETTINGS, "max_steps": 2, "resume_from_checkpoint": str(hostile)})
    code, output = runner.run(config)
    assert_clean_failure(code, output)
    assert f"refused to load {hostile / 'extra_state.pt'}" in output
    assert_no_model_loaded(output)
    assert not marker.exists()
