"""Calling reward functions on one batch, and checking what they return.

TRL's calling convention (:func:`build_batch` lays the groups out,
:func:`run_functions` calls every function, :func:`validate` checks each
result) and the messages a failing function gets. The scorer in
:mod:`grpo_core.scoring.rewards` and the subprocess workers in
:mod:`grpo_core.scoring.reward_workers` both run exactly this code, so a worker
computes what the main process would; neither imports the other for it.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from grpo_core.contract.types import RolloutGroup

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
                completions.append(
                    list(completion.messages)
                    if completion.messages
                    else [{"role": "assistant", "content": completion.text}]
                )
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
        where = (
            f" Sample {sample}: prompt {_excerpt(batch.prompts[sample])!r}, completion "
            f"{_excerpt(batch.completions[sample])!r}."
        )
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
            None,
            describe_failure(
                name, f"returned {len(raw)} values for {len(batch)} completions (one per completion expected)", batch
            ),
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
            error = error or describe_failure(
                name, f"returned a non-number ({type(item).__name__} {str(item)[:40]!r}) as value {i}", batch, i
            )
            continue
        number = float(item)
        if not math.isfinite(number):
            values.append(None)
            error = error or describe_failure(
                name, f"returned {number} as value {i} (rewards must be finite; use None to abstain)", batch, i
            )
            continue
        values.append(number)
    return Outcome(values, error)


def _failure(name: str, exc: BaseException, batch: Batch) -> Outcome:
    return Outcome(None, describe_failure(name, f"raised {type(exc).__name__}: {exc}", batch))


def is_async(func: Callable[..., Any]) -> bool:
    call = getattr(func, "__call__", None)  # noqa: B004 (the bound __call__ of a callable object, not a callability test)
    return inspect.iscoroutinefunction(func) or (call is not None and inspect.iscoroutinefunction(call))


def _call_kwargs(batch: Batch) -> dict[str, Any]:
    return {
        "prompts": batch.prompts,
        "completions": batch.completions,
        "completion_ids": batch.completion_ids,
        **batch.columns,
    }


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
            finish(
                i, _failure(names[i], raw, batch) if isinstance(raw, BaseException) else validate(names[i], raw, batch)
            )
    return [o if o is not None else Outcome(None, "internal: no outcome") for o in outcomes]


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


def function_name(func: Any, spec: str) -> str:
    """A reward function's name in messages: its ``__name__``, else the spec that named it."""
    name = getattr(func, "__name__", None)
    return name if isinstance(name, str) and name else spec
