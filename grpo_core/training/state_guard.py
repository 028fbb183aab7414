"""A plugin's checkpointed state, with its failures named.

The loop calls ``state_dict()`` of every implementation with state when it
saves a checkpoint and ``load_state_dict()`` when it resumes. A plugin bug
there used to surface as a bare traceback from the middle of a save; wrapped
in :class:`GuardedState`, it is a :class:`~grpo_core.contract.errors.PluginError`
naming the extension point and the method (the exception stays its cause, so
its traceback is written to ``output_dir/grpo-error.log``).
"""

from __future__ import annotations

from typing import Any

from grpo_core.contract.errors import GrpoError, PluginError
from grpo_core.contract.types import Checkpointable


class GuardedState:
    """``obj``'s ``state_dict``/``load_state_dict``, failures named as ``name``'s."""

    def __init__(self, name: str, obj: Checkpointable) -> None:
        self.name = name
        self.obj = obj

    def state_dict(self) -> dict[str, Any]:
        try:
            return self.obj.state_dict()
        except GrpoError:
            raise
        except Exception as exc:
            raise PluginError(
                f"the {self.name} implementation ({type(self.obj).__name__}) raised {type(exc).__name__} in "
                f"state_dict() while its state was being checkpointed: {exc}. Fix its state_dict()."
            ) from exc

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            self.obj.load_state_dict(state)
        except GrpoError:
            raise
        except Exception as exc:
            raise PluginError(
                f"the {self.name} implementation ({type(self.obj).__name__}) raised {type(exc).__name__} in "
                f"load_state_dict() while resuming: {exc}. The checkpoint's state for it may come from another "
                "version of the plugin: fix load_state_dict(), or start without resume_from_checkpoint."
            ) from exc
