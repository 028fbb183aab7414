"""Where the time-to-accuracy benchmark's grpo runner spends its start-up.

    .venv/bin/python benchmarks/bench_startup_timeline.py --steps 4 [--without-freezing]

Runs the runner of ``bench_time_to_accuracy.py`` (colocated vLLM, ``bf16 =
"auto"``, the arithmetic example) for a few steps in this process, with every
output line stamped with the seconds since the process started (the
benchmark's clock starts there too), and times each of Python's full garbage
collections (``gc.callbacks``): when it ran, how long it took, how many
objects it freed. Start-up counts in the time to a held-out accuracy, and
was where grpo lost ground to TRL (RESULTS.md, "Start-up without automatic
garbage collection").
"""

from __future__ import annotations

import gc
import sys
import time

STARTED = time.perf_counter()
FULL_COLLECTIONS: list[tuple[float, float, int]] = []  # (began at, seconds, objects freed)
_began = [0.0]


def _time_collections(phase: str, info: dict) -> None:
    if phase == "start":
        _began[0] = time.perf_counter()
    elif info["generation"] == 2:
        FULL_COLLECTIONS.append((_began[0] - STARTED, time.perf_counter() - _began[0], int(info["collected"])))


class Stamped:
    """A stream that starts each line with the seconds since the process started."""

    def __init__(self, inner) -> None:
        self.inner, self.at_line_start = inner, True

    def write(self, text: str) -> int:
        for part in text.splitlines(keepends=True):
            if self.at_line_start:
                self.inner.write(f"[{time.perf_counter() - STARTED:7.2f}] ")
            self.inner.write(part)
            self.at_line_start = part.endswith("\n")
        self.inner.flush()
        return len(text)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


class _NoStartupCollector:
    def __enter__(self) -> _NoStartupCollector:
        return self

    def __exit__(self, *exc_info: object) -> None:
        pass

    def settle(self) -> None:
        pass

    def started(self) -> None:
        pass


def without_freezing() -> None:
    """``--without-freezing``: the run's collector and the colocated engine's
    freeze replaced by nothing, as before they existed (vLLM's own freeze
    after its start stays, as it was)."""
    import types

    import grpo_core.training.run as run
    import grpo_plugins.vllm.colocate as colocate

    run.StartupCollector = _NoStartupCollector
    colocate.gc = types.SimpleNamespace(freeze=lambda: None)


def main() -> None:
    import argparse
    import tempfile
    from pathlib import Path

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--without-freezing",
        action="store_true",
        help="as before grpo_core.runtime.collector: automatic collection on, nothing frozen by grpo",
    )
    args = parser.parse_args()
    gc.callbacks.append(_time_collections)
    sys.stdout, sys.stderr = Stamped(sys.stdout), Stamped(sys.stderr)

    import bench_time_to_accuracy as tta

    from grpo_core.config.loader import validate
    from grpo_core.host.plugin_host import PluginHost
    from grpo_core.modeling.model_files import DEFAULT_MODEL, resolve_model_dir
    from grpo_core.modeling.precision import cpu_flag_summary
    from grpo_core.plugin_api import hookimpl
    from grpo_core.training.run import run_training

    sys.path.insert(0, str(tta.EXAMPLE))
    if args.without_freezing:
        without_freezing()
    marks: dict[str, float] = {}

    class Marks:
        @hookimpl
        def grpo_train_start(self, context) -> None:
            marks.setdefault("engines ready", time.perf_counter() - STARTED)

        @hookimpl
        def grpo_step_end(self, progress, metrics) -> None:
            now = time.perf_counter() - STARTED
            marks.setdefault("first step begins", now - float(metrics["step_time"]))
            marks[f"step {progress.step} ends"] = now

    with tempfile.TemporaryDirectory(prefix="grpo-startup-") as tmp:
        cfg = validate(
            tta.grpo_config(
                resolve_model_dir(DEFAULT_MODEL), args.steps, args.steps + 1, Path(tmp) / "run", "auto", args.seed
            )
        )
        host = PluginHost()
        host.pm.register(Marks(), name="bench.marks")
        run_training(cfg, host)
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    first = marks.get("first step begins", float("inf"))
    last = max(marks.values())
    before = [c for c in FULL_COLLECTIONS if c[0] < first]
    during = [c for c in FULL_COLLECTIONS if first <= c[0] < last]
    print(f"\nCPU flags: {cpu_flag_summary()}")
    for name, at in marks.items():
        print(f"{name:>20}: {at:7.2f} s")
    print(
        f"full collections before the first step: {len(before)}, {sum(c[1] for c in before):.2f} s "
        f"({', '.join(f'{s:.2f}' for _, s, _ in before)}); objects freed: {[c[2] for c in before]}"
    )
    print(
        f"full collections during the steps: {len(during)}, {sum(c[1] for c in during):.2f} s; after the last "
        f"step (final save, shutdown): {len(FULL_COLLECTIONS) - len(before) - len(during)}"
    )


if __name__ == "__main__":
    main()
