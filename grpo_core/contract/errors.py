"""User-facing errors.

Every error a user can cause or fix (a config typo, a broken reward
function, a server that went away) is a :class:`GrpoError`. The CLI prints
its message and exits non-zero without a traceback; anything else is a bug
and keeps its traceback.
"""

from __future__ import annotations

import pickle


class GrpoError(Exception):
    """An error with a message meant for the user, not a bug."""

    exit_code = 2


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

    exit_code = 3


class WeightSyncUnverified(GrpoError):
    """After a weight sync (and one retry) the engine still does not serve
    the weights just synced: its log-probs of a fixed probe differ from the
    trainer's by more than the two precisions explain
    (:mod:`grpo_core.sync.verify`). The message names the engine,
    the policy version and the measured gap."""

    exit_code = 3


class EnvironmentLost(GrpoError):
    """An environment that cannot go on at all (its server keeps dying, or
    never came up). Raised when an episode is made or reset, it ends the
    run, where any other error there ends only that episode."""

    exit_code = 3


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


class TrainingInterrupted(GrpoError):
    """SIGINT/SIGTERM stopped training after a checkpoint was saved."""

    exit_code = 130


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
