"""In-flight weight updates against syncs that land on their own, on a long tail of completion lengths (issue #50).

    nice -n 10 .venv/bin/python benchmarks/bench_inflight.py --steps 10 --rounds 1
    .venv/bin/python benchmarks/bench_inflight.py --steps 2 --dry-run   # the commands only

The task is the arithmetic example (``examples/arithmetic/config.toml``: SmolLM2-135M-Instruct +
LoRA through the managed vLLM server, merged-weight sync, 4 prompts x 8 samples a step) made to
have a long tail: ``max_completion_length`` 256 instead of 48, the reward ``correct_answer`` alone
(the example's ``short_answer`` term trains the tail away within a few steps), and a share of the
prompts (``--explain-share``, default 1 in 4, chosen by a fixed seed) whose system prompt asks
for the reasoning before the number: those samples run long, the others stop after a few
tokens, so a step's generation lasts as long as its longest sample. Both arms run with
``trl.async_prefetch = true`` (the next batch generates while the current one trains; the
weight sync lands while it generates):

- ``boundary``: ``in_flight_weight_updates = false``: the batch is labelled with the version it
  began under (staleness per batch). Since ``grpo_core/sync/between_batches.py`` the load waits
  for the batch being generated; before it (the runs in RESULTS.md of 2026-12-05) the load
  reached the server while requests ran and the sync check's probe waited instead.
- ``inflight``: ``in_flight_weight_updates = true``. The load runs inside ``/pause?mode=abort``
  ... ``/resume``; cut requests go on from their exact ids; each token records its version.
- ``partial``: ``partial_rollout_token_budget = --budget`` with syncs between batches: a sample
  not finished within the budget goes on in the next batch from its exact ids, so a batch no
  longer lasts as long as its longest sample; a prompt's group trains in the batch where its last
  member finishes, so a step trains a varying number of groups (compare seconds per trained
  group, and the reward by wall time, not seconds per step).
- ``inflight_partial``: both (``partial`` with in-flight updates).
- ``sync`` (optional, ``--arms``): no ``async_prefetch``, for reference: generation and training
  take turns, each with both cores.

Same seed, same prompts in the same order; the arms alternate (``boundary`` first in odd
rounds, ``inflight`` first in even ones), so a machine that gets busier or quieter over an
invocation does not always favour one arm. Measured per arm, from each run's metrics.jsonl:
seconds per step (mean and median over steps 2..N: step 1 has nothing to overlap with), the
time the trainer waited for generation (``time/rollout``), the sync's seconds
(``time/weight_sync``; with in-flight updates split into pause, load and resume), the batch's
generation seconds and completion lengths (mean, max, share cut at the limit), per-token
staleness (``token_staleness/mean|max``, ``inflight/*``: in-flight arm only; the boundary arm's
is the batch's ``staleness``), the reward by step and the step seconds until its moving mean
first reaches ``--threshold``. Each run also records the CPU seconds it used and those other
work on the machine used meanwhile (benchmarks/machine_note.py): on a shared machine compare
the per-step counts first. Results: ``benchmarks/results/inflight.json`` and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path
from typing import Any

from machine_note import cpu_description, metered_run

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "arithmetic"
ARMS = ("boundary", "inflight", "partial", "inflight_partial", "sync")
EXPLAIN = "You are a helpful assistant. Explain your reasoning step by step, then give the number."


def long_tail_data(workdir: Path, share: float, seed: int = 0) -> Path:
    """The example's training prompts, ``share`` of them (a fixed random choice) asking for reasoning."""
    rows = [json.loads(line) for line in (EXAMPLE / "data" / "train.jsonl").read_text().splitlines() if line.strip()]
    rng = random.Random(seed)
    for row in rows:
        if rng.random() < share:
            row["prompt"] = [{"role": "system", "content": EXPLAIN}, *row["prompt"][1:]]
    path = workdir / f"train_explain{share:g}.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def command(arm: str, a: argparse.Namespace, data: Path, out: Path) -> list[str]:
    grpo = str(Path(sys.executable).with_name("grpo"))
    sets = {
        "max_steps": a.steps,
        "seed": a.seed,
        "output_dir": json.dumps(str(out)),
        "save_steps": a.steps,
        "datasets[0].path": json.dumps(str(data)),
        "sequence_len": 512,
        # 4 rows a micro-batch: 16 rows of ~300 tokens (the example's 16 are for 48) held 8.7 GB in the
        # trainer and the OOM killer took it beside other work on a 24 GB machine
        "micro_batch_size": 4,
        "gradient_accumulation_steps": 8,
        "trl.max_completion_length": a.max_completion_length,
        "trl.reward_funcs": '["rewards.correct_answer"]',
        "trl.reward_weights": "[1.0]",
        "trl.async_prefetch": json.dumps(arm != "sync"),
        "trl.in_flight_weight_updates": json.dumps(arm in ("inflight", "inflight_partial")),
    }
    if arm in ("partial", "inflight_partial"):
        sets["trl.partial_rollout_token_budget"] = a.budget
    argv = [grpo, "run", str(EXAMPLE / "config.toml")]
    for key, value in sets.items():
        argv += ["--set", f"{key}={value}"]
    for extra in a.set:  # both arms alike, after the script's own
        argv += ["--set", extra]
    return argv


def moving(values: list[float], window: int) -> list[float | None]:
    return [None if i + 1 < window else statistics.mean(values[i + 1 - window : i + 1]) for i in range(len(values))]


def column(steps: list[dict[str, Any]], key: str) -> list[float | None]:
    return [None if key not in r else float(r[key]) for r in steps]


def mean_of(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.mean(present) if present else None


def summarise(records: list[dict[str, Any]], a: argparse.Namespace) -> dict[str, Any]:
    steps = [r for r in records if "step_time" in r]
    later = steps[1:]  # step 1 generated its batch with nothing to overlap
    seconds = [float(r["step_time"]) for r in steps]
    reward = [float(r.get("reward", 0.0)) for r in steps]
    means = moving(reward, a.window)
    reached = next((i for i, m in enumerate(means) if m is not None and m >= a.threshold), None)
    keys = (
        "step_time",
        "time/rollout",
        "time/forward_backward",
        "time/weight_sync",
        "sync/verify_seconds",  # the sync's check; its probe waits for the requests in flight (probe_gate.py)
        "time/generation",
        "completions/mean_length",
        "completions/max_length",
        "completions/clipped_ratio",
        "staleness",
        "token_staleness/mean",
        "token_staleness/max",
        "inflight/tokens_across_update",
        "inflight/samples_across_update",
        "inflight/dropped_stale_samples",
        "inflight/pause_seconds",
        "inflight/load_seconds",
        "inflight/resume_seconds",
        "inflight/recomputed_tokens",
        "partial/finished_groups",
        "partial/continued_samples",
        "partial/open_samples",
    )
    # groups trained per step: the partial arms' vary (the groups that finished in the batch)
    groups = [float(r.get("partial/finished_groups", a.prompts_per_step)) for r in steps]
    return {
        "groups_trained": sum(groups),
        "seconds_per_group_2_on": sum(seconds[1:]) / sum(groups[1:]) if sum(groups[1:]) else None,
        "by_step": {key: column(steps, key) for key in ("reward", *keys)},
        "mean_steps_2_on": {key: mean_of(column(later, key)) for key in keys},
        "median_step_seconds_2_on": statistics.median(seconds[1:]) if len(seconds) > 1 else None,
        "threshold_step": None if reached is None else steps[reached]["step"],
        "seconds_to_threshold": None if reached is None else sum(seconds[: reached + 1]),
        "last_window_reward": statistics.mean(reward[-a.window :]) if reward else None,
    }


def fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def report(results: dict[str, Any], a: argparse.Namespace) -> list[str]:
    lines = [
        f"arithmetic, long tail ({a.explain_share:g} of prompts ask for reasoning, max_completion_length "
        f"{a.max_completion_length}), async_prefetch, {a.steps} steps, seed {a.seed}, partial budget {a.budget}; "
        "means over steps 2..N",
        f"{'round':>5}{'arm':>10}{'s/step':>8}{'median':>8}{'wait gen':>9}{'fwd/bwd':>8}{'sync':>7}{'pause':>7}"
        f"{'resume':>7}{'gen s':>7}{'len':>7}{'max len':>8}{'cut':>6}{'tok stale':>10}{'max':>5}{'across':>8}"
        f"{'recomp':>8}{'s/group':>8}{'reward':>8}{'s to thr':>9}{'others':>8}",
    ]
    for entry in results["runs"]:
        s, m, machine = entry["summary"], entry["summary"]["mean_steps_2_on"], entry["machine"]
        per_token = entry["arm"] in ("inflight", "partial", "inflight_partial")
        stale = m["token_staleness/mean"] if per_token else m["staleness"]
        lines.append(
            f"{entry['round']:>5}{entry['arm']:>10}{fmt(m['step_time'], '.1f'):>8}"
            f"{fmt(s['median_step_seconds_2_on'], '.1f'):>8}{fmt(m['time/rollout'], '.1f'):>9}"
            f"{fmt(m['time/forward_backward'], '.1f'):>8}{fmt(m['time/weight_sync']):>7}"
            f"{fmt(m['inflight/pause_seconds']):>7}{fmt(m['inflight/resume_seconds']):>7}"
            f"{fmt(m['time/generation'], '.1f'):>7}{fmt(m['completions/mean_length'], '.0f'):>7}"
            f"{fmt(m['completions/max_length'], '.0f'):>8}{fmt(m['completions/clipped_ratio']):>6}"
            f"{fmt(stale):>10}{fmt(m['token_staleness/max'], '.0f'):>5}"
            f"{fmt(m['inflight/tokens_across_update'], '.0f'):>8}{fmt(m['inflight/recomputed_tokens'], '.0f'):>8}"
            f"{fmt(s['seconds_per_group_2_on'], '.1f'):>8}"
            f"{fmt(s['last_window_reward'], '.3f'):>8}{fmt(s['seconds_to_threshold'], '.0f'):>9}"
            f"{machine['others_cores_mean']:>8.2f}"
        )
    lines.append(
        "tok stale: per-token staleness for the inflight and partial arms, the batch's (every token labelled alike) "
        "for boundary; s/group: step seconds per prompt group trained (steps 2..N); "
        "across/recomp: tokens per step sampled after an update in a sample begun before it / prompt tokens "
        "computed again by continuations; others: cores other work used meanwhile (of "
        f"{results['cpu']['cores']}); reward: mean of the last {a.window} steps; s to thr: step seconds until the "
        f"moving mean over {a.window} steps of the reward reached {a.threshold}"
    )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=1, help="each round runs both arms, first arm alternating")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--arms", nargs="+", default=list(ARMS[:2]), choices=ARMS)
    parser.add_argument("--max-completion-length", type=int, default=256)
    parser.add_argument("--budget", type=int, default=64, help="partial arms: tokens per sample per batch")
    parser.add_argument("--explain-share", type=float, default=0.25)
    parser.add_argument("--window", type=int, default=3)
    parser.add_argument("--threshold", type=float, default=0.5, help="training reward (moving mean)")
    parser.add_argument("--workdir", type=Path, default=ROOT / "grpo-output" / "bench-inflight")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "inflight.json")
    parser.add_argument("--set", action="append", default=[], help="KEY=VALUE passed to both arms' grpo run")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    a = parser.parse_args()
    a.workdir = a.workdir.resolve()  # the runs start in the example's folder
    a.prompts_per_step = 32 // 8  # micro_batch_size 4 x gradient_accumulation_steps 8, num_generations 8

    a.workdir.mkdir(parents=True, exist_ok=True)
    data = long_tail_data(a.workdir, a.explain_share)
    results: dict[str, Any] = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "cpu": cpu_description()}
    results["runs"] = []
    for k in range(a.rounds):
        for arm in a.arms if k % 2 == 0 else a.arms[::-1]:
            out = a.workdir / f"round{k + 1}-{arm}"
            argv = command(arm, a, data, out)
            print(" ".join(argv), flush=True)
            if a.dry_run:
                continue
            records, machine = metered_run(argv, out, EXAMPLE)
            results["runs"].append({"round": k + 1, "arm": arm, "summary": summarise(records, a), "machine": machine})
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps(results, indent=1))  # after every run: a stopped invocation keeps what it has
    if not a.dry_run:
        print("\n".join(report(results, a)))


if __name__ == "__main__":
    main()
