"""The TRL -> grpo table of docs/from-trl.md is generated from both schemas and up to date."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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

    script = _script()
    rows = {name: key for name, key, _ in script.rows()}
    inherited = {f.name for f in dataclasses.fields(TrainingArguments)}
    for field in dataclasses.fields(TrlGRPOConfig):
        if field.name not in inherited:
            assert field.name in rows, field.name
    for name, key in rows.items():
        if key != "—":
            assert script._grpo_field(key.strip("`")) is not None, (name, key)
    # the renames a TRL user needs most
    assert rows["per_device_train_batch_size"] == "`micro_batch_size`"
    assert rows["num_train_epochs"] == "`num_epochs`"
    assert rows["beta"] == "`trl.beta`"
