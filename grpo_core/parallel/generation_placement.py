"""Where a run generates: on every training process, or on rank 0 alone.

Decided once, before any implementation is built (the other ranks must know
whether to build the rollout), from what the chosen rollout's class declares
and what the training backend can do; the config summary says the same. The
mechanism is :mod:`grpo_core.generation.spread`.
"""

from __future__ import annotations

from grpo_core.config.schema import GRPOConfig
from grpo_core.contract.extension_points import (
    BY_NAME,
    chosen_implementations,
    declared,
)
from grpo_core.contract.types import SAMPLES_TRAINER_MODEL
from grpo_core.host.plugin_host import PluginHost
from grpo_core.parallel import backend_for


def _rollout_spreads(cfg: GRPOConfig, host: PluginHost) -> bool:
    """The chosen rollout samples the trainer's model and may run on every rank (its class, not built)."""
    _, rollout = host.implementation_class("rollout", chosen_implementations(cfg)["rollout"])
    point = BY_NAME["rollout"]
    return SAMPLES_TRAINER_MODEL in declared(rollout, point, "engine_capabilities") and bool(
        declared(rollout, point, "generates_on_every_rank")
    )


def generation_spreads(cfg: GRPOConfig, host: PluginHost, world: int) -> bool:
    """Whether every training process generates a share of each call: several
    processes, a rollout that samples the trainer's model and declares
    ``generates_on_every_rank``, a backend that can make the policy whole on
    every rank for a call, and no ``async_prefetch`` (its producer thread
    must issue no collective: rank 0 then generates alone, as before)."""
    if world < 2 or cfg.trl.async_prefetch or not backend_for(cfg, world).gathers_for_generation(cfg):
        return False
    return _rollout_spreads(cfg, host)


def where_generation_runs(cfg: GRPOConfig, host: PluginHost, world: int) -> str:
    """For the config summary: which processes generate, and why not all when they could."""
    if world < 2:
        return "the one process"
    if generation_spreads(cfg, host, world):
        return (
            "every process, each its share of each call's prompts (the policy made whole on each for the call); "
            "rank 0 scores and scatters, and samples evaluations alone"
        )
    if _rollout_spreads(cfg, host):
        why = (
            "trl.async_prefetch: its producer thread issues no collectives"
            if cfg.trl.async_prefetch
            else f"{backend_for(cfg, world).describe(cfg, world)} cannot make the policy whole on every rank for a call"
        )
        return f"rank 0 alone, with its full copy of the policy ({why})"
    return "rank 0 alone (the rollout samples for every process)"
