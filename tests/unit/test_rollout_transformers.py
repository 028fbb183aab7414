"""The transformers rollout, on the real SmolLM2-135M-Instruct (fp32, CPU).

Tiny budgets: 2 chat prompts x 2 generations x 8 new tokens per call.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from grpo_core.config.loader import validate
from grpo_core.contract.context import RunContext
from grpo_core.contract.errors import ConfigError, GrpoError
from grpo_core.contract.types import Prompt, SamplingSettings
from grpo_core.host.plugin_host import PluginHost
from grpo_plugins.rollout_transformers import TransformersRollout

QUESTIONS = ["What is 2 + 3?", "Name a colour of the sky."]


@pytest.fixture(scope="module")
def model(smollm2_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer) -> list[Prompt]:
    out = []
    for i, question in enumerate(QUESTIONS):
        messages = [{"role": "user", "content": question}]
        encoded = smollm2_tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )
        ids = encoded["input_ids"]
        out.append(Prompt(prompt=messages, prompt_ids=list(ids), columns={"answer": str(i)}, index=i))
    # different lengths, so left padding is exercised
    assert len(out[0].prompt_ids) != len(out[1].prompt_ids)
    return out


def make_context(tmp_path: Path, model, tokenizer, **trl) -> RunContext:
    config = validate({"base_model": "unused", "trl": trl})
    return RunContext(config=config, output_dir=tmp_path, tokenizer=tokenizer, get_model=lambda: model)


def fresh_logprobs(model, prompt_ids: list[int], completion_ids: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of ``completion_ids`` from one unpadded forward pass."""
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    p = len(prompt_ids)
    step_logits = logits[p - 1 : p - 1 + len(completion_ids)] / temperature
    return torch.log_softmax(step_logits, dim=-1).gather(-1, torch.tensor(completion_ids)[:, None]).squeeze(-1)


def test_groups_shape_text_and_logprobs_match_a_fresh_forward(tmp_path, model, smollm2_tokenizer, prompts):
    rollout = TransformersRollout(make_context(tmp_path, model, smollm2_tokenizer))
    sampling = SamplingSettings(max_tokens=8, temperature=0.7, seed=1)
    groups = rollout.grpo_rollout_generate(prompts=prompts, num_generations=2, sampling=sampling, policy_version=5)

    assert [g.prompt for g in groups] == prompts
    eos = smollm2_tokenizer.eos_token_id
    for group in groups:
        assert group.policy_version == 5
        assert len(group.completions) == 2
        for c in group.completions:
            assert 1 <= len(c.token_ids) <= 8
            assert len(c.logprobs) == len(c.token_ids)
            assert c.text == smollm2_tokenizer.decode(c.token_ids, skip_special_tokens=True)
            # EOS only as the last token; truncated exactly when it is missing
            assert eos not in c.token_ids[:-1]
            assert c.truncated == (c.token_ids[-1] != eos)
            if c.truncated:
                assert len(c.token_ids) == 8
            expected = fresh_logprobs(model, group.prompt.prompt_ids, c.token_ids, temperature=0.7)
            torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-4, rtol=0)


def test_seed_makes_sampling_reproducible_and_leaves_global_rng_alone(tmp_path, model, smollm2_tokenizer, prompts):
    rollout = TransformersRollout(make_context(tmp_path, model, smollm2_tokenizer))

    def sample(seed):
        sampling = SamplingSettings(max_tokens=8, temperature=1.0, seed=seed)
        groups = rollout.grpo_rollout_generate(prompts=prompts, num_generations=2, sampling=sampling, policy_version=0)
        return [c.token_ids for g in groups for c in g.completions]

    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    first = sample(7)
    assert torch.rand(1) == before  # the caller's RNG stream is untouched by a seeded call
    assert sample(7) == first
    assert sample(8) != first


def test_chunking_gives_the_same_completions(tmp_path, model, smollm2_tokenizer, prompts):
    """Chunks of 3 rows split the second prompt's generations over two calls."""
    sampling = SamplingSettings(max_tokens=8, temperature=0)  # greedy: independent of RNG consumption
    whole = TransformersRollout(make_context(tmp_path, model, smollm2_tokenizer), chunk_size=64)
    tiny = TransformersRollout(make_context(tmp_path, model, smollm2_tokenizer), chunk_size=3)
    a = whole.grpo_rollout_generate(prompts=prompts, num_generations=2, sampling=sampling, policy_version=0)
    b = tiny.grpo_rollout_generate(prompts=prompts, num_generations=2, sampling=sampling, policy_version=0)
    for ga, gb in zip(a, b, strict=True):
        assert [c.token_ids for c in ga.completions] == [c.token_ids for c in gb.completions]
        # greedy: both generations of a prompt agree, logprobs are log_softmax(logits)
        assert ga.completions[0].token_ids == ga.completions[1].token_ids
        for ca, cb in zip(ga.completions, gb.completions, strict=True):
            torch.testing.assert_close(torch.tensor(ca.logprobs), torch.tensor(cb.logprobs), atol=1e-4, rtol=0)
        expected = fresh_logprobs(model, ga.prompt.prompt_ids, ga.completions[0].token_ids, temperature=1.0)
        torch.testing.assert_close(torch.tensor(ga.completions[0].logprobs), expected, atol=1e-4, rtol=0)


def test_a_seeded_row_samples_alike_in_one_call_or_split_over_two(tmp_path, model, smollm2_tokenizer, prompts):
    """What a completion samples depends on (seed, its place in the whole request) only: the
    request generated in one call, or in two halves with ``prompt_offset`` saying where the second
    starts (as two training processes do), gives the same tokens and log-probs; so does a call
    whose chunks cut a prompt's generations apart. top_k and top_p shape the draw."""
    whole = TransformersRollout(make_context(tmp_path, model, smollm2_tokenizer), chunk_size=64)
    tiny = TransformersRollout(make_context(tmp_path, model, smollm2_tokenizer), chunk_size=3)
    sampling = SamplingSettings(max_tokens=8, temperature=1.0, top_k=50, top_p=0.95, seed=11)

    def tokens(groups):
        return [c.token_ids for g in groups for c in g.completions]

    one = whole.grpo_rollout_generate(prompts=prompts, num_generations=3, sampling=sampling, policy_version=0)
    first = whole.grpo_rollout_generate(prompts=prompts[:1], num_generations=3, sampling=sampling, policy_version=0)
    second = whole.grpo_rollout_generate(
        prompts=prompts[1:],
        num_generations=3,
        policy_version=0,
        sampling=SamplingSettings(**{**sampling.__dict__, "prompt_offset": 1}),
    )
    chunked = tiny.grpo_rollout_generate(prompts=prompts, num_generations=3, sampling=sampling, policy_version=0)
    assert tokens(first) + tokens(second) == tokens(one) == tokens(chunked)
    assert len({tuple(t) for t in tokens(one)}) > 2, "the rows did not draw from streams of their own"
    for ga, gb in zip(one, first + second, strict=True):
        for ca, cb in zip(ga.completions, gb.completions, strict=True):
            torch.testing.assert_close(torch.tensor(ca.logprobs), torch.tensor(cb.logprobs), atol=1e-4, rtol=0)


def test_stop_tokens_and_sampling_options_are_honoured(tmp_path, model, smollm2_tokenizer, prompts):
    rollout = TransformersRollout(make_context(tmp_path, model, smollm2_tokenizer))
    greedy = rollout.grpo_rollout_generate(
        prompts=prompts[:1], num_generations=1, sampling=SamplingSettings(max_tokens=8, temperature=0), policy_version=0
    )[0].completions[0]
    # stop at the greedy completion's 3rd token: the same prefix, cut there, not truncated
    stop = greedy.token_ids[2]
    cut = rollout.grpo_rollout_generate(
        prompts=prompts[:1],
        num_generations=1,
        sampling=SamplingSettings(max_tokens=8, temperature=0, stop_token_ids=[stop]),
        policy_version=0,
    )[0].completions[0]
    first = greedy.token_ids.index(stop)
    assert cut.token_ids == greedy.token_ids[: first + 1]
    assert not cut.truncated

    # top_k=1 samples the argmax even at temperature 1; logprobs stay those of logits / T
    topk = rollout.grpo_rollout_generate(
        prompts=prompts[:1],
        num_generations=2,
        sampling=SamplingSettings(max_tokens=8, temperature=1.0, top_k=1, seed=3),
        policy_version=0,
    )[0].completions
    for c in topk:
        assert c.token_ids == greedy.token_ids
        torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(greedy.logprobs), atol=1e-4, rtol=0)

    # generation_kwargs reach the GenerationConfig: min_new_tokens forbids an early EOS
    forced = rollout.grpo_rollout_generate(
        prompts=prompts[:1],
        num_generations=1,
        sampling=SamplingSettings(max_tokens=8, temperature=0, stop_token_ids=[stop], extra={"min_new_tokens": 8}),
        policy_version=0,
    )[0].completions[0]
    assert len(forced.token_ids) == 8


def test_uses_kv_cache_under_gradient_checkpointing_and_restores_modes(tmp_path, model, smollm2_tokenizer, prompts):
    lengths: list[int] = []
    handle = model.register_forward_pre_hook(
        lambda _m, _a, kw: lengths.append(kw["input_ids"].shape[1]), with_kwargs=True
    )
    frozen = model.model.layers[0]
    model.gradient_checkpointing_enable()
    model.train()
    frozen.eval()  # a sub-module the trainer keeps in eval mode must stay so
    try:
        rollout = TransformersRollout(make_context(tmp_path, model, smollm2_tokenizer))
        sampling = SamplingSettings(max_tokens=8, temperature=0, stop_token_ids=[])
        groups = rollout.grpo_rollout_generate(prompts=prompts, num_generations=2, sampling=sampling, policy_version=0)
        assert model.training and model.model.layers[1].training and not frozen.training
        assert model.is_gradient_checkpointing
        assert torch.is_grad_enabled()
    finally:
        handle.remove()
        model.gradient_checkpointing_disable()
        model.eval()
    # prefill sees the whole padded prompt, every later step exactly one new token (KV cache)
    assert lengths[0] == max(len(p.prompt_ids) for p in prompts)
    assert lengths[1:] and all(n == 1 for n in lengths[1:])
    assert all(c.token_ids for g in groups for c in g.completions)


def test_peft_wrapped_model(tmp_path, smollm2_dir, smollm2_tokenizer, prompts):
    """A freshly initialised LoRA adapter (B = 0) is the base policy: same
    tokens as the base model for the same seed, logprobs from the adapter."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    sampling = SamplingSettings(max_tokens=8, temperature=1.0, seed=11)
    plain = TransformersRollout(make_context(tmp_path, base, smollm2_tokenizer)).grpo_rollout_generate(
        prompts=prompts, num_generations=2, sampling=sampling, policy_version=0
    )
    peft_model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    wrapped = TransformersRollout(make_context(tmp_path, peft_model, smollm2_tokenizer)).grpo_rollout_generate(
        prompts=prompts, num_generations=2, sampling=sampling, policy_version=0
    )
    assert [c.token_ids for g in wrapped for c in g.completions] == [c.token_ids for g in plain for c in g.completions]

    # make the adapter matter: logprobs must then follow the adapted model
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02)
    adapted = TransformersRollout(make_context(tmp_path, peft_model, smollm2_tokenizer)).grpo_rollout_generate(
        prompts=prompts[:1], num_generations=1, sampling=sampling, policy_version=1
    )[0]
    c = adapted.completions[0]
    expected = fresh_logprobs(peft_model, adapted.prompt.prompt_ids, c.token_ids, temperature=1.0)
    torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-4, rtol=0)


def test_user_errors_are_grpo_errors(tmp_path, model, smollm2_tokenizer, prompts):
    with pytest.raises(ConfigError, match="async_prefetch"):
        TransformersRollout(make_context(tmp_path, model, smollm2_tokenizer, async_prefetch=True))
    rollout = TransformersRollout(make_context(tmp_path, model, smollm2_tokenizer))

    def generate(rollout=rollout, **settings):
        sampling = SamplingSettings(max_tokens=4, **settings)
        return rollout.grpo_rollout_generate(prompts=prompts, num_generations=2, sampling=sampling, policy_version=0)

    with pytest.raises(ConfigError, match="generation_kwargs.num_return_sequences"):
        generate(extra={"num_return_sequences": 3})
    with pytest.raises(ConfigError, match="generation_kwargs.top_kk"):
        generate(extra={"top_kk": 3})
    with pytest.raises(GrpoError, match="vLLM"):
        generate(guided_regex="a+")
    with pytest.raises(GrpoError, match="before the trainer loaded"):
        generate(rollout=TransformersRollout(make_context(tmp_path, None, smollm2_tokenizer)))


def test_loads_through_the_entry_point(tmp_path, model, smollm2_tokenizer, prompts):
    host = PluginHost()
    host.load_implementation("rollout", "transformers", make_context(tmp_path, model, smollm2_tokenizer))
    groups = host.hook.grpo_rollout_generate(
        prompts=prompts, num_generations=2, sampling=SamplingSettings(max_tokens=4, seed=0), policy_version=2
    )
    assert len(groups) == 2 and all(len(g.completions) == 2 and g.policy_version == 2 for g in groups)
