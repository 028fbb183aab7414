"""Run by test_vllm_colocate.py in its own interpreter (an in-process vLLM
engine changes process-wide state): a short ``grpo`` training run with
multi-turn episodes on the colocated engine, watched from inside.

``run_training`` runs exactly as ``grpo run`` does; three wrappers only
record what passes by:

* ``Trainer._set_batch``: every trained micro-batch row's completion mask,
  next to the episode the row came from (its loss mask, its model and
  environment token counts, its turns);
* ``VLLMColocateRollout.grpo_rollout_generate``: each call's thread, prompt
  count and the calls overlapping it (the engine serialises them);
* ``InMemorySync.grpo_sync_weights``: each in-memory sync's version and the
  engine's weight label after it.

Prints ``PROBE {json}``.
"""

from __future__ import annotations

import functools
import json
import sys
import threading
import time
from pathlib import Path


def main(config_path: str) -> None:
    import faulthandler
    import os

    if os.environ.get("GRPO_PROBE_STACKS"):  # debugging a stall: every thread's stack every N s
        faulthandler.dump_traceback_later(float(os.environ["GRPO_PROBE_STACKS"]), repeat=True)
    from grpo_core.config.loader import validate
    from grpo_core.training import trainer as trainer_module
    from grpo_core.training.run import run_training
    from grpo_plugins.vllm import colocate

    cfg = validate(json.loads(Path(config_path).read_text()))
    rows: list[dict] = []
    calls: list[dict] = []
    syncs: list[int] = []
    in_flight = [0]
    flight_lock = threading.Lock()

    set_batch = trainer_module.GRPOTrainer._set_batch

    def recording_set_batch(self, batch, old_logps=None):
        set_batch(self, batch, old_logps)
        by_ids = {}
        for scored in batch.groups:
            for c in scored.group.completions:
                by_ids[tuple(scored.group.prompt.prompt_ids) + tuple(c.token_ids)] = (scored.group.prompt.prompt_ids, c)
        for mb in self._micro:
            width = mb.completion_mask.shape[1]
            for r in range(mb.input_ids.shape[0]):
                real = mb.attention_mask[r].bool()
                ids = mb.input_ids[r][real].tolist()
                prompt_ids, c = by_ids[tuple(ids)]
                n = len(c.token_ids)
                mask = mb.completion_mask[r, :n].tolist()
                rows.append(
                    {
                        "mask": [int(m) for m in mask],
                        "padding_mask_sum": float(mb.completion_mask[r, n:width].sum()),
                        "loss_mask": c.loss_mask,
                        "ids": list(c.token_ids),
                        "prompt_ids": list(prompt_ids),
                        "turns": c.episode.turns,
                        "model_tokens": c.episode.model_tokens,
                        "environment_tokens": c.episode.environment_tokens,
                        "tool_calls": c.episode.tool_calls,
                        "ended_by": c.episode.ended_by,
                    }
                )

    trainer_module.GRPOTrainer._set_batch = recording_set_batch

    generate = colocate.VLLMColocateRollout.grpo_rollout_generate

    @functools.wraps(generate)  # keeps the hookimpl marker and the argument names pluggy reads
    def recording_generate(self, prompts, num_generations, sampling, policy_version):
        with flight_lock:
            in_flight[0] += 1
            overlapping = in_flight[0]
        start = time.perf_counter()
        answers = []
        try:
            groups = generate(
                self, prompts=prompts, num_generations=num_generations, sampling=sampling, policy_version=policy_version
            )
            if os.environ.get("GRPO_PROBE_ANSWERS"):  # what the engine was asked and answered, for rebuilding rows
                answers = [
                    [list(p.prompt_ids), [list(c.token_ids) for c in g.completions]] for p, g in zip(prompts, groups)
                ]
            return groups
        finally:
            with flight_lock:
                in_flight[0] -= 1
            calls.append(
                {
                    "thread": threading.current_thread().name,
                    "prompts": len(prompts),
                    "n": num_generations,
                    "overlapping": overlapping,
                    "seconds": time.perf_counter() - start,
                    "answers": answers,
                }
            )

    colocate.VLLMColocateRollout.grpo_rollout_generate = recording_generate

    sync = colocate.InMemorySync.grpo_sync_weights

    @functools.wraps(sync)
    def recording_sync(self, model, version, engine):
        result = sync(self, model=model, version=version, engine=engine)
        syncs.append((version, engine.weight_label))  # the label counts the engine's completed in-memory loads
        return result

    colocate.InMemorySync.grpo_sync_weights = recording_sync

    started = time.perf_counter()
    status = run_training(cfg)
    print(
        "PROBE "
        + json.dumps(
            {"status": status, "rows": rows, "calls": calls, "syncs": syncs, "seconds": time.perf_counter() - started}
        )
    )


if __name__ == "__main__":  # vLLM's engine needs the guard
    main(sys.argv[1])
