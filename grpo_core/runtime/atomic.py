"""Directories that appear whole or not at all.

A directory another process reads (a model cache, the weights handed to an
inference engine) is filled under a temporary sibling name and renamed into
place in one step, so no reader ever sees half of it, and a crash leaves only
a hidden temporary that is cleaned up.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_directory(target: Path, replace: bool = True) -> Iterator[Path]:
    """Yield an empty temporary directory beside ``target``; when the block
    ends without error it becomes ``target``. An existing ``target`` is
    replaced, or (``replace=False``: another process made it first) kept and
    the new copy dropped."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
        if target.exists():
            if not replace:
                shutil.rmtree(tmp)
                return
            shutil.rmtree(target)
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
