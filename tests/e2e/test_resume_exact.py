"""Resume is exact: a run resumed from a checkpoint trains the same steps,
to the same metrics and weights, as the run that never stopped.

On the tiny model (tests/tiny_model.py), with everything that carries
state across steps switched on: warmup + cosine schedule,
``adamw_torch_fused`` (torch's fused AdamW, which runs on CPU too), the
replay buffer, re-rolling from step 0, and ``num_iterations = 2`` with the
checkpoint taken in the middle of a batch (the pending batch and its old
log-probs must come back as they were).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import merged, metrics, raw_config, run_workdir, weights

from grpo_core.config.loader import validate
from grpo_core.training.run import run_training

# Rare reward: most groups are all-zero, so the replay buffer substitutes
# groups and re-roll queues prompts at every step.
REWARDS = (
    "def rare(completion_ids, **kwargs):\n"
    "    return [float(ids[0] % 5 == 0) if ids else 0.0 for ids in completion_ids]\n"
)


def config(tmp: Path, model: str, out: str, **top):
    raw = raw_config(
        model,
        tmp,
        out=out,
        adapter=None,
        sequence_len=64,
        micro_batch_size=8,
        gradient_accumulation_steps=2,
        max_steps=7,
        learning_rate=5e-3,
        lr_scheduler="cosine",
        warmup_steps=2,
        optimizer="adamw_torch_fused",
        weight_decay=0.01,
        seed=5,
        save_steps=3,
        trl={
            "num_generations": 4,
            "max_completion_length": 4,
            "reward_funcs": ["resume_rewards.rare"],
            "temperature": 1.0,
            "num_iterations": 2,
            "replay_buffer_size": 4,
            "reroll_start_fraction": 0.0,
            "reroll_max_groups": 1,
        },
    )
    return validate(merged(raw, **top))


def test_split_run_equals_straight_run(tiny_model_dir: str, tmp_path: Path, monkeypatch) -> None:
    run_workdir(tmp_path, [{"prompt": f"Item {i}:"} for i in range(10)], {"resume_rewards": REWARDS}, monkeypatch)
    model = tiny_model_dir

    assert run_training(config(tmp_path, model, "straight")) == "completed"
    # checkpoint-3: after the first iteration of the second batch (num_iterations = 2)
    resumed = config(tmp_path, model, "resumed", resume_from_checkpoint=str(tmp_path / "straight" / "checkpoint-3"))
    assert run_training(resumed) == "completed"

    straight, split = metrics(tmp_path / "straight"), metrics(tmp_path / "resumed")
    assert [r["step"] for r in split] == [4, 5, 6, 7]
    assert any(r.get("replay/replayed_groups", 0) > 0 for r in straight), "replay never engaged: the test proves less"

    # Same process kind, same CPU kernels, same seeds: the math allows bit-exact, so that is what is asserted.
    def math(record: dict) -> dict:  # everything but wall-clock timings
        return {k: v for k, v in record.items() if k != "step_time" and not k.startswith("time/")}

    for a, b in zip(straight[3:], split, strict=True):
        assert math(a) == math(b)

    wa, wb = weights(tmp_path / "straight"), weights(tmp_path / "resumed")
    assert wa.keys() == wb.keys()
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key


# ---------------------------------------------------------------- the global RNG


def test_resume_restores_the_global_rng_dropout_sees_it(tiny_model_dir: str, tmp_path: Path, monkeypatch) -> None:
    """The run above draws nothing from the global RNG (rollouts are seeded
    per request), so it passes without the RNG restore. Here LoRA dropout
    draws its masks from torch's global generator at every training forward:
    the resumed run matches the straight one only if the checkpoint's RNG
    state comes back (``checkpoint.set_rng_state``); reseeding from
    ``seed`` at start, which every run does, would give other masks."""
    run_workdir(tmp_path, [{"prompt": f"Item {i}:"} for i in range(10)], {"resume_rewards": REWARDS}, monkeypatch)
    model = tiny_model_dir

    def dropout_config(out: str, **top):
        raw = raw_config(
            model,
            tmp_path,
            out=out,
            adapter="lora",
            lora_r=4,
            lora_alpha=8,
            lora_dropout=0.5,
            sequence_len=64,
            micro_batch_size=8,
            max_steps=4,
            learning_rate=5e-2,
            optimizer="adamw_torch",
            seed=5,
            save_steps=2,
            trl={
                "num_generations": 4,
                "max_completion_length": 4,
                "reward_funcs": ["resume_rewards.rare"],
                "temperature": 1.0,
            },
        )
        return validate(merged(raw, **top))

    assert run_training(dropout_config("straight")) == "completed"
    resumed = dropout_config("resumed", resume_from_checkpoint=str(tmp_path / "straight" / "checkpoint-2"))
    assert run_training(resumed) == "completed"

    straight, split = metrics(tmp_path / "straight"), metrics(tmp_path / "resumed")
    assert [r["step"] for r in split] == [3, 4]
    for a, b in zip(straight[2:], split, strict=True):
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"], (a, b)
    from safetensors.torch import load_file

    wa = load_file(str(tmp_path / "straight" / "adapter_model.safetensors"))
    wb = load_file(str(tmp_path / "resumed" / "adapter_model.safetensors"))
    assert wa.keys() == wb.keys() and wa
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key


# ---------------------------------------------------------------- async_prefetch

# A rollout_func that samples from the *starting* weights (an engine that is
# never synced), seeded by the request's seed: the same request gives the same
# completions in any run and in any thread, so the straight run is
# deterministic although generation overlaps training. It logs every call
# (seed, completion ids), which is how the test sees what was generated when.
ASYNC_ENV = """
import json
import pytest
import torch

MODEL = None  # the frozen sampler, set by the test
LOG = None  # path of the call log, set by the test


def frozen(prompts, trainer):
    tok, n, sampling = trainer.processing_class, trainer.num_generations, trainer.sampling
    generator = torch.Generator().manual_seed(sampling.seed)
    out = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
    with torch.no_grad():
        for prompt in prompts:
            ids = tok.encode(prompt, add_special_tokens=False)
            seqs = torch.tensor([ids] * n)
            logps = []
            for _ in range(sampling.max_tokens):
                logits = MODEL(seqs).logits[:, -1].float() / sampling.temperature
                dist = torch.log_softmax(logits, dim=-1)
                token = torch.multinomial(dist.exp(), 1, generator=generator)
                logps.append(dist.gather(1, token))
                seqs = torch.cat([seqs, token], dim=1)
            lp = torch.cat(logps, dim=1)
            for j in range(n):
                out["prompt_ids"].append(ids)
                out["completion_ids"].append(seqs[j, len(ids):].tolist())
                out["logprobs"].append(lp[j].tolist())
    with open(LOG, "a") as handle:
        handle.write(json.dumps({"seed": sampling.seed, "completion_ids": out["completion_ids"]}) + "\\n")
    return out


def even(completion_ids, **kwargs):
    return [sum(t % 2 == 0 for t in ids) / max(1, len(ids)) for ids in completion_ids]
"""


def async_config(tmp: Path, model: str, out: str, depth: int, iterations: int, **top):
    raw = raw_config(
        model,
        tmp,
        out=out,
        adapter=None,
        sequence_len=64,
        micro_batch_size=8,
        gradient_accumulation_steps=1,
        max_steps=7,
        learning_rate=5e-3,
        optimizer="adamw_torch",
        seed=5,
        save_steps=3,
        trl={
            "num_generations": 4,
            "max_completion_length": 4,
            "reward_funcs": ["async_env.even"],
            "rollout_func": "async_env.frozen",
            "temperature": 1.0,
            "num_iterations": iterations,
            "async_prefetch": True,
            "prefetch_depth": depth,
            "log_completions": True,
        },
    )
    return validate(merged(raw, **top))


def calls(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


@pytest.mark.parametrize("iterations", [1, 2], ids=["between-batches", "mid-batch"])
def test_async_split_run_equals_straight_run(tiny_model_dir: str, tmp_path: Path, monkeypatch, iterations: int) -> None:
    """With ``async_prefetch`` the checkpoint at step 3 is taken while the
    prefetch thread holds (or is making) the batch for a later step. It is
    saved with the checkpoint and trained on after resume, not generated
    again, so the resumed run logs the same per-step values (rewards,
    advantages, loss, IS and staleness metrics) and ends with the same
    weights as the straight run.

    ``prefetch_depth = 1``: the thread starts a batch exactly when the trainer
    takes the one before, so the straight run is itself reproducible (with a
    deeper prefetch, when a batch starts, hence its policy version, depends on
    timing). mid-batch: ``num_iterations = 2``, the checkpoint in the middle
    of a batch: the pending and the prefetched batch are saved together."""
    import importlib

    from transformers import AutoModelForCausalLM

    from grpo_core.checkpointing.safe_load import safe_load

    run_workdir(tmp_path, [{"prompt": f"Item {i}:"} for i in range(10)], {"async_env": ASYNC_ENV}, monkeypatch)
    model = tiny_model_dir
    env = importlib.import_module("async_env")
    env.MODEL = AutoModelForCausalLM.from_pretrained(model).eval()

    env.LOG = str(tmp_path / "straight-calls.jsonl")
    assert run_training(async_config(tmp_path, model, "straight", 1, iterations)) == "completed"
    checkpoint = tmp_path / "straight" / "checkpoint-3"
    env.LOG = str(tmp_path / "resumed-calls.jsonl")
    resumed = async_config(tmp_path, model, "resumed", 1, iterations, resume_from_checkpoint=str(checkpoint))
    assert run_training(resumed) == "completed"

    straight, split = metrics(tmp_path / "straight"), metrics(tmp_path / "resumed")
    assert [r["step"] for r in split] == [4, 5, 6, 7]
    # One batch ahead: batch b is sampled from the policy of the step that took batch b - 1.
    versions = [straight[b * iterations]["policy_version"] for b in range(len(straight) // iterations)]
    assert versions == [max(0, (b - 1) * iterations) for b in range(len(versions))], versions
    assert any(k.startswith("is/") for k in split[0]), "no importance-sampling metrics: the test proves less"

    def math(record: dict) -> dict:  # everything but wall-clock timings
        return {k: v for k, v in record.items() if k != "step_time" and not k.startswith("time/")}

    # Same process, same CPU kernels, same seeds: bit-exact is what the math allows, so it is asserted.
    for a, b in zip(straight[3:], split, strict=True):
        assert math(a) == math(b), a["step"]

    wa, wb = weights(tmp_path / "straight"), weights(tmp_path / "resumed")
    assert wa.keys() == wb.keys()
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key

    # The checkpoint holds the batch the thread had made for step 4 (finished before saving).
    saved = safe_load(checkpoint / "extra_state.pt")["prefetched_batches"]
    consumed = -(-3 // iterations)  # batches the trainer had taken by step 3
    straight_calls, resumed_calls = calls(tmp_path / "straight-calls.jsonl"), calls(tmp_path / "resumed-calls.jsonl")
    assert len(saved) == 1
    assert [c.token_ids for g in saved[0].groups for c in g.group.completions] == straight_calls[consumed][
        "completion_ids"
    ]
    # No generation for it after resume: the first call is the batch after it.
    assert straight_calls[consumed]["seed"] not in {c["seed"] for c in resumed_calls}, (
        "the saved batch was generated again"
    )
    assert resumed_calls[0] == straight_calls[consumed + 1]

    # The first batch trained after resume is the saved one: same completions, advantages, policy version.
    def rows(out: Path) -> list[dict]:
        return [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]

    # (a resumed run also logs the rows of the batch it resumed in the middle of; those are left out)
    fresh_rows = [r for r in rows(tmp_path / "resumed") if (r["step"] - 1) % iterations == 0]
    assert [r for r in rows(tmp_path / "straight") if r["step"] > 3] == fresh_rows
    assert fresh_rows[0]["policy_version"] == saved[0].policy_version


def test_a_run_stopped_by_a_failure_under_async_prefetch_keeps_the_batch_made_ahead(
    tiny_model_dir: str, tmp_path: Path, monkeypatch
) -> None:
    """The third way an async run stops (after periodic saves and signals): a
    failure. The sync after step 3 raises; the checkpoint the run leaves
    holds the batch the prefetch thread had made for step 4, and the resumed
    run trains it first, never generating it again, to the same values and
    weights as a run that never failed."""
    import importlib

    from plugin_set import failing_sync_source, write_distribution
    from transformers import AutoModelForCausalLM

    from grpo_core.checkpointing.safe_load import safe_load
    from grpo_core.contract.errors import PluginError
    from grpo_core.host import plugin_host

    site = write_distribution(
        tmp_path / "site",
        "grpo_fails_at_3",
        failing_sync_source(3),
        "grpo-fails-at-3",
        "[grpo.weight_sync]\nfails_at_3 = grpo_fails_at_3:FailsAt\n",
    )
    run_workdir(tmp_path, [{"prompt": f"Item {i}:"} for i in range(10)], {"async_env": ASYNC_ENV}, monkeypatch)
    monkeypatch.syspath_prepend(str(site))
    plugin_host.rescan()
    try:
        model = tiny_model_dir
        env = importlib.import_module("async_env")
        env.MODEL = AutoModelForCausalLM.from_pretrained(model).eval()

        env.LOG = str(tmp_path / "straight-calls.jsonl")
        assert run_training(async_config(tmp_path, model, "straight", 1, 1, save_steps=100)) == "completed"
        env.LOG = str(tmp_path / "failed-calls.jsonl")
        failing = async_config(tmp_path, model, "failed", 1, 1, save_steps=100, plugins={"weight_sync": "fails_at_3"})
        with pytest.raises(PluginError, match="(?s)version 3.*stopped at step 3; checkpoint saved"):
            run_training(failing)
        checkpoint = tmp_path / "failed" / "checkpoint-3"
        env.LOG = str(tmp_path / "resumed-calls.jsonl")
        assert (
            run_training(async_config(tmp_path, model, "resumed", 1, 1, resume_from_checkpoint=str(checkpoint)))
            == "completed"
        )
    finally:
        plugin_host.rescan()

    straight_calls, resumed_calls = calls(tmp_path / "straight-calls.jsonl"), calls(tmp_path / "resumed-calls.jsonl")
    saved = safe_load(checkpoint / "extra_state.pt")["prefetched_batches"]
    assert len(saved) == 1  # the batch for step 4, made while step 3 trained
    assert [c.token_ids for g in saved[0].groups for c in g.group.completions] == straight_calls[3]["completion_ids"]
    assert straight_calls[3]["seed"] not in {c["seed"] for c in resumed_calls}, "the saved batch was generated again"
    assert resumed_calls[0] == straight_calls[4]

    def math(record: dict) -> dict:  # everything but wall-clock timings
        return {k: v for k, v in record.items() if k != "step_time" and not k.startswith(("time/", "sync/"))}

    straight, split = metrics(tmp_path / "straight"), metrics(tmp_path / "resumed")
    assert [r["step"] for r in split] == [4, 5, 6, 7]
    for a, b in zip(straight[3:], split, strict=True):
        assert math(a) == math(b), a["step"]
