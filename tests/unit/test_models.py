"""Loading the tokenizer, policy and reference with the real SmolLM2-135M."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from grpo_core.config.loader import validate
from grpo_core.contract.errors import ConfigError, NotImplementedYet
from grpo_core.modeling.models import (
    DisabledAdapterReference,
    FrozenCopyReference,
    load_policy,
    load_tokenizer,
    reference_model,
    resolve_attn_implementation,
    save_final,
    trainable_parameters,
)

# SmolLM2-135M: 30 layers, hidden 576, 3 KV heads x 64, MLP 1536.
LAYERS, HIDDEN, KV, MLP = 30, 576, 3 * 64, 1536


def cfg_for(model_dir: str, **extra):
    return validate({"base_model": model_dir, **extra})


@pytest.fixture(scope="module")
def inputs(smollm2_tokenizer):
    enc = smollm2_tokenizer(["What is 2 + 3?", "Name a colour."], return_tensors="pt", padding=True)
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


@pytest.fixture(scope="module")
def base_logits(smollm2_dir, inputs):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = base(**inputs).logits
    del base
    return logits


@pytest.fixture(scope="module")
def lora_setup(smollm2_dir):
    cfg = cfg_for(smollm2_dir, adapter="lora", lora_r=8, lora_alpha=16, trl={"beta": 0.04})
    tokenizer = load_tokenizer(cfg, smollm2_dir)
    policy = load_policy(cfg, smollm2_dir, tokenizer)
    # A fresh LoRA is a no-op (B = 0); perturb B so the adapter changes outputs.
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    return cfg, tokenizer, policy.eval()


# ----------------------------------------------------------------------------- tokenizer


def test_tokenizer_pads_left_and_has_pad(smollm2_dir):
    tok = load_tokenizer(cfg_for(smollm2_dir), smollm2_dir)
    assert tok.padding_side == "left"
    assert tok.pad_token is not None
    batch = tok(["a", "a much longer prompt here"], padding=True)
    assert batch["input_ids"][0][0] == tok.pad_token_id  # padding went to the left


def test_special_tokens_existing_and_new(smollm2_dir):
    tok = load_tokenizer(cfg_for(smollm2_dir, special_tokens={"pad_token": "<|endoftext|>"}), smollm2_dir)
    assert tok.pad_token == "<|endoftext|>" and len(tok) == 49152  # already in the vocabulary
    tok = load_tokenizer(
        cfg_for(smollm2_dir, special_tokens={"pad_token": "<|mypad|>", "extra": "<tool>"}), smollm2_dir
    )
    assert tok.pad_token == "<|mypad|>"
    assert len(tok) == 49154
    assert tok.convert_tokens_to_ids("<tool>") == 49153
    assert tok("x <tool> y", add_special_tokens=False)["input_ids"].count(49153) == 1


def test_chat_template_inline_named_and_unknown(smollm2_dir):
    messages = [{"role": "user", "content": "hi"}]
    tok = load_tokenizer(
        cfg_for(smollm2_dir, chat_template="{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}"),
        smollm2_dir,
    )
    assert tok.apply_chat_template(messages, tokenize=False) == "[user] hi"
    tok = load_tokenizer(cfg_for(smollm2_dir, chat_template="chatml"), smollm2_dir)
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert (
        text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )  # no default system prompt, unlike SmolLM2's own
    default = load_tokenizer(cfg_for(smollm2_dir), smollm2_dir)
    assert "SmolLM" in default.apply_chat_template(messages, tokenize=False)
    with pytest.raises(ConfigError, match="chat_template 'nosuch'"):
        load_tokenizer(cfg_for(smollm2_dir, chat_template="nosuch"), smollm2_dir)


# ----------------------------------------------------------------------------- policy


def test_lora_trainable_parameter_count(lora_setup):
    _, _, policy = lora_setup
    r = 8
    per_layer = r * ((HIDDEN + HIDDEN) * 2 + (HIDDEN + KV) * 2 + (HIDDEN + MLP) * 3)  # q,o ; k,v ; gate,up,down
    trainable, total = trainable_parameters(policy)
    assert trainable == LAYERS * per_layer == 2_442_240
    assert total - trainable == 134_515_008  # the frozen base
    names = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert all("lora_" in n for n in names)


def test_lora_target_modules_list(smollm2_dir, smollm2_tokenizer):
    cfg = cfg_for(smollm2_dir, adapter="lora", lora_r=4, lora_target_modules=["q_proj", "v_proj"])
    policy = load_policy(cfg, smollm2_dir, load_tokenizer(cfg, smollm2_dir))
    trainable, _ = trainable_parameters(policy)
    assert trainable == LAYERS * 4 * ((HIDDEN + HIDDEN) + (HIDDEN + KV))


def test_reference_with_lora_is_base_model(lora_setup, inputs, base_logits):
    cfg, _, policy = lora_setup
    ref = reference_model(cfg, cfg.base_model, policy)
    assert isinstance(ref, DisabledAdapterReference)
    with torch.no_grad():
        adapted = policy(**inputs).logits
    assert not torch.allclose(adapted, base_logits, atol=1e-3)  # the adapter matters
    with ref.active() as m:
        assert not torch.is_grad_enabled()
        ref_logits = m(**inputs).logits
    torch.testing.assert_close(ref_logits, base_logits, atol=1e-4, rtol=1e-4)
    with torch.no_grad():  # the adapter is back on after the block
        torch.testing.assert_close(policy(**inputs).logits, adapted)


def test_no_reference_without_kl(smollm2_dir, lora_setup):
    _, _, policy = lora_setup
    assert reference_model(cfg_for(smollm2_dir, adapter="lora"), smollm2_dir, policy) is None


def test_save_and_reload_adapter(lora_setup, inputs, tmp_path, smollm2_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _, tokenizer, policy = lora_setup
    out = save_final(policy, tokenizer, tmp_path / "final")
    adapter_cfg = json.loads((out / "adapter_config.json").read_text())
    assert (out / "adapter_model.safetensors").is_file()
    assert set(adapter_cfg["target_modules"]) == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    assert adapter_cfg["r"] == 8 and adapter_cfg["lora_alpha"] == 16
    assert (out / "tokenizer_config.json").is_file()
    base = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    reloaded = PeftModel.from_pretrained(base, str(out)).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**inputs).logits, policy(**inputs).logits, atol=1e-4, rtol=1e-4)


def test_gradient_checkpointing_with_lora_trains(smollm2_dir, inputs):
    cfg = cfg_for(
        smollm2_dir,
        adapter="lora",
        lora_r=2,
        lora_target_modules=["q_proj"],
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": True},
    )
    policy = load_policy(cfg, smollm2_dir, load_tokenizer(cfg, smollm2_dir))
    policy.train()
    assert policy.base_model.model.is_gradient_checkpointing
    loss = policy(**inputs).logits[:, -1].logsumexp(-1).sum()
    loss.backward()
    grads = [p.grad for n, p in policy.named_parameters() if "lora_B" in n]  # A gets none while B = 0
    assert len(grads) == LAYERS and all(g is not None and g.abs().sum() > 0 for g in grads)


def test_bf16_and_resized_embeddings(smollm2_dir):
    cfg = cfg_for(smollm2_dir, bf16=True, special_tokens={"pad_token": "<|mypad|>"})
    tokenizer = load_tokenizer(cfg, smollm2_dir)
    policy = load_policy(cfg, smollm2_dir, tokenizer)
    # bf16 is compute (autocast); a full fine-tune keeps float32 master weights (grpo_core/modeling/precision.py)
    assert {p.dtype for p in policy.parameters()} == {torch.float32}
    assert policy.get_input_embeddings().num_embeddings == len(tokenizer) == 49153
    assert policy.config.pad_token_id == tokenizer.pad_token_id == 49152
    assert all(p.requires_grad for p in policy.parameters())  # full fine-tuning


def test_flash_attention_falls_back_with_warning(smollm2_dir):
    cfg = cfg_for(smollm2_dir, flash_attention=True)
    if torch.cuda.is_available():  # pragma: no cover - CPU machines here
        pytest.skip("CUDA present: flash-attn may really be available")
    with pytest.warns(UserWarning, match="flash_attention_2 is unavailable.*using 'sdpa'"):
        assert resolve_attn_implementation(cfg) == "sdpa"


def test_full_finetune_reference_is_frozen_copy(smollm2_dir, inputs, base_logits):
    cfg = cfg_for(smollm2_dir, trl={"beta": 0.1, "sync_ref_model": True})
    tokenizer = load_tokenizer(cfg, smollm2_dir)
    policy = load_policy(cfg, smollm2_dir, tokenizer)
    ref = reference_model(cfg, smollm2_dir, policy)
    assert isinstance(ref, FrozenCopyReference)
    assert not any(p.requires_grad for p in ref.model.parameters())
    assert {p.data_ptr() for p in ref.model.parameters()}.isdisjoint(p.data_ptr() for p in policy.parameters())
    with torch.no_grad():  # the policy moves; the reference must not
        policy.get_input_embeddings().weight.mul_(1.5)
    with ref.active() as m:
        torch.testing.assert_close(m(**inputs).logits, base_logits, atol=1e-4, rtol=1e-4)
    before = ref.model.get_input_embeddings().weight.clone()
    ref.sync(policy, alpha=0.5)  # ref <- 0.5 policy + 0.5 ref = 1.25 x base
    torch.testing.assert_close(ref.model.get_input_embeddings().weight, before * 1.25)


def test_lora_sync_ref_model_refused(smollm2_dir, lora_setup):
    _, _, policy = lora_setup
    cfg = cfg_for(smollm2_dir, adapter="lora", trl={"beta": 0.1, "sync_ref_model": True})
    with pytest.raises(NotImplementedYet, match="sync_ref_model"):
        reference_model(cfg, smollm2_dir, policy)


def test_unknown_model_dir_is_config_error(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    cfg = cfg_for(str(tmp_path))
    with warnings.catch_warnings(), pytest.raises(ConfigError, match="tokenizer"):
        warnings.simplefilter("ignore")
        load_tokenizer(cfg, str(tmp_path))
