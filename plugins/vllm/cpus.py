"""Which CPU cores a managed vLLM server computes on, and which the trainer keeps.

With ``trl.async_prefetch`` the engine generates the next batch while the
trainer runs forward/backward on this one. On a CPU both are compute-bound
OpenMP programs: left alone, vLLM pins its engine to the cores it picks and
the trainer's threads run on every core, so the two fight over the engine's
cores. Giving each its own cores (vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` for
the engine, the engine handle's ``cpu_cores`` for the trainer) lets both run
at once; benchmarks/RESULTS.md measures when that beats taking turns on all
cores (a synchronous run, where neither side needs a split).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from grpo_core.plugin_api import ConfigError, format_cpu_list
from grpo_plugins.vllm.settings import vllm_settings

if TYPE_CHECKING:
    from grpo_core.plugin_api import GRPOConfig

NO_SPLIT = "all"


def parse_cpu_list(text: str) -> list[int]:
    """``"0-3,6"`` -> ``[0, 1, 2, 3, 6]`` (vLLM's and taskset's syntax)."""
    cores: list[int] = []
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        first, dash, last = part.partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(part)
        start, stop = int(first), int(last or first)
        if stop < start:
            raise ValueError(part)
        cores.extend(range(start, stop + 1))
    if not cores:
        raise ValueError(text)
    return sorted(set(cores))


@dataclass(frozen=True)
class CpuSplit:
    engine: frozenset[int]
    trainer: frozenset[int]


def plan_cpu_split(cfg: GRPOConfig, usable: frozenset[int], cuda: bool) -> CpuSplit | None:
    """The split for a managed server on a CPU machine, or ``None`` (no split).

    ``[vllm] engine_cpus`` names the engine's cores; unset, a run with
    ``async_prefetch`` gives the engine the first half of ``usable`` (at least
    one core each) and a synchronous run splits nothing: there each side waits
    while the other computes, so each is better off with every core.
    ``"all"`` turns the split off."""
    wanted = vllm_settings(cfg).engine_cpus
    if cuda or wanted == NO_SPLIT:
        return None
    if wanted is None:
        if not cfg.trl.async_prefetch or len(usable) < 2:
            return None
        ordered = sorted(usable)
        engine = frozenset(ordered[: len(ordered) // 2])
        return CpuSplit(engine, usable - engine)
    try:
        engine = frozenset(parse_cpu_list(wanted))
    except ValueError:
        raise ConfigError(
            f"vllm.engine_cpus = {wanted!r}: give CPU core ids like '0-3' or '0,2' (or 'all' for no split)."
        ) from None
    if not engine <= usable:
        raise ConfigError(
            f"vllm.engine_cpus = {wanted!r} names cores this process cannot use ({format_cpu_list(engine - usable)}); "
            f"usable here: {format_cpu_list(usable)}."
        )
    if engine == usable:
        raise ConfigError(
            f"vllm.engine_cpus = {wanted!r} leaves the trainer no core: name fewer cores, or 'all' for no split."
        )
    return CpuSplit(engine, usable - engine)
