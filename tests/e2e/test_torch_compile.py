"""``torch_compile``: a real compiled run on CPU (inductor, gcc) on the tiny model.

Asserts that the decoder body really went through torch.compile (dynamo
counters: frames compiled, graphs captured), that the compiled run's losses
and grad norms match the eager run's for 2 steps within a tolerance (fused
kernels reorder float32 sums, so bit-exact is not expected), and that a
checkpoint saved by the compiled run resumes in an eager run (state-dict keys
unchanged: no ``_orig_mod.`` prefix). LoRA and full fine-tuning both.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import merged, metrics, raw_config, run_workdir

from grpo_core.config.loader import validate
from grpo_core.training.run import run_training

REWARDS = (
    "def even_first(completion_ids, **kwargs):\n"
    "    return [float(ids[0] % 2 == 0) if ids else 0.0 for ids in completion_ids]\n"
)

# float32 on CPU: inductor fuses and reorders reductions; measured differences are ~1e-6 relative.
LOSS_RTOL, LOSS_ATOL = 1e-3, 1e-5


def config(tmp: Path, model: str, out: str, adapter: str | None, **top) -> object:
    raw = raw_config(
        model,
        tmp,
        out=out,
        adapter=adapter,
        lora_r=4,
        lora_alpha=8,
        sequence_len=64,
        micro_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=2,
        learning_rate=5e-3,
        lr_scheduler="constant",
        seed=3,
        save_steps=1,
        trl={
            "num_generations": 4,
            "max_completion_length": 4,
            "reward_funcs": ["compile_rewards.even_first"],
            "temperature": 1.0,
            "num_iterations": 2,
        },
    )
    return validate(merged(raw, **top))


@pytest.fixture()
def tiny(tiny_model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    run_workdir(tmp_path, [{"prompt": f"Item {i}:"} for i in range(8)], {"compile_rewards": REWARDS}, monkeypatch)
    return tiny_model_dir


@pytest.mark.slow
@pytest.mark.parametrize("adapter", ["lora", pytest.param(None, marks=pytest.mark.extended)], ids=["lora", "full"])
def test_compiled_run_matches_eager_and_its_checkpoint_resumes_eager(
    tiny: str, tmp_path: Path, adapter: str | None
) -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    assert run_training(config(tmp_path, tiny, "eager", adapter)) == "completed"
    assert counters["stats"]["unique_graphs"] == 0, "the eager run compiled something"

    assert run_training(config(tmp_path, tiny, "compiled", adapter, torch_compile=True)) == "completed"
    assert counters["stats"]["unique_graphs"] >= 1, "torch_compile = true compiled no graph"
    assert counters["frames"]["ok"] >= 1

    eager, compiled = metrics(tmp_path / "eager"), metrics(tmp_path / "compiled")
    assert [r["step"] for r in compiled] == [1, 2]
    for a, b in zip(eager, compiled, strict=True):
        assert b.get("reward") == a.get(
            "reward"
        )  # step 1's rollout precedes any update; step 2 reuses it (num_iterations 2)
        for key in ("loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=LOSS_RTOL, abs=LOSS_ATOL), (key, a["step"])
    assert compiled[1]["grad_norm"] > 0 and abs(compiled[1]["loss"]) > 1e-3  # step 2 (ratio != 1) is a real comparison

    # The compiled run's checkpoint, resumed without compile: same keys, loads, trains.
    from safetensors.torch import load_file

    name = "adapter_model.safetensors" if adapter else "model.safetensors"
    saved = load_file(str(tmp_path / "compiled" / "checkpoint-1" / "model" / name))
    assert not [k for k in saved if "_orig_mod" in k]
    assert saved.keys() == load_file(str(tmp_path / "eager" / "checkpoint-1" / "model" / name)).keys()
    resumed = config(
        tmp_path, tiny, "resumed", adapter, resume_from_checkpoint=str(tmp_path / "compiled" / "checkpoint-1")
    )
    assert run_training(resumed) == "completed"
    (step2,) = metrics(tmp_path / "resumed")
    assert step2["loss"] == pytest.approx(compiled[1]["loss"], rel=LOSS_RTOL, abs=LOSS_ATOL)


def test_unknown_backend_is_refused_by_config_check(tiny: str, tmp_path: Path) -> None:
    from grpo_core.contract.errors import ConfigError
    from grpo_core.validation.run_check import check_run_config

    with pytest.raises(ConfigError, match="torch_compile_backend = 'nope'.*inductor"):
        check_run_config(config(tmp_path, tiny, "x", "lora", torch_compile=True, torch_compile_backend="nope"))
    warnings = check_run_config(config(tmp_path, tiny, "x", "lora", torch_compile_mode="max-autotune"))
    assert any("no effect without torch_compile" in w for w in warnings)
