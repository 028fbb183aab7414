"""grpo's sampling settings in vLLM's terms, shared by the server rollout
(request JSON) and the colocated one (``SamplingParams``), so both sample
the same way from the same config."""

from __future__ import annotations

from typing import Any

from grpo_core.errors import ConfigError
from grpo_core.types import SamplingSettings


def sampling_fields(sampling: SamplingSettings, n: int, call_index: int) -> dict[str, Any]:
    """vLLM ``SamplingParams`` fields for ``n`` samples per prompt, except
    ``structured_outputs`` and ``generation_kwargs`` (their form differs
    between HTTP and in-process use).

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
        # vLLM seeds the n samples of a prompt seed, seed+1, ...; move the
        # base per call so steps do not replay the same random stream.
        fields["seed"] = (sampling.seed + 1_000_003 * call_index) % (2**63)
    return fields
