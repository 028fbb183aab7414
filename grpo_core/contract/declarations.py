"""What the core reads from an implementation besides its hooks: one Protocol per extension point.

Each Protocol lists the class attributes the core reads (with ``getattr``)
from the chosen implementation of its point, with their types and defaults.
An implementation declares only those it needs; a missing one reads as the
default here. Subclass the Protocol to have a type checker (and an editor)
check what you declare::

    from grpo_core.plugin_api import WEIGHTS_FROM_PATH, WeightSyncImplementation, hookimpl

    class MySync(WeightSyncImplementation):
        required_capabilities = frozenset({WEIGHTS_FROM_PATH})
        sends = "adapter"

:data:`grpo_core.contract.extension_points.EXTENSION_POINTS` takes each
point's attributes and defaults from here, and ``grpo config check`` refuses
a declaration of the wrong type (:func:`declaration_problems`).
"""

from __future__ import annotations

import collections.abc
import types
import typing
from functools import cache
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

from pydantic import BaseModel

Sends = Literal["merged_weights", "adapter", "nothing"]
"""What a weight sync delivers to the engine."""

if TYPE_CHECKING:  # a type checker sees a static method (a plain Callable would read as bound to the instance)
    ConfigPredicate = staticmethod[[Any], bool]
    ConfigNames = staticmethod[[Any], list[str] | None]
else:  # what the runtime check evaluates: staticmethod is not subscriptable
    ConfigPredicate = collections.abc.Callable[[Any], bool]
    ConfigNames = collections.abc.Callable[[Any], list[str] | None]
"""A static function ``(config) -> bool``: decided from the config alone (it runs in ``grpo config check``)."""


class Implementation(Protocol):
    """What the core reads from an implementation of any extension point.

    State that must survive a resume is the pair of methods
    ``state_dict() -> dict`` / ``load_state_dict(state)``
    (:class:`~grpo_core.contract.types.Checkpointable`): both or neither, the
    state plain JSON data."""

    Settings: ClassVar[type[BaseModel] | None] = None
    """A pydantic model validating ``[plugins.<name>]``; the class is then built as ``factory(context, settings)``."""


class RolloutImplementation(Implementation, Protocol):
    """``grpo.rollout``: prompts -> completions."""

    engine_capabilities: ClassVar[frozenset[str]] = frozenset()
    """What the engine this rollout owns can do (names from ``ENGINE_CAPABILITIES``); read by the checks."""
    concurrent_generate: ClassVar[bool] = False
    """``grpo_rollout_generate`` may run in several threads at once (streaming scoring keeps chunks in flight)."""
    runs_rollout_func: ClassVar[bool] = False
    """The rollout calls ``trl.rollout_func`` itself; otherwise the core calls it, sampling through this rollout."""
    generates_on_every_rank: ClassVar[bool] = False
    """With ``SAMPLES_TRAINER_MODEL``: built and called on every process, each sampling its share of a call."""


class EnvironmentImplementation(Implementation, Protocol):
    """``grpo.environment``: multi-turn episodes."""

    episodic: ClassVar[bool] = True
    """``False`` turns episodes off (the built-in ``none``): the run is single-turn."""
    provides_reward: ClassVar[bool | ConfigPredicate] = False
    """Add the ``environment`` reward function to ``reward_funcs``; or a static ``provides_reward(config) -> bool``."""
    turn_rewards: ClassVar[bool | ConfigPredicate] = False
    """Its replies carry a reward per turn (``EnvironmentReply.reward``): what per-turn credit needs."""
    names: ClassVar[list[str] | ConfigNames | None] = None
    """The names dataset rows choose it by (``environment`` column), or a static ``names(config)``; unset: its name."""


class WeightSyncImplementation(Implementation, Protocol):
    """``grpo.weight_sync``: trained weights -> inference engine."""

    required_capabilities: ClassVar[frozenset[str]] = frozenset()
    """What the sync needs from the rollout's engine; ``grpo config check`` refuses a rollout that lacks one."""
    sends: ClassVar[Sends] = "merged_weights"
    """What reaches the engine: full weights (a LoRA merged in), the adapter alone, or nothing."""


class AdvantageAggregationImplementation(Implementation, Protocol):
    """``grpo.advantage_aggregation``: rewards -> group-relative advantages."""

    needs_turn_rewards: ClassVar[bool] = False
    """It credits each turn from the episodes' per-turn rewards (``turn_returns``): refused on a single-turn run,
    with an environment without ``turn_rewards``, without the ``environment`` reward function, or with a loss
    without ``per_token_advantages``."""


class IsCorrectionImplementation(Implementation, Protocol):
    """``grpo.is_correction``: sampler vs trainer log-probs -> per-token weights (no attributes of its own)."""


class PolicyLossImplementation(Implementation, Protocol):
    """``grpo.policy_loss``: micro-batch -> loss."""

    uses_hidden_states: ClassVar[bool] = False
    """The loss reads ``inputs.hidden_states`` (a fused LM head) instead of ``inputs.logprobs``; not under DeepSpeed."""
    per_token_advantages: ClassVar[bool] = False
    """The loss takes ``inputs.advantages`` of shape ``[B, C]`` (one per token, per-turn credit) as well as ``[B]``."""


class ReplayImplementation(Implementation, Protocol):
    """``grpo.replay``: which groups to keep, replace and re-roll. Its state is
    usually the point: store groups as :meth:`ScoredGroup.to_dict` output."""


@cache
def attributes(protocol: type) -> dict[str, Any]:
    """The attributes ``protocol`` lists (its bases' included), with their defaults."""
    return {name: getattr(protocol, name) for name in typing.get_type_hints(protocol)}


def declaration_problems(cls: Any, protocol: type) -> list[str]:
    """Each attribute ``cls`` declares with a value its Protocol's type does
    not allow, as ``name = value: what it must be`` (empty when all fit)."""
    problems = []
    for name, hint in typing.get_type_hints(protocol).items():
        if not hasattr(cls, name):
            continue  # not declared: the default applies
        value = getattr(cls, name)
        if not _fits(value, hint):
            problems.append(f"{name} = {value!r}: it must be {describe(hint)}")
    return problems


def _fits(value: Any, hint: Any) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is ClassVar:
        return _fits(value, args[0])
    if hint is Any:
        return True
    if hint is None or hint is type(None):
        return value is None
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, arg) for arg in args)
    if origin is Literal:
        return value in args
    if origin is collections.abc.Callable:
        return callable(value) and not isinstance(value, type)
    if origin is type:
        return isinstance(value, type) and issubclass(value, args[0])
    if origin is frozenset:
        return isinstance(value, frozenset) and all(_fits(item, args[0]) for item in value)
    if hint is bool:
        return isinstance(value, bool)
    return isinstance(value, origin or hint)


def describe(hint: Any) -> str:
    """A type in words, for the fix a message names."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is ClassVar:
        return describe(args[0])
    if hint is None or hint is type(None):
        return "None"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe(arg) for arg in args)
    if origin is Literal:
        return "one of " + ", ".join(repr(arg) for arg in args)
    if origin is collections.abc.Callable:
        return f"a static function (config) -> {getattr(args[-1], '__name__', str(args[-1]))}"
    if origin is type:
        return f"a class derived from {args[0].__name__}"
    if origin is frozenset:
        return f"a frozenset of {describe(args[0])}, e.g. frozenset({{...}})"
    if origin is list:
        return f"a list of {describe(args[0])}"
    if hint is bool:
        return "True or False"
    return getattr(hint, "__name__", str(hint))
