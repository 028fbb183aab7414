"""Freed memory kept for reuse (``reuse_freed_memory``, on by default on a
CPU) against glibc's defaults, on the time-to-accuracy benchmark's grpo runner.

    .venv/bin/python benchmarks/bench_heap_reuse.py --steps 8 --rounds 2
    .venv/bin/python benchmarks/bench_heap_reuse.py --micro 7 --rounds 4 --out benchmarks/results/heap_reuse_micro.json

Each run is a process of its own (the setting is process-wide), the two ways
alternating, ``--rounds`` of each. A run trains ``--steps`` steps of the
arithmetic example as ``bench_time_to_accuracy.py``'s ``grpo`` runner does
(colocated vLLM, ``bf16 = "auto"``, seed 42), so both ways do the same work:
the summary checks that their losses and rewards agree step by step. Printed
per way: each phase's median seconds a step (``metrics.jsonl`` ``time/*``,
the first step left out), the minor page faults a step (median over steps 4
on: the heap grows over the first steps, RESULTS.md "Freed memory kept for
reuse"), and the process's peak resident memory. ``--micro CALLS`` times the
trainer's forward+backward of the arithmetic micro-batch instead
(``bench_ceiling.py``'s, in bf16 where the CPU computes it natively), CALLS
times in each process: less work around it, so less noise. Writes
``benchmarks/results/heap_reuse.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PHASES = ("step_time", "time/generation", "time/forward_backward", "time/weight_sync", "time/optimizer")
WAYS = {"kept": True, "glibc": False}  # reuse_freed_memory


def child(way: str, steps: int) -> None:
    """One run, in this process: per-step metrics and page faults, peak memory, as one JSON line."""
    sys.path.insert(0, str(HERE))
    import bench_time_to_accuracy as tta

    sys.path.insert(0, str(tta.EXAMPLE))  # the example's reward functions
    from grpo_core.config.loader import validate
    from grpo_core.host.plugin_host import PluginHost
    from grpo_core.modeling.model_files import DEFAULT_MODEL, resolve_model_dir
    from grpo_core.plugin_api import hookimpl
    from grpo_core.training.run import run_training

    faults: list[int] = []

    class Faults:
        @hookimpl
        def grpo_step_end(self, progress, metrics):
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)

    with tempfile.TemporaryDirectory() as scratch:
        output_dir = Path(scratch) / "run"
        raw = tta.grpo_config(str(resolve_model_dir(DEFAULT_MODEL)), steps, steps + 1, output_dir, "auto")
        cfg = validate({**raw, "reuse_freed_memory": WAYS[way], "save_steps": None})
        host = PluginHost()
        host.pm.register(Faults(), name="bench.faults")
        run_training(cfg, host)
        records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]

    print(
        json.dumps(
            {
                "way": way,
                "seconds": {key: [float(r.get(key, 0.0)) for r in records] for key in PHASES},
                "faults": [f - (faults[i - 1] if i else 0) for i, f in enumerate(faults)],
                "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "loss": [r.get("loss") for r in records],
                "reward": [r.get("reward") for r in records],
            }
        )
    )


def micro_child(way: str, repeats: int) -> None:
    """The trainer's forward+backward of the arithmetic micro-batch as bench_ceiling.py times it
    (bf16 where the CPU computes it natively, float32 elsewhere), ``repeats`` times in this process."""
    sys.path.insert(0, str(HERE))
    import time

    import torch
    from bench_ceiling import COMPLETION_TOKENS, PROMPT_TOKENS, PROMPTS, ROWS, trainer_ways
    from bench_shared_prompts import micro_batch, trainer_model

    from grpo_core.modeling.precision import native_bf16
    from grpo_core.runtime.heap import RetainedHeap

    precision = "bf16" if native_bf16("cpu") else "float32"
    with RetainedHeap(WAYS[way]):
        torch.manual_seed(0)
        model = trainer_model(precision)
        ids = micro_batch(torch.Generator().manual_seed(0), PROMPTS, ROWS, PROMPT_TOKENS, COMPLETION_TOKENS)
        step = trainer_ways(model, ids, COMPLETION_TOKENS, precision)["shared"]
        seconds, faults = [], []
        for _ in range(repeats):
            model.zero_grad(set_to_none=True)
            before, began = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
            step()
            seconds.append(time.perf_counter() - began)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(
        json.dumps(
            {
                "way": way,
                "precision": precision,
                "seconds": seconds,
                "faults": faults,
                "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            }
        )
    )


def summarize_micro(runs: list[dict]) -> dict:
    """Per way: each process's median seconds (its first call, warm-up, left out), faults from the 4th call on."""
    out: dict = {
        way: {
            "median_s": [statistics.median(r["seconds"][1:]) for r in runs if r["way"] == way],
            "faults": [statistics.median(r["faults"][3:]) for r in runs if r["way"] == way],
            "peak_rss_mib": [round(r["peak_rss_mib"]) for r in runs if r["way"] == way],
        }
        for way in WAYS
    }
    out["speed_up_per_pair"] = [g / k for k, g in zip(out["kept"]["median_s"], out["glibc"]["median_s"], strict=True)]
    return out


def summarize(runs: list[dict]) -> dict:
    out: dict = {}
    for way in WAYS:
        mine = [r for r in runs if r["way"] == way]
        out[way] = {
            "seconds": {key: statistics.median(s for r in mine for s in r["seconds"][key][1:]) for key in PHASES},
            "faults_per_step": statistics.median(f for r in mine for f in r["faults"][3:]),
            "faults_first_steps": [r["faults"][1:3] for r in mine],
            "peak_rss_mib": [round(r["peak_rss_mib"]) for r in mine],
        }
    first = runs[0]
    out["identical_work"] = all(r["loss"] == first["loss"] and r["reward"] == first["reward"] for r in runs)
    return out


def alternate(rounds: int, command: list[str], label: str) -> tuple[list[dict], list[dict]]:
    """``rounds`` pairs of child processes, the two ways alternating which goes first; the machine's speed between."""
    from bench_time_to_accuracy import machine_speed

    runs, speeds = [], [machine_speed()]
    for round_ in range(rounds):
        for way in list(WAYS) if round_ % 2 == 0 else list(reversed(WAYS)):
            print(f"round {round_ + 1}: {way} ({label})", file=sys.stderr, flush=True)
            done = subprocess.run(
                [sys.executable, __file__, "--child", way, *command],
                capture_output=True,
                text=True,
                cwd=HERE.parent,
                env=os.environ.copy(),
            )
            if done.returncode != 0:
                raise SystemExit(f"the {way} run failed:\n{done.stderr[-4000:]}")
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
            speeds.append(machine_speed())
    return runs, speeds


def print_micro(summary: dict) -> None:
    print("the trainer's forward+backward of the arithmetic micro-batch, median s per process, pairs in order:")
    for way in WAYS:
        s = summary[way]
        print(
            f"  {way:<8} {', '.join(f'{t:.3f}' for t in s['median_s'])}  page faults a call from the 4th: "
            f"{', '.join(f'{f:.0f}' for f in s['faults'])}; peak resident {s['peak_rss_mib']} MiB"
        )
    print(f"  kept over glibc, per pair: {', '.join(f'{r:.2f}x' for r in summary['speed_up_per_pair'])}")


def print_steps(summary: dict) -> None:
    print(f"identical work (loss and reward equal at every step in every run): {summary['identical_work']}")
    print(f"{'median a step (s)':<24}" + "".join(f"{key.removeprefix('time/'):>18}" for key in PHASES))
    for way in WAYS:
        row = summary[way]["seconds"]
        print(f"{way:<24}" + "".join(f"{row[key]:>18.3f}" for key in PHASES))
    print(
        f"{'kept over glibc':<24}"
        + "".join(f"{summary['glibc']['seconds'][k] / summary['kept']['seconds'][k]:>17.2f}x" for k in PHASES)
    )
    for way in WAYS:
        s = summary[way]
        print(
            f"{way}: {s['faults_per_step']:.0f} page faults a step from step 4 (steps 2-3: {s['faults_first_steps']}), "
            f"peak resident {s['peak_rss_mib']} MiB"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--micro",
        type=int,
        default=0,
        metavar="CALLS",
        help="time the trainer's micro-batch forward+backward CALLS times a process instead of training steps",
    )
    parser.add_argument("--out", type=Path, default=HERE / "results" / "heap_reuse.json")
    parser.add_argument("--child", choices=list(WAYS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        micro_child(args.child, args.micro) if args.micro else child(args.child, args.steps)
        return
    if args.micro and args.micro < 5 or not args.micro and args.steps < 5:
        raise SystemExit("--steps / --micro: at least 5 (page faults are counted from the 4th on)")
    sys.path.insert(0, str(HERE))
    from grpo_core.modeling.precision import cpu_flag_summary

    if args.micro:
        runs, speeds = alternate(args.rounds, ["--micro", str(args.micro)], f"{args.micro} forward+backward calls")
        summary = summarize_micro(runs)
    else:
        runs, speeds = alternate(args.rounds, ["--steps", str(args.steps)], f"{args.steps} steps")
        summary = summarize(runs)
    print(
        f"CPU flags: {cpu_flag_summary()}; float32 mm GFLOP/s before each run and at the end: "
        + ", ".join(f"{s['mm_gflops']:.0f}" for s in speeds)
    )
    print_micro(summary) if args.micro else print_steps(summary)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {"cpu_flags": cpu_flag_summary(), "machine_speed": speeds, "runs": runs, "summary": summary}, indent=1
        )
    )


if __name__ == "__main__":
    main()
