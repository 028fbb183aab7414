"""Keys grpo accepts for compatibility but does not act on.

A config written for another framework (the reference guide, Axolotl, TRL)
carries keys that mean nothing for a GRPO run here, or whose effect grpo
gets another way. They are accepted so that config runs, and named in a
warning by ``grpo config check`` and ``grpo run`` so nothing is ignored
silently. ``tests/unit/test_option_coverage.py`` proves every schema field is
either read by the code or listed here.

Each entry: dotted key -> (when it counts as set, what the user should know).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from grpo_core.config.schema import GRPOConfig


@dataclass(frozen=True)
class CompatKey:
    key: str
    is_set: Callable[[GRPOConfig], bool]
    note: str
    example: Any = True  # a value that sets it (what tests/unit/test_option_coverage.py writes)


COMPATIBILITY_ONLY: tuple[CompatKey, ...] = (
    CompatKey(
        "skip_prepare_dataset",
        lambda c: c.skip_prepare_dataset,
        "grpo has no dataset preparation step to skip: prompts are templated and tokenised once at start",
    ),
    CompatKey(
        "trl.use_data_producer",
        lambda c: c.trl.use_data_producer,
        "grpo always runs through its data producer; trl.async_prefetch alone decides whether generation "
        "runs ahead in the background",
    ),
    # Axolotl's keys that mean nothing for a GRPO run (grpo_core/config/axolotl.py has the rest).
    CompatKey(
        "sample_packing",
        lambda c: c.sample_packing is False,
        "grpo never packs: each micro-batch of completions is padded to its longest sequence (true is refused)",
        example=False,
    ),
    CompatKey(
        "pad_to_sequence_len",
        lambda c: c.pad_to_sequence_len is not None,
        "each micro-batch is padded to its longest sequence, which a GRPO batch of generated completions needs",
    ),
    CompatKey(
        "model_type",
        lambda c: c.model_type is not None,
        "every model loads with AutoModelForCausalLM, which picks the class named in the model's config.json",
        example="LlamaForCausalLM",
    ),
    CompatKey(
        "tokenizer_type",
        lambda c: c.tokenizer_type is not None,
        "the tokenizer loads with AutoTokenizer, which picks the class the model publishes",
        example="AutoTokenizer",
    ),
    CompatKey("strict", lambda c: c.strict is not None, "grpo's validation is always strict: unknown keys are errors"),
    CompatKey(
        "dataset_prepared_path",
        lambda c: c.dataset_prepared_path is not None,
        "grpo keeps no prepared-dataset cache: prompts are templated and tokenised once at start",
        example="last_run_prepared",
    ),
    CompatKey(
        "hf_use_auth_token",
        lambda c: c.hf_use_auth_token is not None,
        "Hugging Face credentials are read the standard way (HF_TOKEN or `hf auth login`)",
    ),
)


def compat_warnings(cfg: GRPOConfig) -> list[str]:
    """One warning per compatibility-only key the config sets, then what the
    loader adapted from another framework's layout (:mod:`grpo_core.config.axolotl`)."""
    out = [
        f"{item.key} is accepted for compatibility and has no effect: {item.note}."
        for item in COMPATIBILITY_ONLY
        if item.is_set(cfg)
    ]
    return out + list(cfg._notes)


def compat_keys() -> set[str]:
    return {item.key for item in COMPATIBILITY_ONLY}
