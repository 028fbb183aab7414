"""What an OpenEnv episode costs grpo: reset, step and close round trips.

    .venv/bin/python benchmarks/bench_openenv_steps.py [--episodes 50] [--threads 1]

Starts the test suite's guess-the-number OpenEnv server
(``tests/openenv_guess_env.py``, needs openenv-core) through the ``openenv``
environment's ``command`` setting, then plays ``--episodes`` episodes of one
reset, five steps and a close, ``--threads`` at once, and prints the median
and 90th percentile of each call as the adapter sees it (WebSocket on
loopback, the server's own work included). The game does almost nothing, so
this is the adapter's and OpenEnv's overhead per call, not an environment's.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from grpo_core.config.loader import validate
from grpo_core.contract.context import RunContext
from grpo_core.contract.types import Prompt
from grpo_core.host.plugin_host import PluginHost

TESTS = Path(__file__).resolve().parent.parent / "tests"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    serve = "{python} -m uvicorn openenv_guess_env:app --app-dir " + str(TESTS) + " --host {host} --port {port}"
    cfg = validate(
        {
            "base_model": "unused",
            "trl": {"reward_funcs": ["x.y"]},
            "plugins": {"environment": "openenv", "openenv": {"command": serve, "env": {"MAX_CONCURRENT_ENVS": "64"}}},
        }
    )
    start = time.perf_counter()
    context = RunContext(config=cfg, output_dir=Path(tempfile.mkdtemp(prefix="bench-openenv-")), log=lambda m: None)
    environment = PluginHost().load_implementation("environment", "openenv", context)
    environment.grpo_environment_episode(Prompt("p", [1], index=0), 0).close()  # waits for /health
    print(f"managed server ready after {time.perf_counter() - start:.1f} s")
    timings: dict[str, list[float]] = {"reset": [], "step": [], "close": []}

    def play(i: int) -> None:
        episode = environment.grpo_environment_episode(Prompt("p", [1], index=i), 0)
        for name, call in (
            [("reset", episode.reset)] + [("step", lambda: episode.step("no number"))] * 5 + [("close", episode.close)]
        ):
            t = time.perf_counter()
            call()
            timings[name].append(time.perf_counter() - t)

    try:
        wall = time.perf_counter()
        with ThreadPoolExecutor(args.threads) as pool:
            list(pool.map(play, range(args.episodes)))
        wall = time.perf_counter() - wall
    finally:
        environment.close()
    for name, xs in timings.items():
        xs.sort()
        print(
            f"{name:5s}: median {1000 * statistics.median(xs):.1f} ms, p90 {1000 * xs[int(0.9 * len(xs))]:.1f} ms "
            f"({len(xs)} calls)"
        )
    print(f"{args.episodes} episodes, {args.threads} at a time: {wall:.2f} s wall")


if __name__ == "__main__":
    main()
