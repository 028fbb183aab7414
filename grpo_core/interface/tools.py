"""Tools around a run: ``grpo rewards test``, ``grpo eval`` and ``grpo merge``.

They reuse the run's own pieces (dataset loading, reward resolution, the
``transformers`` rollout through the plugin host, the evaluation of
:mod:`grpo_core.generation.evaluation`) so what they measure is what a run would see.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo_core.contract.errors import ConfigError, DataError
from grpo_core.contract.types import Completion, RolloutGroup

if TYPE_CHECKING:
    from grpo_core.config.schema import GRPOConfig
    from grpo_core.contract.types import Prompt
    from grpo_core.host.plugin_host import PluginHost


def _local_rollout_config(cfg: GRPOConfig) -> GRPOConfig:
    """The config as the transformers rollout accepts it (no background
    generation, no vLLM-only guided decoding)."""
    trl = cfg.trl.model_copy(update={"async_prefetch": False, "vllm_guided_decoding_regex": None})
    return cfg.model_copy(update={"trl": trl})


@dataclass
class _Local:
    """Tokenizer, context and (lazily) a transformers rollout on a model."""

    cfg: GRPOConfig
    host: PluginHost
    context: Any
    tokenizer: Any
    model_dir: str
    model: Any = None

    @classmethod
    def open(cls, cfg: GRPOConfig, host: PluginHost) -> _Local:
        # imported when the command runs, so `grpo --help` stays fast
        from grpo_core.contract.context import RunContext
        from grpo_core.modeling.model_files import resolve_model_dir
        from grpo_core.modeling.models import load_tokenizer

        cfg = _local_rollout_config(cfg)
        model_dir = resolve_model_dir(cfg.base_model)
        tokenizer = load_tokenizer(cfg, model_dir)
        context = RunContext(config=cfg, output_dir=Path(cfg.output_dir), log=lambda _m: None)
        context.tokenizer = tokenizer
        return cls(cfg, host, context, tokenizer, model_dir)

    def load_model(self, adapter: str | None = None) -> None:
        # imported when the command runs (torch, transformers), so `grpo --help` stays fast
        import torch
        from transformers import AutoModelForCausalLM

        from grpo_core.modeling.models import resolve_dtype
        from grpo_core.modeling.weight_files import check_weight_folder

        if adapter:
            if not (Path(adapter) / "adapter_config.json").is_file():
                raise ConfigError(
                    f"--adapter {adapter}: no adapter_config.json there; give a run's output_dir or a checkpoint "
                    "directory."
                )
            check_weight_folder(adapter, f"--adapter {adapter}")
        check_weight_folder(self.model_dir, "base_model")
        model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=resolve_dtype(self.cfg))
        if adapter:
            # imported when the command runs (peft), so `grpo --help` stays fast
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
        model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model = model.to("cuda" if torch.cuda.is_available() else "cpu").eval()
        self.context.get_model = lambda: self.model
        self.host.load_implementation("rollout", "transformers", self.context)

    def stop_ids(self) -> list[int]:
        return [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []


# ---------------------------------------------------------------------- rewards test


@dataclass
class RewardReport:
    name: str
    values: list[float | None] = field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0

    def describe(self) -> list[str]:
        numbers = [v for v in self.values if v is not None and math.isfinite(v)]
        lines = [f"{self.name}: {len(self.values)} completions, {self.seconds * 1000:.1f} ms per call"]
        if self.error:
            lines.append(f"  ERROR: {self.error}")
        if numbers:
            lines.append(
                f"  min {min(numbers):.4g}  mean {statistics.fmean(numbers):.4g}  max {max(numbers):.4g}  "
                f"std {statistics.pstdev(numbers):.4g}  zero {sum(v == 0 for v in numbers) / len(numbers):.0%}"
            )
            common = Counter(round(v, 4) for v in numbers).most_common(5)
            lines.append("  values: " + ", ".join(f"{v:g} x{n}" for v, n in common))
        missing = len(self.values) - len(numbers)
        if missing:
            lines.append(f"  None: {missing}")
        if numbers and max(numbers) == min(numbers):
            lines.append("  every completion scores the same: GRPO gets no learning signal from this function here.")
        return lines


def _column_groups(prompts: list[Prompt], column: str, tokenizer: Any) -> list[RolloutGroup]:
    available = sorted(prompts[0].columns) if prompts else []
    if prompts and column not in prompts[0].columns:
        raise DataError(
            f"--from-column {column}: the dataset has no such column (columns: {', '.join(available) or 'none'})."
        )
    groups = []
    for prompt in prompts:
        text = str(prompt.columns.get(column))
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        groups.append(RolloutGroup(prompt=prompt, completions=[Completion(token_ids=ids, text=text)]))
    return groups


def rewards_test(
    cfg: GRPOConfig, host: PluginHost, samples: int, from_column: str | None, generations: int
) -> tuple[list[RewardReport], list[RolloutGroup]]:
    """Score ``samples`` dataset rows with each reward function on its own."""
    # imported when the command runs, so `grpo --help` stays fast
    from grpo_core.data.prompts import load_prompts
    from grpo_core.generation.producer import sampling_from_config
    from grpo_core.scoring.reward_calls import build_batch, function_name, run_functions

    local = _Local.open(cfg, host)
    prompts = load_prompts(local.cfg, local.tokenizer)[: max(1, samples)]
    specs = list(cfg.trl.reward_funcs or [])
    if not specs:
        raise ConfigError("trl.reward_funcs is empty: nothing to test.")
    funcs = [host.load_reward(spec, local.context) for spec in specs]
    names = [function_name(f, s) for f, s in zip(funcs, specs)]
    if from_column:
        groups = _column_groups(prompts, from_column, local.tokenizer)
    else:
        local.load_model()
        sampling = sampling_from_config(local.cfg, local.stop_ids())
        groups = host.hook.grpo_rollout_generate(
            prompts=prompts, num_generations=generations, sampling=sampling, policy_version=0
        )
    batch = build_batch(groups, 0)
    reports = []
    for func, name in zip(funcs, names):
        started = time.perf_counter()
        outcome = run_functions([func], [name], batch)[0]
        report = RewardReport(
            name, list(outcome.values or [None] * len(batch)), outcome.error, time.perf_counter() - started
        )
        reports.append(report)
    return reports, groups


# ---------------------------------------------------------------------- eval


def run_eval(cfg: GRPOConfig, host: PluginHost, adapter: str | None) -> dict[str, float]:
    """The in-training evaluation, standalone, on the base model or an adapter."""
    # imported when the command runs, so `grpo --help` stays fast
    from grpo_core.data.prompts import load_prompts
    from grpo_core.generation.evaluation import eval_sampling, evaluate, load_eval_prompts
    from grpo_core.scoring.rewards import RewardScorer

    local = _Local.open(cfg, host)
    if not cfg.test_datasets and cfg.val_set_size <= 0:
        raise ConfigError(
            "grpo eval needs evaluation data: add [[test_datasets]], or set val_set_size to score the "
            "prompts a run with this config holds out."
        )
    train = [] if cfg.test_datasets else load_prompts(local.cfg, local.tokenizer)
    _, prompts = load_eval_prompts(local.cfg, local.tokenizer, train)
    scorer = RewardScorer(local.cfg, host, local.context)
    try:
        local.load_model(adapter)
        sampling = eval_sampling(local.cfg, local.stop_ids())
        result = evaluate(sampling, host.hook, scorer, prompts, policy_version=0, step=0)
    finally:
        scorer.close()
    return result.metrics


# ---------------------------------------------------------------------- merge


def merge_adapter(adapter_dir: Path, output: Path | None = None, base: str | None = None) -> Path:
    """Merge a LoRA adapter into its base model: a plain HF model directory
    (safetensors + tokenizer) that transformers and ``vllm serve`` load."""
    # imported when the command runs (peft, torch, transformers), so `grpo --help` stays fast
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    adapter_dir = Path(adapter_dir)
    config_file = adapter_dir / "adapter_config.json"
    if not config_file.is_file():
        raise ConfigError(
            f"{adapter_dir}: no adapter_config.json. grpo merge takes a LoRA run's output_dir (or a "
            "checkpoint); a full fine-tune is already a plain model directory."
        )
    # imported when the command runs, so `grpo --help` stays fast
    from grpo_core.modeling.weight_files import check_weight_folder

    check_weight_folder(adapter_dir, f"grpo merge {adapter_dir}")  # a cut adapter or a damaged adapter_config.json
    base = base or json.loads(config_file.read_text(encoding="utf-8")).get("base_model_name_or_path")
    if not base:
        raise ConfigError(f"{config_file} does not name its base model: pass --base MODEL_DIR.")
    # imported when the command runs, so `grpo --help` stays fast
    from grpo_core.modeling.model_files import resolve_model_dir

    base_dir = resolve_model_dir(base)
    check_weight_folder(base_dir, "--base")
    output = Path(output) if output is not None else adapter_dir / "merged"
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    output.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output, safe_serialization=True)
    tokenizer_src = adapter_dir if (adapter_dir / "tokenizer_config.json").is_file() else base_dir
    AutoTokenizer.from_pretrained(tokenizer_src).save_pretrained(output)
    return output
