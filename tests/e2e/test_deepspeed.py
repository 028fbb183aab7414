"""DeepSpeed ZeRO-2 / ZeRO-3 through accelerate (``deepspeed = "zero2.json"``), 2 processes over gloo.

Real processes (``grpo run --num-processes 2``: accelerate's launcher), the real
DeepSpeed engine on CPU, the tiny model (tests/tiny_model.py) and a deterministic
rollout. GPUs and NCCL cannot run here; gloo runs the same collectives.

The batches are chosen so that every step exercises one rule of grpo's step
(2 processes x 2 micro-batches of one group each; prompts in order, 4 per step):

* step 1: each rank has one micro-batch without learning signal, but the other
  rank has signal there: both ranks train both (agreed skipping);
* step 2: both ranks' *last* micro-batch has no signal and is skipped: the
  accumulation boundary must fall on the first (a boundary set on the last
  index would never reduce the gradients);
* step 3: no micro-batch has signal anywhere: the engine must not step;
* step 4: everything trains.

That schedule is of whole micro-batches: the full fine-tuning test runs
``loss_type = "grpo"``, whose per-micro-batch normalisation keeps
zero-advantage completions in. The LoRA test runs the default ``dapo``,
under which each rank leaves its zero-advantage completions out and keeps
just enough of them to run as many micro-batches as the other (step 2: one
rank trains its one group with signal, the other one zero-advantage row).

Each run is compared with one process without DeepSpeed on the same global batch
(gradient_accumulation_steps 4): loss and grad norm per step within rel 1e-4
and the final weights within rtol 1e-4 / atol 1e-6 (float32; only the summation
order differs; measured: grad norm within rel 2e-6, weights within 3.4e-7).
The loss of these on-policy steps is 0 by construction (ratio 1, advantages
summing to 0 over equal-length groups), so the grad norm and the weights carry
the comparison: with DeepSpeed left to divide the loss by its own
gradient_accumulation_steps the ZeRO-2 test fails on the grad norm (1.04 vs
2.08); stepping the engine on a step that trained nothing, or setting the
boundary on the last micro-batch instead of the last trained one, fail it too.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from helpers import metrics, run_workdir
from test_multiprocess import ROLLOUT, run_grpo, weights_of, write_config

# the `test` extra installs deepspeed; only the launched runs import it (not this process)
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")

SIGNAL = {0, 3, 4, 12, 13, 14}  # prompts whose group has a learning signal (see the module docstring)

ENV = (
    f"SIGNAL = {sorted(SIGNAL)!r}\n"
    + ROLLOUT
    + """
def gated(completion_ids, prompts, **kwargs):
    # the two completions of a group differ in parity (17 x 3 apart): a signal exactly where SIGNAL says
    return [
        float(sum(ids) % 2) if int(p.split()[1].rstrip(":")) in SIGNAL else 1.0
        for ids, p in zip(completion_ids, prompts)
    ]
"""
)

ZERO2 = {
    "zero_optimization": {"stage": 2},
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"},
}
ZERO3 = {
    "zero_optimization": {
        "stage": 3,
        "stage3_param_persistence_threshold": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "reduce_bucket_size": "auto",
    },
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
}


def common(**extra) -> dict:
    trl = {
        "rollout_func": "ds_env.rollout",
        "reward_funcs": ["ds_env.gated"],
        "skip_zero_advantage_batches": True,
        "loss_type": "grpo",
        **extra.pop("trl", {}),
    }
    return {
        "max_steps": 4,
        "save_steps": 2,
        "gradient_accumulation_steps": 2,
        "shuffle_dataset": False,
        "max_grad_norm": 0.5,
        **extra,
        "trl": trl,
    }


@pytest.fixture
def dsdir(tiny_model_dir: str, tmp_path: Path) -> tuple[Path, str]:
    run_workdir(tmp_path, [{"prompt": f"Item {i}:"} for i in range(16)], {"ds_env": ENV})
    (tmp_path / "zero2.json").write_text(json.dumps(ZERO2))
    (tmp_path / "zero3.json").write_text(json.dumps(ZERO3))
    return tmp_path, tiny_model_dir


def math(record: dict) -> dict:
    """A step's metrics but wall-clock timings and alerts (a health alert fires once per run)."""
    return {k: v for k, v in record.items() if k != "step_time" and not k.startswith(("time/", "alerts/"))}


GRPO_LOSS_SKIPS = {"skipped_zero_adv_batches": [0, 1, 3, 3]}  # whole micro-batches only (cumulative, rank 0)
# dapo: rank 0 leaves out its zero group on step 1 and 2, both on step 3; the top-ups are rank 1's
DAPO_SKIPS = {"skipped_zero_adv_batches": [1, 2, 4, 4], "skipped_zero_adv_samples": [2, 4, 8, 8]}


def assert_matches_one_process(
    tmp: Path, sharded: str, single: str, world: int = 2, skips: dict[str, list[int]] = GRPO_LOSS_SKIPS
) -> list[dict]:
    a, c = metrics(tmp / sharded), metrics(tmp / single)
    assert [r["world_size"] for r in a] == [float(world)] * 4 and [r["world_size"] for r in c] == [1.0] * 4
    for ra, rc in zip(a, c, strict=True):
        assert ra["reward"] == rc["reward"]
        assert ra["loss"] == pytest.approx(rc["loss"], rel=1e-4, abs=1e-6)
        assert ra["grad_norm"] == pytest.approx(rc["grad_norm"], rel=1e-4, abs=1e-7)
    # the schedule of signal the module docstring describes
    assert [r["grad_norm"] > 0 for r in a] == [True, True, False, True]
    if world == 2:
        for key, expected in skips.items():
            assert [r[key] for r in a] == expected, key
    wa, wc = weights_of(tmp / sharded), weights_of(tmp / single)
    assert wa.keys() == wc.keys()
    for key in wa:
        torch.testing.assert_close(wa[key], wc[key], rtol=1e-4, atol=1e-6)
    start = weights_of(tmp / single / "checkpoint-2" / "model")
    moved = max(float((wc[k] - start[k]).abs().max()) for k in wc)
    assert moved > 1e-4, "the weights did not move after the checkpoint: the comparison proves little"
    return a


@pytest.mark.extended  # two 2-process DeepSpeed runs and their resumes (~80 s); the ZeRO-3 LoRA test runs in the
# default tier
@needs_deepspeed
def test_zero2_and_zero3_full_finetune_match_one_process_and_resume_exactly(dsdir: tuple[Path, str]) -> None:
    tmp, model = dsdir
    sharded = write_config(tmp, "zero2", model, **common(deepspeed=str(tmp / "zero2.json")))
    single = write_config(tmp, "single", model, **common(gradient_accumulation_steps=4))
    run_grpo(tmp, ["run", str(sharded), "--num-processes", "2"])
    run_grpo(tmp, ["run", str(single)])
    a = assert_matches_one_process(tmp, "zero2", "single")
    assert (tmp / "zero2" / "checkpoint-2" / "deepspeed").is_dir()
    # one process (the engine in a process group of one), ZeRO-3 full fine-tuning: the full weights gathered
    # for checkpoints and the final model are the trained ones
    alone = write_config(
        tmp, "zero3_alone", model, **common(deepspeed=str(tmp / "zero3.json"), gradient_accumulation_steps=4)
    )
    run_grpo(tmp, ["run", str(alone)])
    assert_matches_one_process(tmp, "zero3_alone", "single", world=1)
    torch.testing.assert_close(
        weights_of(tmp / "zero3_alone" / "checkpoint-2" / "model"),
        weights_of(tmp / "single" / "checkpoint-2" / "model"),
        rtol=1e-4,
        atol=1e-6,
    )

    resumed = write_config(
        tmp,
        "zero2_resumed",
        model,
        **common(deepspeed=str(tmp / "zero2.json")),
        resume_from_checkpoint=str(tmp / "zero2" / "checkpoint-2"),
    )
    assert_resumes_exactly(tmp, resumed, "zero2", a)


def assert_resumes_exactly(tmp: Path, resumed_config: Path, straight: str, straight_metrics: list[dict]) -> None:
    """Resumed from the straight run's step 2 on 2 processes: steps 3-4 equal the straight run's, weights bit-equal."""
    run_grpo(tmp, ["run", str(resumed_config), "--num-processes", "2"])
    b = metrics(tmp / f"{straight}_resumed")
    assert [r["step"] for r in b] == [3, 4]
    for ra, rb in zip(straight_metrics[2:], b, strict=True):
        assert math(rb) == math(ra)
    wa, wb = weights_of(tmp / straight), weights_of(tmp / f"{straight}_resumed")
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key


@needs_deepspeed
def test_zero3_lora_with_async_prefetch_matches_one_process_and_resumes_exactly(dsdir: tuple[Path, str]) -> None:
    """ZeRO-3 partitions the parameters: the checkpoints' weights are gathered; the prefetch thread issues no
    collectives (a hang here would be the deadlock the reference warns of)."""
    tmp, model = dsdir
    # gradient checkpointing: reentrant under ZeRO-3 (grpo's default there), non-reentrant in the 1-process run
    lora = {"adapter": "lora", "lora_r": 4, "lora_alpha": 8, "learning_rate": 5e-2, "gradient_checkpointing": True}
    dapo = {"loss_type": "dapo"}  # zero-advantage completions left out (module docstring)
    sharded = write_config(
        tmp, "zero3", model, **common(deepspeed=str(tmp / "zero3.json"), **lora, trl={"async_prefetch": True, **dapo})
    )
    single = write_config(tmp, "single", model, **common(gradient_accumulation_steps=4, **lora, trl=dapo))
    run_grpo(tmp, ["run", str(sharded), "--num-processes", "2"])
    run_grpo(tmp, ["run", str(single)])
    a = assert_matches_one_process(tmp, "zero3", "single", skips=DAPO_SKIPS)

    resumed = write_config(
        tmp,
        "zero3_resumed",
        model,
        **common(deepspeed=str(tmp / "zero3.json"), **lora, trl={"async_prefetch": True, **dapo}),
        resume_from_checkpoint=str(tmp / "zero3" / "checkpoint-2"),
    )
    assert_resumes_exactly(tmp, resumed, "zero3", a)
