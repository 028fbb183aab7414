"""``grpo run --num-processes N``: start N training processes with accelerate's launcher.

It runs ``accelerate launch`` (torch's elastic launcher underneath) on this
same command, so the N processes are exactly those ``accelerate launch -m
grpo_core.cli run CONFIG`` or ``torchrun -m grpo_core.cli run CONFIG``
would start: nothing here connects processes itself. Machines beyond one
are the launchers' own options (``--num_machines``/``--machine_rank``/
``--main_process_ip`` or torchrun's ``--nnodes``/``--rdzv_endpoint``),
documented in the README's "Scaling out".
"""

from __future__ import annotations

import os
import subprocess
import sys

from grpo_core.errors import ConfigError


def launcher_command(num_processes: int, grpo_args: list[str], cuda: bool) -> list[str]:
    """The ``accelerate launch`` command line for ``grpo <grpo_args>`` on N local processes.

    ``--multi_gpu`` selects torch's elastic launcher for N processes; on a
    machine without GPUs the processes join over gloo (grpo asks accelerate
    for its CPU mode there). Port 0: a free port, so runs side by side do
    not collide."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(num_processes),
           "--num_machines", "1", "--main_process_port", "0", "--mixed_precision", "no", "--dynamo_backend", "no"]  # fmt: skip
    if not cuda:
        cmd += ["--num_cpu_threads_per_process", str(max(1, (os.cpu_count() or 1) // num_processes))]
    return [*cmd, "-m", "grpo_core.cli", *grpo_args]


def launch(num_processes: int, grpo_args: list[str]) -> int:
    """Run ``grpo <grpo_args>`` (without ``--num-processes``) as
    ``num_processes`` processes and return their exit code; -1 when this
    process is already one of them (started by a launcher)."""
    from grpo_core.training.distributed import launched_by_launcher, world_size

    if num_processes < 1:
        raise ConfigError(f"--num-processes {num_processes}: give 1 or more processes.")
    if launched_by_launcher():
        if num_processes != world_size():
            raise ConfigError(
                f"--num-processes {num_processes}, but this process was started by a launcher with "
                f"{world_size()} processes: drop --num-processes when using accelerate launch / torchrun."
            )
        return -1  # already one of the N: train here
    import torch

    command = launcher_command(num_processes, grpo_args, torch.cuda.is_available())
    return subprocess.call(command)
