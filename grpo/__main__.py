"""``python -m grpo``: the ``grpo`` command, for launchers that start a module.

``python -m grpo run config.toml`` is ``grpo run config.toml``; so are
``torchrun --nproc_per_node N -m grpo run config.toml`` and
``accelerate launch --num_processes N -m grpo run config.toml``, each
process running the same command (``grpo run --num-processes N`` starts
them this way itself: :mod:`grpo_core.interface.launch`).
"""

from grpo_core.interface.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
