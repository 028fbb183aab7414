"""What is wrong with a local dataset file, by line, in the user's terms.

``datasets`` reports a malformed JSON line as ``DatasetGenerationError: An
error occurred while generating the dataset`` (the line number only in a log
line above it), reads bytes that are not UTF-8 into strings that fail later,
when a row is read, and reports a ragged CSV the same vague way. Before a
local JSON, JSON Lines or CSV file is handed to ``datasets``,
:func:`encoding_problem` checks it is UTF-8; when ``datasets`` fails on a
file, :func:`diagnose` reads it the simple way and names the first line that
is wrong and the fix. Both read the file once, in chunks (a 1 GB file is
about a second).
"""

from __future__ import annotations

import codecs
import csv
import io
import json
from pathlib import Path

TEXT_SUFFIXES = (".json", ".jsonl", ".csv")
CHUNK = 1 << 22


def encoding_problem(path: Path) -> str | None:
    """Where ``path`` stops being UTF-8 (line, byte and value), or ``None``."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    line = 1
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            try:
                decoder.decode(chunk, final=False)
            except UnicodeDecodeError as exc:
                bad = offset + exc.start
                line += chunk.count(b"\n", 0, exc.start)
                return f"line {line} (byte {bad}) is not UTF-8 text (byte 0x{chunk[exc.start]:02x})"
            line += chunk.count(b"\n")
            offset += len(chunk)
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            return f"the file ends in the middle of a UTF-8 character (byte {offset - 1})"
    return None


def _json_document_problem(text: str) -> str | None:
    """What is wrong with ``text`` read as one JSON document (a list of
    rows, or a table of columns)."""
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        cut = " (the file ends there: cut short?)" if exc.pos >= len(text.rstrip()) - 1 else ""
        return f"it is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}{cut}"
    bad = _not_unicode(document)
    return None if bad is None else f"it holds {bad!r}, an escape that is no Unicode character (a lone surrogate)"


def _is_one_document(text: str) -> bool:
    """A file ``datasets`` reads as one JSON document rather than JSON Lines:
    it opens a list, or it is a single object spread over lines."""
    stripped = text.lstrip()
    if stripped.startswith("["):
        return True
    if not stripped.startswith("{"):
        return False
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _not_unicode(value: object) -> str | None:
    """A string inside ``value`` that is no Unicode text (a lone surrogate,
    written ``\\ud800`` in JSON), shown in short."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return value.encode("utf-8", "backslashreplace").decode("ascii")[:60]
        return None
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    for item in items:
        found = _not_unicode(item)
        if found is not None:
            return found
    return None


def _json_lines_problem(text: str) -> str | None:
    """The first line of JSON Lines ``text`` that is not one JSON object of
    Unicode text."""
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            shown = line.strip()
            shown = shown if len(shown) <= 80 else shown[:77] + "..."
            return f"line {number} is not valid JSON ({exc.msg} at column {exc.colno}): {shown}"
        if not isinstance(value, dict):
            kind = type(value).__name__
            return f'line {number} is a JSON {kind}, not an object of column values ({{"prompt": ...}})'
        bad = _not_unicode(value)
        if bad is not None:
            return f"line {number} holds {bad!r}, an escape that is no Unicode character (a lone surrogate)"
    return None


def csv_problem(text: str) -> str | None:
    """The first CSV row whose number of fields differs from the header's."""
    csv.field_size_limit(2**31 - 1)  # a long prompt is a long field (pandas reads them; 128 KiB is csv's default cap)
    reader = csv.reader(io.StringIO(text))
    try:
        header = next(reader)
    except StopIteration:
        return None
    except csv.Error as exc:
        return f"line 1 is not valid CSV ({exc})"
    try:
        for row in reader:
            if row and len(row) != len(header):
                fields = f"the header ({', '.join(header)}) has {len(header)}"
                return f"line {reader.line_num} has {len(row)} field(s), {fields} (quote fields that hold a comma)"
    except csv.Error as exc:
        return f"line {reader.line_num} is not valid CSV ({exc})"
    return None


def diagnose(path: Path) -> str | None:
    """What is wrong with the local file ``path`` for ``datasets``, naming
    the line and the fix, or ``None`` when nothing simple is (the caller then
    reports the library's own message)."""
    suffix = path.suffix.lower()
    if suffix in TEXT_SUFFIXES:
        problem = encoding_problem(path)
        if problem is not None:
            return f"{problem}. Save the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`), or fix that line"
        text = path.read_text(encoding="utf-8")
        if suffix == ".csv":
            problem = csv_problem(text)
        elif _is_one_document(text):
            problem = _json_document_problem(text)
        else:
            problem = _json_lines_problem(text)
        if problem is not None:
            return f"{problem}. Fix " + ("the file" if problem.startswith("it ") else "or delete that line")
        return None
    if suffix == ".parquet":
        try:
            # heavy (pyarrow): loaded on first use, not with this module
            import pyarrow.parquet as pq

            pq.ParquetFile(path).read(columns=[])
        except Exception as exc:  # pyarrow's ArrowInvalid / OSError
            return (
                f"it is not a readable Parquet file ({type(exc).__name__}: {str(exc)[:200]}); it may be cut short. "
                "Write or download it again"
            )
    return None
