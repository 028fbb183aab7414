"""Which GPUs each vLLM server and the trainer use (``[vllm] devices``,
``trainer_devices``, ``data_parallel_size``), and the refusals for a
placement that cannot fit."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from grpo_core.plugin_api import ConfigError, gpu_count_source, visible_gpus
from grpo_plugins.vllm.settings import vllm_settings

if TYPE_CHECKING:
    from grpo_core.plugin_api import GRPOConfig

TRAINER_SHARE_MAX = 0.5
"""A GPU the trainer shares with vLLM may give vLLM at most this fraction of
its memory (``gpu_memory_utilization``): the trainer needs the rest for the
model, its gradients, optimizer state and activations."""
SERVERS_SHARE_MAX = 0.95
"""Servers sharing a GPU may claim at most this much of it together (the
CUDA context and fragmentation need the rest)."""


def placement(cfg: GRPOConfig) -> list[list[int]] | None:
    """The GPU indices of each managed server (``[vllm] devices`` cut into
    ``tensor_parallel_size`` pieces, one per server), or ``None`` when
    ``devices`` is unset."""
    v = vllm_settings(cfg)
    if v.devices is None:
        return None
    per = v.tensor_parallel_size
    return [list(v.devices[i * per : (i + 1) * per]) for i in range(v.data_parallel_size)]


def local_processes(num_processes: int) -> int:
    """Training processes on this machine: a launcher's ``LOCAL_WORLD_SIZE``
    (several machines), else ``num_processes`` (``grpo run --num-processes``
    starts them all here)."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    return int(local) if local.isdigit() and int(local) > 0 else max(1, num_processes)


def trainer_gpus(cfg: GRPOConfig, processes: int) -> list[int]:
    """The GPUs the training processes of this machine use: ``[vllm]
    trainer_devices`` for one process, else one per process by local rank
    (accelerate's placement: process i on GPU i of those visible)."""
    if vllm_settings(cfg).trainer_devices is not None and processes == 1:
        return list(vllm_settings(cfg).trainer_devices)
    return list(range(processes))


def missing_gpu_problems(cfg: GRPOConfig, processes: int, gpus: int) -> list[str]:
    """GPU indices of ``[vllm] devices`` / ``trainer_devices`` that this
    machine's ``gpus`` visible GPUs do not have. (The training processes'
    own GPUs, one per local rank, are the core's check: they need no vLLM.)"""
    v = vllm_settings(cfg)
    out = []
    wanted = [("[vllm] devices", v.devices or [])]
    if processes == 1:
        wanted.append(("[vllm] trainer_devices", v.trainer_devices or []))
    for key, indices in wanted:
        missing = sorted({i for i in indices if i >= gpus})
        if missing:
            out.append(
                f"{key} asks for GPU {', '.join(map(str, missing))}, but the machine shows {gpus} GPU"
                f"{'s' if gpus != 1 else ''} (indices 0-{gpus - 1}; {gpu_count_source()}). Use indices below "
                f"{gpus} (`grpo run` checks them again on the machine it runs on)."
            )
    return out


def unchecked_gpus_note(cfg: GRPOConfig, gpus: int | None = None) -> str | None:
    """A warning that ``[vllm] devices`` / ``trainer_devices`` were not
    checked against real GPUs because this machine shows none; ``None``
    when they were (or nothing is placed)."""
    v = vllm_settings(cfg)
    if v.devices is None and v.trainer_devices is None:
        return None
    if (visible_gpus() if gpus is None else gpus) > 0:
        return None
    return (
        f"[vllm] devices / trainer_devices were not checked against real GPUs: this machine shows none "
        f"({gpu_count_source()}). Only how they fit together was checked; `grpo run` on the GPU machine checks "
        "that each index exists there."
    )


def placement_problems(cfg: GRPOConfig, num_processes: int = 1, gpus: int | None = None) -> list[str]:
    """Why ``[vllm] devices`` / ``trainer_devices`` would not fit beside
    ``num_processes`` training processes (each message names the keys and
    the fix); empty when they do. ``gpus``: the GPUs this machine shows
    (default: ``visible_gpus()``); an index past them is refused,
    and on a machine with none that is not checked (:func:`unchecked_gpus_note`)."""
    v = vllm_settings(cfg)
    problems: list[str] = []
    processes = local_processes(num_processes)
    if v.devices is None and v.trainer_devices is None:
        return problems
    if v.trainer_devices is not None and processes > 1:
        problems.append(
            f"[vllm] trainer_devices narrows the GPUs of one training process, but this run has {processes}: each "
            f"trains on the GPU of its local rank (GPUs 0-{processes - 1} of those visible). Remove trainer_devices "
            f"and give the servers GPUs after them (e.g. devices = [{processes}]), or start the run with "
            "CUDA_VISIBLE_DEVICES listing the trainers' GPUs first."
        )
        return problems
    if any(d < 0 for d in (v.devices or []) + (v.trainer_devices or [])):
        problems.append("[vllm] devices and trainer_devices are GPU indices (0, 1, ...); negative ones mean nothing.")
    if v.trainer_devices is not None and (
        not v.trainer_devices or len(set(v.trainer_devices)) != len(v.trainer_devices)
    ):
        problems.append("[vllm] trainer_devices must list at least one GPU, each once.")
    if v.trainer_devices is not None and v.devices is None:
        problems.append(
            "[vllm] trainer_devices is set without [vllm] devices: set devices too (the GPUs the managed servers get), "
            "so the servers are not left on the trainer's GPUs."
        )
    servers = placement(cfg) or []
    if v.devices is not None:
        need = v.data_parallel_size * v.tensor_parallel_size
        if len(v.devices) != need:
            problems.append(
                f"[vllm] devices lists {len(v.devices)} GPU(s), but data_parallel_size x tensor_parallel_size = "
                f"{v.data_parallel_size} x {v.tensor_parallel_size} = {need} are needed (server i takes the i-th "
                f"{v.tensor_parallel_size}); list exactly {need}."
            )
            return problems
        for i, own in enumerate(servers):
            if len(set(own)) != len(own):
                problems.append(
                    f"[vllm] devices gives server {i} the GPUs {own}: tensor parallelism needs distinct GPUs."
                )
    claims: dict[int, float] = {}
    for own in servers:
        for device in own:
            claims[device] = claims.get(device, 0.0) + v.gpu_memory_utilization
    for device, claimed in sorted(claims.items()):
        if claimed > SERVERS_SHARE_MAX:
            problems.append(
                f"[vllm] devices puts {round(claimed / v.gpu_memory_utilization)} servers on GPU {device}, "
                f"claiming {claimed:.0%} of its memory together (gpu_memory_utilization = {v.gpu_memory_utilization}): "
                f"give each server its own GPU, or lower [vllm] gpu_memory_utilization to at most "
                f"{SERVERS_SHARE_MAX / round(claimed / v.gpu_memory_utilization):.2f}."
            )
    trainer = trainer_gpus(cfg, processes)
    shared = sorted(set(trainer) & set(claims))
    if shared and v.devices is not None:
        worst = max(claims[d] for d in shared)
        if worst > TRAINER_SHARE_MAX:
            if v.trainer_devices is not None:
                whose = "[vllm] trainer_devices"
            elif processes > 1:
                whose = f"the {processes} training processes (GPUs 0-{processes - 1}, one per local rank)"
            else:
                whose = "the trainer's default GPU (index 0; set [vllm] trainer_devices)"
            example = f"devices = [{processes}]" if processes > 1 else "devices = [0], trainer_devices = [1]"
            problems.append(
                f"[vllm] devices and {whose} share GPU {', '.join(map(str, shared))}, where vLLM would claim "
                f"{worst:.0%} of the memory (gpu_memory_utilization = {v.gpu_memory_utilization}) and the trainer "
                f"would run out. Give them different GPUs (e.g. {example}), or lower "
                f"[vllm] gpu_memory_utilization to at most {TRAINER_SHARE_MAX} to share one."
            )
    gpus = visible_gpus() if gpus is None else gpus
    if gpus > 0 and not problems:
        problems += missing_gpu_problems(cfg, processes, gpus)
    return problems


def physical_devices(indices: list[int], visible: str | None = None) -> str:
    """``CUDA_VISIBLE_DEVICES`` for ``indices`` counted among the GPUs this
    process sees: with ``CUDA_VISIBLE_DEVICES=2,3`` set, index 0 is GPU 2.
    ``visible``: that variable's value (unset: this process's)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    seen = [d.strip() for d in visible.split(",") if d.strip()] if visible else None
    out = []
    for i in indices:
        if seen is None:
            out.append(str(i))
        elif i < len(seen):
            out.append(seen[i])
        else:
            raise ConfigError(
                f"[vllm] device index {i}, but CUDA_VISIBLE_DEVICES={visible} shows only {len(seen)} GPU(s)."
            )
    return ",".join(out)


def server_devices(cfg: GRPOConfig, replica: int | None) -> str | None:
    """``CUDA_VISIBLE_DEVICES`` of a server (replica ``replica``, or the one
    server when ``None``), or ``None`` when ``[vllm] devices`` is unset."""
    servers = placement(cfg)
    if servers is None:
        return None
    own = [d for s in servers for d in s] if replica is None else servers[replica]
    return physical_devices(own)


def narrow_trainer_devices(cfg: GRPOConfig) -> str | None:
    """Make this (trainer) process see only ``[vllm] trainer_devices``,
    before CUDA starts; returns the new ``CUDA_VISIBLE_DEVICES`` (``None``
    when unset). Server environments are computed before this, from the
    devices the process saw at start."""
    wanted = vllm_settings(cfg).trainer_devices
    if wanted is None:
        return None
    value = physical_devices(wanted)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized() and os.environ.get("CUDA_VISIBLE_DEVICES") != value:
        raise ConfigError(
            "[vllm] trainer_devices can only narrow the GPUs before CUDA starts, and it has started in this process; "
            f"set CUDA_VISIBLE_DEVICES={value} in the environment of the trainer instead."
        )
    os.environ["CUDA_VISIBLE_DEVICES"] = value
    return value
