"""Which version sampled each token when a weight update lands mid-request
(plugins/vllm/inflight.py), without a server: ``send`` is a script of what
vLLM 0.32 answers (checked against the real server by
tests/e2e/vllm/test_inflight_updates.py): an update that lands while a
request is out aborts it, and its answer carries the tokens sampled so far
with ``finish_reason = "abort"``."""

from __future__ import annotations

import pytest

from grpo_core.contract.errors import GrpoError
from grpo_plugins.vllm.inflight import InFlightGate, generate_across_updates

PROMPT = [1, 2, 3]


def choice(ids: list[int], reason: str, base: float = -0.5) -> dict:
    return {"token_ids": ids, "text": "".join(f"<{t}>" for t in ids), "finish_reason": reason,
            "logprobs": {"token_logprobs": [base - i for i in range(len(ids))]}}  # fmt: skip


class Script:
    """Answers requests in order; ``update_on`` lists the calls during which
    a weight update (to the gate's next version) lands."""

    def __init__(self, gate: InFlightGate, answers: list[list[list[dict]]], update_on: set[int]) -> None:
        self.gate, self.answers, self.update_on = gate, answers, update_on
        self.sent: list[tuple[list[list[int]], int, int]] = []

    def __call__(self, prompts: list[list[int]], n: int, already: int) -> list[list[dict]]:
        call = len(self.sent)
        self.sent.append((prompts, n, already))
        if call in self.update_on:
            with self.gate.update(self.gate.version + 1):
                pass
        return self.answers[call]


def test_tokens_before_the_pause_keep_the_old_version_and_the_rest_get_the_new_one() -> None:
    gate = InFlightGate(version=3)
    send = Script(
        gate,
        [
            [[choice([7, 8], "abort"), choice([9], "stop")]],  # a sibling finished before the pause
            [[choice([10, 11, 12], "length", base=-2.0)]],  # the continuation, under version 4
        ],
        update_on={0},
    )
    ((first, second),) = generate_across_updates(gate, send, [PROMPT], 2, max_tokens=5)
    assert first.token_ids == [7, 8, 10, 11, 12]
    assert first.versions == [3, 3, 4, 4, 4]  # one version per sample ([3] * 5 or [4] * 5) fails here
    assert first.logprobs == [-0.5, -1.5, -2.0, -3.0, -4.0]  # each token's own sampler log-prob
    assert first.finish_reason == "length" and first.text == "<7><8><10><11><12>"
    assert second.token_ids == [9] and second.versions == [3] and second.finish_reason == "stop"
    # the continuation: the exact ids so far appended to the prompt, one sample, what is left of max_tokens
    assert send.sent[1] == ([PROMPT + [7, 8]], 1, 2)
    assert gate.regenerated == 0


def test_two_updates_during_one_sample_give_three_versions() -> None:
    gate = InFlightGate(version=0)
    send = Script(
        gate,
        [[[choice([5], "abort")]], [[choice([6], "abort")]], [[choice([7, 8], "stop")]]],
        update_on={0, 1},
    )
    ((only,),) = generate_across_updates(gate, send, [PROMPT], 1, max_tokens=8)
    assert only.token_ids == [5, 6, 7, 8] and only.versions == [0, 1, 2, 2]
    assert [s[0] for s in send.sent[1:]] == [[PROMPT + [5]], [PROMPT + [5, 6]]]
    # the continuations' prompts are computed again under the new weights: 4 + 5 tokens; counted once
    assert gate.take_costs()["inflight/recomputed_tokens"] == 9.0
    assert gate.take_costs()["inflight/recomputed_tokens"] == 0.0


def test_an_update_times_its_pause_load_and_resume_on_every_server() -> None:
    """``inflight/pause_seconds`` etc. (the cost model in benchmarks/RESULTS.md reads them): each
    phase of the pool's update is timed apart."""
    import time
    from types import SimpleNamespace

    from grpo_plugins.vllm.pool import VLLMEnginePool

    calls: list[str] = []

    class Client:
        def pause(self) -> None:
            calls.append("pause")
            time.sleep(0.05)

        def resume(self) -> None:
            calls.append("resume")
            time.sleep(0.02)

    members = [SimpleNamespace(server="managed", client=Client()) for _ in range(2)]
    pool = VLLMEnginePool(SimpleNamespace(log=print), members=members)  # type: ignore[arg-type]

    def load(member: object) -> None:
        calls.append("load")
        time.sleep(0.1)

    pool.update_in_flight(1, lambda: pool._load_each(load))
    assert calls == ["pause", "pause", "load", "load", "resume", "resume"]
    costs = pool.in_flight.take_costs()
    # each phase runs on both servers at once: its wall time, not the sum over servers
    assert 0.05 <= costs["inflight/pause_seconds"] < 0.5
    assert 0.02 <= costs["inflight/resume_seconds"] < 0.5
    assert 0.1 <= costs["inflight/load_seconds"] < 0.5
    assert pool.in_flight.version == 1


def test_an_answer_read_across_a_pause_with_nothing_aborted_is_sampled_again() -> None:
    # it finished before the pause, or reached the server during it and ran after: which weights is unknown
    gate = InFlightGate(version=1)
    send = Script(gate, [[[choice([5, 6], "stop")]], [[choice([7], "stop")]]], update_on={0})
    ((only,),) = generate_across_updates(gate, send, [PROMPT], 1, max_tokens=4)
    assert only.token_ids == [7] and only.versions == [2]
    assert send.sent[1] == ([PROMPT], 1, 0) and gate.regenerated == 1


def test_an_abort_no_update_of_ours_caused_is_an_error() -> None:
    gate = InFlightGate()
    with pytest.raises(GrpoError, match="no weight update of this run paused"):
        generate_across_updates(gate, Script(gate, [[[choice([5], "abort")]]], set()), [PROMPT], 1, max_tokens=4)


def test_a_failed_load_keeps_the_old_version() -> None:
    gate = InFlightGate(version=2)
    with pytest.raises(OSError), gate.update(3):
        raise OSError("disk full")
    assert gate.ticket() == (2, 1)  # the pause is counted (answers read across it are judged), the version is not


class _Client:
    def __init__(self, name: str, events: list[str], fail: dict[str, BaseException]) -> None:
        self.name, self.events, self.fail, self.base_url = name, events, fail, f"http://{name}"

    def _call(self, what: str) -> None:
        self.events.append(f"{what} {self.name}")
        if what in self.fail:
            raise self.fail[what]

    def pause(self) -> None:
        self._call("pause")

    def resume(self) -> None:
        self._call("resume")


class _Server:
    """What the pool's in-flight update reads of a server (a managed one)."""

    server = "managed"

    def __init__(self, name: str, events: list[str], **fail: BaseException) -> None:
        self.client = _Client(name, events, fail)

    def load_adapter(self, path) -> None:
        self.client._call("load")


def _pool(*members: _Server):
    from types import SimpleNamespace

    from grpo_plugins.vllm.pool import VLLMEnginePool

    return VLLMEnginePool(SimpleNamespace(log=print), members=list(members))  # type: ignore[arg-type]


def test_a_pool_pauses_every_server_before_any_load_and_resumes_each_even_one_the_load_dropped() -> None:
    from grpo_core.contract.errors import EngineUnavailable

    events: list[str] = []
    gone = EngineUnavailable("server b stopped answering")
    a, b, c = _Server("a", events), _Server("b", events, load=gone), _Server("c", events)
    pool = _pool(a, b, c)
    pool.update_in_flight(1, lambda: pool.load_adapter("adapter"))
    assert sorted(events[:3]) == ["pause a", "pause b", "pause c"]  # all paused before any load
    assert sorted(events[3:6]) == ["load a", "load b", "load c"]
    assert sorted(events[6:]) == ["resume a", "resume b", "resume c"]  # b too: our requests may wait on it
    assert pool.live() == [a, c] and pool.in_flight.version == 1


def test_a_server_that_cannot_pause_fails_the_update_and_the_paused_ones_resume() -> None:
    from grpo_plugins.vllm.client import EngineRequestError

    events: list[str] = []
    refused = EngineRequestError("vLLM server at b has no /pause", 404)
    a, b = _Server("a", events), _Server("b", events, pause=refused)
    pool = _pool(a, b)
    with pytest.raises(EngineRequestError, match="no /pause"):
        pool.update_in_flight(1, lambda: pool.load_adapter("adapter"))
    assert sorted(events) == ["pause a", "pause b", "resume a"]  # nothing loaded; b was never paused
    assert pool.in_flight.version == 0 and pool.live() == [a, b]


def test_one_resume_failing_does_not_keep_the_others_paused() -> None:
    from grpo_core.contract.errors import EngineUnavailable

    events: list[str] = []
    a, b, c = _Server("a", events, resume=EngineUnavailable("a is gone")), _Server("b", events), _Server("c", events)
    pool = _pool(a, b, c)
    pool.update_in_flight(2, lambda: pool.load_adapter("adapter"))
    assert sorted(e for e in events if e.startswith("resume")) == ["resume a", "resume b", "resume c"]
    assert pool.live() == [b, c] and pool.in_flight.version == 2
