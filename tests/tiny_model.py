"""A tiny random Llama with SmolLM2's tokenizer, built in the test: for tests
where the point is the loop's math, not the model. Loads and trains in
well under a second per step on one core."""

from __future__ import annotations

from pathlib import Path

PARITY_SCALE = 0.3


def build_tiny_model(tokenizer_dir: str, out: Path, seed: int = 0) -> str:
    """Save a 1-layer, 32-wide Llama over SmolLM2's vocabulary to ``out``.

    Its output embeddings (untied from the input ones, which stay random)
    carry one shared direction, signed by the token id's parity: whether the
    next token is even is then one feature the model can learn in a few
    steps, where a random 49k-token model could only push up the few tokens
    it happened to sample. At start the policy is near indifferent to it."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        emb = model.get_output_embeddings().weight
        direction = torch.nn.functional.normalize(torch.randn(emb.shape[1]), dim=0)
        sign = 1.0 - 2.0 * (torch.arange(emb.shape[0]) % 2).float()  # +1 even id, -1 odd
        emb += PARITY_SCALE * sign[:, None] * direction[None, :]
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return str(out)


def random_llama(
    vocab_size: int = 64,
    hidden_size: int = 16,
    num_hidden_layers: int = 1,
    num_attention_heads: int = 2,
    num_key_value_heads: int = 2,
    seed: int = 0,
    **config: object,
):
    """A small random ``LlamaForCausalLM`` in memory (MLP twice the width), seeded: for
    tests of weights, checkpoints and kernels that need a real transformers model but no
    tokenizer. ``config``: further ``LlamaConfig`` fields (``tie_word_embeddings``, ...)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=2 * hidden_size,
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=num_attention_heads,
            num_key_value_heads=num_key_value_heads,
            **config,
        )
    )
