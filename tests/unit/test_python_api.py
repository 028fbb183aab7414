"""``grpo.train`` in process: the checks ``grpo run`` applies stop a script
the same way, before the model loads; overrides merge into tables; code
objects are passed by import path or held in memory. The scripts that train
for real are tests/e2e/test_python_api_scripts.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import grpo
from grpo_core.contract.errors import ConfigError


def small(**extra: object) -> dict[str, object]:
    data: dict[str, object] = {
        "base_model": "some/model",
        "micro_batch_size": 8,
        "max_steps": 1,
        "trl": {"num_generations": 4, "max_completion_length": 8},
    }
    data.update(extra)
    return data


# ------------------------------------------------------------ checks, no model


def test_train_refuses_what_grpo_run_refuses_before_loading_anything(tmp_path: Path) -> None:
    from datasets import Dataset

    prompts = Dataset.from_list([{"prompt": "What is 1 + 1?"}])
    with pytest.raises(ConfigError, match="'xformers_attention' is not supported"):
        grpo.train(small(xformers_attention=True), reward_funcs=[lambda completions, **kw: [0.0] * len(completions)])
    # a check_config error (run_training runs the checks grpo run runs): no model named "some/model" is fetched
    with pytest.raises(ConfigError, match="not divisible by trl.num_generations = 3"):
        grpo.train(
            small(output_dir=str(tmp_path / "a")), reward_funcs=[len], train_dataset=prompts, trl={"num_generations": 3}
        )
    with pytest.raises(ConfigError, match="reward worker subprocesses"):
        grpo.train(
            small(output_dir=str(tmp_path / "b")),
            reward_funcs=[lambda completions, **kw: [0.0]],
            trl={"reward_num_workers": 2},
        )
    with pytest.raises(ConfigError, match="train_dataset must be a datasets.Dataset"):
        grpo.train(small(output_dir=str(tmp_path / "c")), reward_funcs=[len], train_dataset=[{"prompt": "x"}])


def test_overrides_merge_into_tables_and_dotted_keys_work() -> None:
    from grpo_core.interface.api import _merge

    raw = {"trl": {"num_generations": 4, "beta": 0.0}}
    _merge(raw, "trl", {"beta": 0.04})
    _merge(raw, "trl.temperature", 0.7)
    _merge(raw, "max_steps", 3)
    assert raw == {"trl": {"num_generations": 4, "beta": 0.04, "temperature": 0.7}, "max_steps": 3}


def test_importable_functions_are_passed_by_import_path_others_in_memory() -> None:
    from grpo_core.interface.api import _reward_specs
    from grpo_plugins.rewards.builtin import last_number_match

    class Scorer:
        def __call__(self, completions, **kwargs):
            return [0.0] * len(completions)

    specs, in_memory = _reward_specs([last_number_match, Scorer(), "rewards.r"])
    assert specs == ["grpo_plugins.rewards.builtin.last_number_match", "python:Scorer", "rewards.r"]
    assert list(in_memory) == ["python:Scorer"]


def test_code_objects_without_an_import_path_are_held_and_loaded_like_any_user_code() -> None:
    from grpo_core.contract.errors import ConfigError
    from grpo_core.data.prompts import import_from_cwd
    from grpo_core.generation.user_rollout import import_rollout_func
    from grpo_core.interface.api import _code_spec
    from grpo_plugins.rewards.builtin import last_number_match

    def rollout(prompts, trainer):  # a closure: no import path reaches it
        return {}

    def other(prompts, trainer):
        return {}

    other.__name__ = "rollout"  # same name, another object: held under a name of its own
    first, second = _code_spec(rollout, "rollout_func"), _code_spec(other, "rollout_func")
    assert first.startswith("grpo_core.host.script_objects.rollout") and first != second
    assert import_rollout_func(first) is rollout and import_from_cwd(second) is other
    assert _code_spec(rollout, "rollout_func") == first  # the same object again: the same path
    assert _code_spec(last_number_match, "tools") == "grpo_plugins.rewards.builtin.last_number_match"
    assert _code_spec("mod.fn", "tools") == "mod.fn"
    with pytest.raises(ConfigError, match="environment_factory: expected a function, a class"):
        _code_spec(3, "environment_factory")


def test_trainer_arguments_map_to_config_keys_or_are_refused_by_name(tmp_path: Path) -> None:
    """GRPOTrainer's peft_config and processing_class, without a model: what
    each becomes, and what is refused rather than dropped (the end-to-end
    test below trains with all three)."""
    from peft import LoraConfig, PrefixTuningConfig

    from grpo_core.interface.api import _peft_keys, _processing_class

    keys = _peft_keys(LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["v_proj", "q_proj"]))
    assert keys == {
        "adapter": "lora",
        "lora_r": 4,
        "lora_alpha": 8,
        "lora_dropout": 0.1,
        "lora_target_linear": False,
        "lora_target_modules": ["q_proj", "v_proj"],
    }
    assert _peft_keys(LoraConfig(target_modules="all-linear"))["lora_target_linear"] is True
    with pytest.warns(UserWarning, match="every linear layer"):
        assert _peft_keys(LoraConfig())["lora_target_linear"] is True  # peft would pick per architecture
    with pytest.raises(ConfigError, match=r"modules_to_save=\['lm_head'\], use_dora=True"):
        _peft_keys(LoraConfig(use_dora=True, modules_to_save=["lm_head"], target_modules=["q_proj"]))
    with pytest.raises(ConfigError, match="a regular expression is not supported"):
        _peft_keys(LoraConfig(target_modules=r".*proj"))
    with pytest.raises(ConfigError, match="PrefixTuningConfig is not supported"):
        _peft_keys(PrefixTuningConfig(num_virtual_tokens=4))
    assert _processing_class("org/tokenizer", tmp_path) == "org/tokenizer"

    class Processor:
        image_processor = object()

        def save_pretrained(self, path: str) -> None:
            raise AssertionError("a processor is refused before anything is saved")

    with pytest.raises(ConfigError, match="Processor is not a tokenizer"):
        _processing_class(Processor(), tmp_path)
