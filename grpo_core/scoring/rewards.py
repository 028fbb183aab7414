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
  :mod:`grpo_core.scoring.reward_workers`): each
  worker resolves the specs itself and runs them in its own main thread, so
  ``signal.alarm`` works, and a worker that overruns the timeout is killed.

Both paths call the functions with the same code, :mod:`grpo_core.scoring.reward_calls`
(:func:`~grpo_core.scoring.reward_calls.build_batch`, :func:`~grpo_core.scoring.reward_calls.run_functions`),
so a worker computes exactly what the main process would.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from grpo_core.config.reward_weights import reward_weights
from grpo_core.contract.errors import DataError, RewardError
from grpo_core.contract.types import RolloutGroup
from grpo_core.scoring.reward_calls import (
    FIX_HINT,
    Outcome,
    build_batch,
    function_name,
    required_columns,
    run_functions,
)
from grpo_core.scoring.reward_workers import WorkerPool

if TYPE_CHECKING:
    from grpo_core.config.schema import GRPOConfig
    from grpo_core.contract.context import RunContext
    from grpo_core.host.plugin_host import PluginHost


# ----------------------------------------------------------------------------- scorer


def uses_workers(cfg: GRPOConfig) -> bool:
    """Whether reward functions run in subprocess workers.

    Asked for with ``reward_num_workers > 1`` or ``reward_timeout``; also
    chosen, with no setting, when ``async_prefetch`` is on: scoring then
    happens in the prefetch thread, where ``signal.alarm`` raises
    (math_verify's ``parse`` refuses to run there), while a worker runs the
    functions in its own main thread."""
    trl = cfg.trl
    return trl.reward_num_workers > 1 or trl.reward_timeout is not None or bool(trl.async_prefetch)


class RewardScorer:
    """Resolves, runs and checks the run's reward functions.

    ``score(groups, step)`` returns ``[group][completion][function]`` values
    (``None`` where a function abstained, or failed under
    ``reward_error_policy = 'none'``). Call :meth:`close` at the end (or use
    it as a context manager) to stop subprocess workers.
    """

    def __init__(self, cfg: GRPOConfig, host: PluginHost, context: RunContext) -> None:
        self.weights = reward_weights(cfg)
        specs = list(cfg.trl.reward_funcs or [])
        self.cfg = cfg
        self.specs = specs
        self.funcs = [host.load_reward(spec, context) for spec in specs]
        self.names = [function_name(f, s) for f, s in zip(self.funcs, specs)]
        self.policy = cfg.trl.reward_error_policy
        self.timeout = cfg.trl.reward_timeout
        self._pool: Any = None
        self._num_workers = cfg.trl.reward_num_workers
        if uses_workers(cfg):
            self._pool = WorkerPool(cfg, specs, self.names, host.allow, max(1, self._num_workers), self.timeout)
            if cfg.trl.async_prefetch and self._num_workers <= 1 and self.timeout is None:
                context.log(
                    "reward functions run in a worker process: async_prefetch scores in a background thread, "
                    "where signal.alarm (e.g. math_verify) cannot work"
                )

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
                "; ".join(problems)
                + f". The dataset has: {have}. Keep those columns in the dataset transform's output "
                "(do not list them in remove_columns), or give the parameters a default."
            )

    # ------------------------------------------------------------------ scoring

    def score(self, groups: list[RolloutGroup], step: int) -> list[list[list[float | None]]]:
        if not groups:
            return []
        if self._pool is not None:
            shards = _shard(groups, self._pool.size)
            per_shard = self._pool.run([build_batch(shard, step, live_environments=False) for shard in shards], step)
            matrices = [
                self._apply_policy(outcomes, batch_len=sum(len(g.completions) for g in shard))
                for shard, outcomes in zip(shards, per_shard)
            ]
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
                warnings.warn(
                    outcome.error.replace(FIX_HINT, "Scored None (trl.reward_error_policy = 'none')."), stacklevel=3
                )
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
