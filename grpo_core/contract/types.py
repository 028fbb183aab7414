"""Plain data passed across the plugin contract.

These types are what the hooks in :mod:`grpo_core.contract.hookspecs` take and return.
They are deliberately small, dependency-free dataclasses (token ids are plain
``list[int]``) so a plugin can build them without knowing the trainer's
tensors, and so they pickle cleanly to subprocess reward workers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

Messages = list[dict[str, Any]]
"""A conversational prompt or completion: ``[{"role": ..., "content": ...}]``."""


@dataclass
class Prompt:
    """One dataset row, ready to be sampled from.

    ``prompt`` is what the user wrote (a string, or a list of chat messages);
    ``prompt_ids`` is its tokenisation after the chat template, so rollout
    engines never re-tokenise. ``columns`` are the remaining dataset columns,
    handed to reward functions as keyword arguments.
    """

    prompt: str | Messages
    prompt_ids: list[int]
    columns: dict[str, Any] = field(default_factory=dict)
    index: int = -1  # position in the (shuffled) dataset, for resumption

    @property
    def is_conversational(self) -> bool:
        return isinstance(self.prompt, list)


@dataclass
class SamplingSettings:
    """How completions are sampled; mirrors the seed's generation options."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    guided_regex: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # generation_kwargs
    # Reproducible sampling when set. A rollout must still draw every
    # completion of a call from its own random stream (different prompts of
    # one call never share one): an episode's later turns are prompts of
    # their own, and shared streams would make a group's episodes alike.
    seed: int | None = None
    # Where this call's first prompt stands in the whole request it is a
    # share of: with several training processes the core may split one
    # request's prompts over them (a rollout declaring
    # ``generates_on_every_rank``), each process's call getting a contiguous
    # share and this offset; 0 otherwise. A seeded rollout derives each
    # completion's random stream from (seed, prompt_offset + its prompt's
    # index in the call, its generation's index), so the samples do not
    # depend on how the request was split.
    prompt_offset: int = 0


@dataclass
class EpisodeStats:
    """What happened in one multi-turn episode, for metrics and logs.

    ``ended_by`` says why the episode stopped: ``"environment"`` (it said
    done, or a tool-use turn had no tool call), ``"max_turns"``, ``"length"``
    (``max_completion_length`` reached), ``"error"`` (the environment
    raised; ``error`` names it), ``"timeout"`` (a step outlasted the
    configured timeout). ``reward`` is the sum of the rewards the
    environment gave, ``None`` when it gave none (or failed).
    ``template_mismatch`` is true when the chat template renders the
    conversation differently from the concatenated ids the model saw (the
    ids are kept; see :mod:`grpo_core.generation.turn_tokens`).

    Per model turn, in order (one entry each, ``turns`` in all):
    ``turn_starts`` is where the turn's ids begin in the completion's
    ``token_ids`` (they run, loss mask 1, up to the environment's ids that
    follow), and ``turn_rewards`` the ``reward`` of the environment's reply
    to that turn (``None`` where it gave none, or no reply came). What
    per-turn credit assignment reads (``docs/turn-credit.md``).

    ``environment`` is the name the episode's row chose (several
    environments in one run), for per-environment metrics.

    Model-driven episodes (:class:`DrivenEpisode`) also count
    ``history_rewrites``: requests that did not continue the episode's
    latest model turn (the agent dropped, edited or summarised its history,
    or ran a second conversation); only the chain of the last turn trains,
    and ``untrained_tokens`` are the tokens sampled off it. ``scored`` is
    false for a driven episode that failed: the core gives it no reward at
    all (every reward function's value is ``None``), so it takes no part in
    its group's advantages.
    """

    turns: int = 0
    model_tokens: int = 0
    environment_tokens: int = 0
    tool_calls: int = 0
    tool_failures: int = 0
    ended_by: str = "environment"
    error: str | None = None
    reward: float | None = None
    template_mismatch: bool = False
    turn_starts: list[int] = field(default_factory=list)
    turn_rewards: list[float | None] = field(default_factory=list)
    environment: str | None = None
    history_rewrites: int = 0
    untrained_tokens: int = 0
    scored: bool = True


@dataclass
class Completion:
    """One sampled completion, or one whole multi-turn episode.

    ``logprobs`` are the *sampler's* log-probabilities of ``token_ids`` (one per
    token) when the engine reports them; importance-sampling correction needs
    them. ``truncated`` is true when generation stopped at ``max_tokens``
    rather than at an end-of-sequence or stop token. ``extra`` holds
    per-completion values a rollout wants reward functions to see (they
    arrive as keyword arguments, like dataset columns).

    An **episode** (several model turns with environment or tool messages
    between them) is one completion: ``token_ids`` are the exact ids of every
    turn as the engine returned them, with the environment's ids (rendered
    by the chat template) between them, never re-tokenised. ``loss_mask``
    then has one entry per token: 1 where the policy sampled the token (it
    is trained and counts in every loss normaliser), 0 where the
    environment or the chat template inserted it (no gradient, no count,
    no KL, no entropy, no importance weight). ``None`` means every token is
    the policy's (single-turn). ``logprobs`` entries at mask-0 positions are
    ignored (the drivers write 0.0). ``token_versions``: the policy version
    whose weights sampled each entry of ``token_ids``, when an engine took a
    weight update while the completion was generating
    (``trl.in_flight_weight_updates``: the tokens before the update carry the
    old version, those after it the new one); ``None`` means every token was
    sampled by its group's ``policy_version``. Entries at mask-0 positions
    are not read. ``episode`` records what happened;
    ``messages`` is the episode after the prompt as chat messages (model
    turns and the environment's replies): what conversational reward
    functions receive as the completion, as in TRL.
    ``environment`` is the live episode object while the completion is
    being scored (TRL's ``environments=`` argument of reward functions); it
    is dropped after scoring and never saved.
    """

    token_ids: list[int]
    text: str
    logprobs: list[float] | None = None
    truncated: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    loss_mask: list[int] | None = None
    episode: EpisodeStats | None = None
    messages: Messages | None = None
    environment: Any = field(default=None, repr=False, compare=False)
    token_versions: list[int] | None = None

    @property
    def model_token_count(self) -> int:
        """Tokens the policy sampled (what the loss trains and counts)."""
        return len(self.token_ids) if self.loss_mask is None else int(sum(self.loss_mask))


@dataclass
class RolloutGroup:
    """All completions sampled for one prompt: the unit of group-relative
    advantages, of streaming scoring and of replay."""

    prompt: Prompt
    completions: list[Completion]
    policy_version: int = 0  # the weight version that generated it


@dataclass
class ScoredGroup:
    """A rollout group with its rewards and advantages.

    ``rewards`` has one row per completion and one column per reward function;
    ``None`` marks a value a function chose not to give. ``advantages`` is one
    float per completion. ``token_advantages``, when the run's
    ``advantage_aggregation`` gives one advantage per token (per-turn credit),
    holds them: one list per completion, one float per entry of its
    ``token_ids`` (0 where the loss mask is 0); ``advantages`` then holds each
    completion's mean over its policy tokens, for logs.
    """

    group: RolloutGroup
    rewards: list[list[float | None]]
    advantages: list[float]
    replayed: bool = False
    token_advantages: list[list[float]] | None = None

    @property
    def has_signal(self) -> bool:
        """True when some advantage is non-zero, i.e. the group can teach."""
        if self.token_advantages is not None:
            return any(abs(a) > 1e-8 for row in self.token_advantages for a in row)
        return any(abs(a) > 1e-8 for a in self.advantages)

    @property
    def total_rewards(self) -> list[float]:
        """Unweighted sum per completion, ``None`` counted as 0 (for logs)."""
        return [sum(r for r in row if r is not None and math.isfinite(r)) for row in self.rewards]

    def to_dict(self) -> dict[str, Any]:
        """The group as plain JSON data, for a plugin's ``state_dict`` (a
        checkpoint holds JSON data only). A completion's live ``environment``
        is left out; dataset columns are kept as they are, so they must be
        JSON data too. :meth:`from_dict` reads it back."""
        data = dataclasses.asdict(
            dataclasses.replace(
                self,
                group=dataclasses.replace(
                    self.group, completions=[dataclasses.replace(c, environment=None) for c in self.group.completions]
                ),
            )
        )
        for completion in data["group"]["completions"]:
            del completion["environment"]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ScoredGroup:
        """A group back from :meth:`to_dict` output (after a JSON round trip too)."""
        rollout = data["group"]
        completions = []
        for raw in rollout["completions"]:
            fields = dict(raw)
            if isinstance(fields.get("episode"), Mapping):
                fields["episode"] = EpisodeStats(**fields["episode"])
            completions.append(Completion(**fields))
        return cls(
            group=RolloutGroup(
                prompt=Prompt(**rollout["prompt"]),
                completions=completions,
                policy_version=int(rollout["policy_version"]),
            ),
            rewards=[list(row) for row in data["rewards"]],
            advantages=list(data["advantages"]),
            replayed=bool(data["replayed"]),
            token_advantages=data.get("token_advantages"),
        )


@dataclass
class TrainingProgress:
    """Where the run stands; handed to hooks that schedule by progress."""

    step: int
    max_steps: int

    @property
    def fraction(self) -> float:
        return self.step / self.max_steps if self.max_steps > 0 else 0.0


@runtime_checkable
class RewardFunction(Protocol):
    """What the core calls to score completions (TRL's calling convention).

    ``__call__(prompts=..., completions=..., completion_ids=..., **columns)``
    returns one ``float`` or ``None`` per completion. ``__name__`` names it in
    logs (``rewards/<name>/mean``) and in error messages.
    """

    __name__: str

    def __call__(
        self, *, prompts: list, completions: list, completion_ids: list[list[int]], **columns: Any
    ) -> list[float | None]: ...


@dataclass
class SyncResult:
    """What a weight sync did, for logs: the new policy version and how long
    it took."""

    version: int
    seconds: float
    detail: str = ""


@dataclass
class PolicyLossInputs:
    """One micro-batch, as a ``policy_loss`` implementation sees it
    (:func:`grpo_core.contract.hookspecs.grpo_policy_loss`).

    Tensors are ``[B, C]`` over the completion tokens (``advantages``:
    ``[B]``, or ``[B, C]`` when the run's ``advantage_aggregation`` gives one
    per token; an implementation that cannot take that declares
    ``per_token_advantages = False``) on the training device. The policy's forward is given as
    callables, not results, so an implementation runs only the part it
    needs: ``logprobs`` (per-token log-probs and, when asked, entropies, with
    gradient, as :func:`grpo_core.optimization.logprobs.token_logprobs` computes them) or
    ``hidden_states`` (the decoder's hidden states that predict the
    completion tokens, ``[B, C, H]`` with gradient, and the LM head module:
    for losses that fuse the head, such as Liger's). Either runs under the
    run's precision (autocast) and through the compiled body when
    ``torch_compile`` is on.

    ``is_weights(trainer_logps)`` calls the run's ``is_correction`` with the
    trainer's log-probs at sampling time (pass the detached current
    log-probs when ``old_logps`` is ``None``) and returns ``(weights or None,
    mask)``; it logs the ``is/*`` metrics itself.
    """

    settings: Any  # grpo_core.optimization.loss.LossSettings
    targets: Any  # completion token ids [B, C]
    # 0/1 completion mask [B, C], float: 1 on the policy's tokens (0 on padding, environment tokens, masked truncations)
    mask: Any
    advantages: Any  # [B], or [B, C] (per-token credit)
    old_logps: Any = None
    ref_logps: Any = None
    sampler_logps: Any = None
    temperature: float = 1.0
    num_items_in_batch: float | None = None
    """Policy tokens (mask 1) of the step's accumulation window (TRL's dapo/cispo normaliser)."""
    accumulation_steps: int = 1
    logprobs: Any = None  # Callable[[bool], tuple[Tensor, Tensor | None]]: with_entropy -> (logps, entropy)
    hidden_states: Any = None  # Callable[[], tuple[Tensor, torch.nn.Module]]: -> (hidden [B, C, H], lm_head)
    is_weights: Any = None  # Callable[[Tensor], tuple[Tensor | None, Tensor]]


# --------------------------------------------------------------------------
# Multi-turn episodes, as the contract sees them
# --------------------------------------------------------------------------


@dataclass
class EnvironmentReply:
    """What an :class:`Episode` answers to one model turn.

    ``messages`` are appended to the conversation (chat messages, e.g.
    ``{"role": "user", "content": "higher"}`` or ``{"role": "tool", ...}``):
    the core renders them with the run's chat template and appends their ids
    with loss mask 0, then a generation prompt for the model's next turn.
    ``done`` ends the episode (no messages needed). ``reward`` is added to
    the episode's environment reward. ``tool_calls`` / ``tool_failures``
    count what this step did, for metrics. ``info`` values reach reward
    functions as keyword arguments (the last step's win), like dataset
    columns: keep them picklable.
    """

    messages: Messages = field(default_factory=list)
    done: bool = False
    reward: float | None = None
    tool_calls: int = 0
    tool_failures: int = 0
    info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Episode(Protocol):
    """One independent episode of an environment, for one sample of one
    prompt (``num_generations`` episodes per prompt row, none shared).

    Made by :func:`~grpo_core.contract.hookspecs.grpo_environment_episode`, driven by
    the core: ``reset()`` once, then ``step(text)`` with each model turn's
    text (special tokens removed) until a reply says ``done``, the turn
    limit or ``max_completion_length`` is reached. Steps of different
    episodes run concurrently in threads (many episodes are in flight so the
    engine batches their turns), each episode's own steps one after
    another. A step that raises ends that episode (``ended_by = "error"``);
    one that outlasts ``[episodes] step_timeout`` ends it too
    (``"timeout"``). Optional members: ``final_reward()`` is called once when
    the episode has ended in any way but a failure, and what it returns
    (a float, or ``None``) is added to the episode's reward (TRL's
    ``get_reward``); ``environment`` is the object reward functions receive
    in ``environments=`` (default: the episode itself); ``close()`` is
    called once the episode has been scored.
    """

    def reset(self) -> str | Messages | None:
        """Start the episode. ``None``: the prompt is used as it is; a
        string: appended to the prompt's last user message (TRL's
        ``reset`` convention); a list of messages: the conversation to
        start from instead of the prompt (e.g. with a system prompt naming
        the tools). The core re-renders the prompt with the chat template
        when it changes."""

    def step(self, text: str) -> EnvironmentReply:
        """Answer one model turn."""


@dataclass
class ModelTurn:
    """One generation of a model-driven episode
    (:meth:`EpisodeModel.generate`): what the engine sampled, as it returned it.

    ``ids`` are the sampled token ids (never re-tokenised; a turn that
    trains, trains on exactly these), ``text`` their text with special
    tokens removed, ``logprobs`` the engine's (``None`` if it gave none).
    ``finish_reason`` is ``"stop"`` (the model ended its turn, or a stop
    string was met) or ``"length"`` (the request's ``max_tokens``, the
    turn cap or the episode's budget cut it). ``prompt_tokens`` is the
    length of the context it was sampled on. ``message`` is the assistant
    message the turn became for the agent (the endpoint sets it once it has
    parsed tool calls): the recorded conversation that reward functions
    read holds it. ``index`` is the turn's place in its episode.
    """

    index: int
    ids: list[int]
    text: str
    logprobs: list[float] | None
    finish_reason: str
    prompt_tokens: int
    message: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class EpisodeModel(Protocol):
    """The run's policy as one model-driven episode sees it (made by the
    core for each :class:`DrivenEpisode`, handed to ``drive``).

    A turn's context is given in ids: ``generate(ids, after=turn)`` samples
    on the ids of the earlier ``turn``'s context and its sampled ids, then
    ``ids`` (what came after: tool results, a user message, the next
    generation prompt, rendered by :meth:`render`); ``after=None`` samples
    on ``ids`` alone (a conversation started from scratch). Each call is
    one generation through the run's rollout (the engine batches the calls
    of every episode in flight), limited by ``trl.max_completion_length``
    over the chain of turns, ``[episodes] max_turns`` and ``max_tokens_per_turn``.

    **The trained sample.** Each turn continues an earlier turn or starts
    afresh, so an episode's turns form chains. The episode trains the
    chain that holds its last turn: its context, then each of its turns'
    sampled ids (loss mask 1) with the ids between them (mask 0). A turn
    that continues anything but the episode's latest turn (a fork, a fresh
    start: the agent rewrote its history) counts in
    ``EpisodeStats.history_rewrites``; tokens sampled off the trained chain
    in ``untrained_tokens``.

    Thread-safe; ``generate`` blocks until the engine answers. It raises
    :class:`~grpo_core.contract.errors.EpisodeOver` once the episode cannot
    go on (its budget or turn limit is spent, it timed out, it failed, it
    ended).
    """

    def render(
        self, messages: Messages, *, after: ModelTurn | None = None, tools: list[Any] | None = None
    ) -> list[int]:
        """The ids of ``messages`` with the chat template (``tools`` passed
        to it), ending with the generation prompt: a whole conversation
        (``after=None``), or the messages that follow model turn ``after``
        (its turn closed first), never re-rendering that turn."""

    def encode(self, text: str) -> list[int]:
        """Plain text as ids, no template, no special tokens added."""

    def generate(
        self,
        ids: list[int],
        *,
        after: ModelTurn | None = None,
        conversation: Messages | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop: list[str] | None = None,
    ) -> ModelTurn:
        """One model turn on ``after``'s ids then ``ids``. ``conversation``:
        the messages this context renders (recorded for reward functions).
        ``max_tokens`` is capped by the turn cap and the episode's budget;
        ``temperature``/``top_p`` override the run's (``None``: the run's);
        ``stop``: strings that end the turn (the ids are cut after the token
        that completes one, as an engine stops)."""

    def fail(self, problem: str) -> None:
        """End the episode now as failed (``ended_by = "error"``,
        ``problem`` its error): later calls raise ``EpisodeOver``."""


@runtime_checkable
class DrivenEpisode(Protocol):
    """An episode whose own code drives the model (an agent), instead of
    answering the model's turns (:class:`Episode`).

    Returned by :func:`~grpo_core.contract.hookspecs.grpo_environment_episode`
    like any episode; the core tells them apart by ``drive``. It calls
    ``drive(model)`` once, in a thread of its own (many episodes at once),
    and the episode calls ``model.generate`` as often as it likes. What
    ``drive`` returns is the episode's environment reward (a float, or
    ``None``: then only ``reward_funcs`` score it). ``drive`` raising ends
    the episode as failed (``ended_by = "error"``; ``"timeout"`` for a
    ``TimeoutError``; a :class:`~grpo_core.contract.errors.GrpoError`'s
    message is logged as it is); so does returning without one call of
    ``generate``, or a call after ``drive`` returned. A failed driven
    episode gets no reward at all (``EpisodeStats.scored``), so its group
    trains on its other episodes.

    Optional members: ``timeout`` (seconds ``drive`` may take, from when it
    starts; default ``[episodes] step_timeout``: the core then stops
    waiting, ends the episode with ``"timeout"`` and refuses its later
    calls), ``max_concurrent`` (driven episodes in flight at once; default
    ``[episodes] max_concurrent_steps``), ``environment`` (what reward
    functions get in ``environments=``) and ``close()``, as on :class:`Episode`.
    """

    def drive(self, model: EpisodeModel) -> float | None:
        """Run the episode to its end; return its reward or ``None``."""


# --------------------------------------------------------------------------
# The inference engine, as the contract sees it
# --------------------------------------------------------------------------

WEIGHTS_FROM_PATH = "weights_from_path"
"""Engine capability: :meth:`InferenceEngine.load_weights_from_path`."""
ADAPTER_FROM_PATH = "adapter_from_path"
"""Engine capability: :meth:`InferenceEngine.load_adapter`."""
ADAPTER_FROM_URL = "adapter_from_url"
"""Engine capability: :meth:`InferenceEngine.load_adapter_from_url` (the
engine pulls a PEFT adapter over HTTP: a LoRA sync with no filesystem
shared with the trainer)."""
ADAPTER_LOADS: frozenset[str] = frozenset({ADAPTER_FROM_PATH, ADAPTER_FROM_URL})
"""The capabilities that load a LoRA adapter: an engine asked for one of
them must serve adapters (vLLM: ``--enable-lora``)."""
WEIGHTS_FROM_URL = "weights_from_url"
"""Engine capability: :meth:`InferenceEngine.load_weights_from_url` (the
engine pulls the weights over HTTP: no filesystem shared with the trainer)."""
WEIGHTS_OVER_NCCL = "weights_over_nccl"
"""The engine joins an NCCL group and receives weights broadcast by the
trainer (vLLM's weight-transfer API; CUDA on both sides). The sync drives
the handshake and each round through :meth:`InferenceEngine.control_endpoints`,
so an engine with this capability has :data:`CONTROL_ENDPOINTS` too."""
CONTROL_ENDPOINTS = "control_endpoints"
"""Engine capability: :meth:`InferenceEngine.control_endpoints` (the engine
is one or more HTTP servers a sync may send its own authenticated requests
to)."""
WEIGHTS_IN_MEMORY = "weights_in_memory"
"""Engine capability: :meth:`InferenceEngine.load_weights` (same process)."""
SCORES_TOKENS = "scores_tokens"
"""Engine capability: :meth:`InferenceEngine.score_tokens` (the engine's
log-prob of each token of a sequence, per server). The core uses it to
verify every weight sync (``verify_weight_sync``,
:mod:`grpo_core.sync.verify`); no sync needs it."""
PAUSES_GENERATION = "pauses_generation"
"""Engine capability: ``update_in_flight(version, load)`` (read with
:func:`in_flight_updater`; not a member of :class:`InferenceEngine`, so
engines written before it still satisfy ``isinstance``). It pauses
generation without waiting for the requests in flight, runs ``load`` (the
weight sync, which calls the ``load_*`` methods), resumes, and from then on
records ``version`` for every token it samples: a completion that was
generating across the update carries ``Completion.token_versions`` (its
tokens before the pause the version served before, those after it
``version``). Used with ``trl.in_flight_weight_updates``."""
CONTINUES_FROM_IDS = "continues_from_ids"
"""Rollout capability: a prompt's ``prompt_ids`` may end with tokens the
engine sampled earlier, and the rollout continues from exactly those ids
(never re-tokenised), returns each new token's sampler log-prob, and marks
``truncated`` only when a piece stopped at its ``max_tokens`` (an end of
sequence or stop token sampled as the last allowed token is a stop). What
partial rollouts (``trl.partial_rollout_token_budget``) need to continue a
sample in a later batch (:mod:`grpo_core.generation.partial_rollouts`)."""
SAMPLES_TRAINER_MODEL = "samples_trainer_model"
"""Rollout capability without an engine: it samples the trainer's live model,
so the weights are current the moment the optimizer steps."""

ENGINE_CAPABILITIES: frozenset[str] = frozenset(
    {
        WEIGHTS_FROM_PATH,
        ADAPTER_FROM_PATH,
        ADAPTER_FROM_URL,
        WEIGHTS_FROM_URL,
        WEIGHTS_OVER_NCCL,
        CONTROL_ENDPOINTS,
        WEIGHTS_IN_MEMORY,
        SCORES_TOKENS,
        PAUSES_GENERATION,
        CONTINUES_FROM_IDS,
        SAMPLES_TRAINER_MODEL,
    }
)


@dataclass(frozen=True)
class EngineScore:
    """One server's answer to :meth:`InferenceEngine.score_tokens`.

    ``logprobs[i]`` is the engine's log-prob of ``token_ids[i + 1]`` given
    ``token_ids[: i + 1]`` (the first token has no prefix, so there are
    ``len(token_ids) - 1``), from the full softmax at temperature 1 (no
    sampling processors), under the model the engine serves now
    (``model``: the base, or the adapter the last load installed)."""

    description: str
    """Which server answered, for messages (``"vLLM server at http://..."``)."""
    logprobs: list[float]
    model: str = ""


@runtime_checkable
class ControlEndpoint(Protocol):
    """One server of an :class:`InferenceEngine`, for a weight sync that
    drives a server API of its own (the ``nccl`` sync: vLLM's
    weight-transfer routes). The endpoint carries the engine's credentials
    (API key, private Unix socket), so the sync never handles them."""

    @property
    def description(self) -> str:
        """Which server, for messages (``"vLLM server at http://..."``)."""

    def request(
        self, method: str, path: str, body: Mapping[str, Any] | None = None, *, timeout: float | None = None
    ) -> Any:
        """Send ``body`` as JSON to ``path``, authenticated, **once**: a
        control request need not be idempotent (joining a group twice is
        not), so nothing is retried. Returns the decoded JSON answer
        (``None`` for an empty one). Raises ``EngineUnavailable`` when the
        server does not answer within ``timeout`` seconds (default: the
        engine's own timeout), another :class:`~grpo_core.contract.errors.GrpoError`
        when it refuses the request."""


@runtime_checkable
class InferenceEngine(Protocol):
    """The inference engine a rollout owns, as a weight sync sees it.

    A rollout implementation that samples from an engine of its own (a vLLM
    server, an in-process vLLM) hands this handle out through
    :func:`~grpo_core.contract.hookspecs.grpo_inference_engine`; the core passes it to
    :func:`~grpo_core.contract.hookspecs.grpo_sync_weights`. A sync uses only the
    methods listed in :attr:`capabilities` (``load_*``,
    :meth:`control_endpoints`); the others raise
    :class:`NotImplementedError`. A sync never reaches past this protocol
    (no ``getattr(engine, "client")``): what it needs from an engine is a
    method here, so any rollout's engine can serve it.

    Restarts are the engine's business: an engine that dies and comes back
    re-applies the last ``load_*`` call itself before it samples again, so a
    path (or URL) given to a ``load_*`` method must stay readable until the
    next load.

    One handle may stand for several servers (``trl.vllm_server_base_urls``,
    ``[vllm] data_parallel_size`` > 1): then every ``load_*`` call reaches
    all of them (in parallel) before it returns, and a server that cannot be
    recovered is dropped with a warning; the handle raises
    ``EngineUnavailable`` only when none is left. A weight sync therefore
    never needs to know how many servers there are (except through
    :meth:`control_endpoints`, which lists them).

    Optional, capability-gated: an engine declaring :data:`SCORES_TOKENS`
    has ``score_tokens(token_ids: Sequence[int]) -> list[EngineScore]``:
    for **each** server the handle stands for (each live server of a pool on
    its own, in a fixed order), the engine's log-prob of every token given
    its prefix (:class:`EngineScore`), computed with the weights it serves
    now (the adapter after a ``load_adapter``). It must not change what the
    engine serves; raise ``EngineUnavailable`` when no server answers. The
    core calls it after each weight sync to check that the engine serves the
    weights just synced (``verify_weight_sync``). It is not a member of this
    protocol, so engines written before it still satisfy ``isinstance``;
    read it with :func:`token_scorer`.

    Optional: an engine that computes on this machine's CPU cores may expose
    ``cpu_cores`` (a ``frozenset[int]``): the cores it is pinned to. The
    trainer then runs its own threads on the other cores (read with
    :func:`engine_cpu_cores`); engines without it leave the trainer alone.
    """

    @property
    def description(self) -> str:
        """Where the engine is, for messages (``"vLLM server at http://..."``)."""

    @property
    def capabilities(self) -> frozenset[str]:
        """Which optional methods work (``load_*``, :meth:`control_endpoints`;
        a subset of :data:`ENGINE_CAPABILITIES`)."""

    @property
    def served_model(self) -> str:
        """The model name a generation request names now (the base model, or
        the adapter a LoRA load installed)."""

    @property
    def weight_label(self) -> str | None:
        """A label of the weights the engine holds, set by each load; an
        engine that restarted with other weights reports a different one."""

    @property
    def same_host(self) -> bool:
        """The engine runs on this machine: files handed to it may live in
        this machine's memory-backed temporary storage, not in output_dir."""

    @property
    def weight_dtype(self) -> str | None:
        """The dtype the engine keeps its weights in (``"bfloat16"``,
        ``"float32"``, ...) when known; a sync may send weights in it (half
        the bytes of float32 for bf16). ``None``: send them as they are."""

    def ensure_ready(self) -> None:
        """Block until the engine answers and holds nothing an earlier run
        left on it. Idempotent; raise ``EngineUnavailable`` when it never does."""

    def healthy(self) -> bool:
        """One quick probe; never raises."""

    def restart_if_dead(self) -> bool:
        """Bring an engine whose process exited back up (then re-apply the last
        load). ``True`` if it restarted; ``False`` if it was alive or cannot be
        restarted (an external server)."""

    def load_weights_from_path(self, path: Path) -> None:
        """Replace the weights with the safetensors under ``path`` (HF names;
        weights not in the files keep their values) and drop cached prefixes."""

    def load_adapter(self, path: Path) -> None:
        """Load the PEFT adapter saved at ``path`` (replacing the previous one)
        and serve it from now on."""

    def load_adapter_from_url(self, url: str, token: str) -> None:
        """Load the PEFT adapter the engine fetches from ``url`` (sending
        ``Authorization: Bearer <token>``) and serve it from now on, like
        :meth:`load_adapter` with no shared filesystem. The body is the
        adapter's ``adapter_model.safetensors`` with its
        ``adapter_config.json`` as the safetensors metadata key
        ``adapter_config`` (:func:`grpo_core.modeling.engine_weights.adapter_body`)."""

    def load_weights_from_url(self, url: str, token: str) -> None:
        """Replace the weights with the safetensors bytes the engine fetches
        from ``url`` (sending ``Authorization: Bearer <token>``), like
        :meth:`load_weights_from_path` but with no shared filesystem: the
        trainer serves them, the engine pulls them."""

    def load_weights(self, weights: Mapping[str, Any]) -> None:
        """Copy ``weights`` (HF names -> tensors) into the engine in place."""

    def fused_modules(self) -> tuple[tuple[str, ...], ...]:
        """Groups of HF projections the engine stores as one weight (e.g.
        ``("q_proj", "k_proj", "v_proj")``): a partial update must carry every
        member of a group."""

    def control_endpoints(self) -> list[ControlEndpoint]:
        """Every server this handle stands for, in a fixed order (one for a
        single server; the live ones of a pool), each taking authenticated
        control requests (:class:`ControlEndpoint`). For syncs that must
        talk to each server themselves (``nccl``: every server joins the
        NCCL group at its own ranks). Works when :attr:`capabilities` holds
        :data:`CONTROL_ENDPOINTS`; an engine that is not a server (vLLM in
        the trainer's process) raises :class:`NotImplementedError` saying so.
        A restarted server has lost whatever state those requests set up
        (an NCCL group): the sync finds out from the next request failing."""


def token_scorer(engine: object) -> Callable[[Sequence[int]], list[EngineScore]] | None:
    """The engine's ``score_tokens`` when it declares :data:`SCORES_TOKENS`
    (``None`` otherwise, or without an engine)."""
    if engine is None or SCORES_TOKENS not in getattr(engine, "capabilities", ()):
        return None
    return getattr(engine, "score_tokens", None)


def in_flight_updater(engine: object) -> Callable[[int, Callable[[], None]], None] | None:
    """The engine's ``update_in_flight(version, load)`` when it declares
    :data:`PAUSES_GENERATION` (``None`` otherwise, or without an engine)."""
    if engine is None or PAUSES_GENERATION not in getattr(engine, "capabilities", ()):
        return None
    return getattr(engine, "update_in_flight", None)


def engine_cpu_cores(engine: object) -> frozenset[int] | None:
    """The optional ``cpu_cores`` of an :class:`InferenceEngine` (``None`` when
    it has none, or no engine)."""
    cores = getattr(engine, "cpu_cores", None)
    return frozenset(cores) if cores else None


@runtime_checkable
class Checkpointable(Protocol):
    """An implementation with state that must survive a resume (a replay
    buffer, a learned schedule). ``state_dict`` returns plain data (JSON
    types: dicts, lists, strings, numbers, booleans, ``None``); it is saved
    with every checkpoint and handed back to ``load_state_dict`` on resume."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@runtime_checkable
class Tracker(Protocol):
    """An experiment tracker a run reports to (``report_to``).

    Built as ``factory(context)`` from the ``grpo.tracker`` entry point group
    (see ``docs/plugins.md``, "Trackers"). ``log`` gets the step's scalar metrics
    (finite floats only); ``log_table`` gets the rows added at ``step`` to
    the table ``name`` (e.g. ``completions``): a tracker must keep earlier
    rows visible (append, or one table per step), never overwrite them.
    ``close`` flushes and ends the run; it is called once, also after a
    failure.
    """

    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def log_table(self, name: str, rows: list[dict[str, Any]], step: int) -> None: ...

    def close(self) -> None: ...
