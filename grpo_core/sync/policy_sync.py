"""The policy's weights to the engine, every rank together.

Every rank calls :meth:`PolicySync.sync` (FSDP and ZeRO-3 gather the full
weights as a collective); rank 0 alone runs the ``weight_sync`` plugin through
the :class:`~grpo_core.sync.verify.SyncVerifier`, which checks the engine then
serves what was synced. The other ranks wait for its outcome: a sync that
raises on rank 0 raises on every rank, so all of them stop and checkpoint
together instead of hanging in the next step's collectives.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from grpo_core.contract.errors import GrpoError, shareable_error
from grpo_core.contract.types import PAUSES_GENERATION, in_flight_updater
from grpo_core.sync.between_batches import between_batches
from grpo_core.sync.verify import SyncVerifier, sampled_tokens_can_check

if TYPE_CHECKING:
    import torch
    from pluggy import HookRelay

    from grpo_core.config.schema import GRPOConfig
    from grpo_core.contract.types import InferenceEngine
    from grpo_core.generation.producer import Producer
    from grpo_core.parallel import TrainingBackend
    from grpo_core.runtime.distributed import Distributed


def run_verifier(
    cfg: GRPOConfig,
    model: torch.nn.Module,
    engine: InferenceEngine | None,
    tokenizer: Any,
    precision: Any,
    dist: Distributed,
    log: Callable[[str], None],
) -> SyncVerifier:
    """The run's sync check (``verify_weight_sync``): rank 0 syncs, so rank 0
    checks; with ``"every"`` the sampled tokens stand in for the probe where
    they can, and one line says why where they cannot."""
    mode = cfg.verify_weight_sync if dist.is_main else "never"
    why_not = sampled_tokens_can_check(cfg, model, not dist.active) if mode == "every" else None
    verifier = SyncVerifier.build(mode, engine, tokenizer, precision, log, sampled=mode == "every" and why_not is None)
    if why_not is not None and verifier.active:
        log(
            "verify_weight_sync = 'every': the probe checks every sync (the sampled tokens cannot stand in for it: "
            f"{why_not})"
        )
    return verifier


class PolicySync:
    """Pushes a policy version to the engine once, verified, on every rank's terms."""

    def __init__(
        self,
        hook: HookRelay,
        engine: InferenceEngine | None,
        backend: TrainingBackend,
        dist: Distributed,
        producer: Producer,
        verifier: SyncVerifier,
        in_flight: bool = False,
    ) -> None:
        self.hook = hook
        self.in_flight = in_flight  # trl.in_flight_weight_updates: the engine pauses, loads and resumes
        self.engine = engine
        self.backend = backend
        self.dist = dist
        self.producer = producer
        self.verifier = verifier
        self.last_version = -1  # the version the engine serves; -1 before the first sync

    def sync(self, version: int) -> None:
        """Make the engine serve ``version`` (nothing to do if it already does)."""
        if version == self.last_version:
            return
        failure: Exception | None = None
        model = self.backend.full_model(version)  # a collective under FSDP/ZeRO-3
        if self.dist.is_main:
            try:
                self.verifier.sync(lambda: self._push(model, version), model, version)
            except Exception as exc:
                failure = exc
        if self.dist.active:  # instead of a barrier: every rank learns whether the sync took
            shared = self.dist.broadcast(None if failure is None else shareable_error(failure))
            failure = failure if failure is not None else shared
        if failure is not None:
            raise failure
        self.last_version = version
        self.producer.weights_synced(version)

    def _push(self, model: Any, version: int) -> Any:
        """The weight_sync hook; with in-flight updates, inside the engine's
        pause (requests in flight keep what they sampled with the old
        weights and go on with the new ones, their tokens versioned);
        without, its load waits for the batch a producer thread is making
        (:mod:`grpo_core.sync.between_batches`: every token of a batch is
        its label's version)."""
        if not self.in_flight:
            pause, synced = self.producer.paused, lambda: self.producer.weights_synced(version)
            with between_batches(self.engine, pause, synced) as engine:
                return self.hook.grpo_sync_weights(model=model, version=version, engine=engine)
        update = in_flight_updater(self.engine)
        if update is None:
            raise GrpoError(
                f"trl.in_flight_weight_updates: the rollout's engine ({getattr(self.engine, 'description', None)}) "
                f"does not declare '{PAUSES_GENERATION}': set trl.in_flight_weight_updates = false."
            )
        result: list[Any] = []
        update(
            version,
            lambda: result.append(self.hook.grpo_sync_weights(model=model, version=version, engine=self.engine)),
        )
        return result[0] if result else None

    def verify_now(self) -> None:
        """Check a sync still waiting for its sampled-token check with the
        probe now: before the engine samples for anything but training."""
        self.verifier.flush()
