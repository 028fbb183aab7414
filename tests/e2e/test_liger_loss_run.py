"""The Liger loss in a real run (the trainer's wiring: hidden states, head,
IS weights, old log-probs of ``num_iterations = 2``): two steps on the tiny
model give the built-in loss's losses and grad norms. The loss itself against
the built-in one, in process, is tests/unit/test_liger_loss.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.mark.slow
def test_a_run_with_the_liger_loss_trains_like_the_builtin_one(
    tiny_model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer's wiring (hidden states, head, IS weights, old log-probs of
    num_iterations = 2): 2 steps on the tiny model, same losses and grad norms."""
    pytest.importorskip("liger_kernel.chunked_loss", reason="liger-kernel is not installed (gpu extra)")
    from helpers import metrics, raw_config, run_workdir

    from grpo_core.config.loader import validate
    from grpo_core.training.run import run_training

    rewards = (
        "def even_first(completion_ids, **kwargs):\n"
        "    return [float(ids[0] % 2 == 0) if ids else 0.0 for ids in completion_ids]\n"
    )
    run_workdir(tmp_path, [{"prompt": f"Item {i}:"} for i in range(8)], {"liger_rewards": rewards}, monkeypatch)
    model = tiny_model_dir

    def run(out: str, liger: bool) -> list[dict]:
        cfg = validate(
            raw_config(
                model,
                tmp_path,
                out=out,
                sequence_len=64,
                micro_batch_size=4,
                gradient_accumulation_steps=2,
                max_steps=2,
                learning_rate=5e-3,
                lr_scheduler="constant",
                seed=3,
                trl={
                    "num_generations": 4,
                    "max_completion_length": 4,
                    "reward_funcs": ["liger_rewards.even_first"],
                    "num_iterations": 2,
                    "beta": 0.04,
                    "use_liger_loss": liger,
                },
            )
        )
        assert run_training(cfg) == "completed"
        return metrics(tmp_path / out)

    ours, liger = run("grpo", False), run("liger", True)
    for a, b in zip(ours, liger, strict=True):
        for key in ("loss", "grad_norm", "kl"):
            if key == "loss" and a["step"] == 1:
                # the step's first iteration: ratios 1 and the policy still the reference, so the
                # loss is -mean(advantages) = 0 up to float32 rounding in both (which samples
                # decide); the step's signal is in its grad norm, compared below
                assert abs(a[key]) < 1e-6 and abs(b[key]) < 1e-6, (a[key], b[key])
                continue
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-7), (key, a["step"])
    assert ours[0]["grad_norm"] > 1e-3
    assert abs(liger[1]["loss"]) > 1e-4 and "entropy" not in liger[1]
