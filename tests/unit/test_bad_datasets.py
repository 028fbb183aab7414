"""Broken datasets, generated: every one is a :class:`DataError` naming the
file and line, or the row and column, with the fix; a prompt too long is
dropped with a warning; nothing else gets out (no library exception, so
``grpo run`` never shows a traceback).

The reader under test is :func:`~grpo_core.data.prompts.load_prompts`, in
process (what ``grpo run`` calls before it loads the model; the end-to-end
runs are in ``tests/e2e/reliability/test_input_faults.py``), with real files in
every format ``[[datasets]]`` takes (JSON Lines, a JSON document, CSV,
Parquet, a saved ``datasets`` folder), read by the real ``datasets`` library,
and SmolLM2's real tokenizer and chat template.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grpo_core.config.loader import validate
from grpo_core.contract.errors import DataError
from grpo_core.data.prompts import load_prompts

ROWS = 5
BAD_ROW = 2
HUGE = "Q: " + "word " * 40_000 + "?"
GSM8K_TRANSFORM = '''
def prompt_transform(cfg, *args, **kwargs):
    """The reference guide's GSM8K transform (examples/gsm8k/rewards.py)."""

    def to_prompt(example, tokenizer=None):
        final = example["answer"].split("####")[-1].strip().replace(",", "")
        return {
            "prompt": [
                {"role": "system", "content": "Think, then answer."},
                {"role": "user", "content": example["question"]},
            ],
            "answer": final,
        }

    return to_prompt, {"remove_columns": ["question"]}
'''

BAD_VALUES: dict[str, Any] = {
    "int": 12345,
    "float": 3.5,
    "bool": True,
    "null": None,
    "list": [1, 2],
    "dict": {"a": 1},
    "missing": ...,
    "huge": HUGE,
}
FORMATS = ("jsonl", "json", "csv", "parquet", "saved")


def rows_with(column: str, bad: Any, all_rows: bool = False) -> list[dict[str, Any]]:
    rows = []
    for i in range(ROWS):
        row: dict[str, Any] = {"prompt": f"Q: What is {i} + 1?\nA:", "answer": str(i + 1)}
        if i == BAD_ROW or all_rows:
            if bad is ...:
                del row[column]
            else:
                row[column] = bad
        rows.append(row)
    return rows


def write(folder: Path, fmt: str, rows: list[dict[str, Any]]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    if fmt == "jsonl":
        path = folder / "data.jsonl"
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    elif fmt == "json":
        path = folder / "data.json"
        path.write_text(json.dumps(rows, indent=1, ensure_ascii=False), encoding="utf-8")
    elif fmt == "csv":
        import csv

        path = folder / "data.csv"
        with open(path, "w", newline="", encoding="utf-8") as handle:
            writer = csv.DictWriter(handle, fieldnames=["prompt", "answer"])
            writer.writeheader()
            writer.writerows(rows)
    else:
        from datasets import Dataset

        dataset = Dataset.from_list(rows)
        if fmt == "parquet":
            path = folder / "data.parquet"
            dataset.to_parquet(str(path))
        else:
            path = folder / "saved"
            dataset.save_to_disk(str(path))
    return path


def load(path: Path, tokenizer: Any, **entry: Any) -> tuple[list[Any] | DataError, list[str]]:
    """``load_prompts`` on one ``[[datasets]]`` entry: the prompts or the
    DataError, and the warnings. Any other exception fails the test."""
    cfg = validate(
        {
            "base_model": "m",
            "sequence_len": 4096,
            "micro_batch_size": 8,
            "shuffle_dataset": False,
            "datasets": [{"path": str(path), **entry}],
        }
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            return load_prompts(cfg, tokenizer), [str(w.message) for w in caught]
        except DataError as exc:
            message = str(exc)
            assert "Traceback" not in message and message.startswith("datasets[0]"), message
            return exc, [str(w.message) for w in caught]


def not_text(value: Any) -> bool:
    return not isinstance(value, str)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("bad", list(BAD_VALUES))
def test_the_prompt_column_given_each_bad_value(tmp_path: Path, smollm2_tokenizer: Any, fmt: str, bad: str) -> None:
    """Text formats hold the value in row 2; columnar ones cannot mix types
    in a column, so there every row holds it and row 0 is the one named."""
    value = BAD_VALUES[bad]
    columnar = fmt in ("parquet", "saved") and bad not in ("null", "huge")
    if columnar and bad == "missing":
        pytest.skip("a columnar file has every column in every row")
    path = write(tmp_path, fmt, rows_with("prompt", value, all_rows=columnar))
    result, said = load(path, smollm2_tokenizer)
    if bad == "huge":  # a prompt over trl.max_prompt_length: dropped, said in one warning
        assert not isinstance(result, DataError), result
        assert len(result) == ROWS - 1 and any("dropped 1 of 5 prompts longer than" in w for w in said), said
        return
    row = 0 if columnar else BAD_ROW
    if fmt == "csv":  # CSV holds text: 12345 is the prompt "12345"; an empty field is null
        if bad in ("null", "missing"):
            assert isinstance(result, DataError) and f"row {row}, column 'prompt'" in str(result), result
        else:
            assert not isinstance(result, DataError), result
        return
    assert isinstance(result, DataError), f"{bad} in {fmt} was accepted as a prompt"
    assert f"row {row}, column 'prompt'" in str(result), str(result)
    assert "Fix that row" in str(result) or "not text" in str(result) or "chat messages" in str(result), str(result)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("bad", list(BAD_VALUES))
def test_another_column_given_each_bad_value_reaches_the_rewards_as_is(
    tmp_path: Path, smollm2_tokenizer: Any, fmt: str, bad: str
) -> None:
    """Columns other than the prompt are the reward functions' to judge (a
    missing one is refused by the reward check, tests/unit/test_rewards.py): the
    rows load, every prompt kept."""
    value = BAD_VALUES[bad]
    columnar = fmt in ("parquet", "saved") and bad not in ("null", "huge")
    if columnar and bad == "missing":
        pytest.skip("a columnar file has every column in every row")
    result, _ = load(write(tmp_path, fmt, rows_with("answer", value, all_rows=columnar)), smollm2_tokenizer)
    assert not isinstance(result, DataError), result
    assert len(result) == ROWS


@pytest.mark.parametrize("fmt", ("jsonl", "json", "csv"))
@pytest.mark.parametrize("column", ("prompt", "answer"))
def test_bytes_that_are_not_utf8_are_named_by_line(
    tmp_path: Path, smollm2_tokenizer: Any, fmt: str, column: str
) -> None:
    path = write(tmp_path, fmt, rows_with(column, "caf\u00e9 MARK"))
    data = path.read_bytes()
    path.write_bytes(data.replace("caf\u00e9 MARK".encode(), b"caf\xe9 MARK"))  # latin-1, as a spreadsheet saves it
    line = path.read_bytes()[: path.read_bytes().index(b"\xe9")].count(b"\n") + 1
    result, _ = load(path, smollm2_tokenizer)
    assert isinstance(result, DataError), result
    assert f"{path}: line {line} " in str(result) and "not UTF-8" in str(result) and "UTF-8" in str(result), result


@pytest.mark.parametrize("fmt", ("jsonl", "csv", "json"))
@pytest.mark.parametrize("where", ("start", "middle", "end"))
def test_a_malformed_line_is_named_with_the_file_and_its_number(
    tmp_path: Path, smollm2_tokenizer: Any, fmt: str, where: str
) -> None:
    path = write(tmp_path, fmt, rows_with("answer", "1"))
    lines = path.read_text(encoding="utf-8").splitlines()
    broken = {"jsonl": '{"prompt": "Q: ?", "answer": ', "csv": 'a,"b,c', "json": "  {"}[fmt]
    if fmt == "csv":
        broken = "one,two,three"  # a row with a field too many
    at = {"start": 0 if fmt != "csv" else 1, "middle": len(lines) // 2, "end": len(lines)}[where]
    if fmt == "json" and where == "end":
        lines = lines[:-1]  # cut short: the closing bracket is gone
        at = None
    if at is not None:
        lines.insert(at, broken)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    result, _ = load(path, smollm2_tokenizer)
    assert isinstance(result, DataError), result
    message = str(result)
    assert str(path) in message and "line " in message and "check `split`" not in message, message
    if fmt != "json":
        assert f"line {at + 1} " in message or f"line {at + 1}:" in message, message
        assert "Fix or delete that line" in message, message
    elif where == "end":
        assert "not valid JSON" in message and "cut short" in message and "Fix the file" in message, message
    else:  # a document: the parser stops at the line or just after it
        assert "not valid JSON" in message and "Fix" in message, message


@pytest.mark.parametrize("bad", [k for k in BAD_VALUES if k not in ("huge", "missing")])
def test_the_gsm8k_transform_given_a_question_that_is_not_text(
    tmp_path: Path, smollm2_tokenizer: Any, monkeypatch: pytest.MonkeyPatch, bad: str
) -> None:
    """The issue's case: ``{"question": 12345}`` through the reference
    guide's transform named with its row, the column it came from and the fix,
    not a TypeError from inside the chat template."""
    (tmp_path / "gsm8k_transform.py").write_text(GSM8K_TRANSFORM, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    rows = [{"question": f"What is {i} + 1?", "answer": f"It is.\n#### {i + 1}"} for i in range(ROWS)]
    rows[BAD_ROW]["question"] = BAD_VALUES[bad]
    path = write(tmp_path / "data", "jsonl", rows)
    result, _ = load(path, smollm2_tokenizer, type="gsm8k_transform.prompt_transform")
    assert isinstance(result, DataError), result
    message = str(result)
    assert f"row {BAD_ROW}, column 'prompt'" in message, message
    if bad != "null" or True:
        assert "gsm8k_transform.prompt_transform" in message, message
    if bad not in ("null", "bool"):  # None and True are also other columns' values: not attributed
        assert "column 'question'" in message, message


def test_a_transform_that_fails_on_a_row_names_it(
    tmp_path: Path, smollm2_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "gsm8k_transform.py").write_text(GSM8K_TRANSFORM, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    rows = [{"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"} for i in range(ROWS)]
    rows[BAD_ROW]["answer"] = 7  # .split on an int
    result, _ = load(
        write(tmp_path / "data", "jsonl", rows), smollm2_tokenizer, type="gsm8k_transform.prompt_transform"
    )
    assert isinstance(result, DataError), result
    assert f"failed on row {BAD_ROW} " in str(result) and "AttributeError" in str(result), result


_scalars = st.one_of(
    st.text(max_size=30),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=False, allow_infinity=False),
    st.booleans(),
    st.none(),
)
_message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": _scalars})
_prompts = st.one_of(_scalars, st.lists(_message, min_size=1, max_size=3), st.lists(_scalars, max_size=3))


def good_prompt(value: Any) -> bool:
    if isinstance(value, str):
        return True
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in value)
    )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompts=st.lists(_prompts, min_size=1, max_size=6))
def test_any_prompt_values_load_or_name_the_first_bad_row(
    tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer: Any, prompts: list[Any]
) -> None:
    """JSON Lines rows with generated prompt values (text, numbers, booleans,
    nulls, lists, chat messages with any content): the file loads exactly
    when every prompt is text or chat messages with text; otherwise the error
    names the first bad row."""
    folder = tmp_path_factory.mktemp("rows")
    path = write(folder, "jsonl", [{"prompt": p, "answer": "1"} for p in prompts])
    result, _ = load(path, smollm2_tokenizer)
    bad_rows = [i for i, p in enumerate(prompts) if not good_prompt(p)]
    if not bad_rows:
        assert not isinstance(result, DataError), (prompts, result)
        assert len(result) == len(prompts)
        return
    assert isinstance(result, DataError), (prompts, result)
    message = str(result)
    assert f"row {bad_rows[0]}, column 'prompt'" in message or "line " in message, (prompts, message)


def test_a_parquet_file_cut_short_is_named(tmp_path: Path, smollm2_tokenizer: Any) -> None:
    path = write(tmp_path, "parquet", rows_with("answer", "1"))
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    result, _ = load(path, smollm2_tokenizer)
    assert isinstance(result, DataError) and f"{path}: it is not a readable Parquet file" in str(result), result


def test_a_json_escape_that_is_no_unicode_character_is_named_by_line(tmp_path: Path, smollm2_tokenizer: Any) -> None:
    path = write(tmp_path, "jsonl", rows_with("answer", "1"))
    lines = path.read_text(encoding="utf-8").splitlines()
    lines[3] = '{"prompt": "Q: \\ud800?", "answer": "1"}'  # a lone surrogate: valid JSON, no Unicode text
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    result, _ = load(path, smollm2_tokenizer)
    assert isinstance(result, DataError) and f"{path}: line 4 holds" in str(result), result
    assert "lone surrogate" in str(result)


def test_a_chat_template_that_fails_on_a_row_names_the_row(tmp_path: Path, smollm2_tokenizer: Any) -> None:
    """It compiles (so it passed when the tokenizer loaded) but raises while
    rendering a row: named with the row and the template."""
    rows = rows_with("answer", "1")
    for row in rows:
        row["prompt"] = [{"role": "user", "content": row["prompt"]}]
    rows[BAD_ROW]["prompt"][0]["role"] = "tool"
    tokenizer = smollm2_tokenizer.__class__.from_pretrained(smollm2_tokenizer.name_or_path)
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tool turns here') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}"
    )
    result, _ = load(write(tmp_path, "jsonl", rows), tokenizer)
    assert isinstance(result, DataError), result
    assert f"row {BAD_ROW}, column 'prompt': the tokenizer's chat template failed" in str(result), result
    assert "no tool turns here" in str(result)
