"""Step-0 base rates of the multi-turn examples: how often the untrained
model calls the tool, and solves the task, before any training.

A GRPO run learns only from groups with reward variance, so an episode task
needs a base model that succeeds some of the time. This runs the examples'
episodes through a vLLM server (the same driver and environments as
``grpo run``) with no training, and prints per tool-call format:

    python benchmarks/bench_episode_base_rate.py --prompts 16 --samples 8
    python benchmarks/bench_episode_base_rate.py --base-url http://127.0.0.1:PORT --api-key KEY

Without ``--base-url`` it starts a managed server (about a minute).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "calculator"))
sys.path.insert(0, str(ROOT / "examples" / "guess-number" / "src"))


def _config(model_dir: str, out: Path, base_url: str | None, api_key: str | None, **trl: object):
    from grpo_core.config.loader import validate

    table = {"use_vllm": True, "vllm_server_timeout": 900, "max_completion_length": 128, **trl}
    if base_url:
        table.update(vllm_managed=False, vllm_server_base_url=base_url)
    return validate(
        {
            "base_model": model_dir,
            "output_dir": str(out),
            "sequence_len": 1024,
            "vllm": {
                "host": "127.0.0.1",
                "port": 0,
                "dtype": "float32",
                "max_model_len": 1024,
                "cpu_kvcache_space": 1,
                **({"api_key": api_key} if api_key else {}),
            },
            "trl": table,
        }
    )


def _rows(path: Path, count: int) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()[:count]]


def run(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    from grpo_guess_number import GuessNumber
    from rewards import final_answer_correct
    from transformers import AutoTokenizer

    from grpo_core.contract.context import RunContext
    from grpo_core.contract.types import Prompt, SamplingSettings
    from grpo_core.data.prompts import tokenize_prompt
    from grpo_core.generation.episodes import EpisodeDriver
    from grpo_core.modeling.model_files import DEFAULT_MODEL, resolve_model_dir
    from grpo_core.modeling.precision import cpu_flag_summary
    from grpo_plugins.environments.tools import ToolEnvironment, ToolSettings
    from grpo_plugins.vllm.rollout import VLLMRollout

    model_dir = resolve_model_dir(DEFAULT_MODEL)
    tok = AutoTokenizer.from_pretrained(model_dir)
    out = Path(args.out)
    print("CPU:", cpu_flag_summary())
    cfg = _config(
        model_dir, out, args.base_url, args.api_key, tools=["calculator.calculate"], max_tool_calling_iterations=2
    )
    ctx = RunContext(config=cfg, output_dir=out, log=print)
    rollout = VLLMRollout(ctx)
    rollout.grpo_train_start()

    def generate(prompts, n, sampling):
        return rollout.grpo_rollout_generate(prompts=prompts, num_generations=n, sampling=sampling, policy_version=0)

    sampling = SamplingSettings(max_tokens=128, temperature=1.0, stop_token_ids=[tok.eos_token_id], seed=args.seed)
    results: dict[str, dict[str, float]] = {}
    try:
        calc_rows = _rows(ROOT / "examples" / "calculator" / "data" / "test.jsonl", args.prompts)
        example = tomllib.loads((ROOT / "examples" / "calculator" / "config.toml").read_text())["plugins"]["tools"]
        variants = {
            "json, instructions only": ToolSettings(format="json"),
            "python, instructions only": ToolSettings(format="python"),
            "the example's settings (json + demonstration)": ToolSettings(**example),
        }
        for style, settings in variants.items():
            cfg.episodes = cfg.episodes.model_copy(update={"max_turns": 3, "max_tokens_per_turn": 40})
            env = ToolEnvironment(ctx, settings)
            driver = EpisodeDriver(lambda p, s: env.grpo_environment_episode(p, s), tok, cfg, "tools", print, True)
            prompts = [
                Prompt(r["prompt"], tokenize_prompt(r["prompt"], tok), {"answer": r["answer"]}, i)
                for i, r in enumerate(calc_rows)
            ]
            started = time.perf_counter()
            groups = driver.run(prompts, args.samples, sampling, generate)
            seconds = time.perf_counter() - started
            completions = [c for g in groups for c in g.completions]
            answers = [g.prompt.columns["answer"] for g in groups for _ in g.completions]
            correct = final_answer_correct([c.messages for c in completions], answers)
            results[f"calculator/{style}"] = {
                "episodes": len(completions),
                "called_tool": sum(c.episode.tool_calls > 0 for c in completions) / len(completions),
                "tool_failures_per_call": sum(c.episode.tool_failures for c in completions)
                / max(1, sum(c.episode.tool_calls for c in completions)),
                "solved": sum(correct) / len(correct),
                "groups_with_variance": sum(
                    len(set(correct[i * args.samples : (i + 1) * args.samples])) > 1 for i in range(len(groups))
                )
                / len(groups),
                "turns_mean": sum(c.episode.turns for c in completions) / len(completions),
                "seconds": seconds,
            }
        game = GuessNumber(ctx)
        cfg.episodes = cfg.episodes.model_copy(update={"max_turns": 4, "max_tokens_per_turn": 12})
        driver = EpisodeDriver(lambda p, s: game.grpo_environment_episode(p, s), tok, cfg, "guess_number", print, True)
        rows = _rows(ROOT / "examples" / "guess-number" / "data" / "test.jsonl", args.prompts)
        prompts = [
            Prompt(r["prompt"], tokenize_prompt(r["prompt"], tok), {"secret": r["secret"]}, i)
            for i, r in enumerate(rows)
        ]
        started = time.perf_counter()
        groups = driver.run(prompts, args.samples, sampling, generate)
        seconds = time.perf_counter() - started
        completions = [c for g in groups for c in g.completions]
        rewards = [c.episode.reward or 0.0 for c in completions]
        results["guess-number"] = {
            "episodes": len(completions),
            "solved": sum(r > 0 for r in rewards) / len(rewards),
            "reward_mean": sum(rewards) / len(rewards),
            "groups_with_variance": sum(
                len(set(rewards[i * args.samples : (i + 1) * args.samples])) > 1 for i in range(len(groups))
            )
            / len(groups),
            "turns_mean": sum(c.episode.turns for c in completions) / len(completions),
            "seconds": seconds,
        }
    finally:
        rollout.grpo_train_end()
    for name, row in results.items():
        print(name, json.dumps({k: round(v, 3) for k, v in row.items()}))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--base-url")
    parser.add_argument("--api-key")
    parser.add_argument("--out", default="/tmp/grpo-bench-episodes")
    run(parser.parse_args())


if __name__ == "__main__":
    main()
