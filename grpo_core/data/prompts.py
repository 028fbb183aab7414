"""Turning ``[[datasets]]`` entries into :class:`~grpo_core.contract.types.Prompt` s.

Each entry is loaded with ``datasets`` (a local file, a local directory, or a
hub id), optionally mapped by a ``type = "module.function"`` transform
(the reference's convention: ``fn(cfg)`` returns ``map_fn`` or
``(map_fn, {"remove_columns": [...]})``; ``map_fn(example, tokenizer=None)``),
and must then have a ``prompt`` column: a string, or a list of chat messages
that gets the chat template with a generation prompt. Every other column is
kept for the reward functions.
"""

from __future__ import annotations

import importlib
import inspect
import random
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo_core.contract.errors import DataError
from grpo_core.contract.types import Prompt
from grpo_core.host.user_code import make_cwd_importable

if TYPE_CHECKING:
    from grpo_core.config.schema import DatasetSpec, GRPOConfig

FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def _label(index: int, spec: DatasetSpec) -> str:
    return f"datasets[{index}] (path '{spec.path}')"


# ----------------------------------------------------------------------------- loading


def _base_split(split: str) -> str:
    """'train[:100]' -> 'train' (the data_files key a slice applies to)."""
    return re.split(r"[\[+]", split, maxsplit=1)[0].strip() or "train"


def _is_saved_dataset(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()


def _load_saved(path: Path, split: str, label: str) -> Any:
    # heavy (datasets): loaded on first use, not with this module
    from datasets import DatasetDict, load_from_disk

    loaded = load_from_disk(str(path))
    if isinstance(loaded, DatasetDict):
        base = _base_split(split)
        if base not in loaded:
            raise DataError(f"{label}: split '{base}' not found; the saved dataset has {sorted(loaded)}. Set `split`.")
        loaded = loaded[base]
    if split != _base_split(split):
        # heavy (datasets): loaded on first use, not with this module
        from datasets import ReadInstruction

        try:
            rows = ReadInstruction.from_spec(split).to_absolute({_base_split(split): len(loaded)})[0]
        except (ValueError, AssertionError) as exc:
            raise DataError(f"{label}: cannot read split '{split}': {exc}") from exc
        loaded = loaded.select(range(rows.from_ or 0, rows.to if rows.to is not None else len(loaded)))
    return loaded


def load_raw(spec: DatasetSpec, index: int = 0) -> Any:
    """One entry as a ``datasets.Dataset``, before any transform."""
    # heavy (datasets): loaded on first use, not with this module
    from datasets import load_dataset

    label = _label(index, spec)
    path = Path(spec.path).expanduser()
    try:
        if path.is_file():
            if path.stat().st_size == 0:
                raise DataError(f"{label}: the dataset is empty (the file {path} has no bytes). Fix `path`.")
            builder = FILE_BUILDERS.get(path.suffix.lower())
            if builder is None:
                raise DataError(f"{label}: unsupported file type '{path.suffix}'; use .json, .jsonl, .csv or .parquet.")
            try:
                return load_dataset(builder, data_files={_base_split(spec.split): str(path)}, split=spec.split)
            except ValueError as exc:
                # datasets cannot build a split with no rows (a CSV with only a header, a JSON "[]")
                # and says 'Instruction "train" corresponds to no data!', which reads like a bad `split`.
                if "corresponds to no data" in str(exc):
                    raise DataError(
                        f"{label}: the dataset is empty (the file {path} has no rows). Fix `path`."
                    ) from exc
                raise
        if path.is_dir():
            if _is_saved_dataset(path):
                return _load_saved(path, spec.split, label)
            return load_dataset(str(path), name=spec.name, split=spec.split, data_files=spec.data_files)
        if spec.path.startswith((".", "/", "~")) or path.suffix.lower() in FILE_BUILDERS:
            raise DataError(f"{label}: no such file or directory: {path}. Fix `path`.")
        return load_dataset(spec.path, name=spec.name, split=spec.split, data_files=spec.data_files)
    except DataError:
        raise
    except Exception as exc:  # datasets raises many types (FileNotFound, ConnectionError, ValueError...)
        hint = (
            "download it where a hub is reachable and point `path` at the local copy"
            if not path.exists()
            else "check `split`, `name` and `data_files`"
        )
        raise DataError(f"{label}: could not load: {type(exc).__name__}: {exc}; {hint}.") from exc


# ----------------------------------------------------------------------------- transforms


def import_from_cwd(dotted: str) -> Any:
    """Import ``module.attr`` with the working directory importable (where a
    user's ``rewards.py`` lives), nested packages included."""
    module_name, _, attr = dotted.rpartition(".")
    if not module_name or not attr:
        raise ImportError(f"'{dotted}' is not a 'module.function' path")
    make_cwd_importable()
    importlib.invalidate_caches()
    module = importlib.import_module(module_name)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ImportError(f"module '{module_name}' has no attribute '{attr}'") from None


def _load_transform(cfg: GRPOConfig, spec: DatasetSpec, label: str) -> tuple[Callable[..., Any], dict[str, Any]]:
    assert spec.type is not None
    try:
        factory = import_from_cwd(spec.type)
    except Exception as exc:
        raise DataError(
            f"{label}: cannot import transform type '{spec.type}': {type(exc).__name__}: {exc}. It must be a "
            "'module.function' path importable from the working directory (e.g. rewards.prompt_transform for "
            "./rewards.py)."
        ) from exc
    try:
        made = factory(cfg)
    except Exception as exc:
        raise DataError(f"{label}: transform '{spec.type}'(cfg) raised {type(exc).__name__}: {exc}") from exc
    map_kwargs: dict[str, Any] = {}
    if isinstance(made, tuple):
        if len(made) != 2 or not isinstance(made[1], dict):
            raise DataError(
                f"{label}: transform '{spec.type}' must return map_fn or (map_fn, {{'remove_columns': [...]}})."
            )
        made, map_kwargs = made[0], dict(made[1])
    if not callable(made):
        raise DataError(
            f"{label}: transform '{spec.type}' returned {type(made).__name__}, expected a function map_fn(example)."
        )
    return made, map_kwargs


def _takes_tokenizer(fn: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "tokenizer" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def apply_transform(cfg: GRPOConfig, dataset: Any, spec: DatasetSpec, tokenizer: Any, index: int = 0) -> Any:
    label = _label(index, spec)
    map_fn, map_kwargs = _load_transform(cfg, spec, label)
    if _takes_tokenizer(map_fn):
        map_kwargs.setdefault("fn_kwargs", {})["tokenizer"] = tokenizer
    remove = map_kwargs.get("remove_columns")
    if remove:
        missing = sorted(set([remove] if isinstance(remove, str) else remove) - set(dataset.column_names))
        if missing:
            raise DataError(
                f"{label}: transform '{spec.type}' removes column(s) {missing} the dataset does not have "
                f"({dataset.column_names})."
            )
    if cfg.dataset_num_proc and "num_proc" not in map_kwargs:
        map_kwargs["num_proc"] = cfg.dataset_num_proc
    try:
        return dataset.map(map_fn, **map_kwargs)
    except Exception as exc:
        raise DataError(f"{label}: transform '{spec.type}' failed on the data: {type(exc).__name__}: {exc}") from exc


# ----------------------------------------------------------------------------- prompts


def _check_messages(value: list[Any], label: str, row: int) -> None:
    for message in value:
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise DataError(
                f"{label}: row {row}: a list prompt must be chat messages [{{'role': ..., 'content': ...}}], got "
                f"{str(value)[:200]}"
            )


def tokenize_prompt(
    prompt: str | list[dict[str, Any]], tokenizer: Any, chat_template_kwargs: dict[str, Any] | None = None
) -> list[int]:
    """Prompt ids exactly as the model sees them: chat template with a
    generation prompt for messages (continuing a final assistant message),
    the text as is otherwise (no extra special tokens either way)."""
    if isinstance(prompt, list):
        cont = bool(prompt) and prompt[-1].get("role") == "assistant"
        text = tokenizer.apply_chat_template(
            prompt,
            tokenize=False,
            add_generation_prompt=not cont,
            continue_final_message=cont,
            **(chat_template_kwargs or {}),
        )
    else:
        text = prompt
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _to_prompts(dataset: Any, tokenizer: Any, cfg: GRPOConfig, label: str) -> list[Prompt]:
    if "prompt" not in dataset.column_names:
        raise DataError(
            f"{label}: no 'prompt' column (columns: {dataset.column_names}). Rename the column holding the prompt to "
            "'prompt', or set `type` to a transform that returns {'prompt': ...}."
        )
    if tokenizer.chat_template is None and dataset.num_rows and isinstance(dataset[0]["prompt"], list):
        raise DataError(
            f"{label}: prompts are chat messages but the tokenizer has no chat template; set `chat_template`."
        )
    kwargs = cfg.trl.chat_template_kwargs or {}
    out = []
    for row, example in enumerate(dataset):
        prompt = example.pop("prompt")
        if isinstance(prompt, list):
            _check_messages(prompt, label, row)
        elif not isinstance(prompt, str):
            raise DataError(
                f"{label}: row {row}: 'prompt' must be a string or a list of chat messages, got "
                f"{type(prompt).__name__}."
            )
        out.append(Prompt(prompt=prompt, prompt_ids=tokenize_prompt(prompt, tokenizer, kwargs), columns=example))
    return out


def load_prompts(cfg: GRPOConfig, tokenizer: Any) -> list[Prompt]:
    """Every ``[[datasets]]`` entry, transformed, templated, tokenised,
    filtered by ``trl.max_prompt_length``, shuffled with ``seed`` when
    ``shuffle_dataset``; ``Prompt.index`` is the final position."""
    if not cfg.datasets:
        raise DataError("no [[datasets]] entry in the config; add one with a `path`.")
    prompts: list[Prompt] = []
    for index, spec in enumerate(cfg.datasets):
        label = _label(index, spec)
        dataset = load_raw(spec, index)
        if dataset.num_rows == 0:
            raise DataError(
                f"{label}: the dataset is empty (split '{spec.split}'). Check `path`, `split` and `data_files`."
            )
        if spec.type:
            dataset = apply_transform(cfg, dataset, spec, tokenizer, index)
        prompts.extend(_to_prompts(dataset, tokenizer, cfg, label))

    limit = cfg.trl.max_prompt_length
    if limit is not None:
        kept = [p for p in prompts if len(p.prompt_ids) <= limit]
        dropped = len(prompts) - len(kept)
        if dropped:
            warnings.warn(
                f"dropped {dropped} of {len(prompts)} prompts longer than trl.max_prompt_length = {limit} tokens "
                "(it defaults to sequence_len). Raise it and sequence_len to train on them, or shorten them.",
                stacklevel=2,
            )
        if not kept:
            raise DataError(
                f"every prompt is longer than trl.max_prompt_length = {limit} tokens; raise it (or sequence_len) or "
                "shorten the prompts."
            )
        prompts = kept

    if cfg.shuffle_dataset:
        random.Random(cfg.seed).shuffle(prompts)
    for position, prompt in enumerate(prompts):
        prompt.index = position
    return prompts


def common_columns(prompts: list[Prompt]) -> set[str]:
    """Columns every prompt has: what reward functions can rely on
    (see :meth:`grpo_core.scoring.rewards.RewardScorer.check_columns`)."""
    if not prompts:
        return set()
    shared = set(prompts[0].columns)
    for prompt in prompts[1:]:
        shared &= set(prompt.columns)
    return shared
