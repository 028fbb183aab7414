"""Multi-turn episodes, driven through the run's rollout one turn at a time.

For each prompt, ``num_generations`` independent episodes: the environment
implementation makes each one (:func:`~grpo_core.contract.hookspecs.grpo_environment_episode`)
and may restate its prompt (``reset``). Then, turn after turn, every episode
still running gets one model turn and one environment step:

* **model turn**: episodes whose ids so far are identical are asked for
  together (``n`` = how many), and all distinct contexts of a turn go out
  at once (in parallel threads when the rollout declares
  ``concurrent_generate``), so the engine batches them. Each request is a
  plain :func:`~grpo_core.contract.hookspecs.grpo_rollout_generate` call on the
  exact ids of the episode so far: any engine runs episodes unchanged.
* **environment step**: ``episode.step(text)`` for every episode at once
  (threads, ``[episodes] max_concurrent_steps``), each cut at
  ``[episodes] step_timeout``. A step that raises or hangs ends that episode
  (``ended_by = "error"`` / ``"timeout"``): it keeps the tokens it has, gets
  no environment reward (``None``), and is logged; the rest of its group
  trains as usual. With the environment as the only reward it therefore
  contributes advantage 0. The one exception: an
  :class:`~grpo_core.contract.errors.EnvironmentLost` raised while episodes are made
  or reset (an environment that can serve none, e.g. a server that keeps
  dying) ends the run with its message.

An episode becomes one :class:`~grpo_core.contract.types.Completion`: the model's
ids (loss mask 1, the sampler's log-probs) and the environment's (mask 0,
log-prob 0.0) in order. ``trl.max_completion_length`` bounds the whole
episode: a model turn may sample at most what is left (``[episodes]
max_tokens_per_turn`` caps it further), and a reply that does not fit ends
the episode (``ended_by = "length"``; ``truncated`` is then set, so
``mask_truncated_completions`` applies). When ``reset`` gives different
episodes of a group different prompts, the group keeps their common prefix
as its prompt and each completion starts with the rest of its own (mask 0).
"""

from __future__ import annotations

import json
import numbers
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from grpo_core.contract.errors import EnvironmentLost, GrpoError
from grpo_core.contract.types import (
    Completion,
    EnvironmentReply,
    EpisodeStats,
    Messages,
    Prompt,
    RolloutGroup,
    SamplingSettings,
)
from grpo_core.generation.driven_episodes import DrivenJob, DrivenModel, TurnBatcher, drive_all
from grpo_core.generation.turn_tokens import TemplateError, TurnTokens

GenerateTurn = Callable[[list[Prompt], int, SamplingSettings], list[RolloutGroup]]
"""``generate(prompts, n, sampling)``: one rollout call (the run's engine)."""


def sample_groups(
    hook: Any,
    prompts: list[Prompt],
    num_generations: int,
    sampling: SamplingSettings,
    policy_version: int,
    driver: RolloutDriver | None,
    what: str = "rollout",
) -> list[RolloutGroup]:
    """One group per prompt: a single rollout call, or, when the run has a
    ``driver`` (episodes, ``rollout_func``), whatever rollout calls it makes,
    each stamped ``policy_version``. ``what`` names the caller in errors."""
    if driver is not None:

        def turn(requests: list[Prompt], n: int, turn_sampling: SamplingSettings) -> list[RolloutGroup]:
            return hook.grpo_rollout_generate(
                prompts=requests, num_generations=n, sampling=turn_sampling, policy_version=policy_version
            )

        groups = driver.run(prompts, num_generations, sampling, turn)
        for group in groups or []:
            group.policy_version = policy_version
    else:
        groups = hook.grpo_rollout_generate(
            prompts=prompts, num_generations=num_generations, sampling=sampling, policy_version=policy_version
        )
    if groups is None or len(groups) != len(prompts):
        raise RuntimeError(
            f"{what}: the rollout returned {0 if groups is None else len(groups)} groups for {len(prompts)} prompts"
        )
    return groups


class RolloutDriver(Protocol):
    """What the producer hands a batch's prompts to when generation is more
    than one rollout call: the episode driver below, or ``trl.rollout_func``
    over an engine (:mod:`grpo_core.generation.user_rollout`)."""

    def run(
        self, prompts: list[Prompt], num_generations: int, sampling: SamplingSettings, generate: GenerateTurn
    ) -> list[RolloutGroup]: ...


ENDINGS = ("environment", "max_turns", "length", "error", "timeout")
MAX_LOGGED_FAILURES = 5  # per batch; the metrics count them all


@dataclass
class _FailureLog:
    """How many failures one batch has said in the log so far (streaming
    runs several batches at once, so this is per batch, not per driver)."""

    said: int = 0


@dataclass
class _Live:
    """One episode in flight."""

    prompt: Prompt
    sample: int
    episode: Any
    context: list[int]
    conversation: Messages | None  # the prompt as messages, for the template check
    budget_total: int
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] | None = field(default_factory=list)
    versions: list[int] | None = field(default_factory=list)  # per token, from the rollout (in-flight updates)
    messages: Messages = field(default_factory=list)
    last_ids: list[int] = field(default_factory=list)
    last_text: str = ""
    info: dict[str, Any] = field(default_factory=dict)
    stats: EpisodeStats = field(default_factory=EpisodeStats)
    done: bool = False
    text: str | None = None  # a driven episode's answer (its last turn's content); else the decoded ids
    failures: _FailureLog = field(default_factory=_FailureLog)  # shared by the episodes of a batch

    @property
    def budget(self) -> int:
        return self.budget_total - len(self.ids)

    def end(self, reason: str, error: str | None = None) -> None:
        self.done = True
        self.stats.ended_by = reason
        if error is not None:
            self.stats.error = error
            self.stats.reward = None


def call_each(calls: list[Callable[[], Any]], timeout: float, limit: int) -> list[tuple[str, Any]]:
    """Run ``calls`` in threads, at most ``limit`` at once, each cut at
    ``timeout`` seconds. One ``("ok", value)``, ``("error", exception)`` or
    ``("timeout", None)`` per call, in order. A call still running at its
    timeout is abandoned in a daemon thread (Python cannot stop a thread):
    it can never hold up the run, or the interpreter's exit."""
    results: list[tuple[str, Any]] = [("timeout", None)] * len(calls)
    for start in range(0, len(calls), max(1, limit)):
        wave = list(range(start, min(len(calls), start + max(1, limit))))
        threads = []
        for i in wave:

            def work(i: int = i) -> None:
                try:
                    results[i] = ("ok", calls[i]())
                except BaseException as exc:  # noqa: BLE001 - reported per episode
                    results[i] = ("error", exc)

            thread = threading.Thread(target=work, name="grpo-episode-step", daemon=True)
            thread.start()
            threads.append(thread)
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
    return results


def drives_model(episode: Any) -> bool:
    """A :class:`~grpo_core.contract.types.DrivenEpisode` (its own code calls the model)."""
    return callable(getattr(episode, "drive", None))


def _serialised(generate: GenerateTurn) -> GenerateTurn:
    """``generate`` for a rollout that must not be called from two threads
    at once, when driven episodes and stepped ones share a batch."""
    lock = threading.Lock()

    def call(prompts: list[Prompt], n: int, sampling: SamplingSettings) -> list[RolloutGroup]:
        with lock:
            return generate(prompts, n, sampling)

    return call


def _common_prefix(sequences: list[list[int]]) -> int:
    first = sequences[0]
    n = min(len(s) for s in sequences)
    for i in range(n):
        if any(s[i] != first[i] for s in sequences):
            return i
    return n


class EpisodeDriver:
    """Runs the episodes of one generation batch (re-entrant: streaming
    chunks may run several batches' worth at once)."""

    def __init__(
        self,
        new_episode: Callable[[Prompt, int], Any],
        tokenizer: Any,
        cfg: Any,
        environment_name: str,
        log: Callable[[str], None],
        concurrent_turns: bool,
        name_of: Callable[[Prompt], str | None] | None = None,
    ) -> None:
        self.new_episode = new_episode
        self.name_of = name_of  # the environment a row chose (several in one run), for metrics and logs
        self.tokenizer = tokenizer
        self.turns = TurnTokens(tokenizer, cfg.trl.chat_template_kwargs)
        self._template_kwargs = dict(cfg.trl.chat_template_kwargs or {})
        self.max_context = int(cfg.trl.max_prompt_length or cfg.sequence_len)  # a driven chain's first context
        self._tool_turns: dict[str, TurnTokens] = {}
        self.settings = cfg.episodes
        self.name = environment_name
        self.log = log
        self.concurrent_turns = concurrent_turns
        self._lock = threading.Lock()
        self._template_warned = False

    # ------------------------------------------------------------------ the loop

    def run(
        self, prompts: list[Prompt], num_generations: int, sampling: SamplingSettings, generate: GenerateTurn
    ) -> list[RolloutGroup]:
        """Every episode of ``prompts`` to its end; one group per prompt.
        Driven episodes (an agent's) run in the background meanwhile,
        through the same rollout."""
        live = self._start_all(prompts, num_generations, int(sampling.max_tokens))
        driven = [e for e in live if not e.done and drives_model(e.episode)]
        if driven and not self.concurrent_turns:
            generate = _serialised(generate)
        background: threading.Thread | None = None
        fatal: list[BaseException] = []
        if driven:

            def drive() -> None:
                try:
                    self._drive(driven, sampling, generate)
                except BaseException as exc:  # noqa: BLE001 - re-raised below, in the caller's thread
                    fatal.append(exc)

            background = threading.Thread(target=drive, name="grpo-driven-episodes", daemon=True)
            background.start()
        turn = 0
        while active := [e for e in live if not e.done and not drives_model(e.episode)]:
            self._model_turn(active, sampling, generate, turn)
            self._environment_turn([e for e in active if not e.done], turn)
            turn += 1
        if background is not None:
            background.join()
        if fatal:
            raise fatal[0]
        self._final_rewards([e for e in live if not drives_model(e.episode)])
        return [
            self._group(prompt, live[i * num_generations : (i + 1) * num_generations])
            for i, prompt in enumerate(prompts)
        ]

    def _start_all(self, prompts: list[Prompt], num_generations: int, budget: int) -> list[_Live]:
        """Each episode made and reset; ``budget``: its tokens at most
        (``sampling.max_tokens``, the run's ``max_completion_length``)."""
        starts = [(p, s) for p in prompts for s in range(num_generations)]

        def begin(prompt: Prompt, sample: int) -> tuple[Any, Any]:
            episode = self.new_episode(prompt, sample)
            if episode is None:
                raise GrpoError(f"environment '{self.name}' returned no episode for prompt {prompt.index}")
            return episode, (None if drives_model(episode) else episode.reset())

        outcomes = call_each(
            [lambda p=p, s=s: begin(p, s) for p, s in starts],
            self.settings.step_timeout,
            self.settings.max_concurrent_steps,
        )
        lost = next((value for kind, value in outcomes if kind == "error" and isinstance(value, EnvironmentLost)), None)
        if lost is not None:  # e.g. a server that keeps dying: no episode could be played, so the run ends
            raise lost
        live = []
        failures = _FailureLog()
        for (prompt, sample), (kind, value) in zip(starts, outcomes):
            conversation = list(prompt.prompt) if prompt.is_conversational else None
            e = _Live(prompt, sample, None, list(prompt.prompt_ids), conversation, budget, failures=failures)
            e.stats.environment = self.name_of(prompt) if self.name_of is not None else None
            if kind == "ok":
                e.episode, start = value
                try:
                    self._restate_prompt(e, start)
                except (TemplateError, TypeError, ValueError) as exc:
                    self._fail(e, "error", f"reset returned a start the chat template cannot render: {exc}", 0)
            else:
                self._fail(e, kind, self._describe(kind, value, "reset"), 0)
            live.append(e)
        return live

    def _restate_prompt(self, e: _Live, start: str | Messages | None) -> None:
        """Apply ``reset``'s answer (TRL: a string is appended to the last
        user message; grpo also takes a whole conversation)."""
        if start is None:
            return
        if isinstance(start, str):
            if e.conversation is not None:
                last = e.conversation[-1]
                e.conversation = [*e.conversation[:-1], {**last, "content": str(last.get("content", "")) + start}]
                e.context = self.turns.prompt_ids(e.conversation)
            else:
                e.context = self.turns.prompt_ids(str(e.prompt.prompt) + start)
            return
        if isinstance(start, list) and all(isinstance(m, dict) and "role" in m for m in start):
            e.conversation = list(start)
            e.context = self.turns.prompt_ids(e.conversation)
            return
        raise TypeError(f"reset() returned {type(start).__name__}; expected None, a string or a list of chat messages")

    # ------------------------------------------------------------------ model turns

    def _model_turn(self, active: list[_Live], sampling: SamplingSettings, generate: GenerateTurn, turn: int) -> None:
        same_context: dict[tuple[int, ...], list[_Live]] = {}
        for e in active:
            same_context.setdefault(tuple(e.context + e.ids), []).append(e)
        sharers = list(same_context.values())
        if sampling.temperature == 0:  # greedy: one completion per request (vLLM refuses n > 1)
            sharers = [[e] for members in sharers for e in members]
        by_count: dict[int, list[list[_Live]]] = {}
        for members in sharers:
            by_count.setdefault(len(members), []).append(members)
        calls = []
        for j, (count, groups) in enumerate(sorted(by_count.items())):
            cap = max(m.budget for members in groups for m in members)
            if self.settings.max_tokens_per_turn:
                cap = min(cap, int(self.settings.max_tokens_per_turn))
            seed = None if sampling.seed is None else sampling.seed * 1_000_003 + turn * 1009 + j
            turn_sampling = replace(sampling, max_tokens=max(1, cap), seed=seed)
            requests = [replace(m[0].prompt, prompt_ids=m[0].context + m[0].ids) for m in groups]
            calls.append((requests, count, turn_sampling, groups))

        def one(call: tuple[list[Prompt], int, SamplingSettings, list[list[_Live]]]) -> list[RolloutGroup]:
            requests, count, turn_sampling, groups = call
            answered = generate(requests, count, turn_sampling)
            if answered is None or len(answered) != len(requests):
                raise GrpoError(
                    f"the rollout answered {0 if answered is None else len(answered)} groups for {len(requests)} "
                    "episode turns"
                )
            return answered

        if self.concurrent_turns and len(calls) > 1:
            with ThreadPoolExecutor(max_workers=len(calls), thread_name_prefix="grpo-episode-turn") as pool:
                answers = list(pool.map(one, calls))
        else:
            answers = [one(call) for call in calls]
        for (_, _, _, groups), answered in zip(calls, answers):
            for members, group in zip(groups, answered):
                for e, completion in zip(members, group.completions, strict=True):
                    self._take_turn(e, completion)

    def _take_turn(self, e: _Live, completion: Completion) -> None:
        ids = list(completion.token_ids[: max(0, e.budget)])
        e.stats.turn_starts.append(len(e.ids))  # into e.ids; the completion's own start is added at the end
        e.stats.turn_rewards.append(None)  # until the environment answers this turn
        e.ids += ids
        e.mask += [1] * len(ids)
        if e.logprobs is not None and completion.logprobs is not None:
            e.logprobs += [float(x) for x in completion.logprobs[: len(ids)]]
        else:
            e.logprobs = None
        e.versions = extend_versions(e.versions, completion.token_versions, len(ids))
        text = (
            completion.text
            if len(ids) == len(completion.token_ids)
            else self.tokenizer.decode(ids, skip_special_tokens=True)
        )
        e.last_ids, e.last_text = ids, text
        e.messages.append({"role": "assistant", "content": text})
        e.stats.turns += 1
        e.stats.model_tokens += len(ids)

    # ------------------------------------------------------------------ driven episodes

    def _turns_for(self, tools: list[Any] | None) -> TurnTokens:
        """The renderer for a request's ``tools`` (the template sees them)."""
        if not tools:
            return self.turns
        key = json.dumps(tools, sort_keys=True, default=str)
        with self._lock:
            found = self._tool_turns.get(key)
        if found is None:
            found = TurnTokens(self.tokenizer, {**self._template_kwargs, "tools": tools})
            with self._lock:
                self._tool_turns[key] = found
        return found

    def _drive(self, driven: list[_Live], sampling: SamplingSettings, generate: GenerateTurn) -> None:
        """Every driven episode to its end (:mod:`grpo_core.generation.driven_episodes`)."""
        batcher = TurnBatcher(generate, self.concurrent_turns, sampling.seed)
        unseeded = replace(sampling, seed=None)  # the batcher seeds each call from the run's seed
        jobs = []
        for e in driven:
            model = DrivenModel(
                e.prompt,
                batcher,
                unseeded,
                e.budget_total,
                int(self.settings.max_turns),
                self.settings.max_tokens_per_turn,
                self.tokenizer,
                self._turns_for,
                max_context=self.max_context,
            )
            timeout = getattr(e.episode, "timeout", None) or self.settings.step_timeout
            jobs.append(DrivenJob(e.episode, model, float(timeout)))
        limit = min(
            int(getattr(e.episode, "max_concurrent", None) or self.settings.max_concurrent_steps) for e in driven
        )
        try:
            drive_all(jobs, limit, batcher)
        finally:
            batcher.close()
        for e, job in zip(driven, jobs, strict=True):
            self._finish_driven(e, job)
        if batcher.fatal is not None:
            raise batcher.fatal

    def _finish_driven(self, e: _Live, job: DrivenJob) -> None:
        """The episode's trained chain and how it ended (failures named and logged)."""
        model = job.model
        record = model.record()
        if record is not None:
            e.context, e.ids, e.mask, e.logprobs = record.context, record.ids, record.mask, record.logprobs
            e.versions = record.versions
            start = record.prompt_messages
            e.conversation = record.messages[:start] if record.messages is not None else None
            e.messages = record.messages[start:] if record.messages is not None else []
            e.text = record.text
            e.stats.turns = record.turns
            e.stats.model_tokens = sum(record.mask)
            e.stats.environment_tokens = len(record.mask) - sum(record.mask)
            e.stats.history_rewrites = record.history_rewrites
            e.stats.untrained_tokens = record.untrained_tokens
            e.stats.tool_calls = record.tool_calls
        kind, value = job.outcome
        turn = e.stats.turns
        if model.problem is not None:
            self._fail(e, "error", model.problem, turn)
        elif kind == "timeout":
            self._fail(e, "timeout", f"the agent ran past its timeout of {job.timeout:g} s", turn)
        elif kind == "error" and model.ended in ("length", "max_turns"):
            e.end(str(model.ended))  # it stopped because the episode could not go on: not the agent's fault
        elif kind == "error":
            if isinstance(value, TimeoutError):
                self._fail(e, "timeout", f"the agent raised TimeoutError: {value}", turn)
            elif isinstance(value, GrpoError):
                self._fail(e, "error", str(value), turn)
            else:
                self._fail(e, "error", f"the agent raised {type(value).__name__}: {value}", turn)
        elif record is None:
            self._fail(e, "error", "the agent returned without calling the model", turn)
        elif model.late_calls:
            self._fail(e, "error", "the agent called the model after it had returned", turn)
        elif value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
            self._fail(e, "error", f"the agent returned {type(value).__name__}, not a float or None", turn)
        else:
            e.stats.reward = None if value is None else float(value)
            e.end("length" if record.truncated or model.ended == "length" else str(model.ended or "environment"))
            if e.stats.ended_by == "returned":
                e.stats.ended_by = "environment"
        if e.stats.ended_by in ("error", "timeout"):
            e.stats.scored = False

    # ------------------------------------------------------------------ environment steps

    def _environment_turn(self, active: list[_Live], turn: int) -> None:
        outcomes = call_each(
            [lambda e=e: e.episode.step(e.last_text) for e in active],
            self.settings.step_timeout,
            self.settings.max_concurrent_steps,
        )
        for e, (kind, reply) in zip(active, outcomes):
            if kind == "ok" and not isinstance(reply, EnvironmentReply):
                kind, reply = "error", TypeError(f"step() returned {type(reply).__name__}, not an EnvironmentReply")
            if kind != "ok":
                self._fail(e, kind, self._describe(kind, reply, "step"), turn + 1)
                continue
            self._record(e, reply)
            if reply.done or not reply.messages:
                e.end("environment")
            elif e.stats.turns >= self.settings.max_turns:
                e.end("max_turns")
            elif e.budget <= 0:
                e.end("length")
            else:
                self._append_reply(e, reply.messages, turn)

    def _record(self, e: _Live, reply: EnvironmentReply) -> None:
        if reply.reward is not None:
            e.stats.reward = (e.stats.reward or 0.0) + float(reply.reward)
            e.stats.turn_rewards[-1] = float(reply.reward)  # the reply to the episode's last model turn
        e.stats.tool_calls += int(reply.tool_calls)
        e.stats.tool_failures += int(reply.tool_failures)
        e.info.update(reply.info)

    def _append_reply(self, e: _Live, messages: Messages, turn: int) -> None:
        try:
            ids = self.turns.reply_ids(messages, e.last_ids)
        except TemplateError as exc:
            self._fail(e, "error", str(exc), turn + 1)
            return
        if len(ids) >= e.budget:  # no room left for the model to answer
            e.end("length")
            return
        e.ids += ids
        e.mask += [0] * len(ids)
        if e.logprobs is not None:
            e.logprobs += [0.0] * len(ids)
        if e.versions is not None:
            e.versions += [e.versions[-1] if e.versions else 0] * len(ids)  # mask 0: never read
        e.stats.environment_tokens += len(ids)
        e.messages.extend(messages)
        if e.conversation is not None and not e.stats.template_mismatch:
            whole = [*e.conversation, *e.messages]
            if not self.turns.matches_template(whole, e.context + e.ids, generation_prompt=True):
                e.stats.template_mismatch = True
                self._warn_template_once()

    def _final_rewards(self, live: list[_Live]) -> None:
        scored = [e for e in live if e.stats.error is None and callable(getattr(e.episode, "final_reward", None))]
        outcomes = call_each(
            [lambda e=e: e.episode.final_reward() for e in scored],
            self.settings.step_timeout,
            self.settings.max_concurrent_steps,
        )
        for e, (kind, value) in zip(scored, outcomes):
            if kind != "ok":
                self._fail(e, kind, self._describe(kind, value, "final_reward"), e.stats.turns)
            elif value is not None:
                e.stats.reward = (e.stats.reward or 0.0) + float(value)

    def _warn_template_once(self) -> None:
        with self._lock:
            if self._template_warned:
                return
            self._template_warned = True
        self.log(
            "the chat template renders an episode's conversation differently from the ids the model was given "
            "(it rewrites earlier turns, e.g. drops their reasoning): grpo trains on the ids as the engine sampled "
            "them, turn after turn, and counts such episodes in episodes/template_mismatch"
        )

    # ------------------------------------------------------------------ failures

    def _describe(self, kind: str, value: Any, call: str) -> str:
        if kind == "timeout":
            return f"{call}() took longer than [episodes] step_timeout = {self.settings.step_timeout} s"
        return f"{call}() raised {type(value).__name__}: {value}"

    def _fail(self, e: _Live, kind: str, problem: str, turn: int) -> None:
        e.end(kind, problem)
        if e.failures.said < MAX_LOGGED_FAILURES:
            e.failures.said += 1
            row = f" (row: {_excerpt(e.prompt.prompt)})" if drives_model(e.episode) else ""
            self.log(
                f"environment '{e.stats.environment or self.name}': episode {e.sample} of prompt {e.prompt.index} "
                f"ended at turn {turn}: {problem}{row}"
            )

    # ------------------------------------------------------------------ results

    def _group(self, prompt: Prompt, episodes: list[_Live]) -> RolloutGroup:
        contexts = [e.context for e in episodes]
        shared = _common_prefix(contexts)
        same_start = all(c == contexts[0] for c in contexts)
        group_prompt = prompt
        if shared != len(prompt.prompt_ids) or contexts[0][:shared] != list(prompt.prompt_ids):
            restated: Any = (
                episodes[0].conversation if same_start and episodes[0].conversation is not None else prompt.prompt
            )
            group_prompt = replace(prompt, prompt=restated, prompt_ids=contexts[0][:shared])
        return RolloutGroup(group_prompt, [self._completion(e, shared) for e in episodes])

    def _completion(self, e: _Live, shared: int) -> Completion:
        own_start = e.context[shared:]
        extra = dict(e.info)
        extra["environment_reward"] = e.stats.reward
        e.stats.turn_starts = [len(own_start) + start for start in e.stats.turn_starts]  # into token_ids
        return Completion(
            token_ids=own_start + e.ids,
            text=e.text if e.text is not None else self.tokenizer.decode(e.ids, skip_special_tokens=True),
            logprobs=None if e.logprobs is None else [0.0] * len(own_start) + e.logprobs,
            truncated=e.stats.ended_by == "length",
            extra=extra,
            loss_mask=[0] * len(own_start) + e.mask,
            token_versions=[e.versions[0]] * len(own_start) + e.versions if e.versions else None,
            episode=e.stats,
            environment=getattr(e.episode, "environment", e.episode),
            messages=list(e.messages),
        )


def extend_versions(versions: list[int] | None, turn: list[int] | None, count: int) -> list[int] | None:
    """An episode's per-token policy versions after a model turn of ``count``
    tokens whose own are ``turn`` (``trl.in_flight_weight_updates``: the
    rollout records which weights sampled each token, so a turn after an
    update, or one an update cut in the middle, carries the newer version).
    ``None`` once a turn came without them: then the group's version holds
    for the whole episode, as for any completion without them."""
    if versions is None or turn is None:
        return None
    return versions + [int(v) for v in turn[:count]]


def _excerpt(prompt: Any, limit: int = 120) -> str:
    """A prompt's last message (or text), short, for a log line naming the row."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[-1], dict):
        prompt = prompt[-1].get("content", "")
    text = " ".join(str(prompt).split())
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


def unscored_rows(groups: list[RolloutGroup], rewards: list[list[list[float | None]]]) -> None:
    """A failed driven episode gets no reward from any function (``None``:
    it takes no part in its group's advantages), whatever the functions
    made of its partial conversation. In place."""
    for group, per_group in zip(groups, rewards, strict=True):
        for i, completion in enumerate(group.completions):
            if completion.episode is not None and not completion.episode.scored:
                per_group[i] = [None] * len(per_group[i])


def release(groups: list[RolloutGroup]) -> None:
    """After scoring: close each episode (``close()`` when it has one) and
    drop the live object, so nothing but plain data is kept or saved."""
    for group in groups:
        for completion in group.completions:
            episode, completion.environment = completion.environment, None
            close = getattr(episode, "close", None)
            if callable(close):
                try:
                    close()
                except Exception:  # noqa: BLE001 - closing is best effort
                    pass


def episode_metrics(groups: list[Any]) -> dict[str, float]:
    """``episodes/*`` metrics of a scored batch (empty when single-turn)."""
    stats = [c.episode for s in groups for c in s.group.completions if c.episode is not None]
    if not stats:
        return {}
    n = len(stats)
    metrics = {
        "episodes/turns_mean": sum(s.turns for s in stats) / n,
        "episodes/turns_max": float(max(s.turns for s in stats)),
        "episodes/model_tokens_mean": sum(s.model_tokens for s in stats) / n,
        "episodes/environment_tokens_mean": sum(s.environment_tokens for s in stats) / n,
        "episodes/tool_calls_mean": sum(s.tool_calls for s in stats) / n,
        "episodes/tool_failures": float(sum(s.tool_failures for s in stats)),
        "episodes/template_mismatch": float(sum(s.template_mismatch for s in stats)),
        "episodes/errors": float(sum(s.ended_by in ("error", "timeout") for s in stats)),
        "episodes/history_rewrites": float(sum(s.history_rewrites for s in stats)),
        "episodes/untrained_tokens": float(sum(s.untrained_tokens for s in stats)),
    }
    rewarded = [s.reward for s in stats if s.reward is not None]
    if rewarded:
        metrics["episodes/environment_reward_mean"] = sum(rewarded) / len(rewarded)
    for reason in ENDINGS:
        metrics[f"episodes/ended_by_{reason}"] = sum(s.ended_by == reason for s in stats) / n
    return metrics


def environment_metrics(groups: list[Any], weights: list[float]) -> dict[str, float]:
    """``environments/<name>/*`` of a scored batch whose rows chose among
    several environments: ``reward_mean`` (the weighted reward, as ``reward``),
    ``solve_rate`` (the fraction of its episodes whose weighted reward is above
    0), ``turns_mean``, ``failures`` (episodes that ended in an error or a
    timeout) and ``episodes`` (how many it played). Empty otherwise."""
    by_name: dict[str, list[tuple[float, EpisodeStats]]] = {}
    for scored in groups:
        for row, completion in zip(scored.rewards, scored.group.completions, strict=True):
            stats = completion.episode
            if stats is None or stats.environment is None:
                continue
            total = sum(w * r for w, r in zip(weights, row, strict=False) if r is not None and r == r)
            by_name.setdefault(stats.environment, []).append((float(total), stats))
    metrics: dict[str, float] = {}
    for name, played in sorted(by_name.items()):
        n = len(played)
        metrics[f"environments/{name}/reward_mean"] = sum(t for t, _ in played) / n
        metrics[f"environments/{name}/solve_rate"] = sum(t > 0 for t, _ in played) / n
        metrics[f"environments/{name}/turns_mean"] = sum(s.turns for _, s in played) / n
        metrics[f"environments/{name}/failures"] = float(sum(s.ended_by in ("error", "timeout") for _, s in played))
        metrics[f"environments/{name}/episodes"] = float(n)
    return metrics
