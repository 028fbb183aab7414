"""In-flight weight updates on vLLM servers: pause, load, resume, and which
tokens each version sampled (``trl.in_flight_weight_updates``).

vLLM 0.32's ``POST /pause`` (dev mode) takes a ``mode``: ``"abort"``
(default) aborts every request in flight; their answers come back at once
with ``finish_reason = "abort"`` and the tokens sampled so far (with their
log-probs); ``"wait"`` waits for them to finish (what this feature exists
to avoid); ``"keep"`` freezes them in the scheduler and goes on with them
after ``/resume``, but nothing tells the client how many tokens each had
before the pause (a non-streamed answer arrives whole at the end). Requests
that reach the server while it is paused are queued and run after
``/resume``.

So an update here is ``/pause?mode=abort``, the server-side load (the
weight sync prepares its files first, outside the pause), ``/resume``, and a
request cut by the pause goes on as a new request whose prompt is its prompt
plus the exact ids sampled so far, with what is left of ``max_tokens``: the
tokens of the first answer are the old version's, those of the continuation
the new one's (its prompt, the old tokens included, is computed again under
the new weights: the KV cache is not carried over). Every token's version is
known by construction, never guessed from timing.

One case is ambiguous: an answer that finished normally (not aborted) but
was read after a pause began. It either finished before the pause (old
weights) or reached the server during the pause and ran after the resume
(new weights). Its tokens are thrown away and the sample is generated again
(counted in :attr:`InFlightGate.regenerated`); the window is the time one
answer takes to cross the socket, so this is rare.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from grpo_core.plugin_api import GrpoError

COSTS = ("pause_seconds", "load_seconds", "resume_seconds", "recomputed_tokens")
"""What in-flight updates cost, per step (metrics ``inflight/<name>``): the ``/pause`` and ``/resume``
round trips and the load between them (each phase runs on every server at once: its wall time), and
the tokens the continuations' prompts hold (the prompt and the ids sampled before the cut: computed
again under the new weights, the KV cache is not carried over)."""


class InFlightGate:
    """The version the engine's servers sample, and the pause window.

    A request takes a :meth:`ticket` (waiting while an update runs) right
    before it is sent; :meth:`update` closes the gate, counts the pause
    before ``/pause`` is sent, and sets the new version before the gate
    opens again."""

    def __init__(self, version: int = 0) -> None:
        self._cond = threading.Condition()
        self.version = version
        self.pauses = 0
        self.regenerated = 0  # samples generated again because their answer was ambiguous
        self._updating = False
        self._costs = dict.fromkeys(COSTS, 0.0)  # since the last take_costs(): what the updates cost

    def add_cost(self, name: str, amount: float) -> None:
        """Count ``amount`` of one of :data:`COSTS` (any thread)."""
        with self._cond:
            self._costs[name] += amount

    def take_costs(self) -> dict[str, float]:
        """The costs counted since the last call, as ``inflight/<name>`` metrics; the counts start again."""
        with self._cond:
            costs, self._costs = self._costs, dict.fromkeys(COSTS, 0.0)
        return {f"inflight/{name}": value for name, value in costs.items()}

    def ticket(self) -> tuple[int, int]:
        """``(version, pauses)`` for a request about to be sent."""
        with self._cond:
            self._cond.wait_for(lambda: not self._updating)
            return self.version, self.pauses

    def count_regenerated(self, count: int) -> None:
        with self._cond:
            self.regenerated += count

    def pauses_now(self) -> int:
        with self._cond:
            return self.pauses

    @contextmanager
    def update(self, version: int) -> Iterator[None]:
        """Closed for new requests inside; the pause is counted on entry.
        ``version`` is recorded only when the block succeeds (a failed load
        leaves the old weights, so the old version)."""
        with self._cond:
            self._cond.wait_for(lambda: not self._updating)
            self._updating = True
            self.pauses += 1
        ok = False
        try:
            yield
            ok = True
        finally:
            with self._cond:
                if ok:
                    self.version = version
                self._updating = False
                self._cond.notify_all()


@dataclass
class Partial:
    """One sample being generated, piece by piece across updates."""

    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # set when the sample is finished

    def add(self, piece: dict[str, Any], version: int) -> None:
        """Append one answer's tokens, all sampled by ``version``."""
        ids = [int(t) for t in piece["token_ids"]]
        raw = (piece.get("logprobs") or {}).get("token_logprobs")
        if raw is None or len(raw) != len(ids):
            raise ValueError(f"an answer has {0 if raw is None else len(raw)} log-probs for {len(ids)} tokens")
        self.token_ids += ids
        self.logprobs += [float(x) for x in raw]
        self.versions += [version] * len(ids)
        self.text += str(piece.get("text") or "")

    def continuation_prompt(self) -> list[int]:
        return self.prompt_ids + self.token_ids


def choices_by_prompt(data: dict[str, Any], prompts: list[list[int]], n: int) -> list[list[dict[str, Any]]]:
    """An answer's choices, ``n`` per prompt in order. Raises ValueError on
    one that does not fit the request (the client retries those)."""
    choices = sorted(data["choices"], key=lambda c: c["index"])
    if len(choices) != len(prompts) * n:
        raise ValueError(f"expected {len(prompts) * n} choices, got {len(choices)}")
    out: list[list[dict[str, Any]]] = [[] for _ in prompts]
    for pos, choice in enumerate(choices):
        if choice.get("prompt_token_ids") not in (None, prompts[pos // n]):
            raise ValueError(f"choice {choice['index']} answers a different prompt")
        if choice.get("token_ids") is None:
            raise ValueError(f"choice {choice['index']} has no token_ids")
        out[pos // n].append(choice)
    return out


def settle(
    partials: list[Partial], pieces: list[dict[str, Any]], version: int, crossed: bool, max_tokens: int
) -> tuple[list[Partial], int]:
    """Fold one prompt's choices (one per partial, in order) into
    ``partials``; return those still to generate and how many start again
    from nothing. ``crossed``: a pause began while the request was out.

    An aborted choice keeps its tokens (sampled by ``version`` before the
    pause) and goes on. A choice that finished keeps its tokens too when a
    sibling was aborted (the prompt was in the engine at the pause, so it
    finished before it); read across a pause with no sibling aborted it is
    ambiguous (see the module's docstring) and starts again."""
    aborted = any(piece.get("finish_reason") == "abort" for piece in pieces)
    if aborted and not crossed:
        raise GrpoError(
            "the vLLM server aborted a request that no weight update of this run paused: another client paused or "
            "aborted it (a shared server?)"
        )
    todo: list[Partial] = []
    restarted = 0
    for partial, piece in zip(partials, pieces, strict=True):
        if crossed and not aborted:
            partial.token_ids, partial.logprobs, partial.versions, partial.text = [], [], [], ""
            todo.append(partial)
            restarted += 1
            continue
        partial.add(piece, version)
        reason = piece.get("finish_reason")
        if reason != "abort":
            partial.finish_reason = str(reason)
        elif len(partial.token_ids) >= max_tokens:  # cut at its last allowed token
            partial.finish_reason = "length"
        else:
            todo.append(partial)
    return todo, restarted


def generate_across_updates(
    gate: InFlightGate,
    send: Callable[[list[list[int]], int, int], list[list[dict[str, Any]]]],
    prompt_ids: list[list[int]],
    n: int,
    max_tokens: int,
) -> list[list[Partial]]:
    """``n`` samples of each prompt, each finished whatever updates land
    meanwhile. ``send(prompts, n, already)`` sends one request (``already``:
    tokens each of its prompts already holds, so the request asks for
    ``max_tokens - already`` more) and returns each prompt's choices (raw
    JSON). Continuations are grouped by how many tokens they hold (one
    request per group, with what is left of ``max_tokens``), all groups in
    flight at once."""
    results = [[Partial(list(p)) for _ in range(n)] for p in prompt_ids]
    todo: list[Partial] = []
    version, pauses = gate.ticket()
    answers = send(prompt_ids, n, 0)
    crossed = gate.pauses_now() != pauses
    for partials, pieces in zip(results, answers, strict=True):
        left, restarted = settle(partials, pieces, version, crossed, max_tokens)
        todo += left
        gate.count_regenerated(restarted)
    while todo:
        by_length: dict[int, list[Partial]] = {}
        for partial in todo:
            by_length.setdefault(len(partial.token_ids), []).append(partial)
        todo = []

        def go_on(already: int, group: list[Partial]) -> list[Partial]:
            version, pauses = gate.ticket()
            gate.add_cost("recomputed_tokens", float(sum(len(p.continuation_prompt()) for p in group)))
            answers = send([p.continuation_prompt() for p in group], 1, already)
            crossed = gate.pauses_now() != pauses
            left: list[Partial] = []
            for partial, pieces in zip(group, answers, strict=True):
                more, restarted = settle([partial], pieces, version, crossed, max_tokens)
                left += more
                gate.count_regenerated(restarted)
            return left

        groups = sorted(by_length.items())
        if len(groups) == 1:
            todo = go_on(*groups[0])
            continue
        with ThreadPoolExecutor(max_workers=len(groups), thread_name_prefix="grpo-vllm-continue") as pool:
            for left in pool.map(lambda item: go_on(*item), groups):  # all in flight at once: the server batches them
                todo += left
    return results
