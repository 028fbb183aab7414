"""``trl.rollout_func``: a user function makes the completions (TRL's convention).

``rollout_func(prompts, trainer)`` gets the batch's raw prompts (no
duplication) and returns a dict with ``prompt_ids``, ``completion_ids`` and
``logprobs``, one entry per completion, ``num_generations`` consecutive
entries per prompt. An optional ``env_mask`` (TRL 1.16's multi-turn
convention) gives, per completion, one 0/1 entry per completion token: 1
where the model sampled the token, 0 where the environment inserted it. It
becomes :attr:`~grpo_core.contract.types.Completion.loss_mask` (no gradient, no
count), not a reward column. Any other key is a per-completion list handed
to reward functions as a keyword argument. ``truncated`` counts the whole
completion, environment tokens included.

Two ways it runs:

* with an inference engine (``trl.use_vllm``): the run's rollout is the
  engine's, and ``trainer.generate(prompt_ids, ...)`` samples through it,
  token ids in, token ids and log-probs out (:class:`RolloutFunctionDriver`,
  called by the producer like the episode driver); the weights reach the
  engine by the run's weight sync, as in any run;
* without one: the ``function`` rollout calls it, and it samples the
  trainer's live model itself (``trainer.model``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from grpo_core.contract.errors import ConfigError, GrpoError
from grpo_core.contract.types import Completion, Prompt, RolloutGroup, SamplingSettings

REQUIRED = ("prompt_ids", "completion_ids", "logprobs")
ENV_MASK = "env_mask"  # TRL's key: 1 = model token, 0 = environment token; not a reward column
GenerateCall = Callable[[list[Prompt], int, SamplingSettings], list[RolloutGroup]]


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


@dataclass
class RolloutFuncTrainer:
    """What ``rollout_func``'s second argument offers (TRL names kept)."""

    processing_class: Any
    num_generations: int
    args: Any  # the GRPOConfig
    sampling: SamplingSettings
    context: Any  # the RunContext
    engine_generate: GenerateCall | None = None

    @property
    def model(self) -> Any:
        return self.context.get_model()

    def generate(self, prompt_ids: list[list[int]], num_generations: int = 1, **sampling: Any) -> list[dict[str, Any]]:
        """Sample through the run's inference engine: ``num_generations``
        completions of each list of prompt ids (sent as they are, never
        re-tokenised), in order. Keyword arguments override the run's
        sampling settings (``max_tokens``, ``temperature``, ...). Returns one
        dict per completion: ``prompt_ids``, ``completion_ids``, ``logprobs``
        (the sampler's, ``None`` if the engine gave none), ``text``,
        ``truncated``: the layout ``rollout_func`` itself returns."""
        if self.engine_generate is None:
            raise GrpoError(
                "trainer.generate samples through an inference engine, and this run has none (trl.use_vllm = false): "
                "set trl.use_vllm = true, or sample with trainer.model in the rollout_func"
            )
        unknown = sorted(set(sampling) - set(SamplingSettings.__dataclass_fields__))
        if unknown:
            raise GrpoError(
                f"trainer.generate: unknown sampling settings {unknown} (known: max_tokens, temperature, top_p, ...)"
            )
        prompts = [Prompt("", [int(t) for t in ids], {}, i) for i, ids in enumerate(prompt_ids)]
        groups = self.engine_generate(prompts, int(num_generations), replace(self.sampling, **sampling))
        return [
            {
                "prompt_ids": list(p.prompt_ids),
                "completion_ids": list(c.token_ids),
                "logprobs": c.logprobs,
                "text": c.text,
                "truncated": c.truncated,
            }
            for p, g in zip(prompts, groups, strict=True)
            for c in g.completions
        ]


def _env_mask(spec: str, mask: Any, entry: int, length: int) -> list[int]:
    """Entry ``entry`` of ``env_mask`` as 0/1 ints, one per completion token."""
    if isinstance(mask, (str, bytes)) or not hasattr(mask, "__len__"):
        raise GrpoError(
            f"trl.rollout_func '{spec}' entry {entry}: env_mask must be a list of 0/1 (one per completion "
            f"token), got {type(mask).__name__}"
        )
    values = list(mask)
    if len(values) != length:
        raise GrpoError(
            f"trl.rollout_func '{spec}' entry {entry}: {len(values)} env_mask values for {length} completion "
            "tokens; env_mask needs one 0/1 per completion token (1 = sampled by the model)"
        )
    bad = [v for v in values if isinstance(v, (str, bytes)) or v not in (0, 1)]
    if bad:
        raise GrpoError(
            f"trl.rollout_func '{spec}' entry {entry}: env_mask holds {bad[0]!r}; its values must be 1 "
            "(model token) or 0 (environment token)"
        )
    return [int(v) for v in values]


def groups_from_output(
    spec: str,
    output: Any,
    prompts: list[Prompt],
    num_generations: int,
    tokenizer: Any,
    max_tokens: int,
    policy_version: int,
) -> list[RolloutGroup]:
    """The function's dict, checked, as one group per prompt."""
    if not isinstance(output, dict):
        raise GrpoError(
            f"trl.rollout_func '{spec}' returned {type(output).__name__}, expected a dict with keys {list(REQUIRED)}"
        )
    missing = [k for k in REQUIRED if k not in output]
    if missing:
        raise GrpoError(f"trl.rollout_func '{spec}' returned no {missing}; it must return {list(REQUIRED)}")
    expected = len(prompts) * num_generations
    for key, values in output.items():
        if not isinstance(values, list) or len(values) != expected:
            got = len(values) if isinstance(values, list) else type(values).__name__
            raise GrpoError(
                f"trl.rollout_func '{spec}' returned {got} '{key}' entries; expected {expected} "
                f"({len(prompts)} prompts x {num_generations})"
            )
    extras = {k: v for k, v in output.items() if k not in REQUIRED and k != ENV_MASK}
    env_masks = output.get(ENV_MASK)
    groups = []
    for i, prompt in enumerate(prompts):
        completions = []
        for j in range(i * num_generations, (i + 1) * num_generations):
            ids = [int(t) for t in output["completion_ids"][j]]
            logprobs = output["logprobs"][j]
            if logprobs is not None and len(logprobs) != len(ids):
                raise GrpoError(
                    f"trl.rollout_func '{spec}' entry {j}: {len(logprobs)} logprobs for {len(ids)} completion tokens"
                )
            if list(output["prompt_ids"][j]) != list(prompt.prompt_ids):
                # The trainer scores the tokens the function saw: keep its prompt ids.
                prompt = Prompt(prompt.prompt, [int(t) for t in output["prompt_ids"][j]], prompt.columns, prompt.index)
            completions.append(
                Completion(
                    token_ids=ids,
                    text=tokenizer.decode(ids, skip_special_tokens=True),
                    logprobs=None if logprobs is None else [float(x) for x in logprobs],
                    truncated=len(ids) >= max_tokens,  # the whole episode's length
                    extra={k: v[j] for k, v in extras.items()},
                    loss_mask=None if env_masks is None else _env_mask(spec, env_masks[j], j, len(ids)),
                )
            )
        groups.append(RolloutGroup(prompt=prompt, completions=completions, policy_version=policy_version))
    return groups


class RolloutFunctionDriver:
    """Runs ``trl.rollout_func`` over the run's engine rollout (the producer
    calls :meth:`run` as it calls the episode driver)."""

    def __init__(self, spec: str, context: Any) -> None:
        self.spec = spec
        self.func = import_rollout_func(spec)
        self.context = context

    def run(
        self, prompts: list[Prompt], num_generations: int, sampling: SamplingSettings, generate: GenerateCall
    ) -> list[RolloutGroup]:
        trainer = RolloutFuncTrainer(
            self.context.tokenizer, num_generations, self.context.config, sampling, self.context, generate
        )
        output = self.func([p.prompt for p in prompts], trainer)
        return groups_from_output(
            self.spec, output, prompts, num_generations, self.context.tokenizer, sampling.max_tokens, 0
        )
