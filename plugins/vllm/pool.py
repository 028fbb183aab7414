"""Several vLLM servers as one :class:`~grpo_core.contract.types.InferenceEngine`.

Why a pool behind the same protocol, not a protocol that knows about
several engines: the weight syncs (ours and third-party ones) stay
unchanged. A sync calls ``load_*`` once; the pool runs it on every live
server in parallel and returns when all have the new weights. The rollout
asks the pool which servers are live and spreads whole prompt groups over
them (:meth:`VLLMEnginePool.shares`).

Servers come from ``trl.vllm_server_base_urls`` (external), or from
``[vllm] data_parallel_size`` > 1 in managed mode (grpo starts that many
separate servers, each its own process, socket and log
``vllm-server-<i>.log``). One server is a pool of one and behaves exactly
as before.

When a server fails: a managed one is restarted and given the last weights
again (:class:`~grpo_plugins.vllm.engine.VLLMServerEngine` does that); one
that cannot be recovered, or an external one that stopped answering (its
/health failing for :data:`DROP_GRACE_S` s while others are live), is
dropped with a warning and gets no more requests or syncs, while the others
carry on.
When the last one fails, its ``EngineUnavailable`` is raised as with a
single server.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from grpo_core.plugin_api import (
    ConfigError,
    ControlEndpoint,
    EngineScore,
    EngineUnavailable,
)
from grpo_plugins.vllm.engine import VLLMServerEngine
from grpo_plugins.vllm.inflight import InFlightGate
from grpo_plugins.vllm.placement import narrow_trainer_devices, placement_problems
from grpo_plugins.vllm.settings import vllm_settings

if TYPE_CHECKING:
    from grpo_core.plugin_api import RunContext

T = TypeVar("T")

DROP_GRACE_S = 15.0
"""While other servers are live, an external server that fails its /health
probe is waited for this long at most (or ``trl.vllm_server_timeout`` if
shorter) before it is dropped: the others carry on meanwhile, so there is
no point in waiting the whole timeout for one that is gone."""


def build_members(context: RunContext) -> list[VLLMServerEngine]:
    """The servers the config names, in order (managed ones are started,
    not awaited). ``[vllm] trainer_devices`` narrows this process's GPUs
    after the servers' environments were fixed."""
    cfg = context.config
    trl, v = cfg.trl, vllm_settings(cfg)
    problems = placement_problems(cfg)
    if problems:
        raise ConfigError(" ".join(problems))
    urls = list(trl.vllm_server_base_urls or [])
    if urls:
        if trl.vllm_server_base_url:
            raise ConfigError(
                "trl.vllm_server_base_url and trl.vllm_server_base_urls are both set: keep one (the list may hold one "
                "URL)."
            )
        if trl.vllm_managed:
            raise ConfigError(
                "trl.vllm_managed = true starts its own servers; remove trl.vllm_server_base_urls (or set "
                "trl.vllm_managed = false)."
            )
        if len(set(urls)) != len(urls):
            raise ConfigError(f"trl.vllm_server_base_urls lists a server twice: {urls}.")
        members = [VLLMServerEngine(context, url=url) for url in urls]
    elif v.data_parallel_size > 1 and trl.vllm_managed is not False:
        if trl.vllm_server_base_url:
            raise ConfigError(
                "[vllm] data_parallel_size > 1 starts that many managed servers, but trl.vllm_server_base_url names an "
                "external one: list external servers in trl.vllm_server_base_urls, or remove the URL."
            )
        members = []
        try:
            for replica in range(v.data_parallel_size):
                members.append(VLLMServerEngine(context, replica=replica))
        except BaseException:
            for member in members:
                member.shutdown()
            raise
    else:
        members = [VLLMServerEngine(context)]
    narrow_trainer_devices(cfg)
    return members


class VLLMEnginePool:
    """The rollout's engine: one or more :class:`VLLMServerEngine`."""

    def __init__(self, context: RunContext, members: list[VLLMServerEngine] | None = None) -> None:
        self.context = context
        self.log = context.log
        self.members: list[VLLMServerEngine] = members if members is not None else build_members(context)
        self.dropped: list[VLLMServerEngine] = []
        self._lock = threading.RLock()
        self._down_since: dict[int, float] = {}
        self.in_flight = InFlightGate()  # the version every server samples; an in-flight update's pause window
        self._updating_to: int | None = None  # inside update_in_flight: the version its loads install
        for member in self.members:
            if member.server is None and member.client.dead_check is None:
                # A request to an external server that went away stops retrying once the
                # others are known to carry on (managed servers: their process tells).
                member.client.dead_check = lambda m=member: self.gone(m)

    # ------------------------------------------------------------------ membership

    def live(self) -> list[VLLMServerEngine]:
        with self._lock:
            return list(self.members)

    def drop(self, member: VLLMServerEngine, error: BaseException) -> None:
        """Stop using ``member``; re-raise ``error`` when it was the last one."""
        with self._lock:
            if member not in self.members:
                if not self.members:
                    raise error
                return
            if len(self.members) == 1:
                raise error
            self.members.remove(member)
            self.dropped.append(member)
            left = ", ".join(m.client.base_url for m in self.members)
            first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
            self.log(
                f"WARNING: vLLM server at {member.client.base_url} dropped ({first_line}); "
                f"carrying on with {len(self.members)} server(s): {left}"
            )

    def gone(self, member: VLLMServerEngine) -> str | None:
        """Why a request to external ``member`` should stop retrying: it was
        ready once, has failed /health for :data:`DROP_GRACE_S` s, and other
        servers are live. ``None`` otherwise (keep retrying until
        ``trl.vllm_server_timeout``, as with a single server)."""
        if not member.ready or len(self.live()) < 2:
            return None
        if member.healthy():
            self._down_since.pop(id(member), None)
            return None
        since = self._down_since.setdefault(id(member), time.monotonic())
        if time.monotonic() - since < DROP_GRACE_S:
            return None
        return f"it has not answered /health for {DROP_GRACE_S:.0f} s, and other servers carry on"

    def probe(self) -> None:
        """Health-check every live external server (one GET /health each);
        with others live, one that stays unhealthy for :data:`DROP_GRACE_S`
        is dropped. Managed servers are checked by their process instead
        (a dead one is restarted when used)."""
        for member in self.live():
            # Not before it was first ready: an external server may still be loading its model.
            if member.server is None and member.ready and not member.healthy():
                if len(self.live()) < 2:
                    return  # the last one: the request path waits out trl.vllm_server_timeout
                try:
                    member.client.wait_healthy(timeout=min(member.timeout, DROP_GRACE_S))
                except EngineUnavailable as exc:
                    self.drop(member, exc)

    def each(self, action: Callable[[VLLMServerEngine], T], *, at_once: bool = True) -> list[T]:
        """Run ``action`` on every live server, all at once (or one after
        another with ``at_once=False``), after a health probe; a server that
        fails with ``EngineUnavailable`` is dropped (the error is raised only
        when none is left). Other errors propagate (a 4xx is a bug or a
        config problem, the same on every server)."""
        self.probe()
        members = self.live()
        if len(members) == 1:
            try:
                return [action(members[0])]
            except EngineUnavailable as exc:
                self.drop(members[0], exc)  # raises: it was the last one
                return []
        results: list[T] = []
        with ThreadPoolExecutor(
            max_workers=len(members) if at_once else 1, thread_name_prefix="grpo-vllm-pool"
        ) as pool:
            futures = [(m, pool.submit(action, m)) for m in members]
        errors: list[tuple[VLLMServerEngine, EngineUnavailable]] = []
        for member, future in futures:
            exc = future.exception()
            if exc is None:
                results.append(future.result())
            elif isinstance(exc, EngineUnavailable):
                errors.append((member, exc))
            else:
                raise exc
        for member, exc in errors:
            self.drop(member, exc)
        return results

    def shares(self, count: int, turn: int = 0) -> list[tuple[VLLMServerEngine, range]]:
        """Split ``count`` prompt groups over the live servers: contiguous,
        near-equal slices (whole groups: a group's completions all come from
        one server, in one request). When the split is uneven (fewer groups
        than servers, or a remainder), which servers take the larger shares
        rotates with ``turn`` (the rollout's call number): with streaming
        (``trl.streaming_partial_batch``) every chunk of one group would
        otherwise go to the first server and leave the others idle."""
        members = self.live()
        width = max(1, min(len(members), count))
        if count % width or width < len(members):
            k = turn % len(members)
            members = members[k:] + members[:k]
        used = members[:width]
        base, extra = divmod(count, len(used))
        out, start = [], 0
        for i, member in enumerate(used):
            size = base + (1 if i < extra else 0)
            out.append((member, range(start, start + size)))
            start += size
        return out

    # ------------------------------------------------------------------ InferenceEngine

    @property
    def capabilities(self) -> frozenset[str]:
        return frozenset.intersection(*(frozenset(m.capabilities) for m in self.live()))

    @property
    def description(self) -> str:
        members = self.live()
        if len(members) == 1:
            return members[0].description
        return f"{len(members)} vLLM servers (" + ", ".join(m.client.base_url for m in members) + ")"

    @property
    def served_model(self) -> str:
        return self.live()[0].served_model  # every load reaches every server: they agree

    @property
    def weight_label(self) -> str | None:
        labels = [m.weight_label for m in self.live()]
        return None if any(label is None for label in labels) else ",".join(labels)  # type: ignore[arg-type]

    @property
    def same_host(self) -> bool:
        return all(m.same_host for m in self.live())

    @property
    def cpu_cores(self) -> frozenset[int] | None:
        """The cores the servers' engines are pinned to (the trainer keeps off them)."""
        cores = frozenset().union(*(getattr(m, "cpu_cores", None) or () for m in self.members))
        return cores or None

    @property
    def weight_dtype(self) -> str | None:
        dtypes = {m.weight_dtype for m in self.live()}
        return dtypes.pop() if len(dtypes) == 1 else None

    def ensure_ready(self) -> None:
        self.each(lambda m: m.ensure_ready())

    def healthy(self) -> bool:
        return any(m.healthy() for m in self.live())

    def restart_if_dead(self) -> bool:
        return any(self.each(lambda m: m.restart_if_dead()))

    def ensure_weights(self) -> None:
        """Before generating, health-check every server: a managed one that
        died is restarted, one that lost our weights gets them again, an
        external one that does not answer /health is waited for
        (:meth:`probe`) and then dropped."""

        self.each(lambda m: m.ensure_weights())

    def load_weights_from_path(self, path: Path) -> None:
        self._load_each(lambda m: m.load_weights_from_path(path))

    def load_adapter(self, path: Path) -> None:
        self._load_each(lambda m: m.load_adapter(path))

    def load_adapter_from_url(self, url: str, token: str) -> None:
        self._load_each(lambda m: m.load_adapter_from_url(url, token))

    def load_weights_from_url(self, url: str, token: str) -> None:
        self._load_each(lambda m: m.load_weights_from_url(url, token))

    def load_weights(self, weights: Mapping[str, Any]) -> None:
        raise NotImplementedError(f"{self.description} cannot take weights in memory; use load_weights_from_path")

    def update_in_flight(self, version: int, load: Callable[[], None]) -> None:
        """``PAUSES_GENERATION``: run ``load`` (the weight sync) with every
        ``load_*`` call it makes inside a pause of every live server, so the
        pause lasts the server-side load alone, not the sync's own work
        (merging, writing files). Requests in flight end with what they
        sampled so far and the rollout goes on with them after the resume
        (:mod:`grpo_plugins.vllm.inflight`); tokens sampled from then on are
        recorded as ``version``. A failed load resumes on the old weights
        and raises. A sync that changes the weights without a ``load_*``
        call (``nccl``) is refused with in-flight updates by the config check."""
        self._updating_to = version
        try:
            load()
        finally:
            self._updating_to = None

    def _load_each(self, action: Callable[[VLLMServerEngine], None]) -> None:
        """``action`` on every live server; inside :meth:`update_in_flight`,
        between a pause and a resume of all of them."""
        version = self._updating_to
        if version is None:
            self.each(action)
            return
        gate = self.in_flight
        with gate.update(version):
            paused: list[VLLMServerEngine] = []

            def pause(member: VLLMServerEngine) -> None:
                member.client.pause()
                paused.append(member)

            try:
                self.probe()  # a server that is gone is dropped before the others are paused
                members = self.live()
                started = time.perf_counter()
                # all at once: one slow pause (seconds, docs/engines.md) keeps no other server paused longer
                with ThreadPoolExecutor(max_workers=len(members), thread_name_prefix="grpo-vllm-pause") as pool:
                    futures = [pool.submit(pause, m) for m in members]
                for future in futures:
                    future.result()  # a server that cannot be paused fails the update (the paused ones resume)
                gate.add_cost("pause_seconds", time.perf_counter() - started)
                started = time.perf_counter()
                self.each(action)
                gate.add_cost("load_seconds", time.perf_counter() - started)
            finally:
                started = time.perf_counter()
                self._resume(paused)
                gate.add_cost("resume_seconds", time.perf_counter() - started)

    def _resume(self, paused: list[VLLMServerEngine]) -> None:
        """Resume every server in ``paused``, all at once, whatever another's
        resume does: one dropped by the load is resumed too (requests of ours
        may still be queued on it), one that is gone is dropped. No health
        probe first: it could wait on a dead server while the others idle."""
        if not paused:
            return
        with ThreadPoolExecutor(max_workers=len(paused), thread_name_prefix="grpo-vllm-resume") as pool:
            futures = [(m, pool.submit(m.client.resume)) for m in paused]
        failed = [(m, f.exception()) for m, f in futures if f.exception() is not None]
        for member, exc in failed:
            if not isinstance(exc, EngineUnavailable):
                raise exc  # type: ignore[misc]
            self.drop(member, exc)

    def fused_modules(self) -> tuple[tuple[str, ...], ...]:
        return self.live()[0].fused_modules()

    def control_endpoints(self) -> list[ControlEndpoint]:
        """One endpoint per live server, in the pool's order (a dropped
        server is no longer listed)."""
        return [endpoint for member in self.live() for endpoint in member.control_endpoints()]

    def score_tokens(self, token_ids: Sequence[int]) -> list[EngineScore]:
        """Every live server scores the ids on its own, in the pool's order:
        a server a sync did not reach is told apart from the others. One
        after another (a probe takes a fraction of a second): two pool
        members may be one engine reached under two names, and vLLM's CPU
        LoRA path crashes when a probe shares a batch with another request
        (probe_gate.py); each member's gate knows only its own requests."""
        return [score for scores in self.each(lambda m: m.score_tokens(token_ids), at_once=False) for score in scores]

    def shutdown(self) -> None:
        for member in self.members + self.dropped:
            member.shutdown()
