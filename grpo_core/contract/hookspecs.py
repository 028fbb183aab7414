"""The plugin contract of grpo: every hook a plugin may implement, and
everything an implementation receives or must honour.

grpo's core is a loop: *rollout* prompts into completions, *reward* them,
turn rewards into *advantages*, correct for stale samples
(*is_correction*), compute the *policy loss* and take a gradient step, *sync weights* back to the
inference engine, and decide what to *replay*. Each step is an **extension
point**: a few hooks below, implemented by one implementation per run,
chosen by name. :data:`grpo_core.contract.extension_points.EXTENSION_POINTS` is the
table of points (hooks, config key, default); **lifecycle hooks** are
observed by every registered plugin.

How implementations are found and built
---------------------------------------
An implementation is a class (or any factory) published under the entry
point group of its extension point::

    [project.entry-points."grpo.advantage_aggregation"]
    rank_sum = "my_pkg.ranking:RankSum"

A config chooses it with ``[plugins] advantage_aggregation = "rank_sum"``
(unset, the reference's own options decide: ``trl.use_vllm`` picks the
rollout, and so on). When two installed distributions publish the same name,
the name is ambiguous and refused, naming both; qualify it with the
distribution: ``"my-pkg:rank_sum"``. ``plugins.allow`` (or
``GRPO_PLUGINS_ALLOW``) restricts which distributions may load at all.

The core builds the implementation as ``factory(context)``, or as
``factory(context, settings)`` when it declares ``Settings`` (below), with
the :class:`~grpo_core.contract.context.RunContext` of the run, and registers the
result with pluggy, which checks every ``@hookimpl`` against the specs here.
The built-ins in ``plugins/`` are published the same way: the core cannot
tell them from a third-party package.

Two more groups exist:

* ``grpo.reward``: a named reward function (TRL calling convention), usable
  as ``reward_funcs = ["name"]``.
* ``grpo.plugins``: always-on plugins that observe lifecycle hooks, resolve
  reward specs (:func:`grpo_load_reward`) or add CLI commands. They may wrap
  an extension-point hook (``@hookimpl(wrapper=True)``, e.g. to time it)
  but must not implement one. A wrapper runs around the chosen
  implementation, sees the hook's arguments and returns its result
  (published as ``[project.entry-points."grpo.plugins"] sync_timer =
  "my_pkg.timing:SyncTimer"``)::

      import time

      from grpo_core.plugin_api import hookimpl


      class SyncTimer:  # always-on: print how long each weight sync took
          def __init__(self) -> None:
              self.seconds: list[float] = []

          @hookimpl(wrapper=True)
          def grpo_sync_weights(self, version):
              start = time.perf_counter()
              result = yield  # the chosen weight sync runs here
              self.seconds.append(time.perf_counter() - start)
              print(f"weights v{version} synced in {self.seconds[-1]:.2f}s")
              return result

  (an always-on plugin is built with no arguments; an implementation with
  the context).

What a plugin imports from grpo
-------------------------------
Everything, through one module: :mod:`grpo_core.plugin_api` (the hook
marker, the types below, :class:`~grpo_core.contract.context.RunContext`, the
errors, the config, and helpers several implementations share:
``make_scratch_dir``, ``merged_weights``, ``atomic_directory``, ...). Its
``__all__`` is the public surface; its names keep working when the modules
behind them move, and any other grpo_core module may change without notice.

Lifecycle hooks reach implementations too
-----------------------------------------
An extension-point implementation is registered with pluggy like any
plugin, so besides its own hooks it may implement any lifecycle hook
(:func:`grpo_train_start`, :func:`grpo_step_end`, :func:`grpo_train_end`)
and gets it like an always-on plugin does: a rollout starts its engine in
``grpo_train_start`` and stops it in ``grpo_train_end``; a weight sync
removes its files in ``grpo_train_end``. It must not implement the hooks of
another extension point.

What an implementation is built with
------------------------------------
``factory(context)``: the :class:`~grpo_core.contract.context.RunContext` (its
docstrings in ``grpo_core/contract/context.py`` say more) has these fields, all
read-only:

``config``
    The validated ``GRPOConfig``, defaults filled in.
``output_dir: Path``
    The run's output folder; keep your own files in a subfolder.
``tokenizer``
    The run's HF tokenizer, loaded before any implementation is built.
``get_model() -> model | None``
    The trainer's current (unwrapped) model; ``None`` until it is loaded
    (implementations are built first, so an engine can start meanwhile).
    Under FSDP/ZeRO-3, for a rollout that samples the trainer's model: rank
    0's full copy, holding the weights of the last sync; inside a call of a
    rollout that ``generates_on_every_rank``, the policy made whole on the
    calling process.
``log(line: str)``
    Print a line on the run's console.
``engine_requirements: frozenset[str]``
    The capabilities the chosen weight sync needs from the rollout's
    engine, so a rollout starts its engine accordingly.

Files outside ``output_dir`` (weights written for an engine to load,
sockets, caches) go in a scratch folder that a later run cleans up if this
process is killed before ``grpo_train_end``::

    from grpo_core.runtime.scratch import make_scratch_dir, remove_scratch_dir

    root: Path = make_scratch_dir("my-sync-", parent=None)  # a fresh 0700 <tmp>/my-sync-XXXX
    ...
    remove_scratch_dir(root)  # in grpo_train_end; idempotent

``make_scratch_dir(prefix: str, parent: str | os.PathLike | None = None) ->
Path`` first removes the folders of dead processes under the same prefix
(``parent=None``: the system temp folder).

One optimizer step, in order
----------------------------
1. The batch: :func:`grpo_replay_prompts`, :func:`grpo_rollout_generate`,
   the reward functions, :func:`grpo_aggregate_advantages`,
   :func:`grpo_replay_groups` (with ``async_prefetch`` this runs ahead, up
   to ``trl.prefetch_depth`` batches, in a background thread, so on weights
   from an earlier sync).
2. Per micro-batch: :func:`grpo_is_correction` and
   :func:`grpo_policy_loss`, then backward; then the optimizer step (the
   policy version goes up by one).
3. Every ``trl.vllm_sync_interval`` steps: :func:`grpo_sync_weights`, on
   rank 0, **before** :func:`grpo_step_end` of the same step (its time is
   that step's ``time/weight_sync``); the first sync runs once before the
   first rollout. The core verifies the sync (``verify_weight_sync``)
   when the engine declares ``SCORES_TOKENS``: right after it with a probe,
   or, where the engine's sampled log-probs can stand in for it, during the
   next step's micro-batches, before its optimizer step.
4. ``trl.sync_ref_model``'s reference update, then :func:`grpo_step_end`
   (rank 0 only) with the step's metrics, then logging, evaluation and the
   checkpoint of that step.

What the core reads from an implementation
------------------------------------------
Besides its hooks, the core reads only these class attributes, each
optional (defaults in the extension-point table):

``Settings`` (any implementation, any named reward function)
    A pydantic model. The ``[plugins.<name>]`` table of the config (or
    ``[plugins."dist:name"]``, for a name chosen qualified; not both) is
    validated with it (errors name ``plugins.<name>.<key>``, or
    ``[plugins.<name>]`` for a rule over the whole table) before anything
    heavy starts; the implementation is then built as
    ``factory(context, settings)``, and a reward function is called with the
    settings' fields as extra keyword arguments. Without ``Settings`` a
    ``[plugins.<name>]`` table is an error.
``engine_capabilities: frozenset[str]`` (rollout)
    What the inference engine this rollout owns can do
    (:data:`~grpo_core.contract.types.ENGINE_CAPABILITIES`); a rollout that samples the
    trainer's live model declares ``SAMPLES_TRAINER_MODEL`` (under FSDP and
    ZeRO-3, where no process holds the whole model, ``context.get_model()``
    on rank 0 alone is then rank 0's full copy, refreshed by every weight
    sync; see ``generates_on_every_rank`` for the other way), one whose
    engine lives in the trainer's process ``WEIGHTS_IN_MEMORY``. The checks
    read these, never the implementation's name.
``generates_on_every_rank: bool`` (rollout)
    ``True`` when a rollout that declares ``SAMPLES_TRAINER_MODEL`` may be
    built and called on every training process: with several processes (and
    no ``async_prefetch``) each generation call of rank 0 is then cut into
    contiguous shares of whole prompts, every process calls its own instance
    with its share (``sampling.prompt_offset`` says where the share starts
    in the whole call) and rank 0 gets the groups back in order. During the
    call ``context.get_model()`` is the trainer's policy made whole on that
    process (FSDP2 unsharded, ZeRO-3 gathered, a DDP replica as it is), so
    no process needs a full copy and none idles; the call must need no
    collective of its own and, seeded, must draw each completion's
    randomness from its place in the whole call only
    (:attr:`~grpo_core.contract.types.SamplingSettings.prompt_offset`), so a split
    call samples what one process would. Evaluation still samples on rank 0
    alone. ``False`` (the default): rank 0 alone generates.
``required_capabilities: frozenset[str]`` (weight_sync)
    What the sync needs from the rollout's engine. ``grpo config check``
    refuses a sync whose needs the chosen rollout does not declare.
``sends: str`` (weight_sync)
    What reaches the engine: ``"merged_weights"`` (the default: full
    weights, a LoRA merged in), ``"adapter"`` (the adapter alone; the
    engine keeps its base, so a quantised base works) or ``"nothing"`` (the
    rollout samples the trained model itself). The checks refuse a
    quantised base (``load_in_4bit``) with a sync that sends merged weights.
``uses_hidden_states: bool`` (policy_loss)
    ``True`` when the loss calls ``inputs.hidden_states`` (it fuses the LM
    head, as Liger's does) instead of ``inputs.logprobs``; refused under
    DeepSpeed, whose engine's forward that path does not go through.
``episodic: bool`` / ``provides_reward: bool`` (environment)
    ``episodic = False`` means "no episodes" (the built-in ``none``, the
    default without tools). ``provides_reward = True`` adds the
    ``environment`` reward function (the sum of the rewards its replies
    and ``final_reward`` give) to ``reward_funcs`` when the config does not
    list it; it may also be a static function ``provides_reward(config) ->
    bool`` (decide from the config alone: it runs in ``grpo config check``).
``names`` (environment)
    The names dataset rows choose this implementation by, in their
    ``environment`` column, when a run has several environments
    (``[plugins] environment = ["tools", "agent"]``): a static function
    ``names(config) -> list[str] | None`` (the ``tools`` environment gives
    the keys of a ``trl.environment_factory`` table); ``None``: the
    implementation's own name. The row reaches the implementation's
    :func:`grpo_environment_episode` as ``prompt.columns["environment"]``.
``runs_rollout_func: bool`` (rollout)
    ``True`` when the rollout calls ``trl.rollout_func`` itself (the
    built-in ``function``); otherwise, with ``trl.rollout_func`` set, the
    core calls the function and its ``trainer.generate`` samples through
    this rollout (:mod:`grpo_core.generation.user_rollout`).
``concurrent_generate: bool`` (rollout)
    ``True`` when :func:`grpo_rollout_generate` may run in several threads at
    once. Streaming scoring (``trl.streaming_partial_batch``) then keeps
    every chunk of a batch in flight and scores each as it lands; otherwise
    chunks are generated one after another.
``state_dict()`` / ``load_state_dict(state)`` (any implementation)
    State that must survive a resume
    (:class:`~grpo_core.contract.types.Checkpointable`): plain JSON data, saved with
    every checkpoint.

When a hook fails
-----------------
Raise a :class:`grpo_core.contract.errors.GrpoError` subclass for a problem the user
can fix (its message is shown as is; ``EngineUnavailable`` when the engine
is unreachable after your own retries). Any other exception is reported as
one error naming the hook, the implementation and its distribution, with
the traceback in ``output_dir/grpo-error.log``; inside the training loop a
checkpoint is saved first.

Trackers
--------
``grpo.tracker``: experiment trackers chosen by ``report_to`` (a list, or
``"none"``; ``"all"`` is every installed one). Not pluggy hooks: each entry
is a ``factory(context)`` returning an object that satisfies
:class:`grpo_core.contract.types.Tracker` (``log(metrics, step)``,
``log_table(name, rows, step)``, ``close()``). A factory whose library is
missing raises :class:`grpo_core.observability.tracking.MissingTrackerLibrary`. Names
resolve like implementations (``"my-pkg:name"`` when ambiguous;
``plugins.allow`` applies). ``metrics.jsonl`` is always written, whatever
``report_to`` says.

Writing a hook
--------------
Use :data:`grpo_core.hookimpl`; a hook may accept any subset of the arguments
its spec lists (pluggy passes by name), so new arguments can be added to a
spec without breaking plugins. Extension-point hooks are ``firstresult``: the
chosen implementation's return value is the result.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:  # imported for annotations only: keep plugin import cheap
    import torch

    from grpo_core.contract.context import RunContext
    from grpo_core.contract.types import (
        Episode,
        InferenceEngine,
        PolicyLossInputs,
        Prompt,
        RewardFunction,
        RolloutGroup,
        SamplingSettings,
        ScoredGroup,
        SyncResult,
        TrainingProgress,
    )

PROJECT = "grpo"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

# --------------------------------------------------------------------------
# rollout: prompts -> completions
# --------------------------------------------------------------------------


@hookspec(firstresult=True)
def grpo_rollout_generate(
    prompts: list[Prompt], num_generations: int, sampling: SamplingSettings, policy_version: int
) -> list[RolloutGroup]:
    """Sample ``num_generations`` completions for each prompt.

    Return one :class:`RolloutGroup` per prompt, in the order given, each with
    exactly ``num_generations`` completions. Work from ``prompt.prompt_ids``
    (already templated and tokenised); return token ids, the decoded text,
    the sampler's per-token log-probs when the engine has them (needed for
    importance-sampling correction) and whether the completion was truncated
    at ``sampling.max_tokens``. Stamp every group with ``policy_version``.

    With ``sampling.seed`` set, sampling is reproducible from it, and still
    every completion of the call draws from a random stream of its own:
    prompts of one call never share a seed (an engine that seeds whole
    requests, as vLLM does, needs one request or one seed per prompt). The
    episode driver sends each episode's next turn as a prompt of its own;
    shared streams would make the episodes of a group near copies. A rollout
    that ``generates_on_every_rank`` gets a share of a larger call:
    ``sampling.prompt_offset`` is where its first prompt stands in it, and
    seeding each completion from (seed, offset + prompt index, generation
    index) makes the split sample what one process would.

    May be called from a background thread when ``async_prefetch`` is on; it
    must not touch the trainer's model then (use the inference engine).
    Raise :class:`grpo_core.contract.errors.EngineUnavailable` when the engine cannot
    be reached after the implementation's own retries: the trainer then saves
    a checkpoint and stops cleanly. Declare ``concurrent_generate = True``
    only if several calls may safely run at once.
    """


@hookspec(firstresult=True)
def grpo_inference_engine() -> InferenceEngine | None:
    """The inference engine this rollout owns, for the weight sync.

    Implemented by a rollout that samples from an engine of its own; called
    once after the rollout is built. The handle
    (:class:`~grpo_core.contract.types.InferenceEngine`) is what the chosen weight
    sync receives as ``engine``. A rollout that samples the trainer's model
    (no engine) does not implement it.
    """


# --------------------------------------------------------------------------
# environment: multi-turn episodes driven through the rollout's engine
# --------------------------------------------------------------------------


@hookspec(firstresult=True)
def grpo_environment_episode(prompt: Prompt, sample: int) -> Episode | None:
    """A new, independent :class:`~grpo_core.contract.types.Episode` for sample
    ``sample`` (``0 .. num_generations - 1``) of ``prompt``.

    Chosen by ``[plugins] environment = "name"`` (settings in
    ``[plugins.<name>]``); ``trl.tools`` / ``trl.environment_factory`` pick
    the built-in ``tools`` environment. The core drives every episode
    through the run's rollout, turn by turn, token ids in and token ids
    out: each turn is one :func:`grpo_rollout_generate` call (episodes in
    flight batched together) on the exact ids of the episode so far, so the
    managed or external server, a server pool, colocated vLLM and the
    transformers rollout all run episodes unchanged. The environment's
    messages are rendered by the chat template and enter the completion
    with loss mask 0 (:class:`~grpo_core.contract.types.Completion`), so the policy
    is trained only on the tokens it sampled.

    ``prompt.columns`` is the dataset row (TRL's ``reset(**row)``). Called
    from the rollout's thread (a background thread with ``async_prefetch``).
    Rewards the episode reports reach the reward function named
    ``environment`` (added to ``reward_funcs`` when the implementation
    declares ``provides_reward = True``). An implementation that declares
    ``episodic = False`` (the built-in ``none``) turns episodes off: the
    run is single-turn.

    An episode may instead drive the model itself
    (:class:`~grpo_core.contract.types.DrivenEpisode`: ``drive(model)``, the
    built-in ``agent`` environment's, whose agents call an OpenAI-compatible
    endpoint): the core then hands it an
    :class:`~grpo_core.contract.types.EpisodeModel` whose every ``generate``
    is one rollout call on the episode's exact ids, batched with the other
    episodes' turns, and trains the chain of its last turn. With several
    environments in one run (``[plugins] environment`` as a list) the core
    calls the implementation each row names (its ``environment`` column;
    the ``names`` attribute above).
    """


# --------------------------------------------------------------------------
# reward: completions + dataset columns -> one float (or None) each
# --------------------------------------------------------------------------


@hookspec(firstresult=True)
def grpo_load_reward(spec: str, context: RunContext) -> RewardFunction | None:
    """Turn one ``trl.reward_funcs`` entry into a callable, or return ``None``
    if this plugin does not understand ``spec``.

    Names published under the ``grpo.reward`` entry point group are resolved
    by the core before this hook is asked; this hook handles everything else
    (``module.function`` import paths, reward-model paths, URLs, ...). The
    returned callable follows TRL's convention: it is called as
    ``f(prompts=..., completions=..., completion_ids=..., **columns)`` and
    returns one ``float`` or ``None`` per completion; a coroutine function is
    awaited (several run concurrently).
    """


# --------------------------------------------------------------------------
# advantage_aggregation: per-function rewards -> one advantage per completion
# --------------------------------------------------------------------------


@hookspec(firstresult=True)
def grpo_aggregate_advantages(
    rewards: torch.Tensor, weights: torch.Tensor, group_size: int, scale_rewards: str
) -> torch.Tensor:
    """Combine rewards into group-relative advantages.

    ``rewards`` is ``[num_completions, num_functions]`` float, ``NaN`` where a
    function returned ``None``; rows are ordered group by group, each group
    ``group_size`` consecutive rows. ``weights`` is ``[num_functions]``.
    ``scale_rewards`` is ``"group"``, ``"batch"`` or ``"none"``: divide by the
    group's standard deviation, the batch's, or not at all.

    Return ``[num_completions]`` advantages without ``NaN``; a row where every
    reward is ``NaN`` gets 0.
    """


# --------------------------------------------------------------------------
# is_correction: trainer vs sampler log-probs -> per-token weights and mask
# --------------------------------------------------------------------------


@hookspec(firstresult=True)
def grpo_is_correction(
    trainer_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Correct for completions sampled by a stale or different policy.

    All tensors are ``[batch, completion_len]``: the trainer's log-probs of
    the sampled tokens under the policy that generated the batch (no grad;
    the old log-probs when ``num_iterations > 1``), the sampler's (inference
    engine's) log-probs of the same tokens (``NaN`` where the engine gave
    none), and the 0/1 completion mask (0 on padding and on an episode's
    environment tokens, where the sampler's values mean nothing: a weight
    there must not depend on them, and a sequence-level ratio runs over the
    mask-1 tokens only).

    Return ``(weights, mask, metrics)``:

    * ``weights``: per-token multipliers of the policy-gradient term, the
      ratio ``pi_trainer / pi_sampler`` (i.e. ``exp(trainer_logps -
      sampler_logps)``), capped or zeroed as the implementation decides. A
      token you want dropped gets weight 0 here.
    * ``mask``: the completion mask the loss normalises by (count of tokens).
      Return it unchanged unless you mean to change the loss's denominator;
      the built-ins never narrow it (as in TRL).
    * ``metrics``: scalars logged as ``is/<key>``, averaged over the step's
      micro-batches. They are the only ``is/*`` metrics: the core adds none
      of its own, so report the ones users look for (the built-ins log
      ``sampling_logp_difference/mean`` and ``/max``, ``ratio/mean``, ...).

    Replayed rows of ``trl.replay_recompute_logps`` get weight 1 afterwards,
    whatever this hook returned for them.

    Which implementation runs: ``[plugins] is_correction = "name"`` when set,
    whatever ``trl.vllm_importance_sampling_correction`` says (``grpo config
    check`` warns when that flag is also set to ``false``); otherwise the
    built-in named by ``trl.vllm_importance_sampling_mode`` when the flag is
    true (its default is ``trl.use_vllm``), and ``none`` when it is false.
    ``trl.vllm_importance_sampling_cap`` is the built-ins' bound; read it
    from ``context.config.trl`` if yours has one.
    """


# --------------------------------------------------------------------------
# weight_sync: trained weights -> inference engine
# --------------------------------------------------------------------------


@hookspec(firstresult=True)
def grpo_sync_weights(model: Any, version: int, engine: InferenceEngine | None) -> SyncResult:
    """Make the inference engine sample from ``model``'s current weights.

    ``model`` is the trainer's (unwrapped) model: a PEFT model when an
    adapter is trained. ``version`` is the new policy version: the core
    stamps every rollout requested after this call returns with it.
    ``engine`` is the rollout's engine handle
    (:func:`grpo_inference_engine`), ``None`` when the rollout samples the
    trainer's model; use only the capabilities you declared in
    ``required_capabilities``.

    Called every ``trl.vllm_sync_interval`` optimizer steps, and once before
    the first rollout so the engine starts from this run's own weights
    (whatever an earlier experiment left on it). May run while a prefetch
    thread generates. After an engine restart the engine re-applies your
    last ``load_*`` call by itself: keep the files (or the URL) it read
    until your next sync replaces them, and delete them when a newer version
    is loaded. The engine may stand for several servers: one ``load_*``
    call reaches all of them before it returns (see
    :class:`~grpo_core.contract.types.InferenceEngine`), so call it once. A sync for
    servers that share no filesystem with the trainer declares
    ``WEIGHTS_FROM_URL`` (merged weights) or ``ADAPTER_FROM_URL`` (a LoRA
    adapter) and serves the weights itself (the built-in ``full_http`` and
    ``lora_http`` do). Return what was done and how long it took
    (:class:`~grpo_core.contract.types.SyncResult`); the trainer does not log it
    today: the step's ``time/weight_sync`` metric times the whole call, and
    a ``wrapper=True`` plugin (above) can read the result.

    The weights to send, for any engine: :func:`grpo_core.modeling.engine_weights.merged_weights`
    (every weight for full fine-tuning; for a LoRA only the adapted modules,
    as ``W + delta``, with the base never touched), or the adapter itself:
    :func:`~grpo_core.modeling.engine_weights.save_adapter` writes it as engines load
    one, :func:`~grpo_core.modeling.engine_weights.adapter_body` packs it for
    ``load_adapter_from_url``.

    **Verified.** When the engine declares
    :data:`~grpo_core.contract.types.SCORES_TOKENS` (the built-in vLLM engines do),
    the core checks that the engine serves ``model``'s weights: each
    server scores a fixed probe of a few dozen token ids
    (:meth:`~grpo_core.contract.types.InferenceEngine.score_tokens`) and its
    log-probs must match the trainer's within what the two precisions
    explain, right after this returns, or the engine's log-probs of the
    tokens it then samples are compared with the next step's training
    forward (:mod:`grpo_core.sync.verify`; config
    ``verify_weight_sync``). A sync that returned without the engine
    serving the new weights is called once more with the same arguments
    (so it must be safe to repeat), checked again, and then the run stops
    with a checkpoint and :class:`~grpo_core.contract.errors.WeightSyncUnverified`
    naming the engine, the version and the gap. Return only once the
    engine serves the new weights.

    Runs before :func:`grpo_step_end` of the step it follows (see "One
    optimizer step, in order" above). Write files in a
    :func:`grpo_core.runtime.scratch.make_scratch_dir` folder (signature above) and
    remove it in :func:`grpo_train_end`.
    """


# --------------------------------------------------------------------------
# policy_loss: one micro-batch -> the loss to back-propagate
# --------------------------------------------------------------------------


@hookspec(firstresult=True)
def grpo_policy_loss(inputs: PolicyLossInputs) -> tuple[torch.Tensor, dict[str, float]]:
    """The GRPO loss of one micro-batch and its metrics.

    Run the policy through ``inputs.logprobs`` or ``inputs.hidden_states``
    (:class:`~grpo_core.contract.types.PolicyLossInputs`), apply ``inputs.is_weights``,
    and return a scalar scaled so that summing the gradients of
    ``inputs.accumulation_steps`` micro-batches gives one optimizer step's
    (the core calls ``backward`` on it). Metrics are logged averaged over the
    step's micro-batches; the built-in ``grpo`` implementation
    (:func:`grpo_core.optimization.loss.policy_loss`) logs ``entropy``, ``kl`` and the
    ``clip_ratio/*`` family, and another should log those it can.

    Which completions reach it: with ``trl.skip_zero_advantage_batches``
    (the default) and a token-sum ``loss_type`` (``dapo``, ``cispo``), no
    ``beta`` and no ``top_entropy_quantile``, the core leaves completions
    whose advantage is 0 out of the micro-batches
    (:func:`grpo_core.optimization.loss.zero_advantage_rows_are_inert`):
    ``num_items_in_batch`` still counts their tokens, so a loss that sums
    per-token terms weighted by the advantage is unchanged. An
    implementation whose value depends on which other completions share its
    micro-batch (a statistic over the batch) should say so in its docs and
    ask for ``skip_zero_advantage_batches = false``.
    """


# --------------------------------------------------------------------------
# replay: which groups to keep, replace and re-inject
# --------------------------------------------------------------------------


@hookspec(firstresult=True)
def grpo_replay_prompts(prompts: list[Prompt], progress: TrainingProgress) -> list[Prompt]:
    """Before generation: return the prompts to sample, same length.

    Lets an implementation swap in prompts deferred earlier (deferred
    re-rolling of prompts the model could not yet solve).
    """


@hookspec(firstresult=True)
def grpo_replay_groups(groups: list[ScoredGroup], progress: TrainingProgress) -> list[ScoredGroup]:
    """After scoring: return the groups to train on, same length.

    Sees every scored group, so it can remember groups with signal (a replay
    buffer), replace groups without signal by remembered ones (mark them
    ``replayed=True``), and note prompts to re-roll later.
    """


# --------------------------------------------------------------------------
# lifecycle: observed by every registered plugin
# --------------------------------------------------------------------------


@hookspec
def grpo_validate_config(config: Any) -> list[str] | None:
    """Check the loaded config before anything heavy happens.

    Asked of every always-on plugin and of each implementation the config
    chooses (a static method or class method, since nothing is built yet:
    ``grpo config check`` calls it on the class). Raise
    :class:`grpo_core.contract.errors.ConfigError` for a config that cannot run;
    return warnings (strings) for one that can but probably should not.
    """


@hookspec
def grpo_train_start(context: RunContext) -> None:
    """The model, data and engines are ready; the first rollout is next. An
    engine that starts lazily starts here. Python's automatic garbage
    collection is still off and the heap frozen (start-up makes almost no
    garbage, and each full collection would rescan every module and the
    model: :mod:`grpo_core.runtime.collector`); what an implementation
    creates here is frozen with the rest once every implementation returns."""


@hookspec
def grpo_step_end(progress: TrainingProgress, metrics: dict[str, float]) -> None:
    """An optimizer step finished. ``metrics`` may be extended in place; it is
    logged after every plugin has seen it."""


@hookspec
def grpo_train_end(context: RunContext, status: str) -> None:
    """Training ended: ``status`` is ``"completed"``, ``"interrupted"`` or
    ``"failed"``. Release engines and processes, and remove temporary files,
    here. A process killed outright never gets this call: keep temporary
    folders outside ``output_dir`` in :func:`grpo_core.runtime.scratch.make_scratch_dir`
    folders, which the next run removes when their owner has died."""


@hookspec
def grpo_register_commands(app: Any) -> None:
    """Add sub-commands to the ``grpo`` command line (a ``typer.Typer``).

    Called once when the CLI starts, on always-on plugins only. Keep the
    module that implements it cheap to import: load engines inside the
    command, not at import time, so ``grpo --help`` stays fast and a missing
    optional engine never breaks unrelated commands.
    """
