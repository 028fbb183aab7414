"""Scoring rollout groups with the configured reward functions.

:class:`RewardScorer` resolves ``trl.reward_funcs`` through the plugin host
(named ``grpo.reward`` entry points, then plugins' ``grpo_load_reward``),
calls each function with TRL's convention
``f(prompts=..., completions=..., completion_ids=..., **columns)`` and checks
what comes back, so a broken reward function stops the run with a message
naming the function, the step and one offending sample instead of turning
into NaN advantages three steps later.

Where the functions run:

* in this process (default): synchronous functions one after another in the
  calling thread, ``async def`` functions concurrently on one event loop;
* in subprocess workers when ``trl.reward_num_workers > 1`` or
  ``trl.reward_timeout`` is set, or ``trl.async_prefetch`` is on (scoring in
  a background thread; see :func:`uses_workers` and
  :mod:`grpo_core.reward_workers`): each
  worker resolves the specs itself and runs them in its own main thread, so
  ``signal.alarm`` works, and a worker that overruns the timeout is killed.

The functions shared by both paths (:func:`build_batch`, :func:`run_functions`)
live here so a worker computes exactly what the main process would.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import threading
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from grpo_core.errors import DataError, RewardError
from grpo_core.types import RolloutGroup

if TYPE_CHECKING:
    from grpo_core.config.schema import GRPOConfig
    from grpo_core.context import RunContext
    from grpo_core.plugin_host import PluginHost

RESERVED_ARGS = frozenset({"prompts", "completions", "completion_ids"})
EXCERPT_CHARS = 160
FIX_HINT = "Fix the function, or set trl.reward_error_policy = 'none' to score such calls None and go on."


# ----------------------------------------------------------------------------- batch


@dataclass
class Batch:
    """One call's arguments, flattened group by group (picklable: it is what
    a worker receives)."""

    prompts: list[Any]
    completions: list[Any]
    completion_ids: list[list[int]]
    columns: dict[str, list[Any]]
    step: int
    group_sizes: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.completions)


def build_batch(groups: list[RolloutGroup], step: int, live_environments: bool = True) -> Batch:
    """TRL's layout: one entry per completion, the prompt and every dataset
    column repeated across its group; conversational completions as
    ``[{"role": "assistant", "content": text}]`` (an episode's messages for
    a multi-turn one). ``live_environments``: hand the episodes' live
    objects over as ``environments`` (TRL's argument); a batch for
    subprocess workers leaves them out, since they need not pickle."""
    keys: list[str] = []
    for group in groups:
        keys.extend(k for k in group.prompt.columns if k not in keys and k not in RESERVED_ARGS)
        for completion in group.completions:  # a rollout's per-completion extras
            keys.extend(k for k in completion.extra if k not in keys and k not in RESERVED_ARGS)
    prompts, completions, ids = [], [], []
    columns: dict[str, list[Any]] = {k: [] for k in keys}
    for group in groups:
        conversational = group.prompt.is_conversational
        for completion in group.completions:
            prompts.append(group.prompt.prompt)
            if conversational:
                completions.append(list(completion.messages) if completion.messages else [{"role": "assistant", "content": completion.text}])
            else:
                completions.append(completion.text)
            ids.append(list(completion.token_ids))
            for k in keys:
                columns[k].append(completion.extra[k] if k in completion.extra else group.prompt.columns.get(k))
    live = [c.environment for g in groups for c in g.completions]
    if live_environments and any(env is not None for env in live) and "environments" not in columns:
        columns["environments"] = live  # TRL's environments=: in-process reward functions only (not picklable)
    return Batch(prompts, completions, ids, columns, step, [len(g.completions) for g in groups])


def _excerpt(value: Any) -> str:
    if isinstance(value, list):  # messages: the last one says the most
        value = value[-1].get("content", "") if value and isinstance(value[-1], dict) else str(value)
    text = str(value)
    return text if len(text) <= EXCERPT_CHARS else text[: EXCERPT_CHARS - 3] + "..."


def describe_failure(name: str, problem: str, batch: Batch, sample: int = 0) -> str:
    """The message of a :class:`RewardError`: function, step, one sample, fix."""
    sample = min(max(sample, 0), max(len(batch) - 1, 0))
    where = ""
    if len(batch):
        where = f" Sample {sample}: prompt {_excerpt(batch.prompts[sample])!r}, completion {_excerpt(batch.completions[sample])!r}."
    return f"reward function '{name}' {problem} at step {batch.step}.{where} {FIX_HINT}"


# ----------------------------------------------------------------------------- outcomes


@dataclass
class Outcome:
    """What one function produced for one batch: ``values`` (one per
    completion, ``None`` where absent or invalid) and, when something was
    wrong, ``error`` (the full user-facing message). ``values`` is ``None``
    when the whole call failed."""

    values: list[float | None] | None
    error: str | None = None


def _as_number(value: Any) -> Any:
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0 and not isinstance(value, (int, float)):
        try:
            return value.item()
        except Exception:
            return value
    return value


def validate(name: str, raw: Any, batch: Batch) -> Outcome:
    """Check a function's return value: a sequence of one finite number (or
    ``None``) per completion."""
    if hasattr(raw, "tolist") and not isinstance(raw, (list, tuple)):
        raw = raw.tolist()
    if not isinstance(raw, (list, tuple)):
        return Outcome(None, describe_failure(name, f"returned {type(raw).__name__}, expected a list of floats", batch))
    if len(raw) != len(batch):
        return Outcome(
            None, describe_failure(name, f"returned {len(raw)} values for {len(batch)} completions (one per completion expected)", batch)
        )
    values: list[float | None] = []
    error = None
    for i, item in enumerate(raw):
        item = _as_number(item)
        if item is None:
            values.append(None)
            continue
        if not isinstance(item, numbers.Real):
            values.append(None)
            error = error or describe_failure(name, f"returned a non-number ({type(item).__name__} {str(item)[:40]!r}) as value {i}", batch, i)
            continue
        number = float(item)
        if not math.isfinite(number):
            values.append(None)
            error = error or describe_failure(name, f"returned {number} as value {i} (rewards must be finite; use None to abstain)", batch, i)
            continue
        values.append(number)
    return Outcome(values, error)


def _failure(name: str, exc: BaseException, batch: Batch) -> Outcome:
    return Outcome(None, describe_failure(name, f"raised {type(exc).__name__}: {exc}", batch))


def is_async(func: Callable[..., Any]) -> bool:
    call = getattr(func, "__call__", None)
    return inspect.iscoroutinefunction(func) or (call is not None and inspect.iscoroutinefunction(call))


def _call_kwargs(batch: Batch) -> dict[str, Any]:
    return {"prompts": batch.prompts, "completions": batch.completions, "completion_ids": batch.completion_ids, **batch.columns}


def _run_coroutines(factories: list[Callable[[], Any]]) -> list[Any]:
    """Await coroutines concurrently; results or exceptions, in order. Uses a
    private event loop (in a helper thread when the caller already runs one)."""

    async def gather() -> list[Any]:
        return await asyncio.gather(*(f() for f in factories), return_exceptions=True)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(gather())
    box: list[Any] = []
    thread = threading.Thread(target=lambda: box.append(asyncio.run(gather())), daemon=True)
    thread.start()
    thread.join()
    return box[0]


def run_functions(
    funcs: list[Callable[..., Any]],
    names: list[str],
    batch: Batch,
    on_start: Callable[[list[int]], None] | None = None,
    on_result: Callable[[int, Outcome], None] | None = None,
) -> list[Outcome]:
    """Call every function on ``batch``; never raises for a function's fault.

    Synchronous functions run in the calling thread (so ``signal.alarm``
    works when that is a main thread); ``async`` ones run concurrently
    afterwards. ``on_start``/``on_result`` let a worker report progress.
    """
    outcomes: list[Outcome | None] = [None] * len(funcs)
    kwargs = _call_kwargs(batch)

    def finish(i: int, outcome: Outcome) -> None:
        outcomes[i] = outcome
        if on_result is not None:
            on_result(i, outcome)

    pending_async: list[int] = []
    awaitables: dict[int, Any] = {}
    for i, func in enumerate(funcs):
        if is_async(func):
            pending_async.append(i)
            continue
        if on_start is not None:
            on_start([i])
        try:
            raw = func(**kwargs)
        except Exception as exc:
            finish(i, _failure(names[i], exc, batch))
            continue
        if inspect.isawaitable(raw):  # e.g. a partial of an async function
            pending_async.append(i)
            awaitables[i] = raw
            continue
        finish(i, validate(names[i], raw, batch))

    if pending_async:
        if on_start is not None:
            on_start(list(pending_async))

        def factory(i: int) -> Callable[[], Any]:
            async def call() -> Any:
                return await (awaitables[i] if i in awaitables else funcs[i](**kwargs))

            return call

        results = _run_coroutines([factory(i) for i in pending_async])
        for i, raw in zip(pending_async, results):
            finish(i, _failure(names[i], raw, batch) if isinstance(raw, BaseException) else validate(names[i], raw, batch))
    return [o if o is not None else Outcome(None, "internal: no outcome") for o in outcomes]


# ----------------------------------------------------------------------------- scorer


def required_columns(func: Callable[..., Any]) -> list[str]:
    """Keyword parameters ``func`` needs that only a dataset column can fill."""
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return []
    return [
        p.name
        for p in params
        if p.default is inspect.Parameter.empty
        and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        and p.name not in RESERVED_ARGS
    ]


def uses_workers(cfg: GRPOConfig) -> bool:
    """Whether reward functions run in subprocess workers.

    Asked for with ``reward_num_workers > 1`` or ``reward_timeout``; also
    chosen, with no setting, when ``async_prefetch`` is on: scoring then
    happens in the prefetch thread, where ``signal.alarm`` raises
    (math_verify's ``parse`` refuses to run there), while a worker runs the
    functions in its own main thread."""
    trl = cfg.trl
    return trl.reward_num_workers > 1 or trl.reward_timeout is not None or bool(trl.async_prefetch)


def _function_name(func: Any, spec: str) -> str:
    name = getattr(func, "__name__", None)
    return name if isinstance(name, str) and name else spec


class RewardScorer:
    """Resolves, runs and checks the run's reward functions.

    ``score(groups, step)`` returns ``[group][completion][function]`` values
    (``None`` where a function abstained, or failed under
    ``reward_error_policy = 'none'``). Call :meth:`close` at the end (or use
    it as a context manager) to stop subprocess workers.
    """

    def __init__(self, cfg: GRPOConfig, host: PluginHost, context: RunContext) -> None:
        from grpo_core.config.checks import reward_weights

        self.weights = reward_weights(cfg)
        specs = list(cfg.trl.reward_funcs or [])
        self.cfg = cfg
        self.specs = specs
        self.funcs = [host.load_reward(spec, context) for spec in specs]
        self.names = [_function_name(f, s) for f, s in zip(self.funcs, specs)]
        self.policy = cfg.trl.reward_error_policy
        self.timeout = cfg.trl.reward_timeout
        self._pool: Any = None
        self._num_workers = cfg.trl.reward_num_workers
        if uses_workers(cfg):
            from grpo_core.reward_workers import WorkerPool

            self._pool = WorkerPool(cfg, specs, self.names, host.allow, max(1, self._num_workers), self.timeout)
            if cfg.trl.async_prefetch and self._num_workers <= 1 and self.timeout is None:
                context.log("reward functions run in a worker process: async_prefetch scores in a background thread, "
                            "where signal.alarm (e.g. math_verify) cannot work")

    # ------------------------------------------------------------------ checks

    def check_columns(self, available: set[str]) -> None:
        """Raise :class:`DataError` when a function needs a keyword argument
        that is not a dataset column (caught before the first rollout)."""
        problems = []
        for name, func in zip(self.names, self.funcs):
            missing = [c for c in required_columns(func) if c not in available]
            if missing:
                problems.append(f"reward function '{name}' needs column(s) {missing}")
        if problems:
            have = ", ".join(sorted(available)) or "none besides 'prompt'"
            raise DataError(
                "; ".join(problems) + f". The dataset has: {have}. Keep those columns in the dataset transform's output "
                "(do not list them in remove_columns), or give the parameters a default."
            )

    # ------------------------------------------------------------------ scoring

    def score(self, groups: list[RolloutGroup], step: int) -> list[list[list[float | None]]]:
        if not groups:
            return []
        if self._pool is not None:
            shards = _shard(groups, self._pool.size)
            per_shard = self._pool.run([build_batch(shard, step, live_environments=False) for shard in shards], step)
            matrices = [self._apply_policy(outcomes, batch_len=sum(len(g.completions) for g in shard)) for shard, outcomes in zip(shards, per_shard)]
            rows = [row for matrix in matrices for row in matrix]
        else:
            batch = build_batch(groups, step)
            rows = self._apply_policy(run_functions(self.funcs, self.names, batch), len(batch))
        out, start = [], 0
        for group in groups:
            out.append(rows[start : start + len(group.completions)])
            start += len(group.completions)
        return out

    def _apply_policy(self, outcomes: list[Outcome], batch_len: int) -> list[list[float | None]]:
        columns: list[list[float | None]] = []
        for outcome in outcomes:
            if outcome.error is not None:
                if self.policy == "raise":
                    raise RewardError(outcome.error)
                warnings.warn(outcome.error.replace(FIX_HINT, "Scored None (trl.reward_error_policy = 'none')."), stacklevel=3)
            values = outcome.values if outcome.values is not None else [None] * batch_len
            columns.append(values)
        return [list(row) for row in zip(*columns)] if columns else [[] for _ in range(batch_len)]

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:  # best effort; close() is the contract
        try:
            self.close()
        except Exception:
            pass


def _shard(groups: list[RolloutGroup], workers: int) -> list[list[RolloutGroup]]:
    """Contiguous, near-equal shards of whole prompt groups (order kept)."""
    count = max(1, min(workers, len(groups)))
    size, extra = divmod(len(groups), count)
    shards, start = [], 0
    for i in range(count):
        end = start + size + (1 if i < extra else 0)
        shards.append(groups[start:end])
        start = end
    return shards
