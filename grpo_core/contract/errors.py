"""User-facing errors.

Every error a user can cause or fix (a config typo, a broken reward
function, a server that went away) is a :class:`GrpoError`. The CLI prints
its message and exits non-zero without a traceback. Anything else is what no
rule foresaw: it ends the command as an :class:`UnexpectedFailure`, one line
naming the phase and the exception, its traceback written to a file
(:mod:`grpo_core.runtime.failure`).

Exit codes, one per class of failure (:data:`EXIT_CODES`): 0 success;
2 a user error (config, data, checkpoint, plugin, reward function, disk);
3 an engine, environment or weight sync that could not be reached or
verified; 4 out of memory; 5 a system call failed (a file, a socket, a
process) where no rule expected it; 70 any other unexpected exception (a bug);
130 interrupted (Ctrl-C, SIGTERM), after a checkpoint.
"""

from __future__ import annotations

import pickle

EXIT_USER = 2
EXIT_UNREACHABLE = 3
EXIT_OUT_OF_MEMORY = 4
EXIT_SYSTEM = 5
EXIT_INTERNAL = 70  # sysexits' EX_SOFTWARE
EXIT_INTERRUPTED = 130

EXIT_CODES: dict[int, str] = {
    0: "the command succeeded",
    EXIT_USER: "a user error: config, data, checkpoint, plugin, reward function, disk (named, with the fix)",
    EXIT_UNREACHABLE: "an inference engine, environment or weight sync could not be reached or verified",
    EXIT_OUT_OF_MEMORY: "out of memory (an unexpected MemoryError or CUDA/CPU allocator failure)",
    EXIT_SYSTEM: "a system call failed where no rule expected it (an OSError: a file, a socket, a process)",
    EXIT_INTERNAL: "any other unexpected exception: a bug in grpo or in code the run calls",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C or SIGTERM), after a checkpoint where the run had started training",
}
"""What each exit code of a ``grpo`` command means (docs/reliability.md has the table)."""


class GrpoError(Exception):
    """An error with a message meant for the user, not a bug."""

    exit_code = EXIT_USER


class ConfigError(GrpoError):
    """The config cannot run. The message names the key and the fix."""


class PluginError(GrpoError):
    """A plugin could not be loaded or does not honour the contract. The
    message names the distribution and the entry point."""


class RewardError(GrpoError):
    """A reward function failed. The message names the function, the step
    and one offending sample."""


class DataError(GrpoError):
    """A dataset could not be loaded or lacks what the run needs."""


class StorageError(GrpoError):
    """``output_dir`` could not be written (disk full, quota, file-size limit,
    permissions). The message names the path and what is still on disk."""


class EngineUnavailable(GrpoError):
    """The inference engine could not be reached after retries."""

    exit_code = EXIT_UNREACHABLE


class WeightSyncUnverified(GrpoError):
    """After a weight sync (and one retry) the engine still does not serve
    the weights just synced: its log-probs of a fixed probe differ from the
    trainer's by more than the two precisions explain
    (:mod:`grpo_core.sync.verify`). The message names the engine,
    the policy version and the measured gap."""

    exit_code = EXIT_UNREACHABLE


class EnvironmentLost(GrpoError):
    """An environment that cannot go on at all (its server keeps dying, or
    never came up). Raised when an episode is made or reset, it ends the
    run, where any other error there ends only that episode."""

    exit_code = EXIT_UNREACHABLE


class EpisodeOver(GrpoError):
    """A model-driven episode asked for a turn it cannot have
    (:meth:`~grpo_core.contract.types.EpisodeModel.generate`). ``reason``:
    ``"length"`` (``trl.max_completion_length`` spent on its chain),
    ``"max_turns"`` (``[episodes] max_turns``), ``"ended"`` (it timed out,
    failed or returned), ``"unavailable"`` (the engine failed: the run ends)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class NotImplementedYet(ConfigError):
    """An option from the reference feature list whose feature is not built
    yet: refusing is better than silently ignoring it."""

    def __init__(self, key: str, detail: str = "") -> None:
        msg = f"`{key}` is not implemented yet in grpo"
        super().__init__(msg + (f": {detail}" if detail else "") + ". Remove it from the config.")


class TrainingDiverged(GrpoError):
    """A step's loss or gradient norm was not finite (NaN or inf). The run
    stops at that step rather than train on it; the message names the step,
    the values and the last checkpoint."""


class TrainingInterrupted(GrpoError):
    """SIGINT/SIGTERM stopped training after a checkpoint was saved."""

    exit_code = EXIT_INTERRUPTED


class UnexpectedFailure(GrpoError):
    """An exception no rule foresaw, in one line: the phase, the exception,
    what happened to the checkpoint, the traceback file. ``exit_code`` is its
    class (:data:`EXIT_CODES`); ``original`` is the exception itself."""

    def __init__(self, message: str, exit_code: int = EXIT_INTERNAL, original: BaseException | None = None) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.original = original

    def __reduce__(self) -> tuple[type, tuple[str, int]]:  # crosses processes without the original
        return (type(self), (str(self), self.exit_code))


def shareable_error(exc: BaseException) -> BaseException:
    """``exc`` as another process can receive it (pickled through a
    collective, as when rank 0's failed weight sync must stop every rank):
    the error itself when it survives pickling with its type and message,
    else a :class:`GrpoError` that carries both."""
    try:
        copy = pickle.loads(pickle.dumps(exc))
        if type(copy) is type(exc) and str(copy) == str(exc):
            copy.__traceback__ = None
            return copy
    except Exception:
        pass
    return GrpoError(f"{type(exc).__name__}: {exc}")
