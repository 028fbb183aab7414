"""Every weight sync proves itself: after the sync, the engine serves the
weights just synced.

Why: a sync that reports success without reaching the engine (an adapter
never loaded, a reload that failed silently, one server of a pool left
behind) looks like ordinary staleness for weeks. So after each sync
(``verify_weight_sync``), rank 0 scores a fixed probe of
:data:`PROBE_TOKENS` token ids twice: with the trainer's model (no grad,
eval mode, the run's autocast) and with every server of the engine
(:meth:`~grpo_core.contract.types.InferenceEngine.score_tokens`). The gap of a server
is the mean absolute difference of the per-token log-probs (robust: one
token's rounding cannot fail a check; its maximum is logged beside it).

What gap the same weights show depends on the two precisions (measured on
SmolLM2-135M, benchmarks/RESULTS.md): ~5e-6 nats per token with float32 on
both sides, ~0.03-0.055 when either side computes in bfloat16. The first
verified sync of a run measures this *noise floor* per server (it must be
under the precision's ceiling: an engine serving another model fails
there); every later sync must stay within ``factor x floor + margin`` of
its precision class (:data:`NOISE`). An engine whose dtype is unknown (an
external server) is put in a class by its measured floor, never by this
machine's CPU flags.

A sync that fails the check is run once more and checked again; then the
run stops (:class:`~grpo_core.contract.errors.WeightSyncUnverified`, caught by the
training loop, which saves a checkpoint first).

The sampled tokens stand in for the probe (``verify_weight_sync = "every"``,
single process, plain sampling, no dropout): the engine returns the
log-prob of every token it samples, and the next step's training forward
computes the trainer's log-prob of the same tokens under the same weights
(nothing has stepped since the sync). So after the first sync (probed) and
one step that measures the sampled tokens' own noise floor, a sync is
checked by comparing those two, during the next step and before its
optimizer step, at no cost (the probe took ~4% of a CPU step). A sync that
fails it is run again and then checked with the probe: the step's samples
came from the engine's older weights, the one-step staleness async
prefetch always has; a probe that fails stops the run before the optimizer
steps. Where no sampled tokens of the synced version reach the loss (a
policy loss that does not ask for IS weights, every micro-batch skipped,
several steps per generation), the probe runs then, on the same weights.
``"every_probe"`` probes right after every sync instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from grpo_core.contract.errors import EngineUnavailable, GrpoError, WeightSyncUnverified
from grpo_core.contract.types import (
    WEIGHTS_IN_MEMORY,
    EngineScore,
    engine_cpu_cores,
    token_scorer,
)
from grpo_core.optimization.logprobs import token_logprobs

PROBE_TEXT = (
    "The quick brown fox jumps over the lazy dog. 17 + 25 = 42, and the capital of France is Paris. "
    "Water boils at 100 degrees Celsius at sea level; ice melts at zero. def add(a, b): return a + b"
)
"""Fixed text, tokenized once with the run's tokenizer: words, numbers and
code, so the log-probs are neither all near 0 nor all tiny."""
PROBE_TOKENS = 48
"""Token ids in the probe: one forward of 48 tokens on each side."""

MODES = ("every", "every_probe", "first", "never")
SAMPLED = " (sampled tokens)"
"""Suffix of the floor key and description of an engine's sampled-token check."""


@dataclass(frozen=True)
class Noise:
    """How far apart the same weights may score in one precision class
    (mean |log-prob difference| per token, nats)."""

    name: str
    ceiling: float
    """The first check's limit: above it the engine serves other weights."""
    factor: float
    margin: float

    def bound(self, floor: float) -> float:
        """The limit of a later check, from the first check's gap."""
        return min(self.ceiling, self.factor * floor + self.margin)


FLOAT32 = Noise("float32", ceiling=1e-3, factor=4.0, margin=5e-5)
"""Both sides float32: 5.2e-6 mean, 2.1e-5 max measured (vLLM CPU vs torch)."""
HALF = Noise("16-bit", ceiling=0.25, factor=2.0, margin=0.03)
"""Either side bfloat16/float16: 0.031-0.055 mean, 0.13-0.46 max measured (base and LoRA-served)."""
NOISE = {"float32": FLOAT32, "16-bit": HALF}


def noise_class(trainer_dtype: str, engine_dtype: str | None, floor: float | None = None) -> Noise:
    """The precision class of a trainer/engine pair. An engine of unknown
    dtype is float32 when the trainer is and the measured ``floor`` is within
    float32's ceiling; otherwise (or before any measurement) 16-bit, the
    looser one."""
    if trainer_dtype != "float32":
        return HALF
    if engine_dtype is None:
        return FLOAT32 if floor is not None and floor <= FLOAT32.ceiling else HALF
    return FLOAT32 if engine_dtype.removeprefix("torch.") in ("float32", "float", "fp32") else HALF


def trainer_dtype_name(precision: Any) -> str:
    """``"float32"`` when the trainer computes and keeps its weights in
    float32, else the 16-bit dtype it uses (``grpo_core.modeling.precision.Precision``)."""
    for dtype in (precision.compute_dtype, precision.load_dtype):
        if dtype is not None and dtype != torch.float32:
            return str(dtype).removeprefix("torch.")
    return "float32"


@dataclass(frozen=True)
class ServerGap:
    """One server's comparison."""

    description: str
    mean: float
    max: float
    bound: float
    noise: str
    first: bool
    error: str = ""  # the server could not score the probe (the message)

    @property
    def ok(self) -> bool:
        return not self.error and self.mean <= self.bound

    def describe(self) -> str:
        if self.error:
            return f"{self.description}: {self.error}"
        basis = "the same weights in these precisions differ by at most" if self.first else "bound"
        return (
            f"{self.description}: mean |log-prob gap| {self.mean:.3g} per token (max {self.max:.3g}), "
            f"{basis} {self.bound:.3g} ({self.noise})"
        )


def compare(trainer: Sequence[float], score: EngineScore) -> tuple[float, float]:
    """(mean, max) absolute difference of two log-prob lists of one probe."""
    if len(score.logprobs) != len(trainer):
        raise ValueError(f"{score.description} scored {len(score.logprobs)} tokens, the trainer {len(trainer)}")
    diffs = [abs(a - b) for a, b in zip(trainer, score.logprobs, strict=True)]
    return sum(diffs) / len(diffs), max(diffs)


@dataclass
class Floors:
    """Each server's noise floor, set by its first verified check."""

    trainer_dtype: str
    engine_dtype: str | None
    floors: dict[str, float] = field(default_factory=dict)

    def judge(self, description: str, mean: float, worst: float) -> ServerGap:
        floor = self.floors.get(description)
        first = floor is None
        noise = noise_class(self.trainer_dtype, self.engine_dtype, mean if first else floor)
        bound = noise.ceiling if first else noise.bound(floor)
        return ServerGap(
            description,
            mean,
            worst,
            bound,
            f"{noise.name}: trainer {self.trainer_dtype}, engine "
            f"{self.engine_dtype or 'dtype unknown'}" + ("" if first else f", noise floor {floor:.3g}"),
            first,
        )

    def accept(self, gaps: list[ServerGap]) -> None:
        for gap in gaps:
            if gap.ok and gap.first:
                self.floors[gap.description] = gap.mean


@dataclass
class Verification:
    """One check of one sync: every server's gap, and what it cost."""

    version: int
    gaps: list[ServerGap]
    seconds: float

    @property
    def ok(self) -> bool:
        return bool(self.gaps) and all(g.ok for g in self.gaps)

    def failures(self) -> str:
        return "; ".join(g.describe() for g in self.gaps if not g.ok) or "no server scored the probe"


def probe_ids(tokenizer: Any, tokens: int = PROBE_TOKENS) -> list[int]:
    """The probe: :data:`PROBE_TEXT` in the run's tokenizer, ``tokens`` ids."""
    ids = [int(i) for i in tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"]][:tokens]
    if len(ids) < 8:
        raise GrpoError(f"verify_weight_sync: the tokenizer makes only {len(ids)} tokens of the probe text")
    return ids


def trainer_logprobs(model: Any, ids: Sequence[int], precision: Any) -> list[float]:
    """The trainer's log-prob of each probe token after the first, as the
    training forward computes them (the run's autocast; eval mode so that
    dropout is off; no grad)."""
    device = next(model.parameters()).device
    input_ids = torch.tensor([list(ids)], device=device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), precision.autocast(device.type, model):
            logps, _ = token_logprobs(model, input_ids, torch.ones_like(input_ids), len(ids) - 1)
    finally:
        model.train(was_training)
    return [float(x) for x in logps[0].float().cpu()]


def overlaps(engine: Any) -> bool:
    """Whether the engine may score the probe while the trainer computes its
    side: only where it computes elsewhere (another machine, or CPU cores of
    its own). An engine sharing the trainer's cores would only contend with
    it (measured: slower than one after the other), and one in this process
    (weights in memory) must not run beside the trainer's forward."""
    if engine is None or WEIGHTS_IN_MEMORY in getattr(engine, "capabilities", ()):
        return False
    return not getattr(engine, "same_host", True) or engine_cpu_cores(engine) is not None


@dataclass
class SampledGap:
    """The running |trainer - engine| log-prob gap over one policy version's
    sampled tokens, summed over the micro-batches of a step. Kept as tensors
    on the batch's device, read once in :meth:`SyncVerifier.settle` (no
    device sync per micro-batch)."""

    version: int
    total: Any = 0.0
    worst: Any = 0.0
    tokens: Any = 0
    seconds: float = 0.0

    def add(self, trainer_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor) -> None:
        keep = mask.bool() & torch.isfinite(sampler_logps) & torch.isfinite(trainer_logps)
        diffs = torch.where(keep, (trainer_logps.float() - sampler_logps.float()).abs(), 0.0)
        self.total = self.total + diffs.sum()
        self.worst = torch.clamp(diffs.max(), min=self.worst) if diffs.numel() else self.worst
        self.tokens = self.tokens + keep.sum()

    def read(self) -> tuple[float, float, int]:
        """(mean, max, tokens); the mean is 0.0 when no token was kept."""
        tokens = int(self.tokens)
        return (float(self.total) / tokens if tokens else 0.0), float(self.worst), tokens


def sampled_tokens_can_check(cfg: Any, model: Any, single_process: bool) -> str | None:
    """Why the training forward's log-probs of the sampled tokens cannot
    stand in for the probe in this run, or None when they can: they must be
    what the engine computed when it sampled (one process, whose batches are
    all its own; sampling without filters or penalties, which the engine's
    log-probs include and the trainer's do not; no dropout in the training
    forward; batches sampled from the weights just synced, not prefetched)."""
    trl = cfg.trl
    if not single_process:
        return "several processes"
    if trl.async_prefetch:
        return "trl.async_prefetch samples from the weights before the last sync"
    filters = {
        "top_k": (trl.top_k or 0) > 0,
        "top_p": (trl.top_p or 1.0) < 1.0,
        "min_p": (trl.min_p or 0.0) > 0,
        "repetition_penalty": (trl.repetition_penalty or 1.0) != 1.0,
        "generation_kwargs": bool(trl.generation_kwargs),
    }
    named = [key for key, on in filters.items() if on]
    if named:
        return f"trl.{named[0]} changes the engine's log-probs"
    if dropout_active(model):
        return "dropout in the training forward"
    return None


def dropout_active(model: Any) -> bool:
    """A dropout module or a ``*dropout*`` / ``*_pdrop`` rate above zero in
    the model's config (attention dropout is applied inside the kernel)."""
    if any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules()):
        return True
    config = getattr(model, "config", None)
    items = config.to_dict().items() if hasattr(config, "to_dict") else ()
    return any(
        ("dropout" in key or key.endswith("_pdrop")) and isinstance(value, (int, float)) and value > 0
        for key, value in items
    )


class SyncVerifier:
    """Runs the run's weight syncs and checks each one (the trainer calls
    :meth:`sync` on rank 0 instead of calling the hook itself; with
    ``sampled`` it also calls :meth:`observe` with each micro-batch's
    log-probs and :meth:`settle` before each optimizer step)."""

    def __init__(
        self,
        mode: str,
        engine: Any,
        ids: list[int] | None,
        precision: Any,
        log: Callable[[str], None] = print,
        sampled: bool = False,
    ) -> None:
        self.mode = mode
        self.engine = engine
        self.ids = ids
        self.precision = precision
        self.log = log
        self.score = token_scorer(engine)
        self.overlap = overlaps(engine)
        self.floors = Floors(trainer_dtype_name(precision), getattr(engine, "weight_dtype", None))
        self.checks = 0  # syncs checked so far
        self._pending: list[Verification] = []
        self._retries = 0
        # the sampled-token check: the trainer's samples can stand in for the probe (see the module's docstring)
        self.sampled = sampled and mode == "every" and self.score is not None
        self._probed: int | None = None  # the version the last passed probe verified (calibrates the sampled floor)
        self._deferred: tuple[int, Callable[[], Any], Any] | None = (
            None  # (version, its sync, model): waits for its check
        )
        self._gap: SampledGap | None = None
        if mode != "never" and self.score is None:
            self.log(
                f"verify_weight_sync = '{mode}': "
                + (
                    "the rollout samples the trainer's own model, so there is no engine whose weights could be stale: "
                    "nothing to verify"
                    if engine is None
                    else f"{getattr(engine, 'description', type(engine).__name__)} cannot score tokens (no "
                    "'scores_tokens' capability): weight syncs are not verified"
                )
            )

    @classmethod
    def build(
        cls, mode: str, engine: Any, tokenizer: Any, precision: Any, log: Callable[[str], None], sampled: bool = False
    ) -> SyncVerifier:
        """``mode``: the config's ``verify_weight_sync``; the probe is tokenized here, once."""
        ids = probe_ids(tokenizer) if mode != "never" and token_scorer(engine) is not None else None
        return cls(mode, engine, ids, precision, log, sampled)

    @property
    def waiting(self) -> bool:
        """A synced version waits for its (sampled-token) check."""
        return self._deferred is not None

    @property
    def active(self) -> bool:
        return self.mode != "never" and self.score is not None and self.ids is not None

    def due(self) -> bool:
        return self.active and (self.mode in ("every", "every_probe") or self.checks == 0)

    @property
    def _sampled_key(self) -> str:
        return getattr(self.engine, "description", "the engine") + SAMPLED

    def _may_defer(self) -> bool:
        """The sampled tokens can check this sync: their floor is known."""
        return self.sampled and self._sampled_key in self.floors.floors

    def check(self, model: Any, version: int) -> Verification:
        """Score the probe on both sides and judge every server."""
        assert self.score is not None and self.ids is not None
        start = time.perf_counter()
        # The engine scores while the trainer computes its side where it has cores of its own (overlaps())
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="grpo-sync-check") as pool:
            asked = pool.submit(self.score, self.ids) if self.overlap else None
            mine = trainer_logprobs(model, self.ids, self.precision)
        try:
            scores = asked.result() if asked is not None else self.score(self.ids)
        except EngineUnavailable:
            raise
        except GrpoError as exc:  # the engine answered but could not serve the probe (e.g. the adapter is unknown)
            description = getattr(self.engine, "description", "the engine")
            line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            gaps = [ServerGap(description, float("inf"), float("inf"), 0.0, "", True, error=line)]
            return Verification(version, gaps, time.perf_counter() - start)
        # read now, not when built: an external server tells its dtype once it has answered (ensure_ready)
        self.floors.engine_dtype = getattr(self.engine, "weight_dtype", None)
        gaps = [self.floors.judge(s.description, *compare(mine, s)) for s in scores]
        return Verification(version, gaps, time.perf_counter() - start)

    def sync(self, run_sync: Callable[[], Any], model: Any, version: int) -> None:
        """``run_sync()`` (the weight_sync hook), then the check when due:
        the probe now, or the sampled tokens' check during the next step
        (:meth:`settle`)."""
        run_sync()
        if not self.due():
            return
        if self._may_defer():
            self._deferred = (version, run_sync, model)
            return
        self._probe(run_sync, model, version)

    def _probe(self, run_sync: Callable[[], Any], model: Any, version: int, failed: Verification | None = None) -> None:
        """The probe's check of ``version``; on a failed check (or after
        ``failed``, a failed sampled check) one more sync and probe, then
        :class:`WeightSyncUnverified`."""
        result = failed
        if result is None:
            result = self.check(model, version)
            self._pending.append(result)
        if not result.ok:
            self.log(f"weight sync of policy version {version} not verified ({result.failures()}); syncing again")
            self._retries += 1
            run_sync()
            result = self.check(model, version)
            self._pending.append(result)
            if not result.ok:
                raise WeightSyncUnverified(
                    f"weight sync of policy version {version} did not reach the engine (checked again after a second "
                    f"sync): {result.failures()}. The engine would sample from other weights than the trainer's; check "
                    "the weight sync plugin and the engine's log."
                )
        self.floors.accept(result.gaps)
        self._probed = version
        if len(result.gaps) != 1:  # a pool: a sample cannot name the server that drew it
            self.sampled = False
        first = self.checks == 0
        self.checks += 1
        if first:
            self.log(
                "weight sync verified: "
                + "; ".join(g.describe() for g in result.gaps)
                + f" ({result.seconds:.2f} s; later syncs must stay within the bound above the noise floor)"
            )

    def observe(
        self, version: int, trainer_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor
    ) -> None:
        """One micro-batch's sampled tokens (``mask``: the rows and tokens the
        engine sampled from ``version`` and the loss counts), with the
        trainer's log-probs of them under the weights it synced as
        ``version``. Kept only for the version a check waits for."""
        wanted = self._deferred[0] if self._deferred is not None else self._probed
        if not self.sampled or version != wanted:
            return
        start = time.perf_counter()
        if self._gap is None or self._gap.version != version:
            self._gap = SampledGap(version)
        with torch.no_grad():
            self._gap.add(trainer_logps, sampler_logps, mask)
        self._gap.seconds += time.perf_counter() - start

    def settle(self) -> None:
        """Before a step's optimizer step (the weights are still the synced
        ones): judge the deferred sync on the tokens :meth:`observe` kept, or
        probe it now if none came; calibrate the sampled floor on the tokens
        of a probed version."""
        gap, self._gap = self._gap, None
        mean, worst, tokens = gap.read() if gap is not None else (0.0, 0.0, 0)
        if self._deferred is None:
            if tokens and self.sampled and gap.version == self._probed and self._sampled_key not in self.floors.floors:
                self._calibrate(gap.version, mean, worst, tokens)
            return
        version, run_sync, model = self._deferred
        self._deferred = None
        if not tokens or gap.version != version:
            self._probe(run_sync, model, version)
            return
        result = Verification(version, [self.floors.judge(self._sampled_key, mean, worst)], gap.seconds)
        self._pending.append(result)
        if result.ok:
            self.checks += 1
            return
        self.log(
            f"the samples of policy version {version} do not match the trainer's log-probs "
            f"({result.failures()}); syncing again, then checking with the probe"
        )
        self._probe(run_sync, model, version, failed=result)

    def _calibrate(self, version: int, mean: float, worst: float, tokens: int) -> None:
        """The sampled tokens' noise floor, from the tokens of a version the
        probe verified; above the precision's ceiling (an engine whose
        sampled log-probs are not the trainer's: another temperature, a
        sampling filter), the probe keeps checking every sync."""
        judged = self.floors.judge(self._sampled_key, mean, worst)
        if not judged.ok:
            self.sampled = False
            self.log(
                f"the engine's sampled log-probs differ from the trainer's more than the precisions explain "
                f"({judged.describe()}): every sync stays checked with the probe"
            )
            return
        self.floors.accept([judged])
        self.log(
            f"weight syncs are checked on the sampled tokens from now on: {judged.describe()} over "
            f"{tokens} tokens of policy version {version} (the probe verified it)"
        )

    def flush(self) -> None:
        """Probe a sync still waiting for its sampled check, now: before an
        evaluation samples from the engine, and at the end of training."""
        if self._deferred is not None:
            version, run_sync, model = self._deferred
            self._deferred, self._gap = None, None
            self._probe(run_sync, model, version)

    def take_metrics(self) -> dict[str, float]:
        """``sync/*`` for the checks since the last call: ``sync/verified``
        1.0 when at least one ran and the last one passed, else 0.0 (not
        checked, or failed); ``sync/logprob_gap`` the largest server gap of
        the last check (and ``_max`` its largest token), ``sync/logprob_bound``
        its bound, ``sync/verify_seconds`` their total time, ``sync/retries``
        the syncs repeated after a failed check, ``sync/sampled`` 1.0 when
        the last check compared the sampled tokens instead of the probe."""
        pending, self._pending = self._pending, []
        retries, self._retries = self._retries, 0
        out = {
            "sync/verified": 0.0,
            "sync/verify_seconds": sum(v.seconds for v in pending),
            "sync/retries": float(retries),
        }
        if pending:
            last = pending[-1]
            finite = [g for g in last.gaps if not g.error]
            out["sync/verified"] = 1.0 if last.ok else 0.0
            out["sync/sampled"] = 1.0 if any(g.description.endswith(SAMPLED) for g in last.gaps) else 0.0
            if finite:
                worst = max(finite, key=lambda g: g.mean)
                out["sync/logprob_gap"] = worst.mean
                out["sync/logprob_gap_max"] = max(g.max for g in finite)
                out["sync/logprob_bound"] = worst.bound
        return out
