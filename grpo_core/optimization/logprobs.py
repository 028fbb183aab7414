"""Per-token log-probabilities (and entropies) of completion tokens.

A GRPO step needs ``log p(token)`` for the C completion tokens only, but a
causal LM's ``forward`` returns logits for every position: ``[B, L, V]``
floats, which for a 150k vocabulary dwarfs the rest of the activations.
Here the decoder body runs once, only the C hidden states that predict
completion tokens are kept, and the LM head is applied to them chunk by
chunk. With gradients on and more logits than ``checkpoint_above``, each
chunk runs under activation checkpointing, so backward also holds one chunk
of logits at a time instead of all of them; below it, keeping them costs
little memory and saves backward a second pass through the head.

Semantics follow TRL: the logits are divided by the sampling temperature
before the softmax, and the returned entropy is that of the tempered
distribution (in nats).

Shared prompts (``share_prompts``): the ``num_generations`` completions of a
group repeat one prompt, so a micro-batch holds few distinct prompts. Each
distinct prompt then runs through the decoder once, and its keys/values are
reused by every completion that follows it: the same log-probs and gradients
(to float rounding; autograd sums the gradient of a reused prompt over its
completions) for far fewer tokens through the model.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from grpo_core.modeling.structure import decoder_and_head, logit_transform, unwrap_peft

DEFAULT_CHUNK_SIZE = 256
"""Rows (positions) per LM-head chunk: 256 x 49k vocab x fp32 = 48 MiB."""

DEFAULT_CHECKPOINT_ABOVE = 128 * 2**20
"""Logit elements (positions x vocabulary) of one call above which the head
chunks are checkpointed. Without it backward keeps one logits-sized float32
tensor per chunk (the softmax probabilities, :class:`SelectedLogSoftmax`; a
second with a soft cap or a bf16 head), so 128 Mi elements hold 0.5-1 GiB:
16 completions of 48 tokens over a 49k vocabulary (36 Mi) or 16 x 48 over a
152k one (111 Mi) are kept, 16 x 512 over 152k (1.2 Gi, 5-10 GiB kept) is
checkpointed."""


def head_is_plain(model: Any) -> bool:
    """Whether the logits are the LM head's output as is (no scale, no soft
    cap): what a loss that fuses the head as a plain linear layer assumes."""
    return logit_transform(unwrap_peft(model)) == (1.0, None)


def _chunk_logps(
    head: torch.nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    scale: float,
    softcap: float | None,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = head(hidden).float()
    if scale != 1.0:
        logits = logits * scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    if temperature != 1.0:
        logits = logits / temperature
    logps, entropy = SelectedLogSoftmax.apply(logits, targets, with_entropy)
    return logps, entropy if with_entropy else logps.new_zeros(())


class SelectedLogSoftmax(torch.autograd.Function):
    """``log_softmax(logits)[row, target]`` per row, and optionally the
    entropy (never differentiated: a metric and a mask; an entropy bonus,
    which grpo does not offer, would need its gradient), in fewer passes over
    the ``[rows, vocabulary]`` logits than ``log_softmax`` + ``gather`` +
    ``-(p * log p).sum()``.

    Autograd's way keeps the log-softmax output, allocates the entropy's
    ``exp`` and products, and in backward fills a zero tensor for ``gather``
    before the log-softmax's own backward pass. Here the softmax
    probabilities overwrite the log-softmax output in place and are what
    backward keeps, and the input gradient is one pass:
    ``-grad * p``, plus ``grad`` at each target. The arithmetic micro-batch's
    forward+backward: 1.05-1.07x (benchmarks/RESULTS.md, "The LM head's
    selection"); log-probs equal, gradients and entropy to float32 rounding
    (tests/unit/test_logprobs.py)."""

    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, targets: torch.Tensor, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        logps_all = F.log_softmax(logits, dim=-1)
        selected = logps_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        entropy = None
        if with_entropy:
            log_normalizer = logits[..., 0] - logps_all[..., 0]
        probs = logps_all.exp_()
        if with_entropy:
            # H = sum p (lse - z), with sum p kept rather than taken as 1: the probabilities'
            # float32 rounding then cancels as it does in -(p * log p).sum()
            entropy = log_normalizer * probs.sum(-1) - (probs * logits).sum(-1)
            ctx.mark_non_differentiable(entropy)
        ctx.save_for_backward(probs, targets)
        return selected, entropy

    @staticmethod
    def backward(
        ctx: Any, grad_selected: torch.Tensor, grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor, None, None]:
        probs, targets = ctx.saved_tensors
        grad = probs * grad_selected.neg().unsqueeze(-1)
        grad.scatter_add_(-1, targets.unsqueeze(-1), grad_selected.unsqueeze(-1))
        return grad, None, None


def _shares_exactly(body: Any) -> bool:
    """Whether reusing a prompt's keys/values gives what running it again
    would: not while gradient checkpointing drops the cache in training mode,
    nor while dropout draws a fresh mask for every row (training mode, with
    or without gradients)."""
    if not body.training:
        return True
    if getattr(body, "is_gradient_checkpointing", False):
        return False
    config = getattr(body, "config", None)
    if float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0:
        return False
    return not any(isinstance(m, torch.nn.Dropout) and m.p > 0 and m.training for m in body.modules())


def _is_plain_cache(cache: Any) -> bool:
    """A full key/value cache per layer (no sliding window, no recurrent state)."""
    # heavy (transformers): loaded on first use, not with this module
    from transformers.cache_utils import DynamicCache, DynamicLayer

    layers = getattr(cache, "layers", None)
    return type(cache) is DynamicCache and bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


def _shared_prompt_hidden(
    body: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, c: int
) -> torch.Tensor | None:
    """Hidden states ``[B, C, H]`` that predict the completion tokens, with
    each distinct (left-padded) prompt run once; ``None`` where nothing is
    shared or sharing would not be exact (the caller then runs every row)."""
    batch, length = input_ids.shape
    p = length - c
    prompt_ids, prompt_mask = input_ids[:, :p], attention_mask[:, :p]
    key = torch.where(prompt_mask.bool(), prompt_ids, torch.full_like(prompt_ids, -1))
    unique, row_prompt = torch.unique(key, dim=0, return_inverse=True)
    if unique.shape[0] == batch or not _shares_exactly(body):
        return None
    rows = torch.arange(batch, device=input_ids.device)
    first = torch.empty(unique.shape[0], dtype=torch.long, device=input_ids.device).scatter_(0, row_prompt, rows)
    prefix = body(input_ids=prompt_ids[first], attention_mask=prompt_mask[first], use_cache=True)
    cache = prefix.past_key_values
    if not _is_plain_cache(cache):
        return None
    cache.batch_select_indices(row_prompt)  # an indexing op: gradients flow back to the shared prompt
    rest = body(input_ids=input_ids[:, p:], attention_mask=attention_mask, past_key_values=cache, use_cache=True)
    # the last prompt position predicts the first completion token; completion positions the rest
    return torch.cat([prefix.last_hidden_state[row_prompt, -1:], rest.last_hidden_state[:, :-1]], dim=1)


def token_logprobs(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    num_completion_tokens: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    body: Any = None,
    share_prompts: bool = False,
    checkpoint_above: int = DEFAULT_CHECKPOINT_ABOVE,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the last ``num_completion_tokens`` tokens of ``input_ids``.

    ``input_ids``/``attention_mask`` are ``[B, L]`` (prompt left-padded,
    completion right-padded). Returns ``(logps [B, C], entropy [B, C] or
    None)`` in float32. Padded completion positions get values too; the
    caller masks them. Works for a plain HF causal LM and a PEFT-wrapped one,
    with or without gradients. ``body``: a compiled handle of the model's
    decoder body to run instead of the body itself (``torch_compile``,
    :mod:`grpo_core.modeling.compile`). ``share_prompts``: run each distinct prompt
    once (module docstring); ignored with a compiled ``body``, and where it
    cannot be exact (see :func:`_shared_prompt_hidden`). ``checkpoint_above``:
    the logit elements (``B x C x vocabulary``) above which the head chunks
    are recomputed in backward instead of kept (module docstring).
    """
    if temperature <= 0:
        raise ValueError(f"token_logprobs: temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"token_logprobs: chunk_size must be >= 1, got {chunk_size}")
    batch, length = input_ids.shape
    c = int(num_completion_tokens)
    if not 0 < c < length:
        raise ValueError(f"token_logprobs: num_completion_tokens={c} must be in [1, {length - 1}] for length {length}")

    plain_body, head = decoder_and_head(model)
    body = plain_body if body is None else body
    scale, softcap = logit_transform(unwrap_peft(model))
    hidden = (
        _shared_prompt_hidden(plain_body, input_ids, attention_mask, c)
        if share_prompts and body is plain_body
        else None
    )
    if hidden is None:
        outputs = body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        # Position t predicts token t+1: the C completion tokens come from the C
        # positions just before them.
        hidden = outputs.last_hidden_state[:, -c - 1 : -1, :]
    targets = input_ids[:, -c:]
    flat_hidden = hidden.reshape(batch * c, hidden.size(-1))
    flat_targets = targets.reshape(batch * c)

    use_checkpoint = (
        torch.is_grad_enabled()
        and (flat_hidden.requires_grad or any(p.requires_grad for p in head.parameters()))
        and batch * c * head.weight.shape[0] > checkpoint_above
    )
    logps_parts: list[torch.Tensor] = []
    entropy_parts: list[torch.Tensor] = []
    for start in range(0, batch * c, chunk_size):
        args = (
            head,
            flat_hidden[start : start + chunk_size],
            flat_targets[start : start + chunk_size],
            temperature,
            scale,
            softcap,
            with_entropy,
        )
        if use_checkpoint:
            logps, entropy = checkpoint(_chunk_logps, *args, use_reentrant=False)
        else:
            logps, entropy = _chunk_logps(*args)
        logps_parts.append(logps)
        entropy_parts.append(entropy)

    # Copies, not views of the concatenation: FSDP2 hooks the output of the module it wraps, and an
    # in-place op on a returned view would silently drop that hook (torch warns of it)
    logps_out = torch.cat(logps_parts).view(batch, c).clone()
    entropy_out = torch.cat(entropy_parts).view(batch, c).clone() if with_entropy else None
    return logps_out, entropy_out
