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
from grpo_core.data.file_check import TEXT_SUFFIXES, csv_problem, diagnose, encoding_problem
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


PRESCAN_LIMIT = 4 << 30
"""Local text data files up to this many bytes in all are checked to be
UTF-8 before ``datasets`` reads them (about a second per GB)."""


def _local_data_files(path: Path) -> list[Path]:
    """The data files ``datasets`` would read for a local ``path``."""
    if path.is_file():
        return [path]
    if path.is_dir() and not _is_saved_dataset(path):
        return sorted(f for f in path.rglob("*") if f.is_file() and f.suffix.lower() in FILE_BUILDERS)[:1000]
    return []


def _check_encoding(files: list[Path], label: str) -> None:
    """Refuse a local text file that is not UTF-8 (``datasets`` would read
    it into strings that fail when a row is read) or a CSV row with another
    number of fields than its header (pandas takes a first row with one too
    many as an index column and shifts every column), naming the line."""
    text_files = [f for f in files if f.suffix.lower() in TEXT_SUFFIXES]
    if sum(f.stat().st_size for f in text_files) > PRESCAN_LIMIT:
        return
    for file in text_files:
        problem = encoding_problem(file)
        if problem is not None:
            raise DataError(
                f"{label}: {file}: {problem}. Save the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`), or fix "
                "that line."
            )
        if file.suffix.lower() == ".csv":
            problem = csv_problem(file.read_text(encoding="utf-8"))
            if problem is not None:
                raise DataError(f"{label}: {file}: {problem}. Fix or delete that line.")


def _diagnosed(files: list[Path], label: str) -> DataError | None:
    """After ``datasets`` failed on local files: the first line that is
    wrong in one of them, in the user's terms."""
    for file in files:
        try:
            problem = diagnose(file)
        except OSError:
            continue
        if problem is not None:
            return DataError(f"{label}: {file}: {problem}.")
    return None


def load_raw(spec: DatasetSpec, index: int = 0) -> Any:
    """One entry as a ``datasets.Dataset``, before any transform. A local
    file that is not UTF-8, or one ``datasets`` cannot parse, is named with
    its first bad line (:mod:`grpo_core.data.file_check`)."""
    label = _label(index, spec)
    path = Path(spec.path).expanduser()
    files = _local_data_files(path)
    try:
        return _load_raw(spec, path, label, files)
    except DataError as exc:
        if exc.__cause__ is not None and not isinstance(exc.__cause__, DataError):
            found = _diagnosed(files, label)
            if found is not None:
                raise found from exc.__cause__
        raise


def _load_raw(spec: DatasetSpec, path: Path, label: str, files: list[Path]) -> Any:
    # heavy (datasets): loaded on first use, not with this module
    from datasets import load_dataset

    try:
        if path.is_file():
            if path.stat().st_size == 0:
                raise DataError(f"{label}: the dataset is empty (the file {path} has no bytes). Fix `path`.")
            builder = FILE_BUILDERS.get(path.suffix.lower())
            if builder is None:
                raise DataError(f"{label}: unsupported file type '{path.suffix}'; use .json, .jsonl, .csv or .parquet.")
            _check_encoding(files, label)
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
            _check_encoding(files, label)
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
        where = _failing_row(dataset, map_fn, map_kwargs)
        raise DataError(
            f"{label}: transform '{spec.type}' failed on {where or 'the data'}: {type(exc).__name__}: "
            f"{str(exc)[:300]}. Fix the transform (or that row)."
        ) from exc


def _failing_row(dataset: Any, map_fn: Callable[..., Any], map_kwargs: dict[str, Any]) -> str | None:
    """After a transform failed: the first row it fails on (called row by
    row, as ``datasets`` does without ``batched``), shown in short."""
    if map_kwargs.get("batched") or map_kwargs.get("with_indices") or map_kwargs.get("with_rank"):
        return None
    fn_kwargs = dict(map_kwargs.get("fn_kwargs") or {})
    try:
        for row, example in enumerate(dataset):
            try:
                out = map_fn(dict(example), **fn_kwargs)
            except Exception:
                return f"row {row} {_short(example)}"
            if out is not None and not isinstance(out, dict):
                return f"row {row} {_short(example)} (it returned {type(out).__name__}, not a dict of columns)"
    except Exception:  # the rows themselves cannot be read: the caller's message stands
        return None
    return None


def _short(value: Any, limit: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ----------------------------------------------------------------------------- prompts


def _is_text_content(message: dict[str, Any]) -> bool:
    """Text, a list of content parts (multimodal), or nothing beside tool calls."""
    content = message["content"]
    if isinstance(content, str):
        return True
    if isinstance(content, list):
        return all(isinstance(part, dict) for part in content)
    return content is None and bool(message.get("tool_calls"))


def _source_of(value: Any, source: dict[str, Any] | None) -> str:
    """Which column of the row as loaded (before the transform) holds ``value``."""
    for column, held in (source or {}).items():
        if held is value or (type(held) is type(value) and held == value):
            return column
    return ""


def _check_messages(
    value: list[Any], label: str, row: int, source: dict[str, Any] | None = None, transform: str | None = None
) -> None:
    for i, message in enumerate(value):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise DataError(
                f"{label}: row {row}, column 'prompt': a list prompt must be chat messages "
                f"[{{'role': ..., 'content': ...}}], got {str(value)[:200]}"
            )
        if not isinstance(message["role"], str):
            raise DataError(
                f"{label}: row {row}, column 'prompt': message {i}'s role is {_short(message['role'], 60)} "
                f"({type(message['role']).__name__}), not a string such as 'user'."
            )
        if not _is_text_content(message):
            content = message["content"]
            column = _source_of(content, source)
            held = f" It comes from column '{column}' of the data." if column else ""
            fix = (
                f"Make the transform '{transform}' turn it into text (str(...)), or fix row {row} of the data."
                if transform
                else f"Make it a string in row {row} of the data."
            )
            raise DataError(
                f"{label}: row {row}, column 'prompt': message {i} ({message['role']}) has content "
                f"{_short(content, 80)} of type {type(content).__name__}, not text.{held} {fix}"
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


def _unreadable_row(dataset: Any, row: int, label: str, exc: Exception) -> DataError:
    """A row ``datasets`` cannot hand out (bytes that are not UTF-8 in a
    string column, a value its column type cannot hold): which column."""
    for column in dataset.column_names:
        try:
            dataset.data.table.slice(row, 1).column(column).to_pylist()
        except Exception as inner:
            return DataError(
                f"{label}: row {row}, column '{column}' cannot be read: {type(inner).__name__}: {str(inner)[:200]}. "
                "Fix that row (text must be UTF-8)."
            )
    return DataError(f"{label}: row {row} cannot be read: {type(exc).__name__}: {str(exc)[:200]}. Fix that row.")


def _rows(dataset: Any, label: str) -> Any:
    """``dataset``'s rows, a row that cannot be read named with its column."""
    iterator = iter(dataset)
    row = 0
    while True:
        try:
            example = next(iterator)
        except StopIteration:
            return
        except Exception as exc:  # pyarrow's UnicodeDecodeError, ArrowInvalid, ...
            raise _unreadable_row(dataset, row, label, exc) from exc
        yield row, example
        row += 1


def _template_failure(label: str, row: int, cfg: GRPOConfig, exc: Exception) -> DataError:
    chosen = cfg.chat_template not in (None, "tokenizer_default")
    where = f"chat_template = '{str(cfg.chat_template)[:80]}'" if chosen else "the tokenizer's chat template"
    return DataError(
        f"{label}: row {row}, column 'prompt': {where} failed on this prompt: {type(exc).__name__}: "
        f"{str(exc)[:300]}. Fix the row's messages (roles, text contents) or the template."
    )


def _to_prompts(
    dataset: Any, tokenizer: Any, cfg: GRPOConfig, label: str, source: Any = None, transform: str | None = None
) -> list[Prompt]:
    """Each row's prompt, checked (chat messages with text contents, or a
    string) and tokenised; ``source`` is the dataset as loaded, before
    ``transform``, to say which of its columns a bad value came from."""
    if "prompt" not in dataset.column_names:
        raise DataError(
            f"{label}: no 'prompt' column (columns: {dataset.column_names}). Rename the column holding the prompt to "
            "'prompt', or set `type` to a transform that returns {'prompt': ...}."
        )
    kwargs = cfg.trl.chat_template_kwargs or {}
    out = []
    for row, example in _rows(dataset, label):
        prompt = example.pop("prompt")
        if isinstance(prompt, list):
            if tokenizer.chat_template is None:
                raise DataError(
                    f"{label}: prompts are chat messages but the tokenizer has no chat template; set `chat_template`."
                )
            _check_messages(prompt, label, row, _source_row(source, row), transform)
        elif not isinstance(prompt, str):
            raise DataError(
                f"{label}: row {row}, column 'prompt': must be a string or a list of chat messages, got "
                f"{type(prompt).__name__}{'' if prompt is None else f' ({_short(prompt, 60)})'}. Fix that row"
                + (f" or the transform '{transform}'." if transform else ".")
            )
        try:
            ids = tokenize_prompt(prompt, tokenizer, kwargs)
        except Exception as exc:  # a Jinja error, a template that indexes a missing key, a tokenizer error
            raise _template_failure(label, row, cfg, exc) from exc
        out.append(Prompt(prompt=prompt, prompt_ids=ids, columns=example))
    return out


def _source_row(source: Any, row: int) -> dict[str, Any] | None:
    if source is None or row >= getattr(source, "num_rows", 0):
        return None
    try:
        return dict(source[row])
    except Exception:
        return None


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
        source = None
        if spec.type:
            source, dataset = dataset, apply_transform(cfg, dataset, spec, tokenizer, index)
        prompts.extend(_to_prompts(dataset, tokenizer, cfg, label, source, spec.type))

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
