"""token_logprobs against the naive full-logits computation, on the real
SmolLM2-135M-Instruct, plain and LoRA-wrapped, values and gradients."""

from __future__ import annotations

import copy

import pytest
import torch

from grpo_core.contract.errors import GrpoError
from grpo_core.optimization.logprobs import SelectedLogSoftmax, token_logprobs

TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def model(smollm2_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    m.eval()
    return m


@pytest.fixture(scope="module")
def lora_model(model):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    # init_lora_weights=False: B is random, so the adapter really changes the
    # outputs (with the default zero B the test could not tell it was applied).
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    m = get_peft_model(copy.deepcopy(model), config)
    m.eval()
    return m


@pytest.fixture(scope="module")
def batch(smollm2_tokenizer):
    """TRL layout: prompts left-padded, completions right-padded."""
    tok = smollm2_tokenizer
    prompts = ["What is 3 + 4?", "Name a colour of the sky on a clear day, please.", "Hi"]
    completions = [" It is 7.", " Blue, mostly, during the day", " Hello there"]
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    p_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    c_ids = [tok(c, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for c in completions]
    lp, lc = max(map(len, p_ids)), max(map(len, c_ids))
    rows, masks, cmasks = [], [], []
    for p, c in zip(p_ids, c_ids):
        rows.append([pad] * (lp - len(p)) + p + c + [pad] * (lc - len(c)))
        masks.append([0] * (lp - len(p)) + [1] * (len(p) + len(c)) + [0] * (lc - len(c)))
        cmasks.append([1] * len(c) + [0] * (lc - len(c)))
    return torch.tensor(rows), torch.tensor(masks), torch.tensor(cmasks, dtype=torch.float32), lc


def naive(model, input_ids, attention_mask, c, temperature):
    """The straightforward computation: full [B, L, V] logits."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    logits = logits[:, -c - 1 : -1].float() / temperature
    logps_all = logits.log_softmax(-1)
    logps = logps_all.gather(-1, input_ids[:, -c:].unsqueeze(-1)).squeeze(-1)
    entropy = -(logps_all.exp() * logps_all).sum(-1)
    return logps, entropy


def _objective(logps, entropy, cmask):
    # A loss that weights positions differently so a misaligned gradient shows. The entropy
    # is not in it: token_logprobs returns it detached (a metric and a mask, never trained
    # on, as in TRL), which test_entropy_is_returned_detached checks.
    w = torch.linspace(-1.0, 2.0, logps.numel()).view_as(logps)
    return (logps * w * cmask).sum()


@pytest.fixture(scope="module")
def naive_no_grad(model, batch):
    ids, mask, _, c = batch
    with torch.no_grad():
        return naive(model, ids, mask, c, TEMPERATURE)


# Chunk sizes are multiples of 8 on purpose: on CPU, a GEMM with fewer than 8
# rows over the 49k-long reduction takes a less accurate kernel path
# (measured: ~8e-6 relative error against ~5e-7), which is rounding, not a
# different result (in float64 both paths agree to 1e-14). Which kernel runs
# also depends on the CPU class (AVX2, AVX512, ...): on an AVX512 machine
# without AVX512-BF16 the paths differ by up to 1.8e-5 on a log-prob (a
# logit minus a logsumexp over 49k logits of size ~20, so float32 rounding
# at the logits' scale, ~1e-5, is what shows), and gradient elements (sums
# over every token of the batch) by up to 8e-5 (2.7e-4 relative), varying
# from run to run with the threads' reduction order. Log-probs are compared
# at 5e-5 absolute, gradients at 1e-4 + 1e-3 relative: still far below a
# real error (a wrong token, temperature or mask moves log-probs by > 0.05
# and gradients by tens of percent).
FP32 = {"atol": 5e-5, "rtol": 0.0}
GRAD = {"atol": 1e-4, "rtol": 1e-3}


@pytest.mark.parametrize("chunk_size", [8, 16, 4096])
def test_values_match_naive_no_grad(model, batch, naive_no_grad, chunk_size):
    ids, mask, cmask, c = batch
    ref_lp, ref_ent = naive_no_grad
    with torch.no_grad():
        lp, ent = token_logprobs(model, ids, mask, c, temperature=TEMPERATURE, with_entropy=True, chunk_size=chunk_size)
    assert lp.shape == ent.shape == (ids.size(0), c)
    assert not lp.requires_grad
    torch.testing.assert_close(lp, ref_lp, **FP32)
    torch.testing.assert_close(ent, ref_ent, **FP32)
    # Sanity: real log-probs, and temperature matters.
    assert (lp <= 0).all() and (ent >= 0).all()
    if chunk_size == 16:
        with torch.no_grad():
            lp1, none = token_logprobs(model, ids, mask, c, temperature=1.0)
        assert none is None
        assert (lp1 - lp).abs().max() > 1e-2


@pytest.mark.parametrize("checkpoint_above", [0, None], ids=["head-checkpointed", "head-kept"])
def test_gradients_match_naive_plain_model(model, batch, checkpoint_above):
    ids, mask, cmask, c = batch
    params = [p for p in model.parameters() if p.requires_grad]
    kwargs = {} if checkpoint_above is None else {"checkpoint_above": checkpoint_above}
    lp, ent = token_logprobs(model, ids, mask, c, temperature=TEMPERATURE, with_entropy=True, chunk_size=16, **kwargs)
    ours = torch.autograd.grad(_objective(lp, ent, cmask), params)
    ref_lp, ref_ent = naive(model, ids, mask, c, TEMPERATURE)
    torch.testing.assert_close(lp.detach(), ref_lp.detach(), **FP32)
    ref = torch.autograd.grad(_objective(ref_lp, ref_ent, cmask), params)
    nonzero = 0
    for g, r in zip(ours, ref):
        torch.testing.assert_close(g, r, **GRAD)
        nonzero += int(r.abs().max() > 0)
    assert nonzero > len(params) // 2


def test_head_is_recomputed_in_backward_only_above_the_threshold(lora_model, batch):
    """Below ``checkpoint_above`` backward reuses the head's chunks (one
    head call per chunk); above it each chunk runs again in backward."""
    from grpo_core.modeling.structure import decoder_and_head

    ids, mask, cmask, c = batch
    head = decoder_and_head(lora_model)[1]
    calls = []
    handle = head.register_forward_hook(lambda *args: calls.append(1))
    try:
        elements = ids.size(0) * c * head.weight.shape[0]
        chunks = -(-ids.size(0) * c // 16)
        for threshold, expected in ((elements, chunks), (elements - 1, 2 * chunks)):
            calls.clear()
            lp, ent = token_logprobs(
                lora_model,
                ids,
                mask,
                c,
                temperature=TEMPERATURE,
                with_entropy=True,
                chunk_size=16,
                checkpoint_above=threshold,
            )
            _objective(lp, ent, cmask).backward()
            assert len(calls) == expected, (threshold, len(calls))
    finally:
        handle.remove()
        lora_model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("checkpoint_above", [0, None], ids=["head-checkpointed", "head-kept"])
def test_lora_values_and_gradients_match_naive(lora_model, model, batch, checkpoint_above):
    ids, mask, cmask, c = batch
    lora_params = [p for n, p in lora_model.named_parameters() if p.requires_grad]
    assert lora_params and all("lora_" in n for n, p in lora_model.named_parameters() if p.requires_grad)

    kwargs = {} if checkpoint_above is None else {"checkpoint_above": checkpoint_above}
    lp, ent = token_logprobs(
        lora_model, ids, mask, c, temperature=TEMPERATURE, with_entropy=True, chunk_size=16, **kwargs
    )
    ours = torch.autograd.grad(_objective(lp, ent, cmask), lora_params)
    ref_lp, ref_ent = naive(lora_model, ids, mask, c, TEMPERATURE)
    torch.testing.assert_close(lp.detach(), ref_lp.detach(), **FP32)
    torch.testing.assert_close(ent.detach(), ref_ent.detach(), **FP32)
    ref = torch.autograd.grad(_objective(ref_lp, ref_ent, cmask), lora_params)
    for g, r in zip(ours, ref):
        torch.testing.assert_close(g, r, **GRAD)
    assert max(float(r.abs().max()) for r in ref) > 0

    # The adapter is really applied: log-probs differ from the base model's.
    with torch.no_grad():
        base_lp, _ = token_logprobs(model, ids, mask, c, temperature=TEMPERATURE)
        with lora_model.disable_adapter():
            off_lp, _ = token_logprobs(lora_model, ids, mask, c, temperature=TEMPERATURE)
    assert (base_lp - lp.detach()).abs().max() > 1e-3
    torch.testing.assert_close(off_lp, base_lp, **FP32)


def _saved_bytes(model, fn) -> int:
    """Bytes of activations autograd keeps for backward while ``fn`` runs
    (parameters, which both paths save alike, are left out)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def test_keeps_no_vocab_sized_tensors_for_backward(model, batch):
    """Measured, not assumed: naive keeps [B, C, V] logits (and their
    log-softmax) for backward; chunked + checkpointed (above
    ``checkpoint_above``, 0 here) keeps hidden states only.

    Measured on SmolLM2 (V=49152, fp32), activations saved for backward:
    this tiny batch (B=3, C=8): naive 95.5 MiB, token_logprobs 86.4 MiB;
    B=4, prompt 32, C=128: naive 1013 MiB, token_logprobs 820 MiB. The gap
    is 2 x B x C x V x 4 bytes (log-softmax and its exp); the rest is the
    decoder body, the same in both. Naive also materialises [B, L, V] logits
    in forward (126 MiB at B=4, L=160); token_logprobs one chunk (48 MiB).
    """
    ids, mask, cmask, c = batch
    vocab = model.config.vocab_size
    naive_bytes = _saved_bytes(model, lambda: naive(model, ids, mask, c, TEMPERATURE))
    ours_bytes = _saved_bytes(
        model,
        lambda: token_logprobs(model, ids, mask, c, temperature=TEMPERATURE, with_entropy=True, checkpoint_above=0),
    )
    logits_bytes = ids.size(0) * c * vocab * 4
    # The naive path keeps at least the [B, C, V] log-softmax; ours keeps none of it.
    assert naive_bytes - ours_bytes > logits_bytes
    print(f"saved-for-backward: naive {naive_bytes / 2**20:.1f} MiB, token_logprobs {ours_bytes / 2**20:.1f} MiB")


def test_entropy_is_returned_detached(model, batch):
    ids, mask, cmask, c = batch
    lp, ent = token_logprobs(model, ids, mask, c, temperature=TEMPERATURE, with_entropy=True, chunk_size=16)
    assert lp.requires_grad and not ent.requires_grad


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_selected_log_softmax_matches_float64(temperature):
    """The fused selection against log_softmax + gather in float64: values,
    entropy and the input gradient, on logits as spread as a trained head's."""
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(64, 49152, generator=generator) * 4).requires_grad_()
    targets = torch.randint(0, 49152, (64,), generator=generator)
    weights = torch.randn(64, generator=generator)
    tempered = logits / temperature
    selected, entropy = SelectedLogSoftmax.apply(tempered, targets, True)
    (grad,) = torch.autograd.grad((selected * weights).sum(), logits)

    exact = logits.detach().double().requires_grad_()
    exact_all = (exact / temperature).log_softmax(-1)
    exact_selected = exact_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    (exact_grad,) = torch.autograd.grad((exact_selected * weights.double()).sum(), exact)
    exact_entropy = -(exact_all.exp() * exact_all).sum(-1)
    # float32 rounding at the logits' scale (~20 before the log-normaliser), as the plain path
    torch.testing.assert_close(selected.double(), exact_selected.detach(), atol=2e-5, rtol=0)
    torch.testing.assert_close(entropy.double(), exact_entropy.detach(), atol=5e-5, rtol=0)
    torch.testing.assert_close(grad.double(), exact_grad, atol=1e-7, rtol=1e-4)
    plain_all = tempered.detach().log_softmax(-1)
    plain_entropy = -(plain_all.exp() * plain_all).sum(-1)
    assert (entropy - exact_entropy).abs().max() <= 2 * (plain_entropy - exact_entropy).abs().max() + 1e-6
    _, no_entropy = SelectedLogSoftmax.apply(tempered, targets, False)
    assert no_entropy is None


def test_the_kept_head_saves_one_logits_sized_tensor(model, batch):
    """Below checkpoint_above, backward keeps each chunk's softmax and no
    second logits-sized tensor (log-softmax output and its exp, before)."""
    ids, mask, cmask, c = batch
    vocab = model.config.vocab_size
    kept = _saved_bytes(model, lambda: token_logprobs(model, ids, mask, c, temperature=TEMPERATURE, with_entropy=True))
    checkpointed = _saved_bytes(
        model,
        lambda: token_logprobs(model, ids, mask, c, temperature=TEMPERATURE, with_entropy=True, checkpoint_above=0),
    )
    logits_bytes = ids.size(0) * c * vocab * 4
    assert logits_bytes * 0.99 <= kept - checkpointed <= logits_bytes * 1.1, (kept - checkpointed) / logits_bytes


def test_rejects_bad_arguments(model, batch):
    ids, mask, _, c = batch
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(model, ids, mask, c, temperature=0.0)
    with pytest.raises(ValueError, match="num_completion_tokens"):
        token_logprobs(model, ids, mask, ids.size(1))
    with pytest.raises(GrpoError, match="causal LM"):
        token_logprobs(model.model, ids, mask, c)


# ----------------------------------------------------------------------------- shared prompts


@pytest.fixture(scope="module")
def grouped_batch(smollm2_tokenizer):
    """Two prompts of different lengths, three completions each (a GRPO
    micro-batch: rows of a group repeat their prompt), rows interleaved as
    the length sort leaves them."""
    tok = smollm2_tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    prompts = [
        tok("What is 3 + 4?", add_special_tokens=False)["input_ids"],
        tok("Hi", add_special_tokens=False)["input_ids"],
    ]
    texts = [" It is 7.", " Seven", " 3 + 4 = 7, so seven", " Hello there", " Hi!", " Good morning to you"]
    rows = [
        (prompts[i // 3], tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
        for i, t in enumerate(texts)
    ]
    rows = [rows[i] for i in (0, 3, 1, 4, 2, 5)]
    lp, lc = max(len(p) for p, _ in rows), max(len(c) for _, c in rows)
    ids = [[pad] * (lp - len(p)) + p + c + [pad] * (lc - len(c)) for p, c in rows]
    masks = [[0] * (lp - len(p)) + [1] * (len(p) + len(c)) + [0] * (lc - len(c)) for p, c in rows]
    cmask = [[1] * len(c) + [0] * (lc - len(c)) for _, c in rows]
    return torch.tensor(ids), torch.tensor(masks), torch.tensor(cmask, dtype=torch.float32), lc


def _tokens_through(model, fn) -> int:
    """Token positions the decoder's embedding layer processed while ``fn`` ran."""
    from grpo_core.modeling.structure import decoder_and_head

    seen = []
    handle = decoder_and_head(model)[0].embed_tokens.register_forward_hook(
        lambda _m, args, _out: seen.append(args[0].numel())
    )
    try:
        fn()
    finally:
        handle.remove()
    return sum(seen)


def test_shared_prompts_match_naive_values_and_lora_gradients(lora_model, grouped_batch):
    """Each distinct prompt runs once (fewer tokens through the model), and
    log-probs, entropies and the LoRA gradients are those of running every row."""
    ids, mask, cmask, c = grouped_batch
    params = [p for p in lora_model.parameters() if p.requires_grad]
    lora_model.train()  # the training path (no dropout in this adapter: sharing stays exact)
    try:
        out: dict[str, tuple] = {}
        tokens = _tokens_through(
            lora_model,
            lambda: out.setdefault(
                "shared",
                token_logprobs(
                    lora_model,
                    ids,
                    mask,
                    c,
                    temperature=TEMPERATURE,
                    with_entropy=True,
                    chunk_size=16,
                    share_prompts=True,
                ),
            ),
        )
        lp, ent = out["shared"]
        ours = torch.autograd.grad(_objective(lp, ent, cmask), params)
        ref_lp, ref_ent = naive(lora_model, ids, mask, c, TEMPERATURE)
        ref = torch.autograd.grad(_objective(ref_lp, ref_ent, cmask), params)
    finally:
        lora_model.eval()
    batch, length = ids.shape
    assert tokens == 2 * (length - c) + batch * c < batch * length
    # The attention runs on other shapes (a cached prefix), so float32 rounds differently: up to 6.3e-5
    # on a log-prob of -23 here (2.7e-6 relative); a wrong position or mask moves log-probs by > 0.05.
    shared = {"atol": 5e-5, "rtol": 1e-5}
    torch.testing.assert_close(lp.detach(), ref_lp.detach(), **shared)
    torch.testing.assert_close(ent.detach(), ref_ent.detach(), **shared)
    for g, r in zip(ours, ref):
        torch.testing.assert_close(g, r, **GRAD)
    assert max(float(r.abs().max()) for r in ref) > 0


def test_shared_prompts_fall_back_where_sharing_would_not_be_exact(model, lora_model, batch, grouped_batch):
    """Rows that share nothing, dropout drawing a mask per row, and gradient
    checkpointing (which drops the cache in training) all run every row whole."""
    from peft import LoraConfig, get_peft_model

    ids, mask, _, c = batch  # three different prompts
    whole = ids.numel()
    with torch.no_grad():
        assert _tokens_through(model, lambda: token_logprobs(model, ids, mask, c, share_prompts=True)) == whole
    g_ids, g_mask, _, g_c = grouped_batch
    dropout = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, target_modules=["q_proj"], lora_dropout=0.1))
    dropout.train()
    assert (
        _tokens_through(dropout, lambda: token_logprobs(dropout, g_ids, g_mask, g_c, share_prompts=True))
        == g_ids.numel()
    )
    with torch.no_grad():  # evaluation (no dropout, no backward): shared again
        dropout.eval()
        assert (
            _tokens_through(dropout, lambda: token_logprobs(dropout, g_ids, g_mask, g_c, share_prompts=True))
            < g_ids.numel()
        )
    checkpointed = copy.deepcopy(lora_model)
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    checkpointed.train()
    assert (
        _tokens_through(checkpointed, lambda: token_logprobs(checkpointed, g_ids, g_mask, g_c, share_prompts=True))
        == g_ids.numel()
    )


def test_shared_prompts_under_fsdp2_match_naive_values_and_gradients(model, grouped_batch, tmp_path):
    """FSDP2 (torch's ``fully_shard`` on every decoder layer and the root, as
    grpo's ``fsdp`` config builds it) sees each layer called twice per
    forward, prompts then completions: its all-gathers, reshards and
    post-backward hooks must still give the values and full-weight gradients
    of running every row unsharded. A one-process gloo group (real
    collectives, nothing mocked); the two-process runs are in
    tests/e2e/test_multiprocess.py and tests/e2e/test_deepspeed.py."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from grpo_core.optimization.policy_forward import PolicyLogprobs

    ids, mask, cmask, c = grouped_batch
    reference = copy.deepcopy(model).train()
    ref_lp, ref_ent = naive(reference, ids, mask, c, TEMPERATURE)
    _objective(ref_lp, ref_ent, cmask).backward()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        sharded = copy.deepcopy(model).train()
        for layer in sharded.model.layers:
            fully_shard(layer)
        root = fully_shard(PolicyLogprobs(sharded))  # the module grpo hands FSDP: its forward is token_logprobs
        out: dict[str, tuple] = {}
        tokens = _tokens_through(
            sharded,
            lambda: out.setdefault(
                "shared", root(ids, mask, c, temperature=TEMPERATURE, with_entropy=True, share_prompts=True)
            ),
        )
        lp, ent = out["shared"]
        _objective(lp, ent, cmask).backward()
        grads = {name: p.grad.full_tensor() for name, p in sharded.named_parameters() if p.grad is not None}
    finally:
        dist.destroy_process_group()
    batch, length = ids.shape
    assert tokens == 2 * (length - c) + batch * c < batch * length  # each prompt ran once
    shared = {"atol": 5e-5, "rtol": 1e-5}
    torch.testing.assert_close(lp.detach(), ref_lp.detach(), **shared)
    torch.testing.assert_close(ent.detach(), ref_ent.detach(), **shared)
    expected = {name: p.grad for name, p in reference.named_parameters() if p.grad is not None}
    assert grads.keys() == expected.keys() and len(grads) > 10
    for name in expected:
        torch.testing.assert_close(grads[name], expected[name], **GRAD, msg=name)
