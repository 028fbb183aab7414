"""What the vLLM weight syncs send: merged LoRA weights, computed beside the
trainer's weights, only for what training changes (no engine needed)."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from tiny_model import random_llama
from transformers import LlamaForCausalLM

from grpo_core.modeling.engine_weights import in_dtype, merged_weights
from grpo_plugins.vllm.engine import PACKED_GROUPS


def tiny_llama() -> LlamaForCausalLM:
    return random_llama(num_hidden_layers=2, num_key_value_heads=1, tie_word_embeddings=True)


def lora_model(targets: list[str] | str):
    model = get_peft_model(tiny_llama(), LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.5)
    return model


def test_full_model_sends_every_weight() -> None:
    model = tiny_llama()
    assert set(merged_weights(model, PACKED_GROUPS)) == set(model.state_dict())


def test_lora_weights_equal_peft_merge_and_base_is_untouched() -> None:
    model = lora_model("all-linear")
    before = {k: v.clone() for k, v in model.get_base_model().state_dict().items()}
    sent = merged_weights(model, PACKED_GROUPS)
    # bit-exact: no merge/unmerge round trip on the trainer's weights
    assert all(torch.equal(v, model.get_base_model().state_dict()[k]) for k, v in before.items())

    reference = lora_model("all-linear").merge_and_unload().state_dict()  # same seed, same weights
    for name, tensor in sent.items():
        torch.testing.assert_close(tensor, reference[name], rtol=1e-5, atol=1e-6)
    # embeddings and norms never change under a LoRA: not sent
    assert not any("embed_tokens" in k or "norm" in k for k in sent)
    projections = {k for k in reference if k.endswith("_proj.weight")}
    assert set(sent) == projections


def test_fused_siblings_of_adapted_modules_are_sent_whole() -> None:
    model = lora_model(["q_proj", "v_proj", "gate_proj"])
    sent = merged_weights(model, PACKED_GROUPS)
    layer = "model.layers.0."
    # vLLM fuses q/k/v and gate/up: k_proj and up_proj travel (unchanged) with their adapted siblings
    for member in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
        assert f"{layer}{member}.weight" in sent
    assert f"{layer}self_attn.o_proj.weight" not in sent and f"{layer}mlp.down_proj.weight" not in sent
    base = tiny_llama().state_dict()
    assert torch.equal(sent[f"{layer}self_attn.k_proj.weight"], base[f"{layer}self_attn.k_proj.weight"])
    assert not torch.equal(sent[f"{layer}self_attn.q_proj.weight"], base[f"{layer}self_attn.q_proj.weight"])


def test_other_trainable_weights_mean_everything_is_sent() -> None:
    model = lora_model(["q_proj"])
    model.get_base_model().model.norm.weight.requires_grad_(True)
    assert set(merged_weights(model, PACKED_GROUPS)) == {k for k in tiny_llama().state_dict()}


@pytest.mark.parametrize("targets", [["q_proj"], "all-linear"])
def test_a_zero_adapter_sends_the_base_weights(targets) -> None:
    model = get_peft_model(tiny_llama(), LoraConfig(r=4, target_modules=targets))  # B = 0 at init
    base = tiny_llama().state_dict()
    assert all(torch.equal(t, base[k]) for k, t in merged_weights(model, PACKED_GROUPS).items())


def test_weights_go_in_the_engines_dtype_tied_ones_cast_once() -> None:
    """What a bf16 engine keeps: the sync casts (vLLM would cast too, warning once per tensor)."""
    state = merged_weights(tiny_llama(), PACKED_GROUPS)
    state["step"] = torch.tensor(3)  # a non-floating tensor passes unchanged
    assert in_dtype(state, None) is state
    cast = in_dtype(state, "bfloat16")
    assert cast.keys() == state.keys()
    assert {t.dtype for k, t in cast.items() if k != "step"} == {torch.bfloat16} and cast["step"].dtype == torch.int64
    assert torch.equal(cast["model.norm.weight"], state["model.norm.weight"].to(torch.bfloat16))
    # tied embeddings: one storage under two names, cast once and still one
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    assert cast["lm_head.weight"].data_ptr() == cast["model.embed_tokens.weight"].data_ptr()


def test_the_colocated_engine_names_its_dtype_so_the_in_memory_sync_casts() -> None:
    from grpo_core.config.loader import validate
    from grpo_plugins.vllm.colocate import ColocatedEngine, InMemorySync

    class Recorded(ColocatedEngine):
        """The real engine's dtype rule; load_weights records what arrives (no vLLM started)."""

        def fused_modules(self):
            return PACKED_GROUPS

        def load_weights(self, weights):
            self.loaded = weights

    for dtype in ("bfloat16", "float32"):
        engine = Recorded(validate({"base_model": "m", "vllm": {"dtype": dtype}}))
        assert engine.weight_dtype == dtype
        InMemorySync(context=None).grpo_sync_weights(model=lora_model("all-linear"), version=1, engine=engine)
        assert {t.dtype for t in engine.loaded.values()} == {getattr(torch, dtype)}
