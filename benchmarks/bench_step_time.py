"""Seconds per GRPO step: grpo (transformers rollout, vLLM server, vLLM
colocated) against TRL 1.16's GRPOTrainer, on the same model, data, rewards
and batch shape, in one invocation so the machine's state is shared.

    .venv/bin/python benchmarks/bench_step_time.py --steps 5 \
        --runners trl,grpo-transformers,grpo-vllm,grpo-vllm-colocate

Every runner trains SmolLM2-135M-Instruct with LoRA r=16 on the arithmetic
example's prompts with its batch shape: 4 prompts x 8 completions per step
(2 micro-batches of 16), 48 completion tokens. The first step of each runner
is warm-up and excluded (model load, server start, compilation).
``grpo-vllm`` is a managed server syncing merged weights through files,
``grpo-vllm-lora`` the same server hot-loading the adapter
(``vllm_lora_sync = true``), ``grpo-vllm-colocate`` vLLM in the trainer's
process with in-memory sync (``vllm_mode = "colocate"``); ``grpo-vllm-async``
the managed server with ``async_prefetch`` (engine and trainer on separate
cores, the default split) and ``grpo-vllm-async-nosplit`` the same with
``[vllm] engine_cpus = "all"``. Prints a table
with seconds per step, generated tokens per second, the ratio to TRL and the
start-up (process start to the first step: model load and engine start), and
writes benchmarks/results/step_time.json.
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
DATA = ROOT / "examples" / "arithmetic" / "data" / "train.jsonl"
PROMPTS_PER_STEP = 4
MICRO_BATCH = 16
NUM_GENERATIONS = 8
COMPLETION_TOKENS = 48
LORA_R = 16
LR = 1e-4


def run_trl(model_dir: str, steps: int, workdir: Path) -> dict:
    """TRL's GRPOTrainer with transformers generation (vLLM 0.32 is refused by TRL 1.16)."""
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, str(ROOT / "examples" / "arithmetic"))
    from rewards import correct_answer  # noqa: E402

    dataset = load_dataset("json", data_files=str(DATA), split="train")
    args = GRPOConfig(
        output_dir=str(workdir / "trl"),
        per_device_train_batch_size=MICRO_BATCH,
        gradient_accumulation_steps=PROMPTS_PER_STEP * NUM_GENERATIONS // MICRO_BATCH,
        num_generations=NUM_GENERATIONS,
        max_completion_length=COMPLETION_TOKENS,
        learning_rate=LR,
        max_steps=steps,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        temperature=1.0,
        seed=42,
    )
    times: list[float] = []
    tokens: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.t0)

        def on_log(self, _args, _state, _control, logs=None, **k):
            if logs and "completions/mean_length" in logs:
                tokens.append(logs["completions/mean_length"] * PROMPTS_PER_STEP * NUM_GENERATIONS)

    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=[correct_answer],
        args=args,
        train_dataset=dataset,
        peft_config=LoraConfig(r=LORA_R, lora_alpha=2 * LORA_R, target_modules="all-linear", task_type="CAUSAL_LM"),
        callbacks=[Timer()],
    )
    trainer.train()
    return {"step_seconds": times, "generated_tokens": tokens}


def grpo_config(
    model_dir: str,
    steps: int,
    workdir: Path,
    use_vllm: bool,
    lora_sync: bool = False,
    mode: str = "server",
    async_prefetch: bool = False,
    engine_cpus: str | None = None,
) -> dict:
    trl = {
        "num_generations": NUM_GENERATIONS,
        "max_completion_length": COMPLETION_TOKENS,
        "temperature": 1.0,
        "reward_funcs": ["rewards.correct_answer"],
        "use_vllm": use_vllm,
    }
    if use_vllm:
        trl.update(vllm_lora_sync=lora_sync, vllm_mode=mode, async_prefetch=async_prefetch)
    vllm = {"port": 0, "dtype": "auto", "max_model_len": 512, "cpu_kvcache_space": 2}
    if engine_cpus is not None:
        vllm["engine_cpus"] = engine_cpus
    return {
        "base_model": model_dir,
        "adapter": "lora",
        "lora_r": LORA_R,
        "lora_alpha": 2 * LORA_R,
        "datasets": [{"path": str(DATA)}],
        "sequence_len": 256,
        "micro_batch_size": MICRO_BATCH,
        "gradient_accumulation_steps": PROMPTS_PER_STEP * NUM_GENERATIONS // MICRO_BATCH,
        "max_steps": steps,
        "learning_rate": LR,
        "lr_scheduler": "constant",
        "output_dir": str(workdir / "grpo"),
        "seed": 42,
        "vllm": vllm,
        "trl": trl,
    }


def run_grpo(model_dir: str, steps: int, workdir: Path, use_vllm: bool, **options: object) -> dict:
    started = time.perf_counter()
    sys.path.insert(0, str(ROOT / "examples" / "arithmetic"))
    from grpo_core import hookimpl
    from grpo_core.config.loader import validate
    from grpo_core.host.plugin_host import PluginHost
    from grpo_core.training.run import run_training

    cfg = validate(grpo_config(model_dir, steps, workdir, use_vllm, **options))
    first_step_end: list[float] = []

    class FirstStep:
        @hookimpl
        def grpo_step_end(self, progress, metrics):
            if not first_step_end:
                first_step_end.append(time.perf_counter() - started)

    host = PluginHost()
    host.pm.register(FirstStep(), name="bench.first_step")
    run_training(cfg, host)
    records = [json.loads(line) for line in (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
    return {
        "startup_seconds": first_step_end[0] - records[0]["step_time"],
        "step_seconds": [r["step_time"] for r in records],
        "generated_tokens": [r["completions/mean_length"] * PROMPTS_PER_STEP * NUM_GENERATIONS for r in records],
        "generation_seconds": [r.get("time/generation", 0.0) for r in records],
        "sync_seconds": [r.get("time/weight_sync", 0.0) for r in records],
        "skipped": [r.get("skipped_zero_adv_samples", 0.0) for r in records],
    }


RUNNERS = {
    "trl": lambda m, s, w: run_trl(m, s, w),
    "grpo-transformers": lambda m, s, w: run_grpo(m, s, w, use_vllm=False),
    "grpo-vllm": lambda m, s, w: run_grpo(m, s, w, use_vllm=True),
    "grpo-vllm-lora": lambda m, s, w: run_grpo(m, s, w, use_vllm=True, lora_sync=True),
    "grpo-vllm-colocate": lambda m, s, w: run_grpo(m, s, w, use_vllm=True, mode="colocate"),
    # async_prefetch against the managed server: engine and trainer on separate cores (the
    # default split), and the same with the split turned off (both on every core)
    "grpo-vllm-async": lambda m, s, w: run_grpo(m, s, w, use_vllm=True, async_prefetch=True),
    "grpo-vllm-async-nosplit": lambda m, s, w: run_grpo(m, s, w, use_vllm=True, async_prefetch=True, engine_cpus="all"),
}


def summarise(result: dict) -> dict:
    steady = result["step_seconds"][1:] or result["step_seconds"]
    toks = result["generated_tokens"][1:] or result["generated_tokens"]
    mean = statistics.mean(steady)
    row = {
        "sec_per_step": mean,
        "tokens_per_sec": statistics.mean(toks) / mean if toks else float("nan"),
        "steps": len(steady),
    }
    if "startup_seconds" in result:  # process start to the first step's start: model load, engine start
        row["startup_seconds"] = result["startup_seconds"]
    for key in ("generation_seconds", "sync_seconds"):
        if key in result:
            row[key] = statistics.mean(result[key][1:] or result[key])
    if "skipped" in result:  # cumulative count of completions left out of training for zero advantage
        row["skipped_samples"] = result["skipped"][-1] - (result["skipped"][0] if len(result["skipped"]) > 1 else 0)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--runners", default="trl,grpo-transformers,grpo-vllm,grpo-vllm-colocate")
    parser.add_argument("--runner", help=argparse.SUPPRESS)  # child-process mode
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()

    from grpo_core.modeling.model_files import DEFAULT_MODEL, resolve_model_dir

    model_dir = resolve_model_dir(DEFAULT_MODEL)
    if args.runner:  # one runner per process: no state leaks between peers
        with tempfile.TemporaryDirectory() as tmp:
            result = RUNNERS[args.runner](model_dir, args.steps, Path(tmp))
        Path(args.out).write_text(json.dumps(result))
        return

    summary: dict[str, dict] = {}
    for name in args.runners.split(","):
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
            out = handle.name
        cmd = [sys.executable, __file__, "--runner", name, "--steps", str(args.steps), "--out", out]
        print(f"--- {name}", flush=True)
        subprocess.run(cmd, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        summary[name] = summarise(json.loads(Path(out).read_text()))
        os.unlink(out)

    base = summary.get("trl")
    print(
        f"\n{'runner':<24}{'s/step':>10}{'gen tok/s':>12}{'speed-up vs TRL':>18}{'generate s':>12}{'sync s':>9}"
        f"{'skipped rows':>13}{'start-up s':>12}"
    )
    for name, row in summary.items():
        ratio = base["sec_per_step"] / row["sec_per_step"] if base else float("nan")
        row["speedup_vs_trl"] = ratio
        phases = "".join(
            f"{row[k]:>{w}.2f}" if k in row else f"{'-':>{w}}"
            for k, w in (("generation_seconds", 12), ("sync_seconds", 9))
        )
        skipped = f"{row['skipped_samples']:>13.0f}" if "skipped_samples" in row else f"{'-':>13}"
        startup = f"{row['startup_seconds']:>12.1f}" if "startup_seconds" in row else f"{'-':>12}"
        print(
            f"{name:<24}{row['sec_per_step']:>10.2f}{row['tokens_per_sec']:>12.1f}{ratio:>17.2f}x{phases}{skipped}{startup}"
        )
    results = HERE / "results"
    results.mkdir(exist_ok=True)
    (results / "step_time.json").write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
