"""The ``function`` rollout: ``trl.rollout_func`` without an inference engine.

With ``trl.use_vllm = false`` the function samples the trainer's live model
itself (``trainer.model``), so the weights it samples are current without a
sync. TRL's return convention (``prompt_ids``, ``completion_ids``,
``logprobs``, optional ``env_mask``, extra reward columns) and its checks
are :mod:`grpo_core.generation.user_rollout`'s, shared with the run that
drives the function over an engine (``trl.use_vllm = true``), where
``trainer.generate`` samples through the engine.
"""

from __future__ import annotations

from grpo_core.plugin_api import (
    SAMPLES_TRAINER_MODEL,
    ConfigError,
    Prompt,
    RolloutFuncTrainer,
    RolloutGroup,
    RunContext,
    SamplingSettings,
    groups_from_output,
    hookimpl,
    import_rollout_func,
)


class FunctionRollout:
    """Generation by your trl.rollout_func.

    ``grpo.rollout:function``."""

    engine_capabilities = frozenset({SAMPLES_TRAINER_MODEL})
    runs_rollout_func = True

    def __init__(self, context: RunContext) -> None:
        spec = context.config.trl.rollout_func
        if not spec:
            raise ConfigError("the 'function' rollout needs trl.rollout_func = 'module.function'")
        self.spec = spec
        self.func = import_rollout_func(spec)
        self.context = context

    @hookimpl
    def grpo_rollout_generate(
        self, prompts: list[Prompt], num_generations: int, sampling: SamplingSettings, policy_version: int
    ) -> list[RolloutGroup]:
        trainer = RolloutFuncTrainer(
            self.context.tokenizer, num_generations, self.context.config, sampling, self.context
        )
        output = self.func([p.prompt for p in prompts], trainer)
        return groups_from_output(
            self.spec, output, prompts, num_generations, self.context.tokenizer, sampling.max_tokens, policy_version
        )
