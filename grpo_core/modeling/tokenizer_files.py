"""Which tokenizer or chat-template file is broken, and where.

transformers reports a cut ``tokenizer.json`` as ``Expecting value: line
97580 column 6`` without the file's name, and a chat template with a Jinja
syntax error only when the first prompt is rendered. :func:`damaged_file`
names the file a failed tokenizer load tripped on; :func:`template_problem`
compiles a chat template as transformers will, so a broken one is refused
when the tokenizer loads, naming where the template came from.
"""

from __future__ import annotations

import json
from pathlib import Path

TEXT_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")
TEMPLATE_FILES = ("chat_template.jinja",)


def damaged_file(source: str | Path) -> str | None:
    """The first tokenizer file in the local folder ``source`` that is not
    UTF-8 JSON (or, for a template, UTF-8 text), described; ``None`` when
    they all read (or ``source`` is not a local folder)."""
    folder = Path(source)
    if not folder.is_dir():
        return None
    for name in (*TEXT_FILES, *TEMPLATE_FILES):
        path = folder / name
        if not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
            if name.endswith(".json"):
                json.loads(text)
        except UnicodeDecodeError as exc:
            return f"{path} is not UTF-8 text (byte {exc.start}): damaged"
        except ValueError as exc:
            cut = " (cut short?)" if exc.pos >= len(text) - 1 else ""  # type: ignore[attr-defined]
            return f"{path} is not valid JSON: {exc}{cut}"
        except OSError as exc:
            return f"{path} cannot be read: {exc}"
    return None


def template_problem(template: str) -> str | None:
    """Why ``template`` does not compile as a chat template (the Jinja
    error with its line), or ``None``."""
    try:
        # heavy (transformers, jinja2): loaded on first use, not with this module
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # another transformers: the first prompt rendered will say it
        return None
    try:
        _compile_jinja_template(template)
    except Exception as exc:  # jinja2.TemplateSyntaxError and friends
        line = getattr(exc, "lineno", None)
        return f"{type(exc).__name__}: {exc}" + (f" (line {line} of the template)" if line else "")
    return None
