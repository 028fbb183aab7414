"""A run whose gradient stops being finite stops there, with finite weights on disk.

A learning rate of 1e30 makes step 1's update enormous, and a later step's
forward overflows to inf and NaN. The completions come from a fixed
``rollout_func`` (the policy sampling them would fail first, at generation). Without the guard the run would go on and
save NaN weights as if nothing happened (it did: a step's loss showed as a
missing value in metrics.jsonl, nothing else); with it the step that meets a
non-finite gradient applies nothing, saves nothing, and the run ends with one
line naming the step and the checkpoint to resume from.
"""

from __future__ import annotations

import math
import re

import torch
from fault_harness import Runner, assert_clean_failure, metrics
from safetensors.torch import load_file

FIXED_ROLLOUT = """
def rollout(prompts, trainer):
    tok = trainer.processing_class
    out = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "score": []}
    for p in prompts:
        ids = tok.encode(p if isinstance(p, str) else p[-1]["content"], add_special_tokens=False)
        for k in range(trainer.num_generations):
            out["prompt_ids"].append(list(ids))
            out["completion_ids"].append(tok.encode(str(k), add_special_tokens=False) + [tok.eos_token_id])
            out["logprobs"].append(None)
            out["score"].append(float(k))
    return out

def score(completions, score, **kwargs):
    return list(score)
"""


def test_a_non_finite_gradient_stops_the_run_and_keeps_the_last_finite_checkpoint(runner: Runner) -> None:
    (runner.workdir / "fixed_rollout.py").write_text(FIXED_ROLLOUT)
    trl = {"rollout_func": "fixed_rollout.rollout", "reward_funcs": ["fixed_rollout.score"]}
    config = runner.config(max_steps=6, save_steps=1, learning_rate=1e30, max_grad_norm=1.0, trl=trl)
    code, output = runner.run(config)
    assert_clean_failure(code, output)
    found = re.search(r"step (\d+): the gradient is not finite \(grad_norm = (\S+), loss = (\S+)\)", output)
    assert found, output[-4000:]
    stopped = int(found.group(1))
    assert stopped >= 2 and found.group(2) in ("nan", "inf"), found.group(0)
    out = runner.workdir / "out"
    assert f"resume from {out / f'checkpoint-{stopped - 1}'}" in output
    assert [r["step"] for r in metrics(out)] == list(range(1, stopped))  # the failed step logs nothing
    saved = sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))
    assert saved[-1] == stopped - 1, saved  # nothing of the failed step was saved
    weights = load_file(str(out / f"checkpoint-{stopped - 1}" / "model" / "adapter_model.safetensors"))
    assert all(torch.isfinite(w).all() for w in weights.values())


def test_clip_and_step_skips_a_non_finite_update() -> None:
    from accelerate import Accelerator

    from grpo_core.parallel.base import clip_and_step

    layer = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    before = layer.weight.detach().clone()
    layer(torch.tensor([[1.0, float("nan"), 0.0]])).sum().backward()
    assert math.isnan(clip_and_step(Accelerator(cpu=True), layer, optimizer, 1.0))
    assert torch.equal(layer.weight.detach(), before), "a NaN gradient reached the weights"
    optimizer.zero_grad()
    layer(torch.tensor([[1.0, 2.0, 0.0]])).sum().backward()
    norm = clip_and_step(Accelerator(cpu=True), layer, optimizer, 1.0)
    assert norm > 0 and not torch.equal(layer.weight.detach(), before)
