"""The TRL -> grpo table of docs/from-trl.md: every field of TRL's ``GRPOConfig`` and the grpo key for it.

Generated from both schemas so it stays true: the rows are TRL's own
``GRPOConfig`` fields (read from the installed ``trl``) and the
``TrainingArguments`` fields grpo has a key for; the grpo column is checked
against grpo's schema (a renamed or removed key fails here, not in a user's
script). ``tests/test_trl_mapping.py`` fails when docs/from-trl.md is out of date.

    python scripts/trl_mapping.py          # print the table
    python scripts/trl_mapping.py --write  # rewrite it in docs/from-trl.md
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "docs" / "from-trl.md"
START, END = "<!-- trl-mapping:start -->", "<!-- trl-mapping:end -->"

# TRL names that differ from grpo's. Everything else maps by name: a field of
# [trl] first, then a top-level key, then [vllm].
RENAMES = {
    "per_device_train_batch_size": "micro_batch_size",
    "num_train_epochs": "num_epochs",
    "lr_scheduler_type": "lr_scheduler",
    "optim": "optimizer",
    "vllm_structured_outputs_regex": "trl.vllm_guided_decoding_regex",
    "vllm_gpu_memory_utilization": "vllm.gpu_memory_utilization",
    "vllm_max_model_length": "vllm.max_model_len",
    "vllm_tensor_parallel_size": "vllm.tensor_parallel_size",
}
# Fields whose grpo counterpart is not a key of the same shape.
ELSEWHERE = {
    "model_init_kwargs": "`base_model`, `bf16`, `attn_implementation`, `load_in_4bit` (no free-form kwargs)",
    "report_to": "`report_to` (a list; trackers are `grpo.tracker` plugins; metrics.jsonl always)",
    "vllm_importance_sampling_clip_max": "`trl.vllm_importance_sampling_cap`",
    "reward_funcs": "a GRPOTrainer argument in TRL; names or import paths here, or callables passed to `grpo.train`",
}


def _grpo_field(key: str) -> object | None:
    from grpo_core.config.schema import GRPOConfig

    model: object = GRPOConfig
    field = None
    for part in key.split("."):
        fields = getattr(model, "model_fields", {})
        if part not in fields:
            return None
        field = fields[part]
        model = field.annotation
    return field


def grpo_key(name: str) -> str | None:
    """The grpo key for one TRL field, or None."""
    if name in RENAMES:
        if _grpo_field(RENAMES[name]) is None:
            raise SystemExit(f"RENAMES maps {name} to {RENAMES[name]}, which grpo's schema does not have")
        return RENAMES[name]
    for key in (f"trl.{name}", name, f"vllm.{name}"):
        if _grpo_field(key) is not None:
            return key
    return None


def rows() -> list[tuple[str, str, str]]:
    import trl
    from transformers import TrainingArguments
    from trl import GRPOConfig as TrlGRPOConfig

    inherited = {f.name for f in dataclasses.fields(TrainingArguments)}
    own = [f.name for f in dataclasses.fields(TrlGRPOConfig) if f.name not in inherited]
    base = [f.name for f in dataclasses.fields(TrainingArguments) if grpo_key(f.name) is not None]
    out = []
    for name in [*own, *base, "reward_funcs"]:
        key = grpo_key(name)
        if name in ELSEWHERE:
            out.append((name, f"`{key}`" if key else "—", ELSEWHERE[name]))
        elif key is not None:
            description = getattr(_grpo_field(key), "description", None) or ""
            out.append((name, f"`{key}`", re.split(r"\.\s+(?=[A-Z])", description)[0].rstrip(".")))
        else:
            out.append((name, "—", "not in grpo"))
    del trl
    return out


def render() -> str:
    import trl

    lines = [
        f"| TRL {trl.__version__} `GRPOConfig` field | grpo key | note |",
        "| --- | --- | --- |",
        *(f"| `{name}` | {key} | {note.replace('|', '/')} |" for name, key, note in rows()),
    ]
    return "\n".join(lines)


def readme_with_table(text: str) -> str:
    head, _, rest = text.partition(START)
    _, _, tail = rest.partition(END)
    if not rest:
        raise SystemExit(f"{README} has no {START} marker")
    return f"{head}{START}\n{render()}\n{END}{tail}"


if __name__ == "__main__":
    if "--write" in sys.argv:
        README.write_text(readme_with_table(README.read_text(encoding="utf-8")), encoding="utf-8")
        print(f"wrote the TRL mapping table into {README}")
    else:
        print(render())
