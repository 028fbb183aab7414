"""``python -m multiproc_entry run CONFIG``: grpo's CLI, recording what each rank trains on.

Started by ``torchrun``/``accelerate launch`` in tests/e2e/test_multiprocess.py:
every process appends, for each batch it trains on, its rank and the
texts of its prompts to ``$GRPO_TEST_SHARES/rank<R>.jsonl``.
Nothing else changes: the run is ``grpo run``."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main() -> int:
    import grpo_core.training.trainer as trainer_module
    from grpo_core.interface.cli import main as grpo_main

    out = Path(os.environ["GRPO_TEST_SHARES"])
    real = trainer_module.GRPOTrainer._set_batch

    def set_batch(self, batch, old_logps=None):
        record = {
            "rank": self.dist.rank,
            "world": self.dist.world,
            "step": self.step,
            "prompts": [g.group.prompt.prompt for g in batch.groups],
        }
        with open(out / f"rank{self.dist.rank}.jsonl", "a") as handle:
            handle.write(json.dumps(record) + "\n")
        return real(self, batch, old_logps)

    trainer_module.GRPOTrainer._set_batch = set_batch
    return grpo_main(sys.argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
