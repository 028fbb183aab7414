"""Axolotl's configs in grpo: every key of Axolotl's schema is honoured,
accepted with a note, or refused with its reason. Axolotl's GRPO/GDPO doc and
example configs through the ``grpo`` command (``config check`` unchanged,
``config convert`` to TOML) are tests/e2e/test_axolotl_cli.py.

The key list (``tests/data/axolotl/keys.json``) is read from Axolotl's source
at a recorded commit by ``scripts/axolotl_keys.py``; refreshing it makes any
new key fail here until grpo has an answer for it. No model is loaded here
(the runs are in tests/e2e/test_axolotl_runs.py).
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from helpers import TESTS

from grpo_core.config import axolotl
from grpo_core.config.compat import compat_keys
from grpo_core.config.loader import read_raw, validate
from grpo_core.config.schema import DatasetSpec, TrlSettings, config_model
from grpo_core.contract.errors import ConfigError
from grpo_core.validation.run_check import check_run_config
from grpo_plugins.vllm.settings import VllmSettings

DATA = TESTS / "data" / "axolotl"
KEYS = json.loads((DATA / "keys.json").read_text())

# One Axolotl-style value per key grpo accepts with a note (compat keys):
# each must validate and be named in a warning.
COMPAT_SAMPLES: dict[str, Any] = {
    "sample_packing": False,
    "pad_to_sequence_len": True,
    "model_type": "LlamaForCausalLM",
    "tokenizer_type": "AutoTokenizer",
    "strict": False,
    "dataset_prepared_path": "last_run_prepared",
    "hf_use_auth_token": True,
    "skip_prepare_dataset": True,
}


def base(**extra: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "base_model": "some/model",
        "datasets": [{"path": "some/dataset"}],
        "micro_batch_size": 4,
        "trl": {"num_generations": 4, "reward_funcs": ["last_number_match"]},
    }
    data.update(extra)
    return data


# ------------------------------------------------------------ the key list


def test_key_list_records_its_axolotl_commit() -> None:
    assert re.fullmatch(r"[0-9a-f]{40}", KEYS["commit"])
    assert KEYS["source"] == "https://github.com/axolotl-ai-cloud/axolotl"
    # the keys the issue names are all in the list, so the list is the schema's
    for key in (
        "attn_implementation",
        "rl",
        "num_epochs",
        "save_safetensors",
        "load_in_4bit",
        "sample_packing",
        "pad_to_sequence_len",
        "model_type",
        "plugins",
        "trl",
        "vllm",
    ):
        assert key in KEYS["top_level"], key
    assert len(KEYS["top_level"]) > 300 and len(KEYS["trl"]) > 40


def _category(key: str) -> set[str]:
    if key in axolotl.REWRITTEN:  # e.g. plugins: Axolotl's list form is answered before grpo's table is read
        return {"rewritten"}
    found = set()
    if key in config_model().model_fields:  # [vllm] included: the vLLM plugin's table
        found.add("compat" if key in compat_keys() else "honoured")
    if key in axolotl.REFUSED:
        found.add("refused")
    return found


@pytest.mark.parametrize("key", KEYS["top_level"])
def test_every_top_level_axolotl_key_has_exactly_one_answer(key: str) -> None:
    assert len(_category(key)) == 1, f"{key}: {_category(key) or 'unknown to grpo'}"


@pytest.mark.parametrize(
    ("section", "model", "refused"),
    [
        ("trl", TrlSettings, {}),
        ("vllm", VllmSettings, axolotl.REFUSED_VLLM),  # the vLLM plugin's table
        ("datasets", DatasetSpec, axolotl.REFUSED_DATASET),
    ],
)
def test_every_table_key_has_exactly_one_answer(section: str, model: Any, refused: dict[str, str]) -> None:
    for key in KEYS[section]:
        assert (key in model.model_fields) != (key in refused), f"{section}.{key}"


def test_refused_keys_are_refused_with_their_reason_and_accepted_when_unset() -> None:
    refused = [k for k in KEYS["top_level"] if k in axolotl.REFUSED]
    assert len(refused) > 250
    for key in refused:
        with pytest.raises(ConfigError) as info:
            validate(base(**{key: True}))
        assert f"'{key}' is not supported: {axolotl.REFUSED[key]}" in str(info.value)
        cfg = validate(base(**{key: None}))  # null / false turn nothing on: accepted, named
        assert any(key in note for note in cfg._notes), key


def test_table_keys_are_refused_with_their_reason() -> None:
    for key, reason in axolotl.REFUSED_VLLM.items():
        with pytest.raises(ConfigError, match=re.escape(f"'vllm.{key}' is not supported: {reason}")):
            validate(base(vllm={key: "x"}))
    for key, reason in axolotl.REFUSED_DATASET.items():
        with pytest.raises(ConfigError, match=re.escape(f"'datasets[0].{key}' is not supported: {reason}")):
            validate(base(datasets=[{"path": "d", key: "x"}]))


def test_all_refusals_are_reported_at_once() -> None:
    with pytest.raises(ConfigError) as info:
        validate(base(xformers_attention=True, dpo_beta=0.1, vllm={"device": "cuda"}), "axolotl.yaml")
    assert str(info.value).startswith("axolotl.yaml: 3 problem(s)")


def test_compat_keys_validate_and_are_named_in_a_warning() -> None:
    axolotl_compat = [k for k in KEYS["top_level"] if k in compat_keys()]
    assert set(axolotl_compat) <= set(COMPAT_SAMPLES), "give a sample value for each new compat key"
    for key, value in COMPAT_SAMPLES.items():
        warnings = check_run_config(validate(base(**{key: value})))
        assert any(w.startswith(f"{key} is accepted for compatibility") for w in warnings), (key, warnings)


def test_sample_packing_true_is_refused_with_the_reason() -> None:
    with pytest.raises(ConfigError, match="sample_packing = true is not supported"):
        check_run_config(validate(base(sample_packing=True)))


# ------------------------------------------------------------ honoured keys


def test_rl_gdpo_is_grpo_with_normalize_then_sum() -> None:
    cfg = validate(base(rl="gdpo"))
    assert cfg.trl.multi_objective_aggregation == "normalize_then_sum"
    assert validate(base(rl="grpo")).trl.multi_objective_aggregation == "sum_then_normalize"
    with pytest.raises(ConfigError, match="rl = 'gdpo' is GRPO with trl.multi_objective_aggregation"):
        validate(base(rl="gdpo", trl={"num_generations": 4, "multi_objective_aggregation": "sum_then_normalize"}))


@pytest.mark.parametrize("rl", ["dpo", "kto", "orpo", "simpo", "ebft"])
def test_other_axolotl_trainers_are_refused_by_name(rl: str) -> None:
    with pytest.raises(ConfigError, match=f"'rl: {rl}' is Axolotl's {rl} trainer"):
        validate(base(rl=rl))


def test_plugins_list_is_answered_with_how_grpo_plugins_work() -> None:
    with pytest.raises(ConfigError) as info:
        validate(base(plugins=["axolotl.integrations.liger.LigerPlugin"]))
    text = str(info.value)
    assert "axolotl.integrations.liger.LigerPlugin" in text
    assert "pip install" in text and "grpo plugins" in text and "[plugins] table" in text
    assert validate(base(plugins=[])).plugins.advantage_aggregation is None  # an empty list asks for nothing
    # grpo's own [plugins] table is untouched
    assert (
        validate(base(plugins={"advantage_aggregation": "normalize_then_sum"})).plugins.advantage_aggregation
        == "normalize_then_sum"
    )


def test_num_epochs_and_max_steps() -> None:
    from grpo_core.training.run import steps_for_epochs

    cfg = validate(base(num_epochs=2, gradient_accumulation_steps=2))  # 8 completions = 2 prompts x 4 per step
    assert "max_steps" not in cfg.model_fields_set
    assert steps_for_epochs(cfg, 9) == 9  # ceil(2 x 9 / 2)
    cfg.trl.num_iterations = 2
    assert steps_for_epochs(cfg, 9) == 18
    both = validate(base(num_epochs=2, max_steps=5))
    assert any("max_steps = 5 takes precedence over num_epochs = 2" in w for w in check_run_config(both))


def test_attn_implementation_is_validated_and_flash_falls_back_to_sdpa_without_cuda() -> None:
    import torch

    from grpo_core.modeling.models import resolve_attn_implementation

    assert resolve_attn_implementation(validate(base(attn_implementation="eager"))) == "eager"
    if not torch.cuda.is_available():  # this machine; the CUDA branch needs a GPU
        with pytest.warns(UserWarning, match="flash_attention_2 is unavailable \\(no CUDA device\\); using 'sdpa'"):
            assert resolve_attn_implementation(validate(base(attn_implementation="flash_attention_2"))) == "sdpa"
    with pytest.raises(ConfigError, match="attn_implementation = 'flash' is not an attention implementation"):
        check_run_config(validate(base(attn_implementation="flash")))
    with pytest.raises(ConfigError, match="keep attn_implementation only"):
        check_run_config(validate(base(attn_implementation="sdpa", flash_attention=True)))


def test_optimizer_and_scheduler_keys_reach_torch_and_transformers() -> None:
    import torch

    from grpo_core.optimization.optimizer import build_optimizer, build_scheduler

    model = torch.nn.Linear(4, 4)
    cfg = validate(
        base(
            learning_rate=0.1,
            adam_beta1=0.8,
            adam_beta2=0.95,
            adam_epsilon=1e-6,
            optim_args={"amsgrad": True},
            max_steps=10,
            cosine_min_lr_ratio=0.1,
        )
    )
    optimizer = build_optimizer(cfg, model)
    group = optimizer.param_groups[0]
    assert group["betas"] == (0.8, 0.95) and group["eps"] == 1e-6 and group["amsgrad"] is True
    scheduler = build_scheduler(cfg, optimizer)
    for _ in range(10):
        optimizer.step()
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.01)  # decayed to 10% of 0.1, not to 0
    cfg = validate(
        base(
            lr_scheduler="polynomial", lr_scheduler_kwargs={"power": 2.0, "lr_end": 0.0}, max_steps=4, learning_rate=1.0
        )
    )
    optimizer = build_optimizer(cfg, model)
    scheduler = build_scheduler(cfg, optimizer)
    optimizer.step()
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx((1 - 1 / 4) ** 2)
    with pytest.raises(ConfigError, match="optim_args"):
        build_optimizer(validate(base(optim_args={"no_such_arg": 1})), model)


def test_qlora_needs_load_in_4bit_and_kbit_needs_lora_and_adapter_sync() -> None:
    with pytest.raises(ConfigError, match="'adapter: qlora' trains LoRA on a 4-bit base: set load_in_4bit: true"):
        validate(base(adapter="qlora"))
    assert validate(base(adapter="qlora", load_in_4bit=True)).adapter == "lora"
    with pytest.raises(ConfigError, match="needs a LoRA adapter"):
        check_run_config(validate(base(load_in_8bit=True)))
    with pytest.raises(ConfigError, match="set trl.vllm_lora_sync = true"):
        check_run_config(
            validate(
                base(
                    adapter="lora",
                    load_in_4bit=True,
                    trl={"num_generations": 4, "reward_funcs": ["last_number_match"], "use_vllm": True},
                )
            )
        )
    check_run_config(
        validate(
            base(
                adapter="lora",
                load_in_4bit=True,
                trl={
                    "num_generations": 4,
                    "reward_funcs": ["last_number_match"],
                    "use_vllm": True,
                    "vllm_lora_sync": True,
                },
            )
        )
    )


def test_kbit_is_refused_naming_the_hardware_when_bitsandbytes_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    # Fakes an environment without bitsandbytes (this one has it; the branch is the one other machines take).
    import importlib.util

    from grpo_core.modeling import quantization

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a)
    )
    quantization.bitsandbytes_problem.cache_clear()
    try:
        with pytest.raises(ConfigError) as info:
            check_run_config(validate(base(adapter="lora", load_in_4bit=True)))
    finally:
        quantization.bitsandbytes_problem.cache_clear()
    assert "load_in_4bit cannot run here: bitsandbytes is not installed" in str(info.value)
    assert "CUDA GPU, or an x86-64 CPU" in str(info.value)


def test_chat_template_jinja_becomes_the_chat_template() -> None:
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert validate(base(chat_template="jinja", chat_template_jinja=template)).chat_template == template


def test_nulls_for_grpo_keys_mean_the_default() -> None:
    cfg = validate(
        base(
            flash_attention=None,
            warmup_steps=None,
            trl={"num_generations": 4, "reward_funcs": ["last_number_match"], "use_vllm": None},
        )
    )
    assert cfg.warmup_steps == 0 and cfg.flash_attention is False and cfg.trl.use_vllm is False


# ------------------------------------------------------------ Axolotl's own configs

CONFIGS = sorted(DATA.glob("*/*.yaml"))


def test_the_copied_configs_are_axolotls_files() -> None:
    assert {p.parent.name for p in CONFIGS} == {"grpo-quickstart", "llama3-gdpo", "rlhf-async-grpo", "rlhf-gdpo"}
    for path in CONFIGS:
        assert read_raw(path).get("rl") in {"grpo", "gdpo"} or "rl" not in read_raw(path)
    gdpo = read_raw(DATA / "llama3-gdpo" / "qlora-1b-gdpo.yaml")
    for key in ("attn_implementation", "sample_packing", "pad_to_sequence_len", "num_epochs", "save_safetensors"):
        assert key in gdpo  # the keys the issue found refused are in the copy
