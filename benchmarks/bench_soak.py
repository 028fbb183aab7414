"""A long run stays flat: what a `grpo run` holds over hundreds of steps with
every moving part on and faults injected.

    .venv/bin/python benchmarks/bench_soak.py [--steps 300] [--restart-every 100] [--worker-kill-every 40]

One real `grpo run` (SmolLM2-135M-Instruct, LoRA r4, 2 prompts x 2
completions of 8 tokens a step) through a managed vLLM server, with
``async_prefetch``, ``streaming_partial_batch``, a replay buffer, two reward
worker processes, a checkpoint every 25 steps (two kept) and a weight-sync
check after every sync. While it runs this script kills the server's process
group every ``--restart-every`` steps (the run restarts it and re-applies the
last sync) and one reward worker every ``--worker-kill-every`` steps (it is
replaced; the rewards it was computing are scored None, as
``reward_error_policy = "none"`` says), and samples the trainer process every
``--sample-s`` seconds: its resident memory, open file descriptors, threads,
live descendant processes, and the bytes under its private temporary folder
(scratch: weight-sync files, sockets) and its output folder.

The verdict compares the worst value of each series in the first third after
warm-up with the worst in the last third; :data:`BOUNDS` says how much growth
is allowed. Prints a table and the verdict, writes every sample to ``--out``
(JSON). ``tests/e2e/reliability/test_soak.py`` runs a short version and asserts
the same bounds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

MIB = 1 << 20

BOUNDS = {
    "trainer_rss": 96 * MIB,  # bytes: allocator noise and caches that fill once, not a leak per step
    "fds": 4,
    "threads": 4,
    "descendants": 0,
    "scratch_bytes": 16 * MIB,
}
"""The growth allowed from the first third of the run after warm-up to its last third."""

REWARDS = '''
def varied(completions, **kwargs):
    """Differs within a group (text length mod 3), so most steps train and every one syncs."""
    return [float(len(c[0]["content"] if isinstance(c, list) else c) % 3) / 2.0 for c in completions]
'''


@dataclass
class Sample:
    seconds: float
    step: int
    trainer_rss: int
    fds: int
    threads: int
    descendants: int
    scratch_bytes: int
    output_bytes: int


@dataclass
class SoakResult:
    exit_code: int
    steps: int
    server_kills: int
    worker_kills: int
    server_starts: int
    samples: list[Sample] = field(default_factory=list)
    reward_worker_pids: list[int] = field(default_factory=list)  # every worker process seen, in order
    scratch_left: list[str] = field(default_factory=list)  # what the run left in its TMPDIR after it exited
    output_tail: str = ""

    def growth(self, warmup_steps: int) -> dict[str, float]:
        """Worst value in the last third minus worst in the first third, after ``warmup_steps``."""
        after = [s for s in self.samples if s.step >= warmup_steps]
        if len(after) < 6:
            raise RuntimeError(f"only {len(after)} samples after warm-up: run more steps or sample more often")
        third = len(after) // 3
        first, last = after[:third], after[-third:]
        return {key: max(getattr(s, key) for s in last) - max(getattr(s, key) for s in first) for key in BOUNDS}

    def over_bounds(self, warmup_steps: int) -> dict[str, float]:
        return {key: value for key, value in self.growth(warmup_steps).items() if value > BOUNDS[key]}


def _tree_bytes(root: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass  # removed while walking
    return total


def _steps_done(out: Path) -> int:
    try:
        return sum(1 for _ in (out / "metrics.jsonl").open())
    except OSError:
        return 0


def write_run(work: Path, model_dir: str, steps: int) -> Path:
    """The soak run's dataset, reward module and config under ``work``."""
    import tomli_w

    rows = [{"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}]} for a in range(8) for b in range(8)]
    (work / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (work / "soak_rewards.py").write_text(REWARDS)
    config = {
        "base_model": model_dir,
        "adapter": "lora",
        "lora_r": 4,
        "lora_alpha": 8,
        "sequence_len": 256,
        "datasets": [{"path": str(work / "train.jsonl")}],
        "micro_batch_size": 4,
        "gradient_accumulation_steps": 1,
        "max_steps": steps,
        "learning_rate": 1e-4,
        "lr_scheduler": "constant",
        "output_dir": str(work / "out"),
        "save_steps": 25,
        "save_total_limit": 2,
        "seed": 3,
        "vllm": {"host": "127.0.0.1", "port": 0, "dtype": "float32", "max_model_len": 256, "cpu_kvcache_space": 1},
        "trl": {
            "use_vllm": True,
            "vllm_lora_sync": True,
            "vllm_server_timeout": 120,
            "num_generations": 2,
            "max_completion_length": 8,
            "reward_funcs": ["soak_rewards.varied"],
            "reward_num_workers": 2,
            "reward_error_policy": "none",
            "async_prefetch": True,
            "streaming_partial_batch": True,
            "replay_buffer_size": 8,
        },
    }
    path = work / "soak.toml"
    path.write_text(tomli_w.dumps(config))
    return path


def _live_descendants(trainer: psutil.Process) -> int:
    """Descendants that are running (a killed one is a zombie until its parent reaps it)."""
    count = 0
    for child in trainer.children(recursive=True):
        try:
            count += child.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            pass
    return count


def _reward_workers(trainer: psutil.Process) -> list[psutil.Process]:
    found = []
    for child in trainer.children(recursive=False):
        try:
            if "spawn_main" in " ".join(child.cmdline()) and child.status() != psutil.STATUS_ZOMBIE:
                found.append(child)
        except psutil.Error:
            pass
    return found


def soak(
    work: Path,
    steps: int,
    restart_every: int,
    worker_kill_every: int,
    sample_s: float = 2.0,
    timeout_s: float = 7200.0,
    log=print,
) -> SoakResult:
    """Run the soak under ``work`` (made fresh) and return what was sampled."""
    import shutil
    import tempfile

    from grpo_core.modeling.model_files import DEFAULT_MODEL, resolve_model_dir

    work.mkdir(parents=True, exist_ok=True)
    # The run's TMPDIR: its scratch space is everything under it. Short, under the system's own
    # temporary directory, so the server's engine sockets (107-byte paths at most) fit in it.
    scratch = Path(tempfile.mkdtemp(prefix="grpo-soak-"))
    config = write_run(work, resolve_model_dir(DEFAULT_MODEL), steps)
    out = work / "out"
    grpo = Path(sys.executable).with_name("grpo")
    env = {
        **os.environ,
        "TMPDIR": str(scratch),
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (str(work), os.environ.get("PYTHONPATH", "")) if p),
    }
    log_file = work / "run.out"
    with open(log_file, "wb") as sink:
        run = subprocess.Popen([str(grpo), "run", str(config)], stdout=sink, stderr=subprocess.STDOUT, env=env)  # noqa: S603
    trainer = psutil.Process(run.pid)
    result = SoakResult(exit_code=-1, steps=0, server_kills=0, worker_kills=0, server_starts=0)
    start = time.monotonic()
    next_restart, next_worker_kill = restart_every, worker_kill_every
    try:
        while run.poll() is None:
            if time.monotonic() - start > timeout_s:
                raise TimeoutError(f"the soak run did not finish in {timeout_s:.0f} s")
            step = _steps_done(out)
            try:
                with trainer.oneshot():
                    sample = Sample(
                        seconds=round(time.monotonic() - start, 1),
                        step=step,
                        trainer_rss=trainer.memory_info().rss,
                        fds=trainer.num_fds(),
                        threads=trainer.num_threads(),
                        descendants=_live_descendants(trainer),
                        scratch_bytes=_tree_bytes(scratch),
                        output_bytes=_tree_bytes(out),
                    )
            except psutil.NoSuchProcess:
                break
            result.samples.append(sample)
            for worker in _reward_workers(trainer):
                if worker.pid not in result.reward_worker_pids:
                    result.reward_worker_pids.append(worker.pid)
            if restart_every and step >= next_restart and step < steps:
                pids = re.findall(r"vLLM: starting server \(pid (\d+)\)", log_file.read_text(errors="replace"))
                if pids:
                    log(f"step {step}: killing the vLLM server group {pids[-1]}")
                    try:
                        os.killpg(int(pids[-1]), signal.SIGKILL)
                        result.server_kills += 1
                    except ProcessLookupError:
                        pass
                next_restart += restart_every
            if worker_kill_every and step >= next_worker_kill and step < steps:
                workers = _reward_workers(trainer)
                if workers:
                    log(f"step {step}: killing reward worker {workers[0].pid}")
                    workers[0].kill()
                    result.worker_kills += 1
                next_worker_kill += worker_kill_every
            time.sleep(sample_s)
    finally:
        if run.poll() is None:
            run.kill()
        result.exit_code = run.wait()
    result.scratch_left = sorted(p.name for p in scratch.iterdir())
    shutil.rmtree(scratch, ignore_errors=True)
    text = log_file.read_text(errors="replace")
    result.steps = _steps_done(out)
    result.server_starts = len(re.findall(r"vLLM: starting server \(pid (\d+)\)", text))
    result.output_tail = text[-4000:]
    return result


def _table(result: SoakResult, rows: int = 12) -> str:
    picks = result.samples[:: max(1, len(result.samples) // rows)] + result.samples[-1:]
    lines = [
        "| s | step | trainer RSS MiB | fds | threads | descendants | scratch MiB | output MiB |",
        "|" + "---|" * 8,
    ]
    for s in picks:
        lines.append(
            f"| {s.seconds:.0f} | {s.step} | {s.trainer_rss / MIB:.0f} | {s.fds} | {s.threads} | {s.descendants} | "
            f"{s.scratch_bytes / MIB:.1f} | {s.output_bytes / MIB:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--restart-every", type=int, default=100)
    parser.add_argument("--worker-kill-every", type=int, default=40)
    parser.add_argument("--warmup-steps", type=int, default=None, help="default: a tenth of the steps")
    parser.add_argument("--sample-s", type=float, default=2.0)
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "soak.json")
    args = parser.parse_args()

    import tempfile

    from grpo_core.modeling.precision import cpu_flag_summary

    work = args.work or Path(tempfile.mkdtemp(prefix="grpo-soak-"))
    result = soak(work, args.steps, args.restart_every, args.worker_kill_every, args.sample_s)
    warmup = args.warmup_steps if args.warmup_steps is not None else max(5, args.steps // 10)
    print(f"CPU: {cpu_flag_summary()}; {os.cpu_count()} cores")
    print(
        f"exit code {result.exit_code}; {result.steps} steps; server killed {result.server_kills}x "
        f"({result.server_starts} starts); reward workers killed {result.worker_kills}x"
    )
    print(_table(result))
    growth = result.growth(warmup)
    for key, value in growth.items():
        shown = f"{value / MIB:+.1f} MiB" if key.endswith(("rss", "bytes")) else f"{value:+.0f}"
        bound = f"{BOUNDS[key] / MIB:.0f} MiB" if key.endswith(("rss", "bytes")) else str(BOUNDS[key])
        print(f"{key}: {shown} (bound {bound}) {'OK' if value <= BOUNDS[key] else 'OVER'}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "cpu": cpu_flag_summary(),
                "args": {k: str(v) for k, v in vars(args).items()},
                "result": asdict(result),
                "growth": growth,
            },
            indent=1,
        )
    )
    if result.exit_code != 0 or result.over_bounds(warmup):
        print(result.output_tail, file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
