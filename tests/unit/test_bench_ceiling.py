"""The flop counting of benchmarks/bench_ceiling.py, against sums done by hand."""

from __future__ import annotations

import sys

import pytest
from helpers import REPO
from tiny_model import random_llama

sys.path.insert(0, str(REPO / "benchmarks"))

from bench_ceiling import (  # noqa: E402
    Dims,
    causal_keys_shared,
    causal_keys_whole,
    ceiling_seconds,
    decode_bounds,
    micro_batch_flops,
)

SMOLLM2 = Dims(hidden=576, intermediate=1536, layers=30, heads=9, kv_heads=3, head_dim=64, vocab=49152, lora_r=16)


def test_causal_pairs_count_each_query_against_the_keys_up_to_itself():
    assert causal_keys_whole(rows=2, length=3) == 2 * (1 + 2 + 3)
    # 1 prompt of 2 tokens (1 + 2 pairs) shared by 2 rows of 2 completion tokens (3 + 4 pairs each)
    assert causal_keys_shared(prompts=1, prompt_tokens=2, rows=2, completion=2) == 3 + 2 * (3 + 4)
    # sharing nothing (one row per prompt) counts what running every row whole does
    assert causal_keys_shared(prompts=3, prompt_tokens=5, rows=3, completion=4) == causal_keys_whole(3, 9)


def test_smollm2_micro_batch_flops_by_hand():
    flops = micro_batch_flops(SMOLLM2, "shared", prompts=4, rows=16, prompt_tokens=34, completion=48)
    tokens = 4 * 34 + 16 * 48  # 904 through the decoder
    per_layer_attention = 576 * 576 * 2 + 576 * 192 * 2  # q, o; k, v
    per_layer_mlp = 576 * 1536 * 3
    assert flops["attention projections"] == 4 * tokens * 30 * per_layer_attention
    assert flops["MLP"] == 4 * tokens * 30 * per_layer_mlp
    lora_per_layer = 16 * ((576 + 576) * 2 + (576 + 192) * 2 + (576 + 1536) * 3)
    assert flops["LoRA"] == 6 * tokens * 30 * lora_per_layer
    assert flops["LM head"] == 4 * 16 * 48 * 576 * 49152  # the completion positions only
    pairs = 4 * 34 * 35 // 2 + 16 * (48 * 34 + 48 * 49 // 2)
    assert flops["attention scores"] == 12 * pairs * 9 * 64 * 30
    # RESULTS.md's earlier count of the frozen products alone: about 470 GFLOP
    frozen = flops["attention projections"] + flops["MLP"] + flops["LM head"]
    assert 465e9 < frozen < 475e9


def test_plain_loop_runs_the_head_on_every_position_and_whole_rows_through_the_decoder():
    whole = micro_batch_flops(SMOLLM2, "whole", prompts=4, rows=16, prompt_tokens=34, completion=48)
    plain = micro_batch_flops(SMOLLM2, "plain", prompts=4, rows=16, prompt_tokens=34, completion=48)
    assert plain["LM head"] == whole["LM head"] * 82 / 48
    assert {k: v for k, v in plain.items() if k != "LM head"} == {k: v for k, v in whole.items() if k != "LM head"}
    assert whole["MLP"] == pytest.approx(4 * 16 * 82 * 30 * 576 * 1536 * 3)


def test_ceiling_seconds_sums_each_class_at_its_shapes_rate():
    rates = {
        "MLP [1700x576]x[576x1536]": 100.0,
        "attention projection [1700x576]x[576x576]": 200.0,
        "LM head [768x576]x[576x49152]": 50.0,
    }
    flops = {"MLP": 100e9, "attention projections": 200e9, "LoRA": 0.0, "attention scores": 0.0, "LM head": 50e9}
    assert ceiling_seconds(flops, rates) == pytest.approx(3.0)


def test_decode_bounds_read_each_weight_once_in_the_servers_dtype():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        random_llama(num_key_value_heads=1, tie_word_embeddings=True), LoraConfig(r=2, target_modules="all-linear")
    )
    frozen = sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)  # the tied head counted once
    matmul = 16 * 16 * 2 + 16 * 8 * 2 + 16 * 32 * 3 + 64 * 16  # q, o; k, v; the MLP; the tied head
    f32 = decode_bounds(model, read_gbs=1.0, decode_gflops=1.0, sequences=4)
    bf16 = decode_bounds(model, read_gbs=1.0, decode_gflops=1.0, sequences=4, bytes_per_weight=2)
    assert f32["weight_MB"] == pytest.approx(frozen * 4 / 1e6)
    assert bf16["bandwidth_bound_ms"] == pytest.approx(f32["bandwidth_bound_ms"] / 2)
    assert f32["flops_per_step_G"] == bf16["flops_per_step_G"] == pytest.approx(2 * 4 * matmul / 1e9)
