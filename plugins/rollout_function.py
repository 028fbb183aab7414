"""Rollout by a user function (``trl.rollout_func``), for environment-style
tasks where generation is more than one sampling call (tools, multi-turn,
an external simulator).

The function follows TRL's convention: ``rollout_func(prompts, trainer)``
gets the batch's raw prompts (no duplication) and returns a dict with
``prompt_ids``, ``completion_ids`` and ``logprobs``, one entry per
completion, ``num_generations`` consecutive entries per prompt. An
optional ``env_mask`` (TRL 1.16's multi-turn convention) gives, per
completion, one 0/1 entry per completion token: 1 where the model sampled
the token, 0 where the environment inserted it (tool output, feedback).
It becomes :attr:`Completion.loss_mask`, so environment tokens get no
gradient and do not count in the loss; it is not a reward column. Any
other key is a per-completion list handed to reward functions as a keyword
argument.

``truncated`` (for ``mask_truncated_completions``) counts the whole
completion, environment tokens included: an episode that used up
``max_completion_length`` was cut, whoever wrote its last tokens. ``trainer`` here is a :class:`RolloutFuncTrainer`: the pieces of
the run a rollout needs (tokenizer, model, config, sampling settings).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

from grpo_core import hookimpl
from grpo_core.context import RunContext
from grpo_core.errors import ConfigError, GrpoError
from grpo_core.types import SAMPLES_TRAINER_MODEL, Completion, Prompt, RolloutGroup, SamplingSettings

REQUIRED = ("prompt_ids", "completion_ids", "logprobs")
ENV_MASK = "env_mask"  # TRL's key: 1 = model token, 0 = environment token; not a reward column


@dataclass
class RolloutFuncTrainer:
    """What ``rollout_func``'s second argument offers (TRL names kept)."""

    processing_class: Any
    num_generations: int
    args: Any  # the GRPOConfig
    sampling: SamplingSettings
    context: RunContext

    @property
    def model(self) -> Any:
        return self.context.get_model()


def import_rollout_func(spec: str) -> Callable[..., dict[str, Any]]:
    module_name, _, attr = spec.rpartition(".")
    if not module_name:
        raise ConfigError(f"trl.rollout_func = '{spec}': expected 'module.function'")
    try:
        func = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(
            f"trl.rollout_func = '{spec}' cannot be imported ({exc}); it must be importable from the working "
            "directory or the config's folder"
        ) from None
    if not callable(func):
        raise ConfigError(f"trl.rollout_func = '{spec}' is not callable")
    return func


class FunctionRollout:
    """The ``function`` rollout: delegates generation to ``trl.rollout_func``.

    The function reads the live model from its ``trainer`` argument, so the
    weights it samples are current without a sync."""

    engine_capabilities = frozenset({SAMPLES_TRAINER_MODEL})

    def __init__(self, context: RunContext) -> None:
        spec = context.config.trl.rollout_func
        if not spec:
            raise ConfigError("the 'function' rollout needs trl.rollout_func = 'module.function'")
        self.spec = spec
        self.func = import_rollout_func(spec)
        self.context = context

    def _fail(self, problem: str) -> GrpoError:
        return GrpoError(f"trl.rollout_func '{self.spec}' {problem}")

    def _env_mask(self, mask: Any, entry: int, length: int) -> list[int]:
        """Entry ``entry`` of ``env_mask`` as 0/1 ints, one per completion token."""
        if isinstance(mask, (str, bytes)) or not hasattr(mask, "__len__"):
            raise self._fail(f"entry {entry}: env_mask must be a list of 0/1 (one per completion token), "
                             f"got {type(mask).__name__}")  # fmt: skip
        values = list(mask)
        if len(values) != length:
            raise self._fail(f"entry {entry}: {len(values)} env_mask values for {length} completion tokens; "
                             "env_mask needs one 0/1 per completion token (1 = sampled by the model)")  # fmt: skip
        bad = [v for v in values if isinstance(v, (str, bytes)) or v not in (0, 1)]
        if bad:
            raise self._fail(f"entry {entry}: env_mask holds {bad[0]!r}; its values must be 1 (model token) "
                             "or 0 (environment token)")  # fmt: skip
        return [int(v) for v in values]

    @hookimpl
    def grpo_rollout_generate(
        self, prompts: list[Prompt], num_generations: int, sampling: SamplingSettings, policy_version: int
    ) -> list[RolloutGroup]:
        trainer = RolloutFuncTrainer(self.context.tokenizer, num_generations, self.context.config, sampling, self.context)
        output = self.func([p.prompt for p in prompts], trainer)
        if not isinstance(output, dict):
            raise self._fail(f"returned {type(output).__name__}, expected a dict with keys {list(REQUIRED)}")
        missing = [k for k in REQUIRED if k not in output]
        if missing:
            raise self._fail(f"returned no {missing}; it must return {list(REQUIRED)}")
        expected = len(prompts) * num_generations
        for key, values in output.items():
            if not isinstance(values, list) or len(values) != expected:
                got = len(values) if isinstance(values, list) else type(values).__name__
                raise self._fail(f"returned {got} '{key}' entries; expected {expected} ({len(prompts)} prompts x {num_generations})")
        extras = {k: v for k, v in output.items() if k not in REQUIRED and k != ENV_MASK}
        env_masks = output.get(ENV_MASK)
        tokenizer = self.context.tokenizer
        groups = []
        for i, prompt in enumerate(prompts):
            completions = []
            for j in range(i * num_generations, (i + 1) * num_generations):
                ids = [int(t) for t in output["completion_ids"][j]]
                logprobs = output["logprobs"][j]
                if logprobs is not None and len(logprobs) != len(ids):
                    raise self._fail(f"entry {j}: {len(logprobs)} logprobs for {len(ids)} completion tokens")
                if list(output["prompt_ids"][j]) != list(prompt.prompt_ids):
                    # The trainer scores the tokens the function saw: keep its prompt ids.
                    prompt = Prompt(prompt.prompt, [int(t) for t in output["prompt_ids"][j]], prompt.columns, prompt.index)
                completions.append(
                    Completion(
                        token_ids=ids,
                        text=tokenizer.decode(ids, skip_special_tokens=True),
                        logprobs=None if logprobs is None else [float(x) for x in logprobs],
                        truncated=len(ids) >= sampling.max_tokens,  # the whole episode's length
                        extra={k: v[j] for k, v in extras.items()},
                        loss_mask=None if env_masks is None else self._env_mask(env_masks[j], j, len(ids)),
                    )
                )
            groups.append(RolloutGroup(prompt=prompt, completions=completions, policy_version=policy_version))
        return groups
