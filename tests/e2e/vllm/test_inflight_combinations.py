"""In-flight weight updates combined with the other async machinery, in whole
real runs (real vLLM servers on CPU, SmolLM2):

- a managed pool of two servers (``[vllm] data_parallel_size = 2``) with
  streaming scoring (``trl.streaming_partial_batch``): each sync pauses both
  servers mid-generation, both serve requests, both are stopped at the end;
- partial rollouts (``trl.partial_rollout_token_budget``): samples continued
  across batches and requests cut by an update, every token within the
  documented staleness bound, nothing dropped.

The pause itself, token by token against transformers forwards, is tested in
test_inflight_updates.py; the partial-rollout continuation in
test_partial_rollouts_vllm.py. These check that the pieces hold together in a
run.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from helpers import metrics, no_traceback, write_toml
from process_group import process_group
from test_vllm_training import PARITY_REWARD, gone, run_config
from vllm_session import grpo_run_with_managed_servers

from grpo_core.config.loader import validate
from grpo_core.training.run import run_training

pytestmark = pytest.mark.vllm

COMPLETIONS = re.compile(r'"POST /v1/completions HTTP/1\.1" 200')
PAUSES = re.compile(r'"POST /pause\?[^ ]* HTTP/1\.1" 200')
RESUMES = re.compile(r'"POST /resume HTTP/1\.1" 200')


def rss_mib(pids: list[int]) -> int:
    """The resident memory of ``pids`` together, in MiB (what two servers cost this machine)."""
    total = 0
    for pid in pids:
        status = Path(f"/proc/{pid}/status")
        if status.exists():
            found = re.search(r"^VmRSS:\s+(\d+) kB", status.read_text(), re.M)
            total += int(found.group(1)) if found else 0
    return total // 1024


def per_token_metrics(records: list[dict]) -> None:
    for r in records:
        print(
            {k: r[k] for k in r if k.startswith(("token_staleness", "inflight/", "partial/", "staleness", "policy_"))}
        )


@pytest.mark.extended(
    reason="starts two managed servers and trains (~4-8 min on 2 shared cores); the pool's pause runs in the "
    "default tier on the session server under two URLs (test_inflight_updates.py)"
)
def test_a_managed_pool_streams_and_takes_in_flight_updates(smollm2_dir: str, tmp_path: Path) -> None:
    """``grpo run`` with ``[vllm] data_parallel_size = 2`` (grpo starts both
    servers), ``async_prefetch``, streaming scoring (one prompt group per
    chunk) and ``in_flight_weight_updates``: long samples (``min_tokens``:
    no stop before 160 tokens) on servers that run at most 2 sequences at
    once (``--max-num-seqs 2``), so generating a batch outlasts a training
    step and the syncs land while the next batch generates. Both servers answer
    completions (a one-group chunk goes to the servers in turn, not always
    the first), each sync pauses and resumes both, tokens sampled after an
    update sit in samples begun before it, every token is within the bound
    (prefetch_depth 1: one version), none dropped, and both servers are
    stopped at the end."""
    (tmp_path / "parity_rewards.py").write_text(PARITY_REWARD)  # varies within a group: every step trains and syncs
    cfg = run_config(
        smollm2_dir,
        tmp_path / "out",
        None,
        vllm_lora_sync=True,
        vllm_server_timeout=600,
        max_completion_length=160,
        generation_kwargs={"min_tokens": 160},
        reward_funcs=["parity_rewards.spread_reward"],
        async_prefetch=True,
        streaming_partial_batch=True,
        streaming_min_groups=1,
        in_flight_weight_updates=True,
        vllm_importance_sampling_correction=True,
    )
    cfg["max_steps"] = 3  # micro_batch_size 8 / num_generations 4: two prompt groups a step, one per chunk
    cfg["vllm"]["data_parallel_size"] = 2
    cfg["vllm"]["extra_args"] = ["--max-num-seqs", "2"]
    cfg["verify_weight_sync"] = "first"  # with "every" each sync's probe waits for the batch generating (its warning)
    config = write_toml(tmp_path / "config.toml", cfg)
    started_at = time.monotonic()
    with grpo_run_with_managed_servers(config, tmp_path, servers=2, timeout=1200) as (run, log, started):
        print(f"both servers ready after {time.monotonic() - started_at:.0f} s")
        groups = [process_group(pid) for pid, _ in started]
        print("resident memory of each server (API server, engine core, worker):", [rss_mib(g) for g in groups])
        assert run.wait(timeout=1800) == 0, log.read_text()[-3000:]
    print(f"run finished after {time.monotonic() - started_at:.0f} s")
    output = log.read_text()
    no_traceback(output)

    records = metrics(tmp_path / "out")
    per_token_metrics(records)
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert 0 <= r["token_staleness/mean"] <= r["token_staleness/max"] <= 1  # prefetch_depth 1 bounds every token
        assert r["inflight/dropped_stale_samples"] == 0
    assert records[0]["token_staleness/max"] == 0  # the first batch: sampled by the weights synced at start
    # a sync landed while a streamed batch was generating: requests cut by the pause went on under the new weights
    assert sum(r["inflight/samples_across_update"] for r in records) > 0, records
    assert sum(r["inflight/tokens_across_update"] for r in records) > 0, records
    assert sum(r["inflight/recomputed_tokens"] for r in records) > 0, records
    assert max(r["token_staleness/max"] for r in records) == 1, records

    # Each server generated, and every in-flight update paused and resumed both of them.
    served = [(tmp_path / "out" / f"vllm-server-{i}.log").read_text() for i in range(2)]
    counts = [(len(COMPLETIONS.findall(s)), len(PAUSES.findall(s)), len(RESUMES.findall(s))) for s in served]
    print(f"(completions, pauses, resumes) per server: {counts}")
    assert all(c >= 3 for c, _, _ in counts), counts  # one chunk per step at least (both chunks of a step, in turn)
    assert counts[0][1] == counts[1][1] >= 2, counts  # the first sync and one after each trained step but the last
    assert all(p == r for _, p, r in counts), counts

    # Both stopped: every process of both groups gone, their socket directories removed.
    assert output.count("managed server stopped") == 2
    leftover = [pid for group in groups for pid in group if not gone(pid)]
    assert leftover == [], leftover
    assert not any(socket.parent.exists() for _, socket in started)


BUDGET = 64
MAX_TOKENS = 96


@pytest.mark.extended(
    reason="starts its own server and trains 3 async steps (~4-5 min on 2 shared cores); each part is tested "
    "on its own (test_inflight_updates.py, test_partial_rollouts_vllm.py)"
)
def test_partial_rollouts_go_on_across_in_flight_updates_in_a_run(
    smollm2_dir: str, tmp_path: Path, monkeypatch
) -> None:
    """Async prefetch, in-flight updates and a per-batch token budget of 64
    of 96 tokens; ``min_tokens = 96`` makes every sample long (no stop
    token before it), so each is cut by the budget once and continued in the
    next batch. The managed server runs at most 2 sequences at once
    (``--max-num-seqs 2``): generating a batch (8 continuations and 8 new
    samples) then outlasts a training step (in the runs measured: ~70-400 s
    against ~30 s), so the sync after step 2 lands while batch 3 generates
    and cuts its requests, which go on under the new weights. Every token is
    within the documented bound ((prefetch_depth + ceil(96 / 64) - 1) x 1 =
    2 versions); no sample is dropped and no group lost (every group begun
    is trained or still open)."""
    (tmp_path / "parity_rewards.py").write_text(PARITY_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    raw = run_config(
        smollm2_dir,
        tmp_path / "run",
        None,
        vllm_lora_sync=True,
        vllm_server_timeout=600,
        max_completion_length=MAX_TOKENS,
        partial_rollout_token_budget=BUDGET,
        generation_kwargs={"min_tokens": MAX_TOKENS},
        reward_funcs=["parity_rewards.spread_reward"],
        async_prefetch=True,
        in_flight_weight_updates=True,
        vllm_importance_sampling_correction=True,
    )
    raw["vllm"]["extra_args"] = ["--max-num-seqs", "2"]
    cfg = validate(raw | {"max_steps": 3, "verify_weight_sync": "first"})
    started = time.monotonic()
    assert run_training(cfg) == "completed"
    print(f"run: {time.monotonic() - started:.0f} s")
    records = metrics(tmp_path / "run")
    per_token_metrics(records)
    assert [r["step"] for r in records] == [1, 2, 3]
    # Batch 1: all 8 samples cut by the budget (nothing to train). From batch 2 on: the 8 carried samples go on
    # and finish (64 + 32 = 96 tokens), their 2 groups train, the 8 new ones are cut.
    assert records[0]["partial/finished_groups"] == 0 and records[0]["partial/open_samples"] == 8
    for before, r in zip(records, records[1:]):
        assert r["partial/continued_samples"] == before["partial/open_samples"] == 8, records
        assert r["partial/finished_carried_groups"] == r["partial/finished_groups"] == before["partial/open_groups"]
    # Nothing lost: after batch k, the groups trained so far and those still open are the 2k begun.
    trained = 0
    for k, r in enumerate(records, start=1):
        trained += r["partial/finished_groups"]
        assert trained + r["partial/open_groups"] == 2 * k, (k, records)
    bound = 2  # (prefetch_depth 1 + ceil(96 / 64) 2 - 1) x steps_per_batch 1: docs/engines.md
    for r in records:
        assert 0 <= r["token_staleness/mean"] <= r["token_staleness/max"] <= bound
        assert r["inflight/dropped_stale_samples"] == 0
    # Samples hold tokens of several versions (continued across batches, and cut by an update) ...
    assert sum(r["inflight/tokens_across_update"] for r in records) > 0, records
    # ... and an in-flight update cut requests mid-generation: they went on as new requests whose prompts
    # (prompt + the ids so far) were computed again. Batch boundaries alone never count here.
    assert sum(r["inflight/recomputed_tokens"] for r in records) > 0, records
    assert records[2]["token_staleness/max"] >= 1, records  # batch 2's first pieces (version 0) trained at version 1
