"""grpo's sampling settings in vLLM's terms, shared by the server rollout
(request JSON) and the colocated one (``SamplingParams``), so both sample
the same way from the same config."""

from __future__ import annotations

from typing import Any

from grpo_core.plugin_api import ConfigError, SamplingSettings


def prompt_seed(seed: int, n: int, call_index: int, prompt_index: int) -> int:
    """The seed of one prompt's request: distinct per call and per prompt.

    vLLM seeds a prompt's ``n`` samples ``seed, seed+1, ...`` and gives every
    prompt of a request the same seed, so two prompts sampled with one seed
    draw the same random numbers. For an episode's later turns (each a prompt
    of its own, often alike) that made the episodes of a group near copies of
    each other, with no spread for GRPO to learn from. Offsets of ``n`` per
    prompt keep every sample's stream apart.
    """
    return (seed + 1_000_003 * call_index + n * prompt_index) % (2**63)


def sampling_fields(sampling: SamplingSettings, n: int, call_index: int, prompt_index: int = 0) -> dict[str, Any]:
    """vLLM ``SamplingParams`` fields for ``n`` samples of the prompt at
    ``prompt_index`` of call ``call_index``, except ``structured_outputs``
    and ``generation_kwargs`` (their form differs between HTTP and
    in-process use).

    ``logprobs = 0`` asks for the sampled token's own log-prob, which the
    importance-sampling correction compares with the trainer's.
    """
    if sampling.temperature == 0 and n > 1:
        raise ConfigError(
            f"trl.temperature = 0 is greedy decoding: vLLM cannot sample num_generations = {n} different "
            "completions. Use a temperature > 0 or num_generations = 1."
        )
    fields: dict[str, Any] = {
        "n": n,
        "max_tokens": sampling.max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "logprobs": 0,
        "skip_special_tokens": True,
    }
    if sampling.top_k:  # 0 / None: no top-k
        fields["top_k"] = sampling.top_k
    if sampling.min_p:
        fields["min_p"] = sampling.min_p
    if sampling.repetition_penalty is not None:
        fields["repetition_penalty"] = sampling.repetition_penalty
    if sampling.stop_token_ids:
        fields["stop_token_ids"] = list(sampling.stop_token_ids)
    if sampling.seed is not None:
        fields["seed"] = prompt_seed(sampling.seed, n, call_index, prompt_index)
    return fields


def generation_extra(sampling: SamplingSettings) -> dict[str, Any]:
    """``trl.generation_kwargs`` for one request. ``min_tokens`` is held to
    the request's ``max_tokens``: an episode's later turns get what is left
    of ``max_completion_length``, which can fall below a configured
    ``min_tokens``, and vLLM refuses a request asking for more than it allows."""
    extra = dict(sampling.extra)
    if isinstance(extra.get("min_tokens"), int) and extra["min_tokens"] > sampling.max_tokens:
        extra["min_tokens"] = sampling.max_tokens
    return extra
