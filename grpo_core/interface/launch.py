"""``grpo run --num-processes N``: start N training processes with accelerate's launcher.

It runs ``accelerate launch`` (torch's elastic launcher underneath) on this
same command, so the N processes are exactly those ``accelerate launch -m
grpo_core.interface.cli run CONFIG`` or ``torchrun -m grpo_core.interface.cli run CONFIG``
would start: nothing here connects processes itself. The launcher runs
through this module's ``__main__`` (:func:`quiet_launcher`), which calls
accelerate's own ``launch_command`` but turns a child's failure into its
exit code instead of elastic's ``ChildFailedError`` dump: the child has
already printed its one-line error. Machines beyond one
are the launchers' own options (``--num_machines``/``--machine_rank``/
``--main_process_ip`` or torchrun's ``--nnodes``/``--rdzv_endpoint``),
documented in docs/multi-gpu.md.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from typing import TYPE_CHECKING

from grpo_core.contract.errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

#: Set for the launched processes when the parent has already checked the
#: config and printed its warnings (so N processes do not print them N times).
CHECKED_ENV = "GRPO_CONFIG_CHECKED_BY_LAUNCHER"


def launcher_command(num_processes: int, grpo_args: list[str], cuda: bool) -> list[str]:
    """The ``accelerate launch`` command line for ``grpo <grpo_args>`` on N local processes.

    ``--multi_gpu`` selects torch's elastic launcher for N processes; on a
    machine without GPUs the processes join over gloo (grpo asks accelerate
    for its CPU mode there). Port 0: a free port, so runs side by side do
    not collide."""
    cmd = [
        sys.executable,
        "-m",
        "grpo_core.interface.launch",
        "--multi_gpu",
        "--num_processes",
        str(num_processes),
        "--num_machines",
        "1",
        "--main_process_port",
        "0",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
    ]
    if not cuda:
        cmd += ["--num_cpu_threads_per_process", str(max(1, (os.cpu_count() or 1) // num_processes))]
    return [*cmd, "-m", "grpo_core.interface.cli", *grpo_args]


def launch(num_processes: int, grpo_args: list[str]) -> int:
    """Run ``grpo <grpo_args>`` (without ``--num-processes``) as
    ``num_processes`` processes and return their exit code; -1 when this
    process is already one of them (started by a launcher)."""
    # torch and accelerate's launcher load only for a multi-process run
    from grpo_core.runtime.processes import launched_by_launcher, world_size

    if num_processes < 1:
        raise ConfigError(f"--num-processes {num_processes}: give 1 or more processes.")
    if launched_by_launcher():
        if num_processes != world_size():
            raise ConfigError(
                f"--num-processes {num_processes}, but this process was started by a launcher with "
                f"{world_size()} processes: drop --num-processes when using accelerate launch / torchrun."
            )
        return -1  # already one of the N: train here
    # torch and accelerate's launcher load only for a multi-process run
    import torch

    command = launcher_command(num_processes, grpo_args, torch.cuda.is_available())
    return subprocess.call(command, env={**os.environ, CHECKED_ENV: "1"})


def quiet_launcher(argv: list[str]) -> int:
    """``accelerate launch ARGV``, returning the first failed child's exit code.

    A failed child has printed its own one-line error; torch elastic would
    add a ``ChildFailedError`` traceback and log lines naming pids, which
    bury it. Only a child killed by a signal (it could print nothing) gets a
    line here."""
    # torch and accelerate's launcher load only for a multi-process run
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    args = launch_command_parser().parse_args(argv)
    try:
        launch_command(args)
    except ChildFailedError as exc:
        return failure_exit_code(exc)
    return 0


def failure_exit_code(exc: ChildFailedError) -> int:
    """The exit code of the first child that failed on its own (elastic
    stops the others with SIGTERM once one fails)."""
    failures = sorted(exc.failures.items(), key=lambda item: item[1].timestamp)
    for _rank, failure in failures:
        if failure.exitcode > 0:
            return failure.exitcode
    rank, failure = failures[0]
    try:
        name = signal.Signals(-failure.exitcode).name
    except ValueError:
        name = str(-failure.exitcode)
    print(f"error: training process {rank} was killed by signal {name}", file=sys.stderr)
    return 128 + abs(failure.exitcode)


if __name__ == "__main__":
    raise SystemExit(quiet_launcher(sys.argv[1:]))
