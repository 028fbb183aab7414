"""Episode-level against turn-level advantages on the guessing game (issue #50).

    nice -n 10 .venv/bin/python benchmarks/bench_turn_credit.py --seeds 1 2 3 --steps 40
    .venv/bin/python benchmarks/bench_turn_credit.py --seeds 1 --steps 3 --dry-run   # the commands only

Each seed runs ``examples/guess-number/config.toml`` twice through ``grpo
run`` (SmolLM2-135M-Instruct, LoRA, the managed vLLM server grpo starts and
stops), once per ``advantage_aggregation``:

- ``sum_then_normalize``: GRPO's one advantage per episode, on every token;
- ``turn_returns``: each turn its own group-relative return-to-go
  (docs/turn-credit.md).

Everything else is held equal, the reward above all: both arms play the same
game with the same per-turn reward (``hint_reward``: each guess the hints so
far allow earns it at its own turn) on top of the example's win and closeness
rewards, the same seed (so the same prompts in the same order), batch,
learning rate and steps. The order of the two arms alternates with the seed,
so a machine that slows down over an invocation does not always hit the same
arm.

Measured per arm (from each run's metrics.jsonl): the solve rate of each
step's training games (``episodes/ended_by_environment``: the game ends by
itself only when won), the moving mean of it over ``--window`` steps, the
step seconds summed until that moving mean first reaches ``--threshold``
(time to threshold; none if never), the solve rate of the last ``--window``
steps, and the held-out greedy reward of the run's last evaluation
(``eval/reward``). Results go to ``benchmarks/results/turn_credit.json`` and
a table on stdout, with the command, the CPU flags and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from machine_note import cpu_description, metered_run

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "guess-number"
ARMS = ("sum_then_normalize", "turn_returns")


def guess_site(workdir: Path) -> Path:
    """The guess-number plugin installed into a directory of its own (``--target``), as the example's README says."""
    site = workdir / "guess-site"
    if not (site / "grpo_guess_number").is_dir():
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(EXAMPLE)],
            check=True,
        )
    return site


def command(arm: str, seed: int, a: argparse.Namespace, out: Path) -> list[str]:
    grpo = str(Path(sys.executable).with_name("grpo"))
    sets = {
        "max_steps": a.steps,
        "seed": seed,
        "output_dir": json.dumps(str(out)),
        "save_steps": a.steps,
        "eval_steps": a.eval_steps,
        "micro_batch_size": a.micro_batch,
        "gradient_accumulation_steps": a.accumulation,
        "plugins.advantage_aggregation": json.dumps(arm),
        "plugins.guess_number.hint_reward": a.hint_reward,
        "trl.scale_rewards": json.dumps(a.scale_rewards),
    }
    if a.learning_rate is not None:
        sets["learning_rate"] = a.learning_rate
    argv = [grpo, "run", str(EXAMPLE / "config.toml")]
    for key, value in sets.items():
        argv += ["--set", f"{key}={value}"]
    return argv


def moving(values: list[float], window: int) -> list[float | None]:
    return [None if i + 1 < window else statistics.mean(values[i + 1 - window : i + 1]) for i in range(len(values))]


def threshold(solve: list[float], seconds: list[float], a: argparse.Namespace) -> dict[str, Any]:
    """The first step whose moving mean of the solve rate reaches ``--threshold``, and the step seconds until then
    (computed when reporting, so runs kept with ``--reuse`` are judged by this invocation's window and threshold)."""
    means = moving(solve, a.window)
    reached = next((i for i, m in enumerate(means) if m is not None and m >= a.threshold), None)
    return {
        "threshold_step": None if reached is None else reached + 1,
        "seconds_to_threshold": None if reached is None else sum(seconds[: reached + 1]),
        "last_window_solve_rate": statistics.mean(solve[-a.window :]) if solve else None,
    }


def summarise(records: list[dict[str, Any]], a: argparse.Namespace) -> dict[str, Any]:
    steps = [r for r in records if "episodes/ended_by_environment" in r]
    solve = [float(r["episodes/ended_by_environment"]) for r in steps]
    seconds = [float(r.get("step_time", 0.0)) for r in steps]
    evals = [(r["step"], r["eval/reward"]) for r in records if "eval/reward" in r]
    return {
        "steps": len(steps),
        "solve_rate_by_step": solve,
        "games_won_by_step": [round(rate * a.micro_batch * a.accumulation) for rate in solve],
        "reward_by_step": [float(r.get("reward", 0.0)) for r in steps],
        "step_seconds": seconds,
        "eval_reward": evals,
    }


def report(results: dict[str, Any], a: argparse.Namespace) -> list[str]:
    lines = [
        f"guess-number, SmolLM2 + LoRA through the managed vLLM server; {a.steps} steps, "
        f"{a.micro_batch * a.accumulation} games/step, hint_reward {a.hint_reward}, scale_rewards {a.scale_rewards}; "
        f"threshold: moving mean over {a.window} steps of the training solve rate >= {a.threshold}",
        f"{'seed':>5}{'arm':>20}{'solve, last window':>19}{'all steps':>10}{'step to thr.':>13}{'s to thr.':>10}"
        f"{'s/step':>8}{'eval reward':>12}{'others':>8}  games won by step",
    ]
    for arms in results["runs"].values():
        for arm, s in arms.items():
            arms[arm] = {**s, **threshold(s["solve_rate_by_step"], s["step_seconds"], a)}
    for seed, arms in results["runs"].items():
        for arm, s in arms.items():
            last_eval = s["eval_reward"][-1][1] if s["eval_reward"] else None
            step = "-" if s["threshold_step"] is None else str(s["threshold_step"])
            secs = "-" if s["seconds_to_threshold"] is None else f"{s['seconds_to_threshold']:.0f}"
            shown_eval = "-" if last_eval is None else f"{last_eval:.3f}"
            others = results.get("machine", {}).get(seed, {}).get(arm, {}).get("others_cores_mean")
            per_step = statistics.mean(s["step_seconds"]) if s["step_seconds"] else 0.0
            overall = statistics.mean(s["solve_rate_by_step"]) if s["solve_rate_by_step"] else 0.0
            lines.append(
                f"{seed:>5}{arm:>20}{s['last_window_solve_rate'] or 0:>19.3f}{overall:>10.3f}{step:>13}{secs:>10}"
                f"{per_step:>8.0f}{shown_eval:>12}{'-' if others is None else f'{others:.2f}':>8}  "
                f"{' '.join(str(g) for g in s.get('games_won_by_step', []))}"
            )
    for arm in ARMS:
        runs = [arms[arm] for arms in results["runs"].values() if arm in arms]
        if not runs:
            continue
        last = [r["last_window_solve_rate"] for r in runs if r["last_window_solve_rate"] is not None]
        overall = [statistics.mean(r["solve_rate_by_step"]) for r in runs if r["solve_rate_by_step"]]
        reached = [r["threshold_step"] for r in runs if r["threshold_step"] is not None]
        lines.append(
            f"{arm}: over {len(runs)} seeds, last-window solve rate {statistics.mean(last):.3f}, all-steps solve rate "
            f"{statistics.mean(overall):.3f}, threshold reached in {len(reached)} of {len(runs)}"
            + (f" (mean step {statistics.mean(reached):.1f} of those)" if reached else "")
        )
    lines.append("others: cores that other work on the machine used meanwhile, on average (benchmarks/machine_note.py)")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--eval-steps", type=int, default=10)
    parser.add_argument("--micro-batch", type=int, default=8, help="one group of 8 games per micro-batch")
    parser.add_argument("--accumulation", type=int, default=4, help="4 prompts x 8 games = 32 games a step")
    parser.add_argument("--learning-rate", type=float, default=None, help="both arms; default: the example's")
    parser.add_argument("--hint-reward", type=float, default=0.2)
    parser.add_argument("--scale-rewards", default="group", choices=["group", "batch", "none"])
    parser.add_argument("--window", type=int, default=5)
    parser.add_argument("--threshold", type=float, default=0.15, help="training solve rate (moving mean)")
    parser.add_argument("--workdir", type=Path, default=ROOT / "grpo-output" / "bench-turn-credit")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "turn_credit.json")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    parser.add_argument("--reuse", action="store_true", help="keep the runs already in --out, run the others")
    a = parser.parse_args()
    a.workdir = a.workdir.resolve()  # the runs start in the example's folder

    a.workdir.mkdir(parents=True, exist_ok=True)
    site = None if a.dry_run else guess_site(a.workdir)
    results: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "cpu": cpu_description(),
        "runs": {},
        "machine": {},
        "order": [],
    }
    if a.reuse and a.out.exists():
        kept = json.loads(a.out.read_text())
        results.update(runs=kept.get("runs", {}), machine=kept.get("machine", {}), order=kept.get("order", []))
    for k, seed in enumerate(a.seeds):
        order = ARMS if k % 2 == 0 else ARMS[::-1]
        for arm in order:
            out = a.workdir / f"seed{seed}-{arm}"
            argv = command(arm, seed, a, out)
            print(" ".join(argv), flush=True)
            if a.dry_run:
                continue
            if a.reuse and arm in results["runs"].get(str(seed), {}):
                print(f"seed {seed} {arm}: kept from {a.out} (--reuse)", flush=True)
                continue
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
            records, machine = metered_run(argv, out, EXAMPLE, env)
            results["runs"].setdefault(str(seed), {})[arm] = summarise(records, a)
            results["machine"].setdefault(str(seed), {})[arm] = machine
            results["order"].append(f"seed{seed}-{arm}")
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps(results, indent=1))  # after every run: a stopped invocation keeps what it has
    if not a.dry_run:
        print("\n".join(report(results, a)))


if __name__ == "__main__":
    main()
