"""Rollout with the trainer's own model through transformers ``generate``.

No inference engine and no weight sync: the policy that samples is the
policy that trains (see :mod:`grpo_plugins.weight_sync_in_process`). Each
call runs the model in eval mode (no dropout; gradient checkpointing only
acts in train mode, so the KV cache is used), without gradients, and puts
every module back in the mode it was in.

Sampler log-probs follow TRL's definition of the policy: ``log_softmax(
logits / temperature)`` of the sampled token, before top-k/top-p/min-p and
repetition penalty (those only shape *which* tokens get sampled). They are
recorded step by step from the model's raw logits by a forward hook, so
memory stays at one ``[batch, vocab]`` tensor instead of the
``[steps, batch, vocab]`` that ``output_logits=True`` would keep. With
temperature 0 (greedy) the log-probs are those of ``log_softmax(logits)``.

With ``sampling.seed`` set, every completion draws its tokens from a random
stream of its own, seeded from (seed, its position in the whole request:
``sampling.prompt_offset`` plus its prompt's index, and its generation's
index), never from the global RNG: a completion is the same whether its
prompt was generated in one call, in another chunk, or on another training
process with a share of the prompts (:class:`_RowSampler`).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from typing import Any

import torch

from grpo_core.plugin_api import (
    SAMPLES_TRAINER_MODEL,
    Completion,
    ConfigError,
    GRPOConfig,
    GrpoError,
    Prompt,
    RolloutGroup,
    RunContext,
    SamplingSettings,
    hookimpl,
    resolve_precision,
)

DEFAULT_CHUNK_SIZE = 64
"""Sequences generated per ``generate`` call (bounds activation/KV memory)."""

# generation_kwargs that would change what this module parses out of
# ``generate`` (one sequence per row, sampled from the policy).
_RESERVED_GENERATION_KWARGS = frozenset(
    {
        "num_return_sequences",
        "return_dict_in_generate",
        "output_scores",
        "output_logits",
        "num_beams",
        "num_beam_groups",
        "prompt_lookup_num_tokens",
        "assistant_model",
    }
)


class _SampledLogprobs:
    """Forward hook that keeps the log-prob of each sampled token.

    At every decoding step the model is called with the token sampled at the
    previous step, so the hook gathers that token from the previous step's
    log-probs, then replaces them with this step's. The last sampled token is
    never fed back; :meth:`finish` gathers it from the generated ids.
    """

    def __init__(self, temperature: float) -> None:
        self.temperature = temperature if temperature > 0 else 1.0
        self.pending: torch.Tensor | None = None  # [B, V] log-probs, token not seen yet
        self.steps: list[torch.Tensor] = []  # one [B] tensor per generated token

    def __call__(self, _module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        input_ids = kwargs.get("input_ids")
        if input_ids is None and args:
            input_ids = args[0]
        logits = output.logits if hasattr(output, "logits") else output[0]
        if input_ids is not None and input_ids.shape[1] > 1:
            # (a chunk of) the prompt: nothing has been sampled yet
            self.steps.clear()
        elif self.pending is not None and input_ids is not None:
            token = input_ids[:, -1:].to(self.pending.device)
            self.steps.append(self.pending.gather(-1, token).squeeze(-1))
        self.pending = torch.log_softmax(logits[:, -1, :].float() / self.temperature, dim=-1)

    def finish(self, completion_ids: torch.Tensor) -> torch.Tensor:
        """``[B, L]`` log-probs of ``completion_ids`` (the generated part)."""
        length = completion_ids.shape[1]
        steps = self.steps[:length]
        if len(steps) < length and self.pending is not None:
            token = completion_ids[:, len(steps) : len(steps) + 1].to(self.pending.device)
            steps.append(self.pending.gather(-1, token).squeeze(-1))
        if len(steps) != length:
            raise RuntimeError(
                f"recorded {len(steps)} sampled-token log-probs for {length} generated tokens: this generation "
                "mode (assisted/speculative decoding?) is not supported by the transformers rollout"
            )
        if length == 0:
            return torch.zeros(completion_ids.shape[0], 0)
        return torch.stack(steps, dim=1).cpu()


@contextlib.contextmanager
def _generation_mode(model: torch.nn.Module) -> Iterator[None]:
    """Eval mode and no grad for the duration; every module's own train/eval
    flag is restored afterwards (not just the root's)."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for module, training in modes:
            module.training = training


@contextlib.contextmanager
def _seeded(seed: int | None) -> Iterator[None]:
    """Seed the RNGs for this call only; the caller's RNG state is untouched."""
    if seed is None:
        yield
        return
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        yield


def row_seed(seed: int, row: int) -> int:
    """The seed of the random stream of completion ``row`` (its position in
    the whole request) of a request seeded ``seed``: a hash, so nearby seeds
    and rows give unrelated streams."""
    digest = hashlib.blake2b(f"{seed}:{row}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _warpers(config: Any) -> list[Any]:
    """The sampling warpers transformers builds from ``config`` when it
    samples, in its order (``GenerationMixin._get_logits_processor``, 5.x):
    :class:`_RowSampler` draws from the distribution they leave."""
    # heavy (transformers): loaded on first use, not with this module
    from transformers import generation as gen

    out: list[Any] = []
    if config.temperature is not None and config.temperature != 1.0:
        out.append(gen.TemperatureLogitsWarper(config.temperature))
    if getattr(config, "top_h", None) is not None and hasattr(gen, "TopHLogitsWarper"):
        out.append(gen.TopHLogitsWarper(top_h=config.top_h))
    if config.top_k is not None and config.top_k != 0:
        out.append(gen.TopKLogitsWarper(top_k=config.top_k, min_tokens_to_keep=1))
    if config.top_p is not None and config.top_p < 1.0:
        out.append(gen.TopPLogitsWarper(top_p=config.top_p, min_tokens_to_keep=1))
    if config.min_p is not None:
        out.append(gen.MinPLogitsWarper(min_p=config.min_p, min_tokens_to_keep=1))
    if config.typical_p is not None and config.typical_p < 1.0:
        out.append(gen.TypicalLogitsWarper(mass=config.typical_p, min_tokens_to_keep=1))
    if config.epsilon_cutoff is not None and 0.0 < config.epsilon_cutoff < 1.0:
        out.append(gen.EpsilonLogitsWarper(epsilon=config.epsilon_cutoff, min_tokens_to_keep=1))
    if config.eta_cutoff is not None and 0.0 < config.eta_cutoff < 1.0:
        out.append(gen.EtaLogitsWarper(epsilon=config.eta_cutoff, min_tokens_to_keep=1))
    return out


class _RowSampler:
    """A logits processor that draws each row's next token with that row's
    own ``torch.Generator`` and leaves only that token finite.

    transformers applies custom processors before its sampling warpers and
    then draws every row from the global RNG, so a row's sample would depend
    on the rows beside it. This processor applies the warpers itself (the
    same ones, :func:`_warpers`), draws per row, and hands transformers a
    distribution with one token of probability 1: its warpers keep that
    token and its draw picks it. The logits the model returned, which the
    sampler's log-probs are read from, are untouched."""

    def __init__(self, warpers: list[Any], seeds: list[int]) -> None:
        self.warpers = warpers
        self.seeds = seeds
        self.generators: list[torch.Generator] | None = None  # made on the logits' device at the first step

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.generators is None:
            self.generators = [torch.Generator(device=scores.device).manual_seed(s) for s in self.seeds]
        warped = scores.clone()
        for warper in self.warpers:
            warped = warper(input_ids, warped)
        probs = torch.softmax(warped.float(), dim=-1)
        tokens = torch.cat([torch.multinomial(probs[row], 1, generator=g) for row, g in enumerate(self.generators)])
        chosen = torch.full_like(scores, float("-inf"))
        chosen.scatter_(1, tokens[:, None], 0.0)
        return chosen


def _hook_target(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose forward ``generate`` calls (PEFT's wrapped model)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


class TransformersRollout:
    """Generation with transformers' generate on the trainer's own model.

    ``chunk_size`` caps the sequences (prompts x generations) of one
    ``generate`` call; a prompt's completions may span several calls.
    """

    engine_capabilities = frozenset({SAMPLES_TRAINER_MODEL})
    # With several training processes each samples its share of a call with the model
    # context.get_model() returns then (its policy, made whole for the call); rows seeded by place.
    generates_on_every_rank = True

    def __init__(self, context: RunContext, chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.grpo_validate_config(context.config)
        self.context = context
        self.chunk_size = chunk_size

    @staticmethod
    def grpo_validate_config(config: GRPOConfig) -> list[str]:
        trl = config.trl
        if trl.async_prefetch:
            raise ConfigError(
                "trl.async_prefetch generates in a background thread, but rollout 'transformers' (trl.use_vllm = "
                "false) samples with the model being trained and cannot: set trl.use_vllm = true (a vLLM server "
                "generates) or trl.async_prefetch = false."
            )
        if trl.vllm_guided_decoding_regex:
            raise ConfigError(
                "trl.vllm_guided_decoding_regex needs the vLLM rollout: set trl.use_vllm = true or remove the key."
            )
        return []

    # ------------------------------------------------------------------ hook

    @hookimpl
    def grpo_rollout_generate(
        self, prompts: list[Prompt], num_generations: int, sampling: SamplingSettings, policy_version: int
    ) -> list[RolloutGroup]:
        if num_generations < 1:
            raise ValueError(f"num_generations must be >= 1, got {num_generations}")
        if sampling.guided_regex:
            raise GrpoError("guided decoding (a regex) needs the vLLM rollout: set trl.use_vllm = true.")
        if not prompts:
            return []
        model = self.context.get_model()
        tokenizer = self.context.tokenizer
        if model is None or tokenizer is None:
            raise GrpoError("rollout 'transformers' was called before the trainer loaded its model and tokenizer.")

        stop_ids = self._stop_token_ids(model, tokenizer, sampling)
        config = self._generation_config(model, tokenizer, sampling, stop_ids)
        # One row per completion (prompt-major). Rows are expanded here rather
        # than with num_return_sequences, which greedy decoding refuses.
        rows = [prompt for prompt in prompts for _ in range(num_generations)]
        # Each row's place in the whole request (this call may be one process's share of it).
        first_row = sampling.prompt_offset * num_generations
        completions: list[Completion] = []
        device_type = next(model.parameters()).device.type
        # The same precision the trainer computes in, so its log-probs and ours agree.
        with (
            _generation_mode(model),
            _seeded(sampling.seed),
            resolve_precision(self.context.config, device_type).autocast(device_type, model),
        ):
            for start in range(0, len(rows), self.chunk_size):
                chunk = rows[start : start + self.chunk_size]
                seeds = (
                    None
                    if sampling.seed is None
                    else [row_seed(sampling.seed, first_row + start + k) for k in range(len(chunk))]
                )
                completions.extend(self._generate(model, tokenizer, chunk, config, sampling, stop_ids, seeds))

        return [
            RolloutGroup(
                prompt=prompt,
                completions=completions[i * num_generations : (i + 1) * num_generations],
                policy_version=policy_version,
            )
            for i, prompt in enumerate(prompts)
        ]

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _stop_token_ids(model: Any, tokenizer: Any, sampling: SamplingSettings) -> list[int]:
        ids: list[int] = []
        model_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        for value in (tokenizer.eos_token_id, model_eos, sampling.stop_token_ids):
            for token in value if isinstance(value, (list, tuple)) else [value]:
                if token is not None and int(token) not in ids:
                    ids.append(int(token))
        if not ids:
            raise GrpoError(
                "the tokenizer has no eos_token and no stop_token_ids were given: generation could never stop."
            )
        return ids

    @staticmethod
    def _generation_config(model: Any, tokenizer: Any, sampling: SamplingSettings, stop_ids: list[int]) -> Any:
        """Every sampling field is set explicitly: transformers fills fields left
        ``None`` from the model's own generation_config (e.g. a hub top_k=50)."""
        # heavy (transformers): loaded on first use, not with this module
        from transformers import GenerationConfig

        greedy = sampling.temperature == 0
        kwargs: dict[str, Any] = {
            "max_new_tokens": sampling.max_tokens,
            "do_sample": not greedy,
            "eos_token_id": stop_ids,
            "pad_token_id": tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0],
            "bos_token_id": tokenizer.bos_token_id,
            "use_cache": True,
            "repetition_penalty": sampling.repetition_penalty or 1.0,
            "disable_compile": True,
        }
        if not greedy:
            kwargs |= {
                "temperature": sampling.temperature,
                "top_p": sampling.top_p if sampling.top_p is not None else 1.0,
                "top_k": sampling.top_k or 0,
                "min_p": sampling.min_p or 0.0,
            }
        extra = dict(sampling.extra or {})
        known = set(GenerationConfig().to_dict())
        for key in extra:
            if key in _RESERVED_GENERATION_KWARGS:
                raise ConfigError(
                    f"trl.generation_kwargs.{key} cannot be used with the transformers rollout (it decides how many "
                    "sequences come back and how they are sampled): remove it."
                )
            if key not in known:
                raise ConfigError(
                    f"trl.generation_kwargs.{key} is not a transformers GenerationConfig field: "
                    "fix the name or remove it."
                )
        kwargs |= extra
        if greedy:
            kwargs["do_sample"] = False
        return GenerationConfig(**kwargs)

    def _generate(
        self,
        model: Any,
        tokenizer: Any,
        prompts: list[Prompt],
        config: Any,
        sampling: SamplingSettings,
        stop_ids: list[int],
        seeds: list[int] | None = None,
    ) -> list[Completion]:
        """One completion per row of ``prompts``, from one ``generate`` call;
        with ``seeds`` (one per row) each row samples from its own stream."""
        device = next(model.parameters()).device
        pad_id = config.pad_token_id
        width = max(len(p.prompt_ids) for p in prompts)
        if width == 0:
            raise GrpoError("a prompt has no tokens (empty prompt_ids): drop empty prompts from the dataset.")
        input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            length = len(prompt.prompt_ids)
            input_ids[row, width - length :] = torch.tensor(prompt.prompt_ids, dtype=torch.long)
            attention_mask[row, width - length :] = 1

        recorder = _SampledLogprobs(sampling.temperature)
        processors = [_RowSampler(_warpers(config), seeds)] if seeds is not None and config.do_sample else []
        handle = _hook_target(model).register_forward_hook(recorder, with_kwargs=True)
        try:
            sequences = model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                generation_config=config,
                logits_processor=processors or None,
                # every process generates its own rows, as many steps as they need: never in lock-step
                # with the others (the core made the whole weights available for the call)
                synced_gpus=False,
            )
        finally:
            handle.remove()
        if not isinstance(sequences, torch.Tensor):  # a ModelOutput if a config asked for it
            sequences = sequences.sequences
        generated = sequences[:, width:].cpu()
        logprobs = recorder.finish(generated)

        stop = torch.isin(generated, torch.tensor(stop_ids, dtype=generated.dtype))
        out = []
        for row in range(generated.shape[0]):
            hits = stop[row].nonzero()
            end = int(hits[0]) + 1 if len(hits) else generated.shape[1]
            ids = generated[row, :end].tolist()
            out.append(
                Completion(
                    token_ids=ids,
                    text=tokenizer.decode(ids, skip_special_tokens=True),
                    logprobs=logprobs[row, :end].tolist(),
                    truncated=not len(hits),
                )
            )
        return out
