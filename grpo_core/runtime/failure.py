"""The last line of a grpo command that failed: where, what, and the traceback on disk.

Every failure that ends a ``grpo`` command (or :func:`grpo.train`) reaches
the user as one ``error:`` line, never a Python traceback. A
:class:`~grpo_core.contract.errors.GrpoError` already says what to fix; when
something raised it (a plugin hook, a reward module's import, a library
writing a file) the traceback of that exception goes to :data:`TRACEBACK_FILE`
and the line says where. Any other exception is what no rule foresaw: it is
reported as :class:`~grpo_core.contract.errors.UnexpectedFailure` naming the
phase the run was in (:func:`tag`, set by :mod:`grpo_core.training.safety_net`),
the exception, and the traceback file, with an exit code per class of failure
(:data:`~grpo_core.contract.errors.EXIT_CODES`).
"""

from __future__ import annotations

import datetime
import os
import tempfile
import traceback
from collections.abc import Iterator
from pathlib import Path

from grpo_core.contract.errors import (
    EXIT_INTERNAL,
    EXIT_OUT_OF_MEMORY,
    EXIT_SYSTEM,
    GrpoError,
    UnexpectedFailure,
)

TRACEBACK_FILE = "grpo-error.log"
"""The file in ``output_dir`` that collects the tracebacks of a run's failures
(the plugin host writes a failing hook's there too)."""

_WHERE = "_grpo_where"  # (phase, whether a checkpoint may be saved after it), set where the exception passed
_REPORTED = "_grpo_reported"  # set once an error's message says where its traceback went


def tag(exc: BaseException, where: str, can_save: bool = False) -> None:
    """Remember that ``exc`` was raised while the run was ``where`` (e.g.
    ``step 3 (syncing the weights)``) and whether the trainer's state there
    is one a checkpoint may be taken of (``can_save``: between two steps, not
    in the middle of an update). The innermost phase wins: a tag set on the
    way out of a deeper phase is kept."""
    if getattr(exc, _WHERE, None) is None:
        try:
            setattr(exc, _WHERE, (where, can_save))
        except (AttributeError, TypeError):  # an exception type without a __dict__
            pass


def chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, then what caused it, innermost last (each once)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or (None if current.__suppress_context__ else current.__context__)


def _innermost(exc: BaseException) -> tuple[str, bool] | None:
    found = None
    for link in chain(exc):
        found = getattr(link, _WHERE, None) or found
    return found


def where_of(exc: BaseException) -> str | None:
    """The innermost phase recorded on ``exc`` or its causes."""
    found = _innermost(exc)
    return found[0] if found else None


def can_save_after(exc: BaseException) -> bool:
    """Whether the innermost phase of ``exc`` left a state a checkpoint may be taken of."""
    found = _innermost(exc)
    return bool(found and found[1])


def raised_by_code(exc: BaseException) -> BaseException | None:
    """The exception under a :class:`GrpoError` that code raised (a hook, an
    import, a library), whose traceback says more than the message; ``None``
    when every link is grpo's own message."""
    for link in chain(exc):
        if not isinstance(link, GrpoError) and link.__traceback__ is not None:
            return link
    return None


def exit_code_of(exc: BaseException) -> int:
    """The exit code of an exception no rule caught (its class of failure)."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return EXIT_OUT_OF_MEMORY
    text = str(exc)
    if isinstance(exc, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text.lower()):
        return EXIT_OUT_OF_MEMORY  # torch's CPU allocator says so in a RuntimeError
    if isinstance(exc, OSError):
        return EXIT_SYSTEM
    return EXIT_INTERNAL


ADVICE = {
    EXIT_OUT_OF_MEMORY: (
        "The process ran out of memory: lower micro_batch_size, trl.max_completion_length or "
        "trl.num_generations, or enable gradient_checkpointing."
    ),
    EXIT_SYSTEM: "A system call failed (a file, a socket or a process): the message says which.",
    EXIT_INTERNAL: (
        "No check foresaw this: it is a bug in grpo or in code the run calls (the traceback's last frames say "
        "which); please report it with the traceback file."
    ),
}


def one_line(text: str, limit: int = 600) -> str:
    """``text`` on one line, at most ``limit`` characters."""
    flat = " ".join(part.strip() for part in str(text).splitlines() if part.strip())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def default_directory() -> Path:
    """Where a command that has no ``output_dir`` writes its traceback."""
    return Path(tempfile.gettempdir())


def write_traceback(exc: BaseException, directory: Path | None, where: str | None) -> Path | None:
    """Append ``exc``'s full traceback (its causes included) to
    :data:`TRACEBACK_FILE` in ``directory`` (the temporary directory when that
    cannot be written); return the file, or ``None`` when nothing could be
    written anywhere."""
    rank = os.environ.get("RANK")
    stamp = datetime.datetime.now().isoformat(timespec="seconds")
    header = f"--- {stamp} pid {os.getpid()}" + (f" rank {rank}" if rank else "") + (f", {where}" if where else "")
    text = header + "\n" + "".join(traceback.format_exception(exc))
    candidates = [directory] if directory is not None else []
    candidates.append(default_directory())
    for folder in candidates:
        name = TRACEBACK_FILE if folder == directory else f"grpo-error-{os.getpid()}.log"
        path = folder / name
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with open(path, "a", encoding="utf-8") as handle:
                handle.write(text)
            return path
        except OSError:
            continue
    return None


def annotate(exc: GrpoError, directory: Path | None, where: str | None) -> GrpoError:
    """A :class:`GrpoError` that something raised: its traceback written (once),
    its message extended with where the run was and where the traceback went.
    The error keeps its type and exit code."""
    if getattr(exc, _REPORTED, False):
        return exc
    cause = raised_by_code(exc)
    if cause is None:
        return exc
    message = str(exc)
    already = directory is not None and str(directory / TRACEBACK_FILE) in message  # the plugin host wrote it
    path = None if already else write_traceback(exc, directory, where)
    said = []
    if where:
        said.append(f"phase: {where}")
    if path is not None:
        said.append(f"full traceback in {path}")
    if said:
        exc.args = (f"{message.rstrip()} ({'; '.join(said)})", *exc.args[1:]) if exc.args else (message,)
    setattr(exc, _REPORTED, True)
    return exc


def unexpected(exc: BaseException, directory: Path | None, where: str | None, checkpoint: str = "") -> GrpoError:
    """The one line for an exception no rule caught: the phase, the
    exception, ``checkpoint`` (what happened to the run's state), what to do,
    the traceback file. A :class:`GrpoError` is :func:`annotate` d instead."""
    if isinstance(exc, GrpoError):
        return annotate(exc, directory, where)
    path = write_traceback(exc, directory, where)
    code = exit_code_of(exc)
    parts = [
        f"{where or 'grpo'}: {type(exc).__name__}: {one_line(exc).rstrip('.')}.",
        checkpoint,
        ADVICE[code],
        f"Full traceback: {path}." if path else "The traceback could not be written anywhere.",
    ]
    report = UnexpectedFailure(" ".join(part for part in parts if part), code, original=exc)
    mark_reported(report)
    return report


def reported(exc: BaseException) -> bool:
    return bool(getattr(exc, _REPORTED, False))


def mark_reported(exc: BaseException) -> None:
    try:
        setattr(exc, _REPORTED, True)
    except (AttributeError, TypeError):
        pass
