"""Every weight sync is verified in the run, against the real vLLM server.

The first sync is checked by the server scoring a fixed probe
(``prompt_logprobs``) against the trainer's own log-probs; later ones by the
server's log-probs of the tokens it sampled against the next step's training
forward (grpo_core/sync/verify.py), or by the probe after every sync
(``verify_weight_sync = "every_probe"``). Here: syncs that work verify at
float32 noise (LoRA adapter loads and merged full-weight loads); a sync that
reports success without loading anything is caught (by the samples: in the
next step, before its optimizer step; by the probe: right after it), synced
once more, and the run stops with a checkpoint and one error line naming the
server, the version and the gap (through ``grpo run``, as a user sees it); a
sync the second attempt fixes lets the run go on; one server of a pool that
the sync never reached is named on its own. The faulty syncs are real plugin
distributions found by entry point (as in tests/e2e/test_step_record.py).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
from helpers import grpo, no_traceback, write_toml
from plugin_set import write_distribution
from test_vllm_training import PARITY_REWARD, metrics, run_config

from grpo_core.config.loader import validate
from grpo_core.contract.errors import WeightSyncUnverified
from grpo_core.host import plugin_host
from grpo_core.sync.verify import FLOAT32
from grpo_core.training.run import run_training

pytestmark = pytest.mark.vllm

SYNC_MODULE = '''
from pathlib import Path

from grpo_plugins.weight_sync_files import FullFilesystemSync


class SkipsLoads(FullFilesystemSync):
    """The merged-weight sync, except that from policy version 1 on it
    writes the files and reports success without the engine loading them."""

    def _apply(self, engine, path):
        version = int(path.name[1:])
        if version >= 1:
            with open(Path(self.context.output_dir) / "skipped.txt", "a") as out:
                out.write(f"{version}\\n")
            return
        super()._apply(engine, path)


class SkipsOnce(FullFilesystemSync):
    """Skips the load of version 2 once: the second attempt reaches the engine."""

    skipped = False

    def _apply(self, engine, path):
        if path.name == "v2" and not SkipsOnce.skipped:
            SkipsOnce.skipped = True
            return
        super()._apply(engine, path)
'''


@pytest.fixture
def faulty_sync_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    site = write_distribution(
        tmp_path / "site",
        "grpo_faulty_sync",
        SYNC_MODULE,
        "grpo-faulty-sync",
        "[grpo.weight_sync]\nskips_loads = grpo_faulty_sync:SkipsLoads\nskips_once = grpo_faulty_sync:SkipsOnce\n",
    )
    (site / "parity_rewards.py").write_text(PARITY_REWARD)  # every step trains: each sync has new weights to deliver
    monkeypatch.syspath_prepend(str(site))
    plugin_host.rescan()
    yield site
    plugin_host.rescan()
    sys.modules.pop("grpo_faulty_sync", None)


def parity_run(smollm2_dir: str, out: Path, base_url: str | None, **trl: object) -> dict:
    return run_config(smollm2_dir, out, base_url, reward_funcs=["parity_rewards.parity_reward"], **trl)


@pytest.mark.parametrize("sync", ["lora", pytest.param("merged", marks=pytest.mark.extended)])
def test_every_sync_is_verified_at_float32_noise(
    vllm_server, smollm2_dir: str, tmp_path: Path, faulty_sync_site: Path, sync: str
) -> None:
    """``lora``: the adapter is loaded and the probe is scored under its name;
    ``merged``: W + BA reloaded into the base. Each of the 3 steps trains,
    syncs and is verified; the gap is float32 noise. Step 1's record holds
    the first sync's probe (held to the ceiling); steps 2 and 3 hold the
    checks of the syncs before them, on the server's sampled tokens, held
    to the bound the floor of step 1's samples sets (far under the ceiling)."""
    cfg = validate(parity_run(smollm2_dir, tmp_path / "run", vllm_server.base_url, vllm_lora_sync=sync == "lora"))
    assert cfg.verify_weight_sync == "every"  # the default
    assert run_training(cfg) == "completed"
    rows = metrics(tmp_path / "run")
    print(
        sync,
        [
            (
                r["sync/logprob_gap"],
                r["sync/logprob_gap_max"],
                r["sync/logprob_bound"],
                r["sync/verify_seconds"],
                r["time/weight_sync"],
                r["sync/sampled"],
            )
            for r in rows
        ],
    )
    assert all(r["grad_norm"] > 0 for r in rows)  # every step moved the weights the sync then delivered
    assert [r["sync/verified"] for r in rows] == [1.0, 1.0, 1.0]
    assert [r["sync/sampled"] for r in rows] == [0.0, 1.0, 1.0]
    assert all(0 < r["sync/logprob_gap"] < 1e-4 and r["sync/logprob_gap_max"] < 1e-3 for r in rows)
    assert rows[0]["sync/logprob_bound"] == FLOAT32.ceiling  # the first check: the ceiling
    assert all(r["sync/logprob_bound"] < FLOAT32.ceiling / 5 for r in rows[1:])  # later ones: the floor's bound
    assert all(r["sync/retries"] == 0.0 and r["sync/verify_seconds"] > 0 for r in rows)
    assert rows[0]["sync/verify_seconds"] > 100 * max(
        r["sync/verify_seconds"] for r in rows[1:]
    )  # the samples cost nothing


@pytest.mark.parametrize("mode", ["every", pytest.param("every_probe", marks=pytest.mark.extended)])
def test_a_sync_that_never_loads_stops_the_run_with_a_checkpoint(
    vllm_server, smollm2_dir: str, tmp_path: Path, faulty_sync_site: Path, mode: str
) -> None:
    """Through ``grpo run``: version 0 loads (the engine starts from this
    run's weights), version 1 after step 1 is written but never loaded. The
    check catches it (``every``: step 2's samples, drawn from version 0,
    before step 2's optimizer step; ``every_probe``: the probe right after
    the sync), the sync runs once more (skipped again), the probe fails, and
    the run stops: exit 3, one error line naming the server, the version and
    the gap, a checkpoint of step 1, and no traceback."""
    out = tmp_path / "out"
    # every micro-batch trains (none left out for zero advantage): step 2's forward sees its samples
    cfg = parity_run(smollm2_dir, out, vllm_server.base_url, skip_zero_advantage_batches=False)
    cfg["plugins"] = {"weight_sync": "skips_loads"}
    cfg["verify_weight_sync"] = mode
    config = write_toml(tmp_path / "config.toml", cfg)
    env = {
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([str(faulty_sync_site), os.environ.get("PYTHONPATH", "")]),
    }
    done = grpo("run", str(config), env=env, timeout=900)
    output = done.stdout + done.stderr
    assert done.returncode == 3, output[-3000:]
    no_traceback(output)
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, output[-3000:]
    line = errors[0]
    gap = float(re.search(r"mean \|log-prob gap\| ([0-9.e+-]+) per token", line).group(1))
    bound = float(re.search(r"bound ([0-9.e+-]+) \(float32", line).group(1))
    print(line)
    assert "policy version 1 did not reach the engine" in line and f"vLLM server at {vllm_server.base_url}" in line
    assert gap > 10 * bound and bound < FLOAT32.ceiling
    assert "syncing again" in output  # the retry was said
    if mode == "every":
        assert "the samples of policy version 1 do not match the trainer's log-probs" in output
    assert (out / "skipped.txt").read_text().split() == ["1", "1"]  # version 1 was synced twice, never loaded
    assert "Training stopped at step 1; checkpoint saved to" in output and (out / "checkpoint-1").is_dir()
    [record] = metrics(out)  # step 2 never finished: its optimizer step never ran on the stale samples
    assert record["step"] == 1
    if mode == "every_probe":  # the failed checks are step 1's own
        assert record["sync/verified"] == 0.0 and record["sync/retries"] == 1.0
        assert record["sync/logprob_gap"] == pytest.approx(gap, rel=1e-2)


@pytest.mark.extended  # a third real run of this file (~22 s); the failing and passing checks run in the default tier
def test_a_sync_the_second_attempt_fixes_lets_the_run_go_on(
    vllm_server, smollm2_dir: str, tmp_path: Path, faulty_sync_site: Path
) -> None:
    cfg = validate(
        {**parity_run(smollm2_dir, tmp_path / "run", vllm_server.base_url), "plugins": {"weight_sync": "skips_once"}}
    )
    assert run_training(cfg) == "completed"
    rows = metrics(tmp_path / "run")
    assert [r["sync/verified"] for r in rows] == [1.0, 1.0, 1.0]
    assert [r["sync/retries"] for r in rows] == [0.0, 1.0, 0.0]  # step 2's sync (version 2) needed its second attempt
    assert all(r["sync/logprob_gap"] < 1e-4 for r in rows)


def test_a_pool_server_the_sync_never_reached_is_named(
    vllm_server, smollm2_dir: str, tmp_path: Path, faulty_sync_site: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pool of two servers (the session's server under two URLs, so that
    each has its own name and served model): every adapter load reaches the
    first and never the second, which keeps serving the base model. The
    first sync passes (the fresh adapter is the base), the one after step 1
    fails for the second server only, which the error names."""
    from grpo_plugins.vllm.engine import VLLMServerEngine

    port = vllm_server.base_url.rsplit(":", 1)[1]
    stale_url = f"http://localhost:{port}"
    real_load = VLLMServerEngine.load_adapter
    skipped: list[str] = []

    def load_adapter(self: VLLMServerEngine, path: Path) -> None:
        if self.client.base_url == stale_url:
            skipped.append(path.name)
            return
        real_load(self, path)

    monkeypatch.setattr(VLLMServerEngine, "load_adapter", load_adapter)
    settings = parity_run(
        smollm2_dir,
        tmp_path / "run",
        None,
        vllm_lora_sync=True,
        vllm_managed=False,
        vllm_server_base_urls=[vllm_server.base_url, stale_url],
    )
    with pytest.raises(WeightSyncUnverified) as info:
        run_training(validate(settings))
    message = str(info.value)
    print(message)
    first_line = message.splitlines()[0]
    assert "policy version 1" in first_line and f"vLLM server at {stale_url}" in first_line
    assert vllm_server.base_url not in first_line  # the server the sync reached passed
    assert skipped == ["v0", "v1", "v1"]  # the stale server was asked twice for version 1
    assert "checkpoint saved to" in message and (tmp_path / "run" / "checkpoint-1").is_dir()
    [record] = metrics(tmp_path / "run")
    assert record["sync/verified"] == 0.0 and record["sync/logprob_gap"] > 10 * record["sync/logprob_bound"]
