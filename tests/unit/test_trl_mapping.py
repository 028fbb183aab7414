"""The TRL -> grpo table of docs/from-trl.md is generated from both schemas and up to date."""

from __future__ import annotations

import importlib.util

from helpers import REPO

ROOT = REPO


def _script():
    spec = importlib.util.spec_from_file_location("trl_mapping", ROOT / "scripts" / "trl_mapping.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_readme_table_is_up_to_date() -> None:
    script = _script()
    readme = (ROOT / "docs" / "from-trl.md").read_text(encoding="utf-8")
    assert script.readme_with_table(readme) == readme, "run: python scripts/trl_mapping.py --write"


def test_every_trl_field_is_a_row_and_mapped_keys_exist_in_grpo() -> None:
    import dataclasses

    from transformers import TrainingArguments
    from trl import GRPOConfig as TrlGRPOConfig

    from grpo_core.config.trl_names import schema_field

    script = _script()
    rows = {name: key for name, key, _ in script.rows()}
    inherited = {f.name for f in dataclasses.fields(TrainingArguments)}
    for field in dataclasses.fields(TrlGRPOConfig):
        if field.name not in inherited:
            assert field.name in rows, field.name
    for name, key in rows.items():
        if key != "—":
            assert schema_field(key.strip("`")) is not None, (name, key)
    # the renames a TRL user needs most
    assert rows["per_device_train_batch_size"] == "`micro_batch_size`"
    assert rows["num_train_epochs"] == "`num_epochs`"
    assert rows["beta"] == "`trl.beta`"


def test_every_difference_says_why_in_the_one_page_that_tables_them() -> None:
    """docs/from-trl.md is the one source: the defaults, the `trl grpo` and
    `GRPOTrainer` arguments and the field mapping are each generated into it
    once (the up-to-date check is above), and no other page repeats them."""
    script = _script()
    doc = (ROOT / "docs" / "from-trl.md").read_text(encoding="utf-8")
    assert not [name for name, *_ in script.differences() if name not in script.WHY]
    assert doc.count("| `per_device_train_batch_size` = `8` | `micro_batch_size` | `1` |") == 1
    for name in script.SECTIONS:
        assert doc.count(f"<!-- {name}:start -->") == 1, name
    headers = [line for line in doc.splitlines() if line.startswith("| ") and "argument |" in line]
    assert len(headers) == len(set(headers)) == 2, headers  # the trl grpo and GRPOTrainer tables, once each
    others = [p for p in (ROOT / "docs").glob("*.md") if p.name != "from-trl.md"]
    assert not [p.name for p in others if "| `per_device_train_batch_size` = `8`" in p.read_text(encoding="utf-8")]


def test_the_trl_defaults_grpo_names_are_the_installed_trls() -> None:
    """What `grpo config check` says TRL's defaults are, and what `grpo config
    convert` writes for them, hold against the installed TRL."""
    import dataclasses

    from trl import GRPOConfig as TrlGRPOConfig

    from grpo_core.config.trl_cli import KEPT_DEFAULTS, TRL_EPOCHS, TRL_REWARDS
    from grpo_core.config.trl_names import DEFAULT_DIFFERENCES, SCRIPT_KEYS, grpo_key

    defaults = {f.name: f.default for f in dataclasses.fields(TrlGRPOConfig)}
    for difference in DEFAULT_DIFFERENCES:
        assert defaults[difference.trl_field] == difference.trl_default, difference.trl_field
        assert grpo_key(difference.trl_field) in (difference.key, "num_epochs"), difference.trl_field
    for key, field, value in KEPT_DEFAULTS:
        expected = True if field == "bf16" else defaults[field]  # TRL's bf16 None becomes true without fp16
        assert value == expected and grpo_key(field) == key, field
    assert defaults["num_train_epochs"] == TRL_EPOCHS
    import trl.scripts.grpo as trl_script

    for name, path in TRL_REWARDS.items():
        module, _, attr = path.rpartition(".")
        assert getattr(__import__(module, fromlist=[attr]), attr).__name__ == name
        assert f'"{name}"' in open(trl_script.__file__, encoding="utf-8").read()  # one of `trl grpo`'s reward names
    import trl

    fields = {f.name for cls in (trl.ScriptArguments, trl.ModelConfig) for f in dataclasses.fields(cls)}
    assert set(SCRIPT_KEYS) - {"torch_dtype", "reward_model_name_or_path"} <= fields
