"""``trl.rollout_func``'s ``env_mask`` through real runs on the tiny model
(tests/tiny_model.py): environment tokens get no gradient, zero-advantage rows
and shared prompts change nothing with episodes, a bad mask is named, two
processes match one. The loss mask's arithmetic, in process, is
tests/unit/test_loss_mask.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import merged, metrics, raw_config, run_workdir, weights

from grpo_core.contract.errors import GrpoError
from grpo_core.contract.types import Prompt

# ---------------------------------------------------------------- trl.rollout_func's env_mask, real runs

# A deterministic rollout (no sampling): every run sees the same episodes.
# Prompts "Item i"; sample k of prompt i is a model turn, an environment
# reply (interior, mask 0), a second model turn, then (``tail``) a closing
# environment message (trailing, mask 0) whose ids depend on ``tail``.
ENV = """
def _ids(seed, n, base):
    return [base + (seed * 7 + j * 13) % 800 for j in range(n)]

def _rollout(prompts, trainer, interior, tail):
    tok = trainer.processing_class
    out = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": [], "env_score": []}
    for p in prompts:
        ids = tok.encode(p, add_special_tokens=False)
        i = int(p.split()[1].rstrip(":"))
        for k in range(trainer.num_generations):
            seed = i * 31 + k * 17
            parts = [(_ids(seed, 2 + i % 3, 100), 1)]  # episodes of different lengths
            if interior:
                parts += [(_ids(seed + 1, 2, 2000), 0), (_ids(seed + 2, 2, 100) + [tok.eos_token_id], 1)]
            if tail is not None:
                parts.append((_ids(seed + tail, 3, 3000), 0))
            completion = [t for seg, _ in parts for t in seg]
            out["prompt_ids"].append(list(ids))
            out["completion_ids"].append(completion)
            out["logprobs"].append([-10.8 if m else 0.0 for seg, m in parts for _ in seg])  # ~ the tiny model's
            out["env_mask"].append([m for seg, m in parts for _ in seg])
            out["env_score"].append([0.0, 1.0, 0.5, 0.5][k])  # samples 2 and 3 of every group: advantage 0
    return out

def tail_a(prompts, trainer):
    return _rollout(prompts, trainer, interior=False, tail=5)

def tail_b(prompts, trainer):
    return _rollout(prompts, trainer, interior=False, tail=400)

def no_tail(prompts, trainer):
    out = _rollout(prompts, trainer, interior=False, tail=None)
    del out["env_mask"]
    return out

def episodes(prompts, trainer):
    return _rollout(prompts, trainer, interior=True, tail=5)

def bad_length(prompts, trainer):
    out = _rollout(prompts, trainer, interior=True, tail=None)
    out["env_mask"][2] = out["env_mask"][2][:-1]
    return out

def bad_value(prompts, trainer):
    out = _rollout(prompts, trainer, interior=True, tail=None)
    out["env_mask"][1][0] = 2
    return out

def env_reward(completions, env_score, **kwargs):
    assert "env_mask" not in kwargs, "env_mask is not a reward column"
    return list(env_score)
"""


@pytest.fixture(scope="module")
def rundir(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    rows = [{"prompt": f"Item {i}:"} for i in range(8)]
    return run_workdir(tmp_path_factory.mktemp("mask-runs"), rows, {"mask_env": ENV}), tiny_model_dir


def _run(rundir: tuple[Path, str], name: str, func: str, monkeypatch: pytest.MonkeyPatch, **trl) -> Path:
    from grpo_core.config.loader import validate
    from grpo_core.training.run import run_training

    tmp, model = rundir
    monkeypatch.syspath_prepend(str(tmp))
    top = trl.pop("top", {})
    raw = raw_config(
        model,
        tmp,
        out=name,
        sequence_len=64,
        micro_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=2,
        learning_rate=5e-3,
        lr_scheduler="constant",
        seed=3,
        save_steps=100,
        trl={
            "num_generations": 4,
            "max_completion_length": 16,
            "rollout_func": f"mask_env.{func}",
            "reward_funcs": ["mask_env.env_reward"],
            **trl,
        },
    )
    cfg = validate(merged(raw, **top))
    assert run_training(cfg) == "completed"
    return tmp / name


# Batches of other shapes round float32 sums differently, and Adam divides by sqrt(v): a gradient entry
# near 0 turns that rounding into updates of up to ~3e-6 (seen once). Training environment tokens moves
# them far more: restoring `completion_mask[row, :c] = 1` put tail_a's weights 3.2e-2 from tail_b's.
ACROSS_SHAPES = {"rtol": 1e-4, "atol": 2e-5}


def _assert_same_weights(a: Path, b: Path, start: Path, **tol) -> None:
    wa, wb, w0 = weights(a), weights(b), weights(start)
    moved = 0.0
    for key in wa:
        torch.testing.assert_close(wb[key], wa[key], **tol)
        moved = max(moved, float((wa[key] - w0[key]).abs().max()))
    assert moved > 1e-4, "the weights did not move: the comparison proves nothing"


def test_rollout_func_env_mask_trains_only_the_model_tokens(rundir, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two real runs whose trailing environment tokens differ, and one without
    them, train to the same weights with the same losses (KL, IS correction,
    and num_iterations = 2: recomputed old log-probs, ratios away from 1):
    environment tokens got no gradient and counted nowhere."""
    trl = {"beta": 0.04, "vllm_importance_sampling_correction": True, "num_iterations": 2, "top": {"max_steps": 4}}
    a = _run(rundir, "tail_a", "tail_a", monkeypatch, **trl)
    b = _run(rundir, "tail_b", "tail_b", monkeypatch, **trl)
    plain = _run(rundir, "no_tail", "no_tail", monkeypatch, **trl)
    start = Path(rundir[1])
    _assert_same_weights(a, b, start, rtol=1e-5, atol=1e-7)
    _assert_same_weights(a, plain, start, **ACROSS_SHAPES)
    for ra, rb, rp in zip(metrics(a), metrics(b), metrics(plain), strict=True):
        for key in ("loss", "grad_norm", "kl", "is/importance_sampling_ratio/mean"):
            assert ra[key] == pytest.approx(rp[key], rel=1e-4, abs=1e-7), key
            assert ra[key] == pytest.approx(rb[key], rel=1e-5, abs=1e-8), key
    assert len(metrics(a)) == 4 and abs(metrics(a)[1]["loss"]) > 1e-6


def test_zero_advantage_rows_and_shared_prompts_with_episodes_change_nothing(rundir, monkeypatch) -> None:
    """Episodes with interior environment tokens: leaving zero-advantage rows
    out (dapo) and running each prompt once give the plain path's weights."""

    def run(name: str, drop: bool, share: bool) -> Path:
        return _run(
            rundir, name, "episodes", monkeypatch, skip_zero_advantage_batches=drop, top={"share_prompt_prefix": share}
        )

    base, dropped, shared = run("ep_plain", False, False), run("ep_dropped", True, False), run("ep_shared", False, True)
    assert metrics(dropped)[-1]["skipped_zero_adv_samples"] > 0, "rows were left out"
    assert metrics(base)[-1]["skipped_zero_adv_samples"] == 0
    start = Path(rundir[1])
    _assert_same_weights(base, dropped, start, **ACROSS_SHAPES)
    _assert_same_weights(base, shared, start, **ACROSS_SHAPES)


@pytest.mark.parametrize(
    ("func", "message"),
    [
        ("bad_length", r"trl.rollout_func 'mask_env.bad_length' entry 2: 6 env_mask values for 7 completion tokens"),
        ("bad_value", r"trl.rollout_func 'mask_env.bad_value' entry 1: env_mask holds 2; its values must be 1"),
    ],
)
def test_rollout_func_bad_env_mask_is_named(rundir, monkeypatch: pytest.MonkeyPatch, func: str, message: str) -> None:
    with pytest.raises(GrpoError, match=message):
        _run(rundir, func, func, monkeypatch)


def test_two_processes_with_episodes_match_one(rundir) -> None:
    """DDP (2 processes, gloo) on masked episodes: each rank's dapo normaliser
    is the global count of policy tokens, so losses, gradient norms and
    weights match one process on the same global batch."""
    from test_multiprocess import run_grpo, write_config

    tmp, model = rundir
    trl = {
        "rollout_func": "mask_env.episodes",
        "reward_funcs": ["mask_env.env_reward"],
        "max_completion_length": 16,
        "beta": 0.04,
    }
    one = write_config(tmp, "ddp_one", model, gradient_accumulation_steps=2, trl=dict(trl))  # 1 x 2 x 2 completions
    two = write_config(tmp, "ddp_two", model, trl=dict(trl))  # 2 processes x 2 x 1
    run_grpo(tmp, ["run", str(one)])
    run_grpo(tmp, ["run", str(two), "--num-processes", "2"])
    a, b = metrics(tmp / "ddp_one"), metrics(tmp / "ddp_two")
    assert [r["world_size"] for r in b] == [2, 2]
    # output_dir was locked once, by rank 0 (the other rank ran beside it): one run recorded, no lock left
    runs = [json.loads(line) for line in (tmp / "ddp_two" / "lineage.jsonl").read_text().splitlines()]
    assert [(r["event"], r.get("status")) for r in runs] == [("start", None), ("end", "completed")]
    assert not (tmp / "ddp_two" / "run.lock").exists()
    for ra, rb in zip(a, b, strict=True):
        assert rb["reward"] == ra["reward"]
        for key in ("loss", "grad_norm", "kl"):
            assert rb[key] == pytest.approx(ra[key], rel=1e-4, abs=1e-7), key
        assert ra["grad_norm"] > 0
    _assert_same_weights(tmp / "ddp_one", tmp / "ddp_two", Path(model), rtol=1e-4, atol=1e-6)


def test_rollout_func_episode_length_counts_environment_tokens(rundir, smollm2_tokenizer, monkeypatch) -> None:
    """``truncated`` compares the whole episode (environment tokens included)
    with max_completion_length; env_mask becomes the loss mask and no column."""
    from grpo_core.config.loader import validate
    from grpo_core.contract.context import RunContext
    from grpo_core.contract.types import SamplingSettings
    from grpo_plugins.rollout_function import FunctionRollout

    monkeypatch.syspath_prepend(str(rundir[0]))
    cfg = validate({"base_model": "unused", "trl": {"rollout_func": "mask_env.episodes", "num_generations": 4}})
    rollout = FunctionRollout(RunContext(config=cfg, output_dir=rundir[0], tokenizer=smollm2_tokenizer))
    prompt = Prompt("Item 1:", smollm2_tokenizer.encode("Item 1:", add_special_tokens=False))
    # "Item 1:" episodes: 3 model, 2 environment, 3 model (EOS last), 3 environment tokens: 11, 6 the model's
    for max_tokens in (11, 12):
        groups = rollout.grpo_rollout_generate(
            prompts=[prompt], num_generations=4, policy_version=0, sampling=SamplingSettings(max_tokens=max_tokens)
        )
        for c in groups[0].completions:
            assert c.loss_mask is not None and len(c.loss_mask) == len(c.token_ids)
            assert c.model_token_count == 3 + 3 and "env_mask" not in c.extra and "env_score" in c.extra
            assert c.truncated == (len(c.token_ids) >= max_tokens)
        assert {c.truncated for c in groups[0].completions} == ({True} if max_tokens <= 11 else {False})
