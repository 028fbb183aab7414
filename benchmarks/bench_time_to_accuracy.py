"""Wall time to 50%, 70% and 85% held-out accuracy: grpo against TRL's
GRPOTrainer, in one invocation.

    .venv/bin/python benchmarks/bench_time_to_accuracy.py --steps 60 --every 5 \
        --runners trl,grpo

The task is the arithmetic example (examples/arithmetic): SmolLM2-135M-Instruct
+ LoRA r=16 on all linear layers, 4 prompts x 8 completions per step (2
micro-batches of 16), 48 completion tokens, lr 1e-4 constant after 2 warm-up
steps, rewards ``correct_answer`` (1.0) + ``short_answer`` (0.2), seed 42
(``--seed``: the same seed for every runner).
Each runner trains in its own process:

- ``trl``: TRL's GRPOTrainer with its own defaults for everything not listed
  above (transformers generation: TRL 1.16 refuses this vLLM), in the
  precision grpo's ``bf16 = "auto"`` picks on this CPU (bf16 autocast where
  the CPU computes bf16 natively, float32 elsewhere), so both runners do
  their arithmetic alike; ``trl-bf16`` / ``trl-fp32`` force one.
- ``grpo``: grpo's best setup for a CPU: vLLM colocated in the trainer's
  process (``vllm_mode = "colocate"``, in-memory sync), ``bf16 = "auto"`` and
  ``[vllm] dtype = "auto"`` (bf16 where the CPU computes it natively, float32
  elsewhere), zero-advantage completions left out of training (grpo's default).
- ``grpo-bf16`` / ``grpo-fp32``: the same with ``bf16`` forced on / off, for the
  precision table.

Every ``--every`` steps a runner saves its adapter; the seconds spent saving
are excluded from its clock, which starts before the model loads (so start-up
counts). After all runners finished, one process scores every saved adapter
with the same evaluator, ``grpo eval``'s: the 64 held-out prompts of
examples/arithmetic/data/test.jsonl (no (a, b) pair of them is in training),
greedy decoding with transformers, the ``correct_answer`` reward. Evaluation
time is therefore excluded from both runners, and both are judged by the same
code. A threshold counts as reached at the first evaluation at or above it.

Where the CPU computes bf16 natively, run TRL both ways (``--runners
grpo,trl-fp32,trl``): each threshold's ratio is taken against the TRL run that
reached it first, so grpo is compared with TRL's faster precision there.

Is the machine quiet? Each runner records the share of CPU time the
hypervisor stole while it ran (``/proc/stat``), and the parent times fixed
work (a float32 ``mm``, a 256 MiB copy) before each runner and after the
last: a ratio between runners that ran while the machine changed speed is
flagged in the summary. Both were added after runs on the same machine gave
3.3x and 4.0x, TRL's unchanged step taking 32 s in one and 43 s in the other.

Step time on identical work: the mean over steps (warm-up step excluded) in
which grpo trained every completion, against TRL's mean step; grpo's steps
that left out zero-advantage completions are reported on their own line.
Writes benchmarks/results/time_to_accuracy_raw.json (``--raw-out``) and the
summary beside it (time_to_accuracy.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
EXAMPLE = ROOT / "examples" / "arithmetic"
TRAIN = EXAMPLE / "data" / "train.jsonl"
TEST = EXAMPLE / "data" / "test.jsonl"
PROMPTS_PER_STEP = 4
MICRO_BATCH = 16
NUM_GENERATIONS = 8
COMPLETION_TOKENS = 48
LORA_R = 16
LR = 1e-4
WARMUP = 2
REWARD_WEIGHTS = (1.0, 0.2)
THRESHOLDS = (0.50, 0.70, 0.85)


def cpu_ticks() -> tuple[int, int] | None:
    """(stolen, all) CPU ticks of the whole machine so far (``/proc/stat``), or None off Linux."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    return (fields[7] if len(fields) > 7 else 0), sum(fields)


def machine_speed(repeats: int = 100) -> dict[str, float]:
    """This machine's speed now, on fixed work, measured as bench_ceiling.py
    measures its ceilings: float32 ``mm`` GFLOP/s at 1024^3, and copy and
    read GB/s over 256 MiB, each the median of ``repeats`` samples (about
    10 s in all). Taken before each runner and after the last, so a machine that changed speed
    between the runners' halves shows as such (TRL's unchanged float32 mean
    step took 32-43 s across runs, under 1% of the CPU stolen in the two runs
    that recorded it)."""
    import torch
    from bench_ceiling import bandwidth_gbs, mm_gflops

    bandwidth = bandwidth_gbs(repeats, mib=256)
    return {
        "mm_gflops": mm_gflops(1024, 1024, 1024, torch.float32, repeats),
        "copy_gbs": bandwidth["copy (read + write)"],
        "read_gbs": bandwidth["read (sum)"],
    }


class Clock:
    """Seconds since the runner started, less the seconds set aside (saving);
    and the share of the machine's CPU time the hypervisor stole meanwhile
    (a virtual machine's neighbours: 35-51% stolen was seen on this project's
    machines, with a bf16 matmul at 206-290 GFLOP/s instead of 530-630)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.excluded = 0.0
        self.ticks = cpu_ticks()

    def now(self) -> float:
        return time.perf_counter() - self.start - self.excluded

    def steal_share(self) -> float | None:
        """Stolen CPU time over all CPU time since the runner started."""
        now = cpu_ticks()
        if now is None or self.ticks is None or now[1] == self.ticks[1]:
            return None
        return (now[0] - self.ticks[0]) / (now[1] - self.ticks[1])


def run_trl(
    model_dir: str, steps: int, every: int, save_dir: Path, clock: Clock, seed: int, bf16: bool | None = None
) -> dict:
    """TRL's run; ``bf16=None``: as grpo's ``bf16 = "auto"`` decides on this CPU."""
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from grpo_core.modeling.precision import native_bf16

    sys.path.insert(0, str(EXAMPLE))
    from rewards import correct_answer, short_answer  # noqa: E402

    dataset = load_dataset("json", data_files=str(TRAIN), split="train")
    args = GRPOConfig(
        output_dir=str(save_dir / "trl-run"),
        per_device_train_batch_size=MICRO_BATCH,
        gradient_accumulation_steps=PROMPTS_PER_STEP * NUM_GENERATIONS // MICRO_BATCH,
        num_generations=NUM_GENERATIONS,
        max_completion_length=COMPLETION_TOKENS,
        learning_rate=LR,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=WARMUP,
        reward_weights=list(REWARD_WEIGHTS),
        max_steps=steps,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        bf16=native_bf16("cpu") if bf16 is None else bf16,
        save_strategy="no",
        temperature=1.0,
        seed=seed,
    )
    step_ends: list[float] = []
    step_seconds: list[float] = []
    load: list[float] = []  # 1-minute load average at each step's end: was anything else running?
    steal: list[float | None] = []  # the CPU share stolen since the start, at each step's end
    saved: dict[int, str] = {}

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t0 = clock.now()

        def on_step_end(self, _args, state, _control, model=None, **k):
            step_seconds.append(clock.now() - self.t0)
            step_ends.append(clock.now())
            load.append(os.getloadavg()[0])
            steal.append(clock.steal_share())
            if state.global_step % every == 0 or state.global_step == steps:
                began = time.perf_counter()
                target = save_dir / f"trl-step-{state.global_step}"
                model.save_pretrained(str(target))
                saved[state.global_step] = str(target)
                clock.excluded += time.perf_counter() - began

    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=[correct_answer, short_answer],
        args=args,
        train_dataset=dataset,
        peft_config=LoraConfig(r=LORA_R, lora_alpha=2 * LORA_R, target_modules="all-linear", task_type="CAUSAL_LM"),
        callbacks=[Timer()],
    )
    trainer.train()
    return {
        "bf16": bool(args.bf16),
        "step_end_seconds": step_ends,
        "step_seconds": step_seconds,
        "skipped_micro_batches": [0] * len(step_ends),
        "load_average": load,
        "steal_share": steal,
        "adapters": saved,
    }


def grpo_config(model_dir: str, steps: int, every: int, output_dir: Path, bf16: bool | str, seed: int = 42) -> dict:
    return {
        "base_model": model_dir,
        "adapter": "lora",
        "lora_r": LORA_R,
        "lora_alpha": 2 * LORA_R,
        "lora_target_linear": True,
        "datasets": [{"path": str(TRAIN)}],
        "sequence_len": 256,
        "micro_batch_size": MICRO_BATCH,
        "gradient_accumulation_steps": PROMPTS_PER_STEP * NUM_GENERATIONS // MICRO_BATCH,
        "max_steps": steps,
        "learning_rate": LR,
        "lr_scheduler": "constant_with_warmup",
        "warmup_steps": WARMUP,
        "bf16": bf16,
        "output_dir": str(output_dir),
        "save_steps": every,
        "logging_steps": 1,
        "seed": seed,
        "vllm": {"dtype": "auto", "max_model_len": 512, "cpu_kvcache_space": 2},
        "trl": {
            "use_vllm": True,
            "vllm_mode": "colocate",
            "num_generations": NUM_GENERATIONS,
            "max_completion_length": COMPLETION_TOKENS,
            "temperature": 1.0,
            "reward_funcs": ["rewards.correct_answer", "rewards.short_answer"],
            "reward_weights": list(REWARD_WEIGHTS),
        },
    }


def run_grpo(model_dir: str, steps: int, every: int, save_dir: Path, clock: Clock, seed: int, bf16: bool | str) -> dict:
    sys.path.insert(0, str(EXAMPLE))
    from grpo_core import hookimpl
    from grpo_core.config.loader import validate
    from grpo_core.host.plugin_host import PluginHost
    from grpo_core.training.run import run_training

    output_dir = save_dir / "grpo-run"
    cfg = validate(grpo_config(model_dir, steps, every, output_dir, bf16, seed))
    step_ends: list[float] = []
    load: list[float] = []
    steal: list[float | None] = []

    class StepTimes:
        @hookimpl
        def grpo_step_end(self, progress, metrics):
            # A checkpoint is timed in the step after it (time/checkpoint): set it aside.
            clock.excluded += float(metrics.get("time/checkpoint", 0.0))
            step_ends.append(clock.now())
            load.append(os.getloadavg()[0])
            steal.append(clock.steal_share())

    host = PluginHost()
    host.pm.register(StepTimes(), name="bench.step_times")
    run_training(cfg, host)
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]

    def per_step(key: str) -> list[float]:  # the metrics are cumulative
        total = [r.get(key, 0.0) for r in records]
        return [s - (total[i - 1] if i else 0.0) for i, s in enumerate(total)]

    adapters = {}
    for step in range(every, steps + 1, every):
        path = output_dir / f"checkpoint-{step}" / "model"
        adapters[step] = str(path if path.is_dir() else output_dir)  # the last step's model is the final save
    adapters[steps] = str(output_dir)
    from grpo_core.modeling.precision import native_bf16

    return {
        "bf16": native_bf16("cpu") if bf16 == "auto" else bool(bf16),
        "step_end_seconds": step_ends,
        "step_seconds": [r["step_time"] - r.get("time/checkpoint", 0.0) for r in records],
        "skipped_micro_batches": per_step("skipped_zero_adv_batches"),
        "skipped_samples": per_step("skipped_zero_adv_samples"),
        "load_average": load,
        "steal_share": steal,
        "adapters": adapters,
    }


RUNNERS = {
    "trl": lambda *run: run_trl(*run),
    "trl-bf16": lambda *run: run_trl(*run, bf16=True),
    "trl-fp32": lambda *run: run_trl(*run, bf16=False),
    "grpo": lambda *run: run_grpo(*run, bf16="auto"),
    "grpo-bf16": lambda *run: run_grpo(*run, bf16=True),
    "grpo-fp32": lambda *run: run_grpo(*run, bf16=False),
}


def evaluate_adapters(adapters: list[str | None]) -> list[float]:
    """Held-out greedy accuracy of each adapter (``None``: the base model),
    with ``grpo eval``'s evaluator, in this one process."""
    sys.path.insert(0, str(EXAMPLE))
    from grpo_core.config.loader import load_config
    from grpo_core.host.plugin_host import PluginHost
    from grpo_core.interface.tools import run_eval

    cfg = load_config(
        str(EXAMPLE / "config.toml"),
        overrides=[
            f'test_datasets=[{{path = "{TEST.as_posix()}"}}]',
            "trl.use_vllm=false",
            'trl.reward_funcs=["rewards.correct_answer"]',
            "trl.reward_weights=[1.0]",
            f"trl.max_completion_length={COMPLETION_TOKENS}",
        ],
    )
    # A fresh host per adapter: each evaluation loads its own rollout implementation.
    return [run_eval(cfg, PluginHost(), adapter)["eval/rewards/correct_answer/mean"] for adapter in adapters]


def report(name: str, run: dict, accuracy: dict[int, float]) -> dict:
    ends, seconds = run["step_end_seconds"], run["step_seconds"]
    startup = ends[0] - seconds[0] if ends else None
    median = statistics.median(seconds[1:] or seconds)
    reached = {}
    for threshold in THRESHOLDS:
        hit = next((step for step in sorted(accuracy) if accuracy[step] >= threshold), None)
        # Wall time only: a "start-up + steps x median step" estimate was tried and dropped, because
        # answers shorten as a policy learns, so the early steps that reach a threshold cost more
        # than the run's median step (it under-stated both runners' times by 30-40% on a quiet machine).
        reached[f"{threshold:.0%}"] = {"step": hit, "seconds": ends[hit - 1] if hit else None}
    steady = list(range(1, len(seconds)))  # the first step is warm-up
    # a step that left out zero-advantage completions did less work: not "identical"
    left_out = run.get("skipped_samples") or run["skipped_micro_batches"]
    trained = [i for i in steady if not left_out[i]]
    skipped = [i for i in steady if left_out[i]]
    mean = lambda idx: statistics.mean(seconds[i] for i in idx) if idx else None  # noqa: E731
    load = run.get("load_average") or []
    steal = [v for v in run.get("steal_share") or [] if v is not None]
    return {
        "runner": name,
        "reached": reached,
        "accuracy": {str(k): v for k, v in sorted(accuracy.items())},
        "trained_step_seconds": mean(trained),
        "trained_steps": len(trained),
        "skipped_step_seconds": mean(skipped),
        "skipped_steps": len(skipped),
        "median_step_seconds": median,
        "startup_seconds": startup,
        "bf16": run.get("bf16"),
        "load_average": {"mean": statistics.mean(load), "max": max(load)} if load else None,
        "steal_share": steal[-1] if steal else None,
    }  # over the whole run: each value is since the start


def summarize(raw: dict, out: Path | None = None) -> None:
    """Print the tables from one run's raw data and write the results file (``out``)."""
    base = raw["base_accuracy"]
    rows = [
        report(name, run, {0: base} | {int(k): v for k, v in raw["accuracy"][name].items()})
        for name, run in raw["runs"].items()
    ]
    peers = [r for r in rows if r["runner"].startswith("trl")]  # TRL in each precision run
    print(
        f"\nCPU flags: {raw['cpu_flags']}; {raw.get('cores', '?')} cores; started {raw['started']}; "
        f"seed {raw.get('seed', 42)}"
    )
    print(f"base model held-out accuracy: {base:.1%}")
    print(
        "\nwall seconds to each held-out accuracy (eval and saving excluded); a ratio is against the TRL run "
        "that got there first"
    )
    print(f"{'runner':<12}" + "".join(f"{'to ' + t:>20}" for t in ("50%", "70%", "85%")))
    for row in rows:
        cells = ""
        for threshold in ("50%", "70%", "85%"):
            hit = row["reached"][threshold]
            if hit["seconds"] is None:
                cells += f"{'not reached':>20}"
                continue
            peer_times = [p["reached"][threshold]["seconds"] for p in peers if p["reached"][threshold]["seconds"]]
            ratio = f" {min(peer_times) / hit['seconds']:.1f}x" if peer_times and row not in peers else ""
            cell = f"{hit['seconds']:.0f}s (step {hit['step']}){ratio}"
            cells += f"{cell:>20}"
        print(f"{row['runner']:<12}{cells}")
    print(
        f"\n{'runner':<12}{'best acc':>10}{'trained s/step':>18}{'skipped s/step':>16}{'median s/step':>15}"
        f"{'start-up s':>12}{'load avg':>14}{'CPU stolen':>12}"
    )
    for row in rows:
        skipped = f"{row['skipped_step_seconds']:.2f} ({row['skipped_steps']})" if row["skipped_steps"] else "-"
        load = f"{row['load_average']['mean']:.1f} / {row['load_average']['max']:.1f}" if row["load_average"] else "-"
        steal = f"{row['steal_share']:.1%}" if row.get("steal_share") is not None else "-"
        print(
            f"{row['runner']:<12}{max(row['accuracy'].values()):>10.1%}{row['trained_step_seconds']:>12.2f} "
            f"({row['trained_steps']}){skipped:>16}{row['median_step_seconds']:>15.2f}{row['startup_seconds']:>12.0f}"
            f"{load:>14}{steal:>12}"
        )
        precision = "bf16 autocast" if row["bf16"] else "float32" if row["bf16"] is False else "not recorded"
        print(f"    precision: {precision}")
        print("    accuracy by step: " + ", ".join(f"{k}: {v:.0%}" for k, v in row["accuracy"].items()))
    speeds = raw.get("machine_speed") or []
    if len(speeds) == len(rows) + 1:
        print(
            "\nmachine speed before each runner and after the last (float32 mm GFLOP/s, copy GB/s): "
            + ", ".join(
                f"{name} {s['mm_gflops']:.0f} / {s['copy_gbs']:.1f}"
                for name, s in zip([r["runner"] for r in rows] + ["end"], speeds)
            )
        )
        rates = [s["mm_gflops"] for s in speeds]
        if max(rates) > 1.1 * min(rates):
            print(
                f"the machine's matmul rate moved {max(rates) / min(rates) - 1:.0%} during the run: not a steady "
                "machine, and the ratios above carry that change"
            )
    stolen = [r["steal_share"] for r in rows if r.get("steal_share") is not None]
    if len(stolen) > 1 and max(stolen) - min(stolen) > 0.05:
        print(
            f"\nthe hypervisor stole {min(stolen):.0%}-{max(stolen):.0%} of the CPU time, differently per runner: "
            "not a quiet machine, and the ratios above carry that difference"
        )
    for peer in peers:
        for row in rows:
            if row not in peers and row["trained_step_seconds"]:
                print(
                    f"step time on identical work, {row['runner']} vs {peer['runner']}: "
                    f"{peer['trained_step_seconds'] / row['trained_step_seconds']:.2f}x "
                    f"({row['trained_steps']} steps that trained every micro-batch)"
                )
    if out is None:
        return
    out.write_text(
        json.dumps(
            {
                **{k: raw[k] for k in ("cpu_flags", "started", "base_accuracy")},
                "seed": raw.get("seed", 42),
                "runners": rows,
            },
            indent=2,
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=5, help="save (and later evaluate) every this many steps")
    parser.add_argument("--runners", default="trl,grpo")
    parser.add_argument(
        "--seed",
        type=int,
        default=42,
        help="every runner's seed (sampling, data order, LoRA init): "
        "a threshold's step is one draw of a learning curve, so compare over several seeds",
    )
    parser.add_argument(
        "--raw-out",
        default=str(HERE / "results" / "time_to_accuracy_raw.json"),
        help="where to keep this run's raw data (a runner-only run should not overwrite the main one)",
    )
    parser.add_argument(
        "--report",
        metavar="RAW_JSON",
        help="print the tables again from a run's raw data (benchmarks/results/time_to_accuracy_raw.json)",
    )
    parser.add_argument("--runner", help=argparse.SUPPRESS)  # child-process mode
    parser.add_argument("--save-dir", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.report:
        summarize(json.loads(Path(args.report).read_text()))
        return
    if args.runner:  # one runner per process: no state leaks between peers
        clock = Clock()
        from grpo_core.modeling.model_files import DEFAULT_MODEL, resolve_model_dir

        model_dir = resolve_model_dir(DEFAULT_MODEL)
        result = RUNNERS[args.runner](model_dir, args.steps, args.every, Path(args.save_dir), clock, args.seed)
        Path(args.out).write_text(json.dumps(result))
        return

    from grpo_core.modeling.model_files import DEFAULT_MODEL, resolve_model_dir
    from grpo_core.modeling.precision import cpu_flag_summary

    resolve_model_dir(DEFAULT_MODEL)  # convert the GGUF once, outside every runner's clock
    started = time.strftime("%Y-%m-%d %H:%M")
    runs: dict[str, dict] = {}
    speeds: list[dict[str, float]] = []  # before each runner, and after the last
    with tempfile.TemporaryDirectory(prefix="grpo-tta-") as tmp:
        for name in args.runners.split(","):
            out, save_dir = Path(tmp) / f"{name}.json", Path(tmp) / name
            save_dir.mkdir()
            speeds.append(machine_speed())
            print(
                f"--- {name} (machine: {speeds[-1]['mm_gflops']:.0f} GFLOP/s float32 mm, "
                f"{speeds[-1]['copy_gbs']:.1f} GB/s copy)",
                flush=True,
            )
            cmd = [
                sys.executable,
                __file__,
                "--runner",
                name,
                "--steps",
                str(args.steps),
                "--every",
                str(args.every),
                "--seed",
                str(args.seed),
                "--save-dir",
                str(save_dir),
                "--out",
                str(out),
            ]
            subprocess.run(cmd, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
            runs[name] = json.loads(out.read_text())
        speeds.append(machine_speed())
        print("--- evaluating every saved adapter (one evaluator for all runners)", flush=True)
        order = [(None, None, 0)] + [
            (name, path, int(step)) for name, run in runs.items() for step, path in run["adapters"].items()
        ]
        scores = evaluate_adapters([path for _, path, _ in order])
    raw = {
        "cpu_flags": cpu_flag_summary(),
        "cores": os.cpu_count(),
        "started": started,
        "seed": args.seed,
        "base_accuracy": scores[0],
        "runs": runs,
        "machine_speed": speeds,
        "accuracy": {
            name: {str(step): score for (who, _, step), score in zip(order, scores) if who == name} for name in runs
        },
    }
    Path(args.raw_out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.raw_out).write_text(json.dumps(raw, indent=2))
    raw_out = Path(args.raw_out)
    summarize(raw, raw_out.with_name(raw_out.name.replace("_raw", "")))


if __name__ == "__main__":
    main()
