"""Config loading, validation messages, defaults and the semantic checks.

Everything here is pure Python on small dicts and files: no model loads.
The option tables of the reference guide (names, types, defaults) are kept
as test data in ``tests/data/reference_options.json``, so an option of the
guide missing from the schema fails the test on any clone.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
from helpers import HUB_OFFLINE, REPO, TESTS, minimal_config
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from grpo_core.config.convert import to_toml_text
from grpo_core.config.loader import apply_overrides, load_config, parse_override, read_raw, validate
from grpo_core.config.schema import EFFECTIVE_DEFAULTS, TrlSettings, config_model
from grpo_core.contract.errors import ConfigError, GrpoError, NotImplementedYet
from grpo_core.contract.types import SAMPLES_TRAINER_MODEL
from grpo_core.host.plugin_host import EntryPointInfo, PluginHost
from grpo_core.validation.checks import implementation_names
from grpo_core.validation.run_check import check_run_config

QUICKSTART = REPO / "examples" / "quickstart"
REFERENCE_OPTIONS = TESTS / "data" / "reference_options.json"


def minimal(**top: Any) -> dict[str, Any]:
    """The smallest config that passes every check (helpers.minimal_config), 2 micro-batches a step."""
    return minimal_config(**{"gradient_accumulation_steps": 2, **top})


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# ------------------------------------------------------------------ quickstart


def test_quickstart_yaml_and_toml_twin_validate_to_the_same_config(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in HUB_OFFLINE:  # checked as where the hub is reachable
        monkeypatch.delenv(variable, raising=False)
    from_yaml = load_config(QUICKSTART / "config.yaml")
    from_toml = load_config(QUICKSTART / "config.toml")
    assert from_yaml.model_dump() == from_toml.model_dump()
    assert from_yaml.trl.reward_funcs == ["rewards.accuracy_reward", "rewards.format_reward"]
    assert from_yaml.trl.num_generations == 8 and from_yaml.learning_rate == pytest.approx(5e-6)
    warnings = check_run_config(from_yaml)
    assert all(isinstance(w, str) for w in warnings)
    assert any("'openai/gsm8k'" in w and "fetched from the Hugging Face hub" in w for w in warnings), warnings


def test_convert_of_quickstart_yaml_reads_back_as_the_same_data() -> None:
    raw = read_raw(QUICKSTART / "config.yaml")
    text = to_toml_text(raw)
    assert tomllib.loads(text) == raw
    assert "[[datasets]]" in text and "[trl]" in text and "[vllm]" in text


def test_convert_lists_dropped_nulls_in_a_comment() -> None:
    text = to_toml_text({"base_model": "m", "chat_template": None, "trl": {"beta": None, "top_k": 5}})
    assert text.startswith("# null in the source")
    assert "chat_template" in text.splitlines()[0] and "trl.beta" in text.splitlines()[0]
    assert tomllib.loads(text) == {"base_model": "m", "trl": {"top_k": 5}}


def test_quickstart_rewards_score_real_completions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(QUICKSTART))
    import rewards  # examples/quickstart/rewards.py

    completions = [
        [{"role": "assistant", "content": "<think>6*7</think> <answer>42</answer>"}],
        [{"role": "assistant", "content": "It is 41."}],
        [{"role": "assistant", "content": "1,042 apples"}],
    ]
    assert rewards.accuracy_reward(completions, answer=["42", "42", "1042"]) == [1.0, 0.0, 1.0]
    assert rewards.format_reward(completions) == [1.0, 0.0, 0.0]
    transform, kwargs = rewards.prompt_transform(None)
    row = transform({"question": "What is 6*7?", "answer": "6*7=42\n#### 1,042"})
    assert row["answer"] == "1042" and row["prompt"][-1] == {"role": "user", "content": "What is 6*7?"}
    assert kwargs == {"remove_columns": ["question"]}


# ------------------------------------------------------------------ messages


def test_misspelt_key_is_named_with_a_suggestion() -> None:
    data = minimal()
    data["trl"]["num_generatons"] = 4
    with pytest.raises(ConfigError) as info:
        validate(data, "cfg.toml")
    message = str(info.value)
    assert "'trl.num_generatons'" in message and "'trl.num_generations'" in message and "cfg.toml" in message


@pytest.mark.parametrize(
    ("where", "key", "hint"),
    [
        ((), "num_generations", "[trl]: write 'trl.num_generations'"),
        (("trl",), "learning_rate", "top level, not in [trl]"),
        (("trl",), "gpu_memory_utilization", "[vllm]: write 'vllm.gpu_memory_utilization'"),
        (("vllm",), "use_vllm", "[trl]: write 'trl.use_vllm'"),
    ],
)
def test_key_in_the_wrong_table_names_the_right_table(where: tuple[str, ...], key: str, hint: str) -> None:
    data = minimal()
    node = data
    for part in where:
        node = node.setdefault(part, {})
    node[key] = 1
    with pytest.raises(ConfigError, match=re.escape(hint)):
        validate(data)


def test_wrong_type_names_the_key_path() -> None:
    data = minimal(trl={"num_generations": "eight"})
    with pytest.raises(ConfigError) as info:
        validate(data)
    assert "'trl.num_generations'" in str(info.value) and '"eight"' in str(info.value)
    data = minimal(datasets=[{"path": "a.jsonl"}, {"path": 3, "split": ["x"]}])
    with pytest.raises(ConfigError) as info:
        validate(data)
    assert "'datasets[1].path'" in str(info.value) and "'datasets[1].split'" in str(info.value)


def test_missing_required_key_is_named() -> None:
    data = minimal()
    del data["base_model"]
    with pytest.raises(ConfigError, match="'base_model' is required"):
        validate(data)


def test_malformed_toml_and_yaml_give_clear_errors(tmp_path: Path) -> None:
    bad_toml = write(tmp_path, "bad.toml", 'base_model = "m"\n[trl\nbeta = 0\n')
    with pytest.raises(ConfigError, match=r"bad\.toml is not valid TOML.*line 2"):
        load_config(bad_toml)
    bad_yaml = write(tmp_path, "bad.yaml", "trl:\n  beta: [0\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml is not valid YAML"):
        load_config(bad_yaml)
    not_table = write(tmp_path, "list.yaml", "- a\n- b\n")
    with pytest.raises(ConfigError, match="table of settings"):
        load_config(not_table)
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.toml")


# ------------------------------------------------------------------ overrides


def test_set_overrides_nested_and_typed_values(tmp_path: Path) -> None:
    path = write(tmp_path, "c.toml", to_toml_text(minimal()))
    cfg = load_config(
        path,
        [
            "trl.num_generations=8",
            "trl.temperature=0.5",
            "trl.use_vllm=true",
            "trl.vllm_lora_sync=false",
            'trl.reward_funcs=["a.b", "c.d"]',
            "trl.generation_kwargs={stop = ['</answer>']}",
            "vllm.port=9001",
            "output_dir=/tmp/run 1",
            "lora_r = 8",
        ],
    )
    assert cfg.trl.num_generations == 8 and isinstance(cfg.trl.num_generations, int)
    assert cfg.trl.temperature == 0.5 and cfg.trl.use_vllm is True
    assert cfg.trl.reward_funcs == ["a.b", "c.d"]
    assert cfg.trl.generation_kwargs == {"stop": ["</answer>"]}
    assert cfg.vllm.port == 9001 and str(cfg.output_dir) == "/tmp/run 1" and cfg.lora_r == 8


def test_set_null_is_none_and_a_quoted_null_is_the_string(tmp_path: Path) -> None:
    path = write(tmp_path, "c.toml", to_toml_text(minimal(adapter="lora", trl={"beta": 0.1})))
    cfg = load_config(path, ["adapter=null", "trl.beta = null", 'output_dir="null"'])
    assert cfg.adapter is None  # full fine-tune, as `adapter: null` in a YAML config
    assert cfg.trl.beta == EFFECTIVE_DEFAULTS["beta"]  # None: grpo's default is filled in
    assert str(cfg.output_dir) == "null"
    assert parse_override("trl.top_k=null") == (["trl", "top_k"], None)
    # a key whose type has no None reads null as a YAML config does: unset, its default
    assert (
        load_config(path, ["micro_batch_size=null"]).micro_batch_size
        == validate(minimal(micro_batch_size=None)).micro_batch_size
        == 1
    )


def test_set_override_errors_name_the_item() -> None:
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_override("trl.beta")
    with pytest.raises(ConfigError, match="'base_model' is not a table"):
        apply_overrides({"base_model": "m"}, ["base_model.x=1"])
    with pytest.raises(ConfigError, match="trl.num_generatons"):
        validate(apply_overrides(minimal(), ["trl.num_generatons=3"]))


# ------------------------------------------------------------------ defaults / schema


def test_effective_defaults_are_filled() -> None:
    cfg = validate({"base_model": "m", "sequence_len": 600, "trl": {"max_completion_length": 100, "epsilon": 0.3}})
    for key, value in EFFECTIVE_DEFAULTS.items():
        if key in {"max_completion_length", "epsilon"}:
            continue
        assert getattr(cfg.trl, key) == value, key
    assert cfg.trl.epsilon_high == 0.3  # defaults to epsilon
    assert cfg.trl.max_prompt_length == 600  # defaults to sequence_len
    assert cfg.trl.scale_rewards == "group"
    assert cfg.trl.vllm_importance_sampling_correction is False and cfg.trl.vllm_mode is None
    vllm_cfg = validate(minimal(adapter="lora", trl={"use_vllm": True}))
    assert vllm_cfg.trl.vllm_importance_sampling_correction is True and vllm_cfg.trl.vllm_mode == "server"
    assert vllm_cfg.lora_target_linear is True


def test_json_schema_is_generated_with_every_table() -> None:
    schema = config_model().model_json_schema()  # [vllm] is the vLLM plugin's table
    assert schema["required"] == ["base_model"]
    assert {"trl", "vllm", "plugins", "datasets"} <= set(schema["properties"])
    trl = schema["$defs"]["TrlSettings"]
    assert trl["additionalProperties"] is False and "num_generations" in trl["properties"]


# ------------------------------------------------------------------ reference tables


def reference_options() -> list[tuple[str, str, str, str]]:
    """(section, option, type, default) for every row of the guide's
    Configuration Reference tables."""
    import json

    return [tuple(row) for row in json.loads(REFERENCE_OPTIONS.read_text(encoding="utf-8"))["rows"]]  # type: ignore[misc]


def _doc_default(text: str) -> Any:
    return (
        {"null": None, "true": True, "false": False}.get(text, None)
        if text in {"null", "true", "false"}
        else (text.strip('"') if text.startswith('"') else (float(text) if "." in text else int(text)))
    )


def _sample_values(doc_type: str) -> list[Any]:
    """Values the guide's type column says are valid (str types are checked
    by their options elsewhere)."""
    quoted = re.findall(r'"([^"]+)"', doc_type)
    if quoted:
        return quoted
    return {
        "bool": [True, False],
        "int": [1],
        "float": [0.5],
        "list[str]": [["a"]],
        "list[float]": [[1.0]],
        "dict": [{}],
    }.get(doc_type, [])


def test_reference_tables_parse() -> None:
    rows = reference_options()
    sections = {r[0] for r in rows}
    assert {
        "Core GRPO",
        "Reward functions",
        "Generation parameters",
        "Async pipeline",
        "Importance sampling",
        "Replay and re-roll",
        "Reference model",
        "Logging",
    } == sections
    assert len(rows) >= 50


@pytest.mark.parametrize(("section", "option", "doc_type", "default"), reference_options())
def test_every_reference_option_exists_under_trl_with_the_doc_default(
    section: str, option: str, doc_type: str, default: str
) -> None:
    fields = TrlSettings.model_fields
    assert option in fields, f"[trl].{option} ({section}) is missing from the schema"
    assert fields[option].default == _doc_default(default), f"trl.{option}: doc default {default}"
    for value in _sample_values(doc_type):
        TrlSettings.model_validate({option: value})  # the doc's type is accepted


# ------------------------------------------------------------------ semantic checks


def test_minimal_config_passes_without_warnings() -> None:
    assert check_run_config(validate(minimal())) == []


@pytest.mark.parametrize(
    ("changes", "fragments"),
    [
        ({"trl": {"reward_funcs": []}}, ["trl.reward_funcs is empty"]),
        ({"trl": {"reward_weights": [1.0, 0.5]}}, ["2 weight(s)", "1 function(s)"]),
        ({"datasets": []}, ["datasets is empty"]),
        (
            {"trl": {"num_generations": 3}},
            [
                "micro_batch_size (4) x gradient_accumulation_steps (2) = 8",
                "trl.num_generations = 3",
                "gradient_accumulation_steps = 3",
                "divisor of 8 (2, 4, 8)",
            ],
        ),
        (
            {"trl": {"generation_batch_size": 10}},
            ["trl.generation_batch_size = 10", "trl.num_generations = 4", "trl.generation_batch_size = 8"],
        ),
        ({"trl": {"num_generations": 1}}, ["at least 2"]),
        ({"trl": {"temperature": 0.0}}, ["greedy"]),
        ({"trl": {"async_prefetch": True}}, ["background thread", "trl.use_vllm = true", "trl.async_prefetch = false"]),
        ({"trl": {"use_vllm": True, "vllm_lora_sync": True}}, ["no adapter", "adapter = 'lora'"]),
        (
            {"trl": {"use_vllm": True, "vllm_mode": "colocate", "async_prefetch": True, "use_data_producer": True}},
            ["take turns", "vllm_mode = 'server'"],
        ),
        ({"bf16": True, "fp16": True}, ["bf16 and fp16"]),
    ],
)
def test_impossible_configs_raise_with_the_fix(changes: dict[str, Any], fragments: list[str]) -> None:
    cfg = validate(minimal(**changes))
    with pytest.raises(ConfigError) as info:
        check_run_config(cfg)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_deepspeed_zero3_with_non_reentrant_checkpointing_is_an_error(tmp_path: Path) -> None:
    ds = write(tmp_path, "ds.json", '{"zero_optimization": {"stage": 3}}')
    cfg = validate(
        minimal(
            deepspeed=str(ds),
            gradient_checkpointing=True,
            trl={"num_generations": 4, "use_vllm": True, "reward_funcs": ["last_number_match"]},
            gradient_checkpointing_kwargs={"use_reentrant": False},
        )
    )
    with pytest.raises(ConfigError) as info:
        check_run_config(cfg)
    assert "use_reentrant = true" in str(info.value)
    stage2 = write(tmp_path, "ds2.json", '{"zero_optimization": {"stage": 2}}')
    cfg = validate(
        minimal(
            deepspeed=str(stage2), gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False}
        )
    )
    check_run_config(cfg)  # ZeRO-2 takes non-reentrant checkpointing


def test_zero3_defaults_use_reentrant_to_true_and_fsdp_keeps_false(tmp_path: Path) -> None:
    from grpo_core.modeling.models import gradient_checkpointing_kwargs

    zero3 = write(tmp_path, "z3.json", '{"zero_optimization": {"stage": 3}}')
    zero2 = write(tmp_path, "z2.json", '{"zero_optimization": {"stage": 2}}')
    assert gradient_checkpointing_kwargs(validate(minimal(deepspeed=str(zero3)))) == {"use_reentrant": True}
    assert gradient_checkpointing_kwargs(validate(minimal(deepspeed=str(zero2)))) == {"use_reentrant": False}
    assert gradient_checkpointing_kwargs(validate(minimal(fsdp=["full_shard", "auto_wrap"]))) == {
        "use_reentrant": False
    }
    explicit = validate(minimal(deepspeed=str(zero3), gradient_checkpointing_kwargs={"use_reentrant": True, "x": 1}))
    assert gradient_checkpointing_kwargs(explicit) == {"use_reentrant": True, "x": 1}


@pytest.mark.parametrize(
    ("json_text", "fragments"),
    [
        ('{"zero_optimization": {"stage": 1}}', ["zero_optimization.stage is 1", "stage 2 or 3"]),
        ('{"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW"}}', ['remove its "optimizer" section']),
        ('{"zero_optimization": {"stage": 2}, "scheduler": {"type": "WarmupLR"}}', ['remove its "scheduler" section']),
        (
            '{"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 8}',
            ["micro_batch_size = 4", '"auto"'],
        ),
        ('{"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 4}', ["gradient_accumulation_steps = 4"]),
        ('{"zero_optimization": {"stage": 2}, "gradient_clipping": 0.3}', ["max_grad_norm"]),
        ('{"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}', ["offload_optimizer.device"]),
        ('{"zero_optimization": {"stage": 2}, "fp16": {"enabled": true}}', ["fp16.enabled = true", "float32"]),
        ('{"zero_optimization": ', ["not valid JSON"]),
        (
            '{"zero_optimization": {"stage": 3, "sub_group_size": "auto"}}',
            ["zero_optimization.sub_group_size", "numbers"],
        ),
    ],
)
def test_deepspeed_configs_grpo_cannot_run_name_the_key_and_fix(
    tmp_path: Path, json_text: str, fragments: list[str], monkeypatch
) -> None:
    import grpo_core.modeling.precision as precision

    monkeypatch.setattr(precision, "cpu_flags", lambda: set())  # bf16 = "auto" stays float32 whatever this CPU has
    ds = write(tmp_path, "ds.json", json_text)
    with pytest.raises(ConfigError) as info:
        check_run_config(validate(minimal(deepspeed=str(ds), bf16="auto")))
    message = str(info.value)
    assert f'deepspeed = "{ds}"' in message
    for fragment in fragments:
        assert fragment in message


def test_deepspeed_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the DeepSpeed config"):
        check_run_config(validate(minimal(deepspeed=str(tmp_path / "nope.json"))))


def test_deepspeed_autos_are_filled_from_grpo_config(tmp_path: Path, monkeypatch) -> None:
    import grpo_core.modeling.precision as precision
    from grpo_core.parallel.zero import engine_config, fill_model_autos

    monkeypatch.setattr(precision, "cpu_flags", lambda: set())
    ds = write(
        tmp_path,
        "ds.json",
        '{"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", '
        '"stage3_prefetch_bucket_size": "auto"}, "train_micro_batch_size_per_gpu": "auto", '
        '"gradient_accumulation_steps": "auto", "gradient_clipping": "auto", '
        '"bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}}',
    )
    cfg = validate(minimal(deepspeed=str(ds), max_grad_norm=0.5, bf16="auto"))
    out = engine_config(cfg, world=2)
    # grpo drives accumulation: the engine never divides the loss by it nor steps on its own count
    assert out["gradient_accumulation_steps"] == 1
    assert out["train_micro_batch_size_per_gpu"] == 4 and out["train_batch_size"] == 8
    assert out["gradient_clipping"] == 0.5
    assert out["bf16"]["enabled"] is False and out["fp16"]["enabled"] is False
    assert engine_config(validate(minimal(deepspeed=str(ds), bf16=True)), 1)["bf16"]["enabled"] is True

    class Config:
        hidden_size = 10

    fill_model_autos(out, Config())
    assert out["zero_optimization"]["reduce_bucket_size"] == 100
    assert out["zero_optimization"]["stage3_prefetch_bucket_size"] == 90
    out["zero_optimization"]["sub_group_size"] = "auto"
    with pytest.raises(ConfigError, match="zero_optimization.sub_group_size"):
        fill_model_autos(out, Config())


def test_zero3_refuses_a_reference_model_it_cannot_partition(tmp_path: Path) -> None:
    ds = write(tmp_path, "ds.json", '{"zero_optimization": {"stage": 3}}')
    with pytest.raises(ConfigError) as info:
        check_run_config(
            validate(
                minimal(
                    deepspeed=str(ds), trl={"num_generations": 4, "beta": 0.1, "reward_funcs": ["last_number_match"]}
                )
            )
        )
    assert "trl.beta > 0" in str(info.value) and "rollout 'transformers'" not in str(info.value)


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        (
            {
                "trl": {
                    "use_vllm": True,
                    "async_prefetch": True,
                    "use_data_producer": True,
                    "vllm_importance_sampling_correction": False,
                }
            },
            "vllm_importance_sampling_correction",
        ),
        (
            {"trl": {"use_vllm": True, "async_prefetch": True, "use_data_producer": True}},
            "trl.use_data_producer is accepted for compatibility and has no effect",
        ),
        ({"skip_prepare_dataset": True}, "skip_prepare_dataset is accepted for compatibility"),
        ({"trl": {"replay_buffer_size": 10, "replay_recompute_logps": False}}, "stale log-probabilities"),
        ({"trl": {"use_vllm": False, "vllm_lora_sync": True}, "adapter": "lora"}, "no effect without trl.use_vllm"),
        (
            {"trl": {"use_vllm": True, "vllm_mode": "colocate", "vllm_lora_sync": True}, "adapter": "lora"},
            "weight sync 'vllm_in_memory' sends merged weights, not the adapter (the engine lives in the trainer's "
            "process)",
        ),
        ({"gradient_checkpointing_kwargs": {"use_reentrant": False}}, "gradient_checkpointing is false"),
    ],
)
def test_risky_configs_warn(changes: dict[str, Any], fragment: str) -> None:
    warnings = check_run_config(validate(minimal(**changes)))
    assert any(fragment in w for w in warnings), warnings


def test_fsdp_with_async_prefetch_needs_no_deadlock_warning() -> None:
    # The prefetch thread issues no collectives (only the trainer's thread scatters): nothing to warn about.
    cfg = validate(
        minimal(
            fsdp=["full_shard", "auto_wrap"], trl={"use_vllm": True, "async_prefetch": True, "use_data_producer": True}
        )
    )
    assert not any("deadlock" in w for w in check_run_config(cfg))


def test_fsdp_options_that_cannot_run_are_refused_by_name() -> None:
    with pytest.raises(ConfigError) as info:
        check_run_config(validate(minimal(fsdp=["hybrid_shard"], fsdp_config={"fsdp_bogus": 1})))
    assert "hybrid_shard" in str(info.value) and "fsdp_bogus" in str(info.value)


class _HostWith(PluginHost):
    """A real plugin host that finds one extra implementation, as if a
    third-party package published it (no entry point needed in a test)."""

    def __init__(self, point: str, name: str, cls: type) -> None:
        super().__init__()
        self.extra = (point, name, cls)

    def implementation_class(self, point: str, spec: str, key: str | None = None):  # type: ignore[override]
        if (point, spec) == self.extra[:2]:
            return EntryPointInfo(f"grpo.{point}", spec, f"thirdparty:{spec}", "grpo-plugin-thirdparty"), self.extra[2]
        return super().implementation_class(point, spec, key)


class _ThirdPartySampler:
    """A rollout of another package that samples the trainer's own model."""

    engine_capabilities = frozenset({SAMPLES_TRAINER_MODEL})

    def grpo_rollout_generate(
        self, prompts, num_generations, sampling, policy_version
    ):  # pragma: no cover - never built
        raise AssertionError


def test_fsdp_and_zero3_accept_a_rollout_that_samples_the_trainers_model(tmp_path: Path) -> None:
    """Rank 0 samples with its full copy of a sharded policy (the runs are in
    tests/e2e/test_multiprocess.py), so FSDP and ZeRO-3 take the transformers
    rollout and a third-party one that samples the trainer's model alike."""
    ds = write(tmp_path, "ds.json", '{"zero_optimization": {"stage": 3}}')
    host = _HostWith("rollout", "my_sampler", _ThirdPartySampler)
    for sharding in ({"fsdp": ["full_shard"]}, {"deepspeed": str(ds)}):
        check_run_config(validate(minimal(**sharding)))
        check_run_config(validate(minimal(**sharding, plugins={"rollout": "my_sampler"})), host=host)


def test_quantised_base_is_judged_by_what_the_sync_sends() -> None:
    """``load_in_4bit`` needs a sync that leaves the engine's base alone: the
    adapter sync passes the rule, every merged-weights sync is refused
    (``full_http`` too, which the old list of names missed)."""
    base = {"adapter": "lora", "load_in_4bit": True}
    for sync in ("full_filesystem", "full_http", "nccl"):
        with pytest.raises(ConfigError, match=f"weight sync '{sync}' sends merged full weights"):
            check_run_config(validate(minimal(**base, trl={"use_vllm": True}, plugins={"weight_sync": sync})))
    try:
        check_run_config(validate(minimal(**base, trl={"use_vllm": True, "vllm_lora_sync": True})))
    except ConfigError as exc:
        assert "sends merged full weights" not in str(exc)


def test_sequence_level_is_with_liger_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    import grpo_plugins.liger_loss as liger_loss

    cfg = validate(minimal(trl={"importance_sampling_level": "sequence", "use_liger_loss": True}))
    monkeypatch.setattr(liger_loss, "liger_problem", lambda: None)  # as if liger-kernel were installed
    assert any("'token'" in w for w in check_run_config(cfg))


@pytest.fixture
def an_unimplemented_option(monkeypatch) -> str:
    """NOT_IMPLEMENTED is empty now (DeepSpeed, its last entry, landed): a stand-in entry keeps the mechanism tested."""
    import grpo_core.validation.checks as checks

    entry = checks._Unimplemented("tf32", lambda c: c.tf32 is not None, "a stand-in for a missing feature")
    monkeypatch.setattr(checks, "NOT_IMPLEMENTED", (entry,))
    return "tf32"


def test_unimplemented_options_are_refused(an_unimplemented_option: str) -> None:
    with pytest.raises(NotImplementedYet) as info:
        check_run_config(validate(minimal(tf32=True)))
    assert f"`{an_unimplemented_option}` is not implemented yet" in str(info.value)


def test_an_unimplemented_option_is_listed_with_the_other_problems(an_unimplemented_option: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_run_config(validate(minimal(tf32=True, torch_compile=True, torch_compile_backend="nope")))
    message = str(info.value)
    assert "2 problems" in message and "`tf32`" in message and "torch_compile_backend = 'nope'" in message


def test_implementation_names_follow_the_reference_options() -> None:
    assert implementation_names(validate(minimal())) == {
        "rollout": "transformers",
        "advantage_aggregation": "sum_then_normalize",
        "is_correction": "none",
        "weight_sync": "in_process",
        "replay": "default",
        "policy_loss": "grpo",
        "environment": "none",
    }
    assert implementation_names(validate(minimal(trl={"tools": ["m.f"]})))["environment"] == "tools"
    assert implementation_names(validate(minimal(trl={"environment_factory": "m.C"})))["environment"] == "tools"
    cfg = validate(
        minimal(
            adapter="lora",
            trl={
                "use_vllm": True,
                "vllm_lora_sync": True,
                "multi_objective_aggregation": "normalize_then_sum",
                "vllm_importance_sampling_mode": "sequence_mask",
            },
            plugins={"replay": "mine"},
        )
    )
    assert implementation_names(cfg) == {
        "rollout": "vllm",
        "advantage_aggregation": "normalize_then_sum",
        "is_correction": "sequence_mask",
        "weight_sync": "lora_filesystem",
        "replay": "mine",
        "policy_loss": "grpo",
        "environment": "none",
    }
    cfg.trl.vllm_mode = "colocate"
    assert (implementation_names(cfg)["rollout"], implementation_names(cfg)["weight_sync"]) == (
        "vllm_colocate",
        "vllm_in_memory",
    )


def test_unknown_implementation_names_are_errors_with_a_host() -> None:
    from grpo_core.host.plugin_host import PluginHost

    cfg = validate(minimal(plugins={"advantage_aggregation": "no_such_thing"}))
    with pytest.raises(ConfigError) as info:
        check_run_config(cfg, PluginHost())
    message = str(info.value)
    assert "plugins.advantage_aggregation" in message and "'no_such_thing'" in message
    assert "sum_then_normalize" in message  # lists what is available


# ------------------------------------------------------------------ fuzz

_KNOWN_KEYS = sorted(config_model().model_fields) + [f"trl.{k}" for k in TrlSettings.model_fields][:40]
_scalars = st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.floats(allow_nan=True) | st.text(max_size=12)
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)


def _nest(flat: dict[Any, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        if not isinstance(key, str):  # YAML allows non-string keys
            out[key] = value
            continue
        head, _, tail = key.partition(".")
        if tail:
            table = out.setdefault(head, {})
            if isinstance(table, dict):
                table[tail] = value
        else:
            out[key] = value
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(_KNOWN_KEYS) | st.text(max_size=10) | st.integers(0, 3), _values, max_size=8))
@example({"datasets": True})  # once a TypeError in the Axolotl rewrite (datasets that is not a list)
def test_fuzz_loader_raises_only_config_errors(flat: dict[Any, Any]) -> None:
    data = _nest(flat)
    data.setdefault("base_model", "m")
    try:
        cfg = validate(data)
    except ConfigError as exc:
        assert str(exc)
        return
    try:
        check_run_config(cfg)
    except ConfigError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(max_size=30), max_size=4))
def test_fuzz_overrides_raise_only_config_errors(items: list[str]) -> None:
    try:
        data = apply_overrides(minimal(), items)
        validate(data)
    except GrpoError as exc:
        assert isinstance(exc, ConfigError)


_toml_scalars = st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False) | st.text(max_size=10)
_toml_values = st.recursive(
    _toml_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=10,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(max_size=8), _toml_values, max_size=6))
def test_fuzz_convert_round_trips(data: dict[str, Any]) -> None:
    assert tomllib.loads(to_toml_text(data)) == data


def test_top_level_key_written_after_a_table_header_says_move_it(tmp_path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('base_model = "m"\n\n[[datasets]]\npath = "d.jsonl"\nmax_steps = 3\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "datasets[0].max_steps" in message and "move 'max_steps' above the first [table] header" in message


# ------------------------------------------------------------------ set, but never read


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"trl": {"prefetch_depth": 2}}, "trl.prefetch_depth = 2 has no effect without trl.async_prefetch = true"),
        (
            {"trl": {"streaming_min_groups": 2}},
            "trl.streaming_min_groups = 2 has no effect without trl.streaming_partial_batch = true",
        ),
        (
            {"trl": {"vllm_importance_sampling_mode": "token_mask"}},
            "trl.vllm_importance_sampling_mode has no effect: the importance-sampling correction is off "
            "(trl.vllm_importance_sampling_correction = false, its default without trl.use_vllm)",
        ),
        (
            {
                "trl": {
                    "use_vllm": True,
                    "vllm_importance_sampling_correction": False,
                    "vllm_importance_sampling_cap": 2.0,
                }
            },
            "trl.vllm_importance_sampling_cap has no effect: the importance-sampling correction is off "
            "(trl.vllm_importance_sampling_correction = false)",
        ),
        ({"trl": {"use_bias_correction_kl": True}}, "trl.use_bias_correction_kl has no effect with trl.beta = 0"),
        (
            {"trl": {"ref_model_mixup_alpha": 0.5, "ref_model_sync_steps": 8}},
            "trl.ref_model_mixup_alpha and trl.ref_model_sync_steps have no effect without trl.sync_ref_model = true",
        ),
        (
            {"trl": {"vllm_server_port": 9000, "vllm_server_base_url": "http://h:1"}},
            "trl.vllm_server_port, trl.vllm_server_base_url have no effect with trl.use_vllm = false",
        ),
        ({"trl": {"vllm_sync_interval": 2}}, "trl.vllm_sync_interval = 2 has no effect with trl.use_vllm = false"),
        (
            {"trl": {"skip_zero_advantage_batches": True, "beta": 0.1}},
            "trl.skip_zero_advantage_batches has no effect with trl.beta = 0.1",
        ),
        (
            {"plugins": {"is_correction": "token_mask"}, "trl": {"vllm_importance_sampling_correction": False}},
            "trl.vllm_importance_sampling_correction = false has no effect: plugins.is_correction = 'token_mask'",
        ),
    ],
)
def test_an_option_set_but_never_read_is_named(changes: dict[str, Any], fragment: str) -> None:
    warnings = check_run_config(validate(minimal(**changes)))
    assert any(fragment in w for w in warnings), warnings


@pytest.mark.parametrize(
    "changes",
    [
        {"trl": {"prefetch_depth": 2, "async_prefetch": True, "use_vllm": True}},
        {"trl": {"streaming_min_groups": 2, "streaming_partial_batch": True}},
        {"trl": {"use_vllm": True, "vllm_importance_sampling_mode": "token_mask"}},  # the correction's default: on
        {"trl": {"use_bias_correction_kl": True, "beta": 0.1}},
        {"trl": {"ref_model_sync_steps": 8, "sync_ref_model": True, "beta": 0.1}},
        {"trl": {"use_vllm": True, "vllm_server_port": 9000, "vllm_sync_interval": 2}},
        {"trl": {"skip_zero_advantage_batches": False, "beta": 0.1}},
        {"trl": {"beta": 0.1}},  # skip_zero_advantage_batches left at its default: not the user's doing
    ],
)
def test_the_same_options_where_they_are_read_are_not_warned_about(changes: dict[str, Any]) -> None:
    assert check_run_config(validate(minimal(**changes))) == []


def test_a_default_grpo_fills_in_is_never_warned_about() -> None:
    """Every key of EFFECTIVE_DEFAULTS is filled in without use_vllm/async_prefetch/beta: none was written."""
    cfg = validate(minimal())
    assert cfg.trl.prefetch_depth == 1 and cfg.trl.vllm_importance_sampling_mode == "token_truncate"
    assert set(EFFECTIVE_DEFAULTS) & cfg.trl.model_fields_set == {"num_generations"}  # the one minimal() writes
    assert check_run_config(cfg) == []


def test_a_config_dumped_with_only_what_was_set_derives_its_defaults_again() -> None:
    """What the Python API does with a GRPOConfig plus overrides: the filled-in values are not
    frozen into the dump, so turning vLLM on turns its default correction on too."""
    cfg = validate(minimal())
    assert cfg.trl.vllm_importance_sampling_correction is False  # its default without vLLM
    raw = cfg.model_dump(mode="json", exclude_unset=True)
    assert "vllm_importance_sampling_correction" not in raw["trl"] and "prefetch_depth" not in raw["trl"]
    again = validate({**raw, "trl": {**raw["trl"], "use_vllm": True}})
    assert again.trl.vllm_importance_sampling_correction is True and again.trl.vllm_mode == "server"


def test_accumulation_with_a_generation_batch_says_how_many_steps_it_feeds() -> None:
    cfg = validate(minimal(micro_batch_size=2, gradient_accumulation_steps=4, trl={"generation_batch_size": 16}))
    warnings = check_run_config(cfg)
    assert any(
        "trl.generation_batch_size = 16 with gradient_accumulation_steps = 4: each generation feeds 2 "
        "optimizer steps of 8 completions" in w
        for w in warnings
    ), warnings
    assert not any("has no effect" in w for w in warnings), warnings
    from grpo_core.interface.cli import summary

    assert "2 optimizer steps per generation" in summary(cfg)  # the summary and the warning agree
    one = validate(minimal(micro_batch_size=2, gradient_accumulation_steps=4, trl={"generation_batch_size": 8}))
    assert check_run_config(one) == []  # one generation per step: nothing to say


def test_sync_ref_model_with_lora_is_refused_at_check_time() -> None:
    with pytest.raises(NotImplementedYet) as info:
        check_run_config(validate(minimal(adapter="lora", trl={"sync_ref_model": True, "beta": 0.1})))
    message = str(info.value)
    assert "trl.sync_ref_model" in message and "adapter = 'lora'" in message and "trl.sync_ref_model = false" in message
    check_run_config(validate(minimal(trl={"sync_ref_model": True, "beta": 0.1})))  # full weights: it runs


def test_a_loss_that_fuses_the_lm_head_is_refused_under_deepspeed(tmp_path: Path) -> None:
    """Liger's loss declares ``uses_hidden_states``; the rule reads that."""
    ds = write(tmp_path, "ds.json", '{"zero_optimization": {"stage": 2}}')
    with pytest.raises(ConfigError, match="policy_loss 'liger' with deepspeed: a loss that fuses the LM head"):
        check_run_config(validate(minimal(deepspeed=str(ds), trl={"use_liger_loss": True})))
    try:
        check_run_config(validate(minimal(deepspeed=str(ds))))
    except ConfigError as exc:
        assert "fuses the LM head" not in str(exc)


def test_lora_http_sends_the_adapter_and_asks_the_engine_for_adapters() -> None:
    """``lora_http`` is judged as an adapter sync (a quantised base passes,
    no adapter or the colocated engine is refused), and a managed server for
    it gets LoRA layers, as ``lora_filesystem``'s does."""
    from grpo_core.contract.types import ADAPTER_FROM_URL
    from grpo_plugins.vllm.command_line import engine_flags, managed_spec, server_spec

    plugins = {"weight_sync": "lora_http"}
    with pytest.raises(ConfigError, match="no adapter is trained"):
        check_run_config(validate(minimal(trl={"use_vllm": True}, plugins=plugins)))
    with pytest.raises(ConfigError, match="lora_http.*colocate"):
        check_run_config(
            validate(minimal(adapter="lora", trl={"use_vllm": True, "vllm_mode": "colocate"}, plugins=plugins))
        )
    cfg = validate(minimal(adapter="lora", load_in_4bit=True, trl={"use_vllm": True}, plugins=plugins))
    try:
        check_run_config(cfg)
    except ConfigError as exc:
        assert "sends merged full weights" not in str(exc)
    needs = PluginHost().engine_requirements(cfg)
    assert ADAPTER_FROM_URL in needs
    assert "--enable-lora" in managed_spec(cfg, needs).argv
    assert "--enable-lora" not in managed_spec(cfg, frozenset()).argv
    # its worker fetches the adapter through /collective_rpc: a dev endpoint, so a network bind must say so
    with pytest.raises(ConfigError, match=r"fetches its adapter \(lora_http\).*expose_dev_endpoints = true"):
        server_spec(cfg, host="10.1.2.3", port=8000, **engine_flags(needs))
    cfg.vllm.expose_dev_endpoints = True
    assert server_spec(cfg, host="10.1.2.3", port=8000, **engine_flags(needs)).dev_mode
    lora_files = PluginHost().engine_requirements(
        validate(minimal(adapter="lora", trl={"use_vllm": True, "vllm_lora_sync": True}))
    )
    assert not server_spec(
        cfg.model_copy(update={"vllm": cfg.vllm.model_copy(update={"expose_dev_endpoints": False})}),
        host="10.1.2.3",
        port=8000,
        **engine_flags(lora_files),
    ).dev_mode  # a path-loaded adapter needs none
