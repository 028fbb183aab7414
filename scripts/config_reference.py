"""The configuration reference page, rendered from the config schema.

The rows are ``grpo config schema``'s data (``config_model().model_json_schema()``,
with the tables plugins claim, such as the vLLM plugin's ``[vllm]``):
every key, its type, its default and its description, table by table. Where
the schema's default is ``null`` and grpo fills in a value after validation
(``EFFECTIVE_DEFAULTS``, the reference guide's "use the trainer's default"),
the filled-in value is shown beside it. A key without a description is an
error: the page must explain every key.

Used two ways:

    python scripts/config_reference.py     # print the page (Markdown)
    mkdocs build                           # mkdocs.yml names this file as a hook: the page is
                                           # generated as configuration.md at every build
"""

from __future__ import annotations

import json
from typing import Any

PAGE = "configuration.md"

INTRO = """# Configuration reference

Every key of a grpo config, generated from the schema at each build of this site
(`scripts/config_reference.py`, from the data `grpo config schema` prints). Keys with a dot live
in a table: `trl.beta` is `beta` under `[trl]`. A default shown as `null → X` is one the reference
guide leaves to the trainer: grpo fills in `X` after validation, and `grpo config check` prints the
values that will run. Where grpo's default differs from TRL's, [Migrating from TRL](from-trl.md)
says so.

Unknown keys are errors that suggest the closest name; keys of Axolotl's own schema are accepted,
warned about or refused with the reason ([Migrating from Axolotl](from-axolotl.md)).
"""

# (title, path of the table in the schema, how the key is written in a config); the tables
# plugins claim ([vllm]) follow [[datasets]], titled by their model's docstring (plugin_sections)
CORE_SECTIONS = [
    ("Top level", (), ""),
    ("`[[datasets]]` and `[[test_datasets]]`", ("datasets",), "datasets[]."),
    ("`[trl]`: every GRPO option", ("trl",), "trl."),
    ("`[episodes]`: multi-turn episodes", ("episodes",), "episodes."),
    ("`[alerts]`: health alerts", ("alerts",), "alerts."),
    ("`[plugins]`: which implementation of each extension point", ("plugins",), "plugins."),
]


def plugin_sections() -> list[tuple[str, tuple[str, ...], str]]:
    """One section per table a plugin claims: its title is the first clause
    of its model's docstring ("The inference servers grpo starts: ...")."""
    from grpo_core.config.schema import GRPOConfig, config_model

    out = []
    for name, field in config_model().model_fields.items():
        if name not in GRPOConfig.model_fields:
            clause = (field.description or "").split(":")[0].strip().rstrip(".")
            title = f"`[{name}]`: {clause[:1].lower()}{clause[1:]}" if clause else f"`[{name}]`"
            out.append((title, (name,), f"{name}."))
    return out


SECTIONS = [*CORE_SECTIONS[:2], *plugin_sections(), *CORE_SECTIONS[2:]]
TABLES = {path[0] for _, path, _ in SECTIONS if path}


def schema() -> dict[str, Any]:
    from grpo_core.config.schema import config_model

    return config_model().model_json_schema()


def effective_defaults() -> dict[str, Any]:
    from grpo_core.config.schema import EFFECTIVE_DEFAULTS

    return dict(EFFECTIVE_DEFAULTS)


def _ref(prop: dict[str, Any]) -> str | None:
    for candidate in [prop, *prop.get("allOf", []), *prop.get("anyOf", []), prop.get("items", {})]:
        if isinstance(candidate, dict) and "$ref" in candidate:
            return candidate["$ref"].rsplit("/", 1)[-1]
    return None


def _table(data: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    """The schema object of the table at ``path`` (``()``: the top level)."""
    table = data
    for part in path:
        table = data["$defs"][_ref(table["properties"][part])]
    return table


def type_of(prop: dict[str, Any]) -> str:
    """A short type: ``int``, ``str | null``, ``"a" | "b"``, ``list[str]``."""
    if "anyOf" in prop:
        return " | ".join(dict.fromkeys(type_of(p) for p in prop["anyOf"]))
    if "enum" in prop:
        return " | ".join(json.dumps(v) for v in prop["enum"])
    if "const" in prop:
        return json.dumps(prop["const"])
    kind = prop.get("type")
    if kind == "array":
        return f"list[{type_of(prop.get('items', {})) or 'any'}]"
    if kind == "object":
        return "table"
    names = {"integer": "int", "number": "float", "string": "str", "boolean": "bool", "null": "null"}
    if kind in names:
        return names[kind]
    if "$ref" in prop:
        return "table"
    return "any"


def _value(value: Any) -> str:
    return f"`{json.dumps(value)}`"


def default_of(prop: dict[str, Any], key: str, required: bool, filled: dict[str, Any]) -> str:
    if required:
        return "required"
    if "default" not in prop:
        return "`[]`" if prop.get("type") == "array" else "—"
    shown = _value(prop["default"])
    if prop["default"] is None and key in filled:
        shown += f" → {_value(filled[key])}"
    return shown


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;").replace("\n", " ")


def rows(data: dict[str, Any], path: tuple[str, ...], prefix: str) -> list[tuple[str, str, str, str]]:
    """(key, type, default, description) for every key of one table."""
    table = _table(data, path)
    props, required = table["properties"], set(table.get("required", []))
    filled = effective_defaults() if path == ("trl",) else {}
    out = []
    for key, prop in props.items():
        if not path and key in TABLES | {"test_datasets"}:
            continue
        out.append(
            (
                f"{prefix}{key}",
                type_of(prop),
                default_of(prop, key, key in required, filled),
                (prop.get("description") or "").strip(),
            )
        )
    return out


def undocumented(data: dict[str, Any] | None = None) -> list[str]:
    """Keys the schema gives no description."""
    data = data or schema()
    return [key for _, path, prefix in SECTIONS for key, _, _, text in rows(data, path, prefix) if not text]


def render(data: dict[str, Any] | None = None) -> str:
    data = data or schema()
    missing = undocumented(data)
    if missing:
        raise SystemExit(
            "config keys without a description (add Field(description=...) in grpo_core/config/schema.py, or in "
            "the model of the plugin that claims the table): " + ", ".join(missing)
        )
    parts = [INTRO]
    for title, path, prefix in SECTIONS:
        parts.append(f"\n## {title}\n")
        if path == ("datasets",):
            parts.append(
                "Each `[[datasets]]` table is one source of training prompts; `[[test_datasets]]` tables, in "
                "the same format, hold evaluation prompts (the top-level `test_datasets`).\n"
            )
        if path == ("plugins",):
            parts.append(
                "A `[plugins.<name>]` table holds the settings of the implementation (or named reward function) "
                "`<name>`, validated by its own `Settings` model ([Plugins](plugins.md)).\n"
            )
        parts.append("| key | type | default | description |\n| --- | --- | --- | --- |")
        for key, kind, default, text in rows(data, path, prefix):
            # a pipe inside a code span does not split a cell; elsewhere it is escaped
            parts.append(f"| `{key}` | `{kind}` | {_cell(default)} | {_cell(text)} |")
    return "\n".join(parts) + "\n"


def on_files(files: Any, config: Any) -> Any:
    """mkdocs hook: add the generated page to the site."""
    from mkdocs.structure.files import File

    files.append(File.generated(config, PAGE, content=render()))
    return files


if __name__ == "__main__":
    print(render(), end="")
