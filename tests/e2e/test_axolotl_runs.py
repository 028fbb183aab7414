"""Axolotl's configs run for real: Axolotl's GDPO example through the ``grpo``
command with the model and the dataset swapped for local ones, and the keys
it honours (QLoRA through bitsandbytes, attn_implementation,
save_safetensors) reaching the model that trains. SmolLM2 on CPU, the
transformers rollout, one short step each.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import REPO, TESTS, grpo, raw_config, run_workdir

from grpo_core.config.loader import load_config, validate
from grpo_core.validation.checks import implementation_names

ROOT = REPO
DATA = TESTS / "data" / "axolotl"
GSM8K_LOCAL = ROOT / "examples" / "gsm8k" / "data" / "train.jsonl"  # GSM8K's columns, 40 rows


def test_gdpo_example_is_gdpo() -> None:
    cfg = load_config(ROOT / "examples" / "gdpo" / "config.toml")
    assert cfg.rl == "gdpo" and implementation_names(cfg)["advantage_aggregation"] == "normalize_then_sum"
    assert len(cfg.trl.reward_funcs or []) == 2


@pytest.mark.extended  # a GDPO run of Axolotl's example (~26 s); GDPO and the Axolotl config are tested in the default
# tier
def test_axolotl_gdpo_example_runs_with_a_local_model_and_dataset(tmp_path: Path, smollm2_dir: str) -> None:
    out = tmp_path / "out"
    result = grpo(
        "run",
        str(DATA / "llama3-gdpo" / "qlora-1b-gdpo.yaml"),
        "--set",
        f"base_model={json.dumps(smollm2_dir)}",
        "--set",
        f"datasets[0].path={json.dumps(str(GSM8K_LOCAL))}",
        # tiny, for CI: one step of one prompt x 2 generations, 8 tokens
        "--set",
        "max_steps=1",
        "--set",
        "gradient_accumulation_steps=2",
        "--set",
        "trl.max_completion_length=8",
        "--set",
        f"output_dir={json.dumps(str(out))}",
        cwd=tmp_path,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # what the config asked for, said by name
    assert "attn_implementation = 'flash_attention_2': flash_attention_2 is unavailable" in result.stderr
    assert "max_steps = 1 takes precedence over num_epochs = 1" in result.stderr
    assert "sample_packing is accepted for compatibility" in result.stderr
    assert "step 1: sample completions" in result.stderr  # log_completions prints the sample, as TRL does
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert {"rewards/format_reward/mean", "rewards/correctness_reward/mean", "kl"} <= set(record)
    assert (out / "model.safetensors").is_file()  # full fine-tune (no adapter in that example), save_safetensors


def test_qlora_with_attn_implementation_and_bin_weights_trains(
    tmp_path: Path, smollm2_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # SmolLM2, not the tiny model: bitsandbytes' 4-bit CPU kernels refuse the tiny model's 32-wide layers
    # (RuntimeError: shape '[32, 0]' is invalid for input of size 16)
    pytest.importorskip("bitsandbytes")
    import bitsandbytes as bnb

    from grpo_core.modeling.models import load_policy, load_tokenizer
    from grpo_core.modeling.quantization import bitsandbytes_problem
    from grpo_core.training.run import run_training

    if bitsandbytes_problem() is not None:
        pytest.skip(bitsandbytes_problem())
    monkeypatch.chdir(tmp_path)
    # a reward that always varies within a group, so the step has gradients to apply
    rewards = (
        "def length(completions, **kwargs):\n"
        "    return [float(len(c[0]['content'] if isinstance(c, list) else c)) for c in completions]\n"
    )
    rows = [{"prompt": f"What is {a} + 2?", "answer": str(a + 2)} for a in range(8)]
    run_workdir(tmp_path, rows, {"qlora_rewards": rewards})
    cfg = validate(
        raw_config(
            smollm2_dir,
            tmp_path,
            adapter="qlora",
            load_in_4bit=True,
            attn_implementation="eager",
            save_safetensors=False,
            micro_batch_size=4,
            max_steps=1,
            learning_rate=1e-4,
            trl={
                "num_generations": 4,
                "max_completion_length": 8,
                "reward_funcs": ["qlora_rewards.length"],
                "temperature": 1.0,
            },
        )
    )
    model = load_policy(cfg, smollm2_dir, load_tokenizer(cfg, smollm2_dir))
    base = model.get_base_model()
    assert base.config._attn_implementation == "eager"
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in base.modules())
    del model, base
    assert run_training(cfg) == "completed"
    out = tmp_path / "out"
    assert (out / "adapter_model.bin").is_file() and not (out / "adapter_model.safetensors").exists()
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert record["step"] == 1 and record["grad_norm"] > 0  # LoRA on the 4-bit base took a real step
