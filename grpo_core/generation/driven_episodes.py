"""Model-driven episodes: an agent's own code asks for each model turn.

Where :mod:`grpo_core.generation.episodes` answers the model turn by turn, a
:class:`~grpo_core.contract.types.DrivenEpisode` (the ``agent`` environment's
episodes) runs code of its own that calls the model when it likes, as often
as it likes: the episode's turns are its requests. This module gives each
such episode its :class:`~grpo_core.contract.types.EpisodeModel`, runs the
episodes (many at once, each under a deadline), and keeps the token record
the episode trains on.

* **Same engine path.** Every request is one
  :func:`~grpo_core.contract.hookspecs.grpo_rollout_generate` call on the
  exact ids of its context, as the episode driver's turns are:
  :class:`TurnBatcher` gathers the requests of all episodes in flight, asks
  for identical contexts together (``n`` = how many), and sends each
  batch as one call (several at once when the rollout declares
  ``concurrent_generate``).
* **Exact ids.** A request names the earlier turn it continues (``after``)
  and the ids that follow it (rendered by the chat template from the
  messages after that turn); the turn's sampled ids are reused as the
  engine returned them, never decoded and re-tokenised.
* **The rule for rewritten histories.** An episode's turns form chains (a
  request may continue any earlier turn, or start from scratch). The
  episode trains the chain of its **last** turn: that is where its answer
  is, the one the reward judges. Requests that did not continue the latest
  turn count as ``history_rewrites``; tokens sampled off the trained chain
  as ``untrained_tokens``. A fork from an earlier turn keeps the sampled
  ids before the fork (mask 1: they were sampled in exactly that context).
* **Budget.** ``trl.max_completion_length`` bounds each chain after its
  first context (what the trained completion can hold); ``[episodes]
  max_turns`` bounds the requests of an episode, ``max_tokens_per_turn``
  each one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from grpo_core.contract.errors import EpisodeOver, GrpoError
from grpo_core.contract.types import (
    Completion,
    Messages,
    ModelTurn,
    Prompt,
    RolloutGroup,
    SamplingSettings,
)

GenerateTurn = Callable[[list[Prompt], int, SamplingSettings], list[RolloutGroup]]

GATHER_SECONDS = 0.2
"""How long the batcher may wait after the first request of a batch for the
others. It sends the call as soon as every running agent is waiting in a
request (:meth:`TurnBatcher.set_running`), so this bounds only the wait for
an agent busy with its own work (a tool, a slow client start on a loaded
machine): one call for all lets the engine batch them (and share their
identical first contexts, ``n`` > 1)."""

TOKENIZER_LOCK = threading.Lock()
"""Requests render and decode in the endpoint's threads; a fast tokenizer is
not safe to share between threads that call it at once."""

FATAL_GRACE_SECONDS = 5.0
"""After the engine failed, how long episodes still running may take to
notice (their requests are refused) before the run ends with the failure."""


# ---------------------------------------------------------------------------- batching


@dataclass
class _Request:
    prompt: Prompt
    sampling: SamplingSettings
    done: threading.Event = field(default_factory=threading.Event)
    result: Completion | None = None
    error: BaseException | None = None


def _sampling_key(sampling: SamplingSettings) -> str:
    """What must be equal for two requests to share a rollout call (all but
    ``max_tokens``: a call samples the largest, each answer is cut to its own)."""
    return repr(replace(sampling, max_tokens=0))


class TurnBatcher:
    """Gathers the turns many episodes ask for into rollout calls.

    ``submit`` blocks its caller (one thread per request) until the call
    holding its request returns. One dispatcher thread plans the calls;
    with ``concurrent`` they run in parallel threads, else one after
    another (the engine is then never called from two threads at once).
    An exception from the rollout fails every request of that call and is
    kept as :attr:`fatal`: the engine is gone, and the run must end with it.
    """

    def __init__(self, generate: GenerateTurn, concurrent: bool, base_seed: int | None) -> None:
        self.generate = generate
        self.concurrent = concurrent
        self.base_seed = base_seed
        self.fatal: BaseException | None = None
        self._pending: list[_Request] = []
        self._running: int | None = None  # agents running now (None: unknown, wait GATHER_SECONDS)
        self._in_flight = 0  # requests in a call now: their agents are waiting too
        self._cond = threading.Condition()
        self._closed = False
        self._calls = 0
        self._thread = threading.Thread(target=self._loop, name="grpo-driven-turns", daemon=True)
        self._thread.start()

    def submit(self, prompt: Prompt, sampling: SamplingSettings) -> Completion:
        request = _Request(prompt, sampling)
        with self._cond:
            if self.fatal is not None or self._closed:
                raise EpisodeOver("unavailable", self._unavailable())
            self._pending.append(request)
            self._cond.notify_all()
        request.done.wait()
        if request.error is not None:
            raise request.error
        assert request.result is not None
        return request.result

    def set_running(self, count: int) -> None:
        """How many agents are running: when that many requests wait, they go out at once."""
        with self._cond:
            self._running = count
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            for request in self._pending:
                request.error = EpisodeOver("unavailable", "the batch's episodes are over")
                request.done.set()
            self._pending.clear()
            self._cond.notify_all()

    def _unavailable(self) -> str:
        if self.fatal is None:
            return "the batch's episodes are over"
        return f"the inference engine failed: {type(self.fatal).__name__}: {self.fatal}"

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                until = time.monotonic() + GATHER_SECONDS
                while not self._closed and (
                    self._running is None or len(self._pending) + self._in_flight < self._running
                ):
                    left = until - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                batch, self._pending = self._pending, []
                self._in_flight += len(batch)
            for call in self._plan(batch):
                if self.concurrent:
                    threading.Thread(target=self._run, args=(call,), name="grpo-driven-call", daemon=True).start()
                else:
                    self._run(call)

    def _plan(self, batch: list[_Request]) -> list[tuple[list[Prompt], int, SamplingSettings, list[list[_Request]]]]:
        """One call per (sampling, number of requests sharing a context)."""
        by_key: dict[str, dict[tuple[int, ...], list[_Request]]] = {}
        for request in batch:
            contexts = by_key.setdefault(_sampling_key(request.sampling), {})
            contexts.setdefault(tuple(request.prompt.prompt_ids), []).append(request)
        calls = []
        for contexts in by_key.values():
            sharers = list(contexts.values())
            first = sharers[0][0].sampling
            if first.temperature == 0:  # greedy: one completion per request (vLLM refuses n > 1)
                sharers = [[r] for members in sharers for r in members]
            by_count: dict[int, list[list[_Request]]] = {}
            for members in sharers:
                by_count.setdefault(len(members), []).append(members)
            for count, groups in sorted(by_count.items()):
                cap = max(r.sampling.max_tokens for members in groups for r in members)
                seed = first.seed
                if seed is None and self.base_seed is not None:
                    self._calls += 1
                    seed = self.base_seed * 1_000_003 + self._calls
                sampling = replace(first, max_tokens=max(1, cap), seed=seed)
                calls.append(([members[0].prompt for members in groups], count, sampling, groups))
        return calls

    def _run(self, call: tuple[list[Prompt], int, SamplingSettings, list[list[_Request]]]) -> None:
        prompts, count, sampling, groups = call
        try:
            answered = self.generate(prompts, count, sampling)
            if answered is None or len(answered) != len(prompts):
                raise GrpoError(
                    f"the rollout answered {0 if answered is None else len(answered)} groups for {len(prompts)} "
                    "agent requests"
                )
            for members, group in zip(groups, answered, strict=True):
                for request, completion in zip(members, group.completions, strict=True):
                    request.result = completion
        except BaseException as exc:  # noqa: BLE001 - handed to every request, and ends the run
            with self._cond:
                if self.fatal is None:
                    self.fatal = exc
            for members in groups:
                for request in members:
                    request.error = EpisodeOver("unavailable", self._unavailable())
        finally:
            with self._cond:
                self._in_flight -= sum(len(members) for members in groups)
            for members in groups:
                for request in members:
                    request.done.set()


# ---------------------------------------------------------------------------- one episode's model


@dataclass
class _Node:
    """A model turn with the whole chain it ends: ``ids`` (context and
    every turn, in order), ``mask`` (1 on tokens sampled in this chain),
    ``logprobs`` (the engine's at mask-1 positions, 0.0 elsewhere),
    ``versions`` (the policy version of each token, at mask-1 positions;
    ``None`` when a turn came without them), and ``root``: where the
    chain's first context ends."""

    turn: ModelTurn
    parent: _Node | None
    ids: list[int]
    mask: list[int]
    logprobs: list[float] | None
    versions: list[int] | None
    root: int
    conversation: Messages | None
    at_budget: bool = False


@dataclass
class DrivenRecord:
    """What a finished driven episode trains on: the chain of its last turn."""

    context: list[int]
    ids: list[int]
    mask: list[int]
    logprobs: list[float] | None
    versions: list[int] | None  # per token (in-flight weight updates); None: the group's version for all
    messages: Messages | None
    prompt_messages: int  # how many of ``messages`` the chain's first request sent (its prompt)
    text: str
    turns: int
    truncated: bool
    history_rewrites: int
    untrained_tokens: int
    tool_calls: int = 0  # in the chain's answers (the endpoint sets each turn's message)


class DrivenModel:
    """:class:`~grpo_core.contract.types.EpisodeModel` for one episode."""

    def __init__(
        self,
        prompt: Prompt,
        batcher: TurnBatcher,
        sampling: SamplingSettings,
        budget: int,
        max_turns: int,
        max_tokens_per_turn: int | None,
        tokenizer: Any,
        turn_tokens: Callable[[list[Any] | None], Any],
        max_context: int | None = None,
    ) -> None:
        self.prompt = prompt
        self.max_context = max_context  # a chain's first context at most (trl.max_prompt_length / sequence_len)
        self.batcher = batcher
        self.sampling = sampling
        self.budget = budget
        self.max_turns = max_turns
        self.max_tokens_per_turn = max_tokens_per_turn
        self.tokenizer = tokenizer
        self._turn_tokens = turn_tokens
        self._lock = threading.Lock()
        self._nodes: list[_Node] = []
        self._latest: _Node | None = None
        self._requests = 0
        self.rewrites = 0
        self.late_calls = 0
        self.ended: str | None = None  # why no more turns: "length", "max_turns", "timeout", "error", "returned"
        self.problem: str | None = None  # fail()'s problem

    # ------------------------------------------------------------------ EpisodeModel

    def render(
        self, messages: Messages, *, after: ModelTurn | None = None, tools: list[Any] | None = None
    ) -> list[int]:
        with TOKENIZER_LOCK:
            turns = self._turn_tokens(tools)
            if after is None:
                return list(turns.prompt_ids(list(messages)))
            node = self._node_of(after)
            return list(turns.reply_ids(list(messages), node.turn.ids))

    def encode(self, text: str) -> list[int]:
        with TOKENIZER_LOCK:
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def generate(
        self,
        ids: list[int],
        *,
        after: ModelTurn | None = None,
        conversation: Messages | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop: list[str] | None = None,
    ) -> ModelTurn:
        with self._lock:
            self._check_open()
            parent = self._node_of(after) if after is not None else None
            context = (parent.ids if parent is not None else []) + [int(i) for i in ids]
            root = parent.root if parent is not None else len(context)
            if parent is None and self.max_context is not None and len(context) > self.max_context:
                problem = (
                    f"a request's context has {len(context)} tokens, more than the {self.max_context} a conversation "
                    "may start with (trl.max_prompt_length, else sequence_len)"
                )
                if self.ended is None:
                    self.ended, self.problem = "error", problem
                raise EpisodeOver("length", problem)
            left = self.budget - (len(context) - root)
            if self._requests >= self.max_turns:
                self._end("max_turns")
                raise EpisodeOver(
                    "max_turns", f"the episode has had its {self.max_turns} model turns ([episodes] max_turns)"
                )
            if left <= 0:
                self._end("length")
                raise EpisodeOver(
                    "length",
                    f"the episode's token budget is spent: {self.budget} tokens after its first request "
                    "(trl.max_completion_length)",
                )
            cap = left
            for bound in (max_tokens, self.max_tokens_per_turn):
                if bound is not None:
                    cap = min(cap, int(bound))
            cap = max(1, cap)
            self._requests += 1
        sampling = replace(
            self.sampling,
            max_tokens=cap,
            temperature=self.sampling.temperature if temperature is None else float(temperature),
            top_p=self.sampling.top_p if top_p is None else float(top_p),
            seed=seed,
        )
        completion = self.batcher.submit(replace(self.prompt, prompt_ids=context), sampling)
        sampled = list(completion.token_ids[:cap])
        logprobs = None if completion.logprobs is None else [float(x) for x in completion.logprobs[:cap]]
        versions = None if completion.token_versions is None else [int(v) for v in completion.token_versions[:cap]]
        cut = len(sampled) < len(completion.token_ids)
        finish = "length" if (completion.truncated or cut) else "stop"
        if stop:
            with TOKENIZER_LOCK:
                at = self._stop_at(sampled, stop)
            if at is not None:
                sampled, cut, finish = sampled[:at], True, "stop"
                logprobs = None if logprobs is None else logprobs[:at]
                versions = None if versions is None else versions[:at]
        if cut:
            with TOKENIZER_LOCK:
                text = self.tokenizer.decode(sampled, skip_special_tokens=True)
        else:
            text = completion.text
        if stop:
            text = _before_stop(text, stop)
        with self._lock:
            if self.ended is not None and self.ended not in ("length", "max_turns"):
                # it timed out (or failed) while the engine sampled: nothing more is recorded
                raise EpisodeOver("ended", self._over_message())
            turn = ModelTurn(
                index=len(self._nodes),
                ids=sampled,
                text=text,
                logprobs=logprobs,
                finish_reason=finish,
                prompt_tokens=len(context),
                message={"role": "assistant", "content": text},
            )
            between = len(context) - (len(parent.ids) if parent is not None else 0)
            base_mask = parent.mask if parent is not None else []
            base_logprobs = parent.logprobs if parent is not None else []
            base_versions = parent.versions if parent is not None else []
            node = _Node(
                turn=turn,
                parent=parent,
                ids=context + sampled,
                mask=base_mask + [0] * between + [1] * len(sampled),
                logprobs=None
                if (logprobs is None or base_logprobs is None)
                else base_logprobs + [0.0] * between + logprobs,
                versions=None
                if (versions is None or base_versions is None)
                else base_versions + [(base_versions or versions or [0])[-1]] * between + versions,  # mask 0: unread
                root=root,
                conversation=None if conversation is None else list(conversation),
                at_budget=finish == "length" and len(sampled) >= left,
            )
            if self._nodes and parent is not self._latest:
                self.rewrites += 1
            self._nodes.append(node)
            self._latest = node
            return turn

    def fail(self, problem: str) -> None:
        with self._lock:
            if self.ended in (None, "length", "max_turns"):
                self.ended, self.problem = "error", problem

    # ------------------------------------------------------------------ the core's side

    @property
    def turns(self) -> int:
        return len(self._nodes)

    def close(self, reason: str) -> None:
        """No more turns: the episode returned (``"returned"``), timed out or failed."""
        with self._lock:
            if self.ended is None or (reason != "returned" and self.ended in ("length", "max_turns")):
                self.ended = reason

    def record(self) -> DrivenRecord | None:
        """The trained chain (``None`` when the episode had no turn)."""
        with self._lock:
            node = self._latest
            if node is None:
                return None
            sampled = sum(len(n.turn.ids) for n in self._nodes)
            messages = None if node.conversation is None else [*node.conversation, dict(node.turn.message)]
            root, calls = node, 0
            while True:  # the chain's first turn, and the tool calls its answers made
                calls += len(root.turn.message.get("tool_calls") or [])
                if root.parent is None:
                    break
                root = root.parent
            return DrivenRecord(
                context=node.ids[: node.root],
                ids=node.ids[node.root :],
                mask=node.mask[node.root :],
                logprobs=None if node.logprobs is None else node.logprobs[node.root :],
                versions=None if node.versions is None else node.versions[node.root :],
                messages=messages,
                prompt_messages=len(root.conversation or []) if messages is not None else 0,
                text=str(node.turn.message.get("content") or node.turn.text),
                turns=len(self._nodes),
                truncated=node.at_budget,
                history_rewrites=self.rewrites,
                untrained_tokens=sampled - sum(node.mask),
                tool_calls=calls,
            )

    def _check_open(self) -> None:
        if self.ended in (None, "length", "max_turns"):
            if self.ended == "length":
                raise EpisodeOver("length", "the episode's token budget is spent (trl.max_completion_length)")
            if self.ended == "max_turns":
                raise EpisodeOver("max_turns", f"the episode has had its {self.max_turns} model turns")
            return
        if self.ended == "returned":
            self.late_calls += 1
        raise EpisodeOver("ended", self._over_message())

    def _over_message(self) -> str:
        why = {
            "returned": "its agent already returned",
            "timeout": "it ran past its timeout",
            "error": f"it failed ({self.problem})" if self.problem else "it failed",
        }.get(self.ended or "", str(self.ended))
        return f"the episode is over: {why}"

    def _end(self, reason: str) -> None:
        if self.ended is None:
            self.ended = reason

    def _node_of(self, turn: ModelTurn) -> _Node:
        index = getattr(turn, "index", -1)
        if not isinstance(index, int) or not 0 <= index < len(self._nodes) or self._nodes[index].turn is not turn:
            raise GrpoError("EpisodeModel: 'after' is not a turn of this episode")
        return self._nodes[index]

    def _stop_at(self, ids: list[int], stop: list[str]) -> int | None:
        """How many ids to keep: up to the token that completes the first
        stop string (what an engine that stops on strings keeps)."""
        if not any(s and s in self.tokenizer.decode(ids, skip_special_tokens=True) for s in stop):
            return None
        text = ""
        for i in range(len(ids)):
            text = self.tokenizer.decode(ids[: i + 1], skip_special_tokens=True)
            if any(s and s in text for s in stop):
                return i + 1
        return None


def _before_stop(text: str, stop: list[str]) -> str:
    """The text up to the first stop string (which an OpenAI server leaves out)."""
    cuts = [text.find(s) for s in stop if s and s in text]
    return text[: min(cuts)] if cuts else text


# ---------------------------------------------------------------------------- running episodes


@dataclass
class DrivenJob:
    """One driven episode to run: its episode object, its model, and (once
    run) ``("ok", reward)``, ``("error", exception)`` or ``("timeout", None)``."""

    episode: Any
    model: DrivenModel
    timeout: float
    outcome: tuple[str, Any] = ("timeout", None)
    done: threading.Event = field(default_factory=threading.Event)
    deadline: float = 0.0


def drive_all(jobs: list[DrivenJob], limit: int, batcher: TurnBatcher) -> None:
    """Run every job's ``drive``, at most ``limit`` at once, each cut at its
    own timeout (counted from its start). A job still running then is
    abandoned in a daemon thread and its model closed, so its agent's later
    requests are refused; it can never hold up the run. When the engine
    fails, the jobs not started yet are not started, and the ones running
    get :data:`FATAL_GRACE_SECONDS` to notice."""
    waiting = list(jobs)
    running: list[DrivenJob] = []
    changed = threading.Condition()

    def work(job: DrivenJob) -> None:
        outcome: tuple[str, Any]
        try:
            outcome = ("ok", job.episode.drive(job.model))
        except BaseException as exc:  # noqa: BLE001 - reported per episode
            outcome = ("error", exc)
        job.model.close("returned")
        with changed:
            if not job.done.is_set():  # a job abandoned at its deadline keeps "timeout"
                job.outcome = outcome
                job.done.set()
            changed.notify_all()

    with changed:
        while waiting or running:
            now = time.monotonic()
            for job in list(running):
                if job.done.is_set():
                    running.remove(job)
                elif now >= job.deadline:
                    job.model.close("timeout")
                    job.outcome = ("timeout", None)
                    job.done.set()
                    running.remove(job)
            if batcher.fatal is not None:
                for job in waiting:
                    job.outcome = ("error", EpisodeOver("unavailable", batcher._unavailable()))
                waiting.clear()
                for job in running:
                    job.deadline = min(job.deadline, now + FATAL_GRACE_SECONDS)
            while waiting and len(running) < max(1, limit):
                job = waiting.pop(0)
                job.deadline = time.monotonic() + job.timeout
                running.append(job)
                threading.Thread(target=work, args=(job,), name="grpo-driven-episode", daemon=True).start()
            batcher.set_running(sum(not job.done.is_set() for job in running))
            if running:
                changed.wait(max(0.01, min(j.deadline for j in running) - time.monotonic()))
