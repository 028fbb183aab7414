"""The Python entry point for scripts: ``grpo.train(config, **overrides)``.

For people who write a training script, as TRL users do, instead of a config
file and a command. It takes what a TRL script has at hand (reward functions
as callables, a ``datasets.Dataset``) and runs the very path ``grpo run``
runs: the same loader (TOML, YAML, Axolotl keys), the same
:func:`~grpo_core.validation.checks.check_config` (inside
:func:`~grpo_core.training.run.run_training`), the same trainer.

Callables reach the run through an in-memory plugin that answers
``grpo_load_reward`` for them; a ``Dataset`` is saved into
``output_dir/train_dataset`` and named as the run's only ``[[datasets]]``
entry, so what was trained on stays beside the model.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import json
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpo_core.config.schema import GRPOConfig
from grpo_core.contract.errors import ConfigError
from grpo_core.contract.hookspecs import hookimpl
from grpo_core.host.script_objects import CALLABLE_PREFIX, hold


@dataclass
class TrainResult:
    """Where a run put its results."""

    status: str
    """``completed`` (an interrupted run raises instead)."""
    output_dir: Path
    """The final adapter (or full model) and tokenizer, in standard PEFT / HF format."""
    metrics_path: Path
    """One JSON object per logged step."""
    checkpoints: list[Path] = field(default_factory=list)
    config: GRPOConfig | None = None
    """The validated config that ran (defaults filled in)."""

    def metrics(self) -> list[dict[str, Any]]:
        """The logged steps, read back from :attr:`metrics_path`."""
        if not self.metrics_path.is_file():
            return []
        return [json.loads(line) for line in self.metrics_path.read_text(encoding="utf-8").splitlines() if line.strip()]


class _CallableRewards:
    """An in-memory plugin: ``python:<name>`` specs -> the callables given to :func:`train`."""

    def __init__(self, functions: Mapping[str, Callable[..., Any]]) -> None:
        self.functions = dict(functions)

    @hookimpl
    def grpo_load_reward(self, spec: str, context: Any) -> Any:
        return self.functions.get(spec)


def _merge(target: dict[str, Any], key: str, value: Any) -> None:
    """``trl={"beta": 0.1}`` merges into the trl table; ``"trl.beta"`` works too."""
    parts = key.split(".")
    node = target
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override '{key}': '{part}' is not a table")
        node = child
    last = parts[-1]
    if isinstance(value, Mapping) and isinstance(node.get(last), dict):
        for sub, sub_value in value.items():
            _merge(node[last], str(sub), sub_value)
    else:
        node[last] = copy.deepcopy(value)


def _raw_config(config: str | Path | Mapping[str, Any] | GRPOConfig) -> tuple[dict[str, Any], Path | None]:
    """The config as the raw dict the loader validates, and the folder its relative paths hang off."""
    # the training stack loads when a run starts, so `import grpo` stays fast
    from grpo_core.config.loader import read_raw

    if isinstance(config, GRPOConfig):
        # Only what was set: defaults (and max_steps under num_epochs) are derived again.
        return config.model_dump(mode="json", exclude_unset=True), None
    if isinstance(config, (str, Path)):
        return read_raw(config), Path(config).parent
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config)), None
    raise ConfigError(f"config must be a path, a dict or a GRPOConfig, not {type(config).__name__}")


def _importable_path(func: Any) -> str | None:
    """``module.function`` when the callable can be imported back by that name
    (so reward worker subprocesses can load it too)."""
    module, name = getattr(func, "__module__", None), getattr(func, "__qualname__", None)
    if not module or not name or module == "__main__" or "<" in name or "." in name:
        return None
    try:
        return f"{module}.{name}" if getattr(importlib.import_module(module), name, None) is func else None
    except Exception:  # an unimportable module: keep the object itself
        return None


def _reward_specs(reward_funcs: Sequence[str | Callable[..., Any]]) -> tuple[list[str], dict[str, Callable[..., Any]]]:
    specs: list[str] = []
    in_memory: dict[str, Callable[..., Any]] = {}
    for item in reward_funcs:
        if isinstance(item, str):
            specs.append(item)
            continue
        if not callable(item):
            raise ConfigError(f"reward_funcs entries must be callables or names, got {type(item).__name__}")
        path = _importable_path(item)
        if path is not None:
            specs.append(path)
            continue
        name = getattr(item, "__name__", None) or type(item).__name__
        spec = f"{CALLABLE_PREFIX}{name}"
        while spec in in_memory and in_memory[spec] is not item:
            spec += "_"
        in_memory[spec] = item
        specs.append(spec)
    return specs, in_memory


def _code_spec(obj: str | Any, key: str) -> str:
    """An import path for ``obj`` (a name, or the object itself): its own
    when it has one, else one that :mod:`grpo_core.host.script_objects` holds."""
    if isinstance(obj, str):
        return obj
    if not callable(obj):
        raise ConfigError(f"{key}: expected a function, a class or a 'module.name' path, got {type(obj).__name__}")
    path = _importable_path(obj)
    if path is not None:
        return path
    return hold(obj, getattr(obj, "__name__", None) or type(obj).__name__)


def _save_dataset(dataset: Any, output_dir: Path, name: str = "train_dataset") -> str:
    target = output_dir / name
    if not hasattr(dataset, "save_to_disk"):
        raise ConfigError(f"{name} must be a datasets.Dataset, not {type(dataset).__name__}")
    output_dir.mkdir(parents=True, exist_ok=True)
    dataset.save_to_disk(str(target))
    return str(target.resolve())


_LORA_KEYS = {"r": "lora_r", "lora_alpha": "lora_alpha", "lora_dropout": "lora_dropout"}
_LORA_IGNORED = {"task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision"}


def _peft_keys(peft_config: Any) -> dict[str, Any]:
    """``GRPOTrainer``'s ``peft_config`` (a ``peft.LoraConfig``) as grpo's
    LoRA keys; any option grpo does not build, set away from peft's default,
    is refused by name rather than dropped."""
    if isinstance(peft_config, Mapping):
        raise ConfigError(
            "peft_config: pass a peft.LoraConfig, or write adapter = 'lora' and lora_* keys in the config"
        )
    kind = str(getattr(getattr(peft_config, "peft_type", None), "value", getattr(peft_config, "peft_type", "")))
    if kind != "LORA" or not dataclasses.is_dataclass(peft_config):
        raise ConfigError(
            f"peft_config: {type(peft_config).__name__} is not supported; grpo trains LoRA adapters (peft.LoraConfig)."
        )
    task = getattr(peft_config, "task_type", None)
    if task is not None and str(getattr(task, "value", task)) != "CAUSAL_LM":
        raise ConfigError(f"peft_config.task_type = {task}: grpo trains causal LMs (task_type 'CAUSAL_LM' or None).")
    default = type(peft_config)()
    keys: dict[str, Any] = {"adapter": "lora"}
    keys.update({grpo: getattr(peft_config, name) for name, grpo in _LORA_KEYS.items()})
    targets = peft_config.target_modules
    if targets == "all-linear" or targets is None:
        keys["lora_target_linear"] = True
        if targets is None:
            warnings.warn(
                "peft_config.target_modules is None, where peft picks modules for the model's architecture: grpo "
                "trains LoRA on every linear layer instead (lora_target_linear); set target_modules to choose.",
                stacklevel=3,
            )
    elif isinstance(targets, str):
        raise ConfigError(
            f"peft_config.target_modules = {targets!r}: a regular expression is not supported; list the module names."
        )
    else:
        keys["lora_target_linear"] = False
        keys["lora_target_modules"] = sorted(targets)
    unsupported = [
        f"{f.name}={getattr(peft_config, f.name)!r}"
        for f in dataclasses.fields(peft_config)
        if f.name not in {*_LORA_KEYS, "target_modules", *_LORA_IGNORED}
        and getattr(peft_config, f.name) != getattr(default, f.name)
    ]
    if unsupported:
        raise ConfigError(
            f"peft_config sets {', '.join(unsupported)}, which grpo's LoRA does not build (it takes r, lora_alpha, "
            "lora_dropout and target_modules): leave them at peft's defaults."
        )
    return keys


def _processing_class(processing_class: Any, output_dir: Path) -> str:
    """``GRPOTrainer``'s ``processing_class``: a tokenizer (saved beside the
    run, with its chat template, and loaded from there) or its name/path."""
    if isinstance(processing_class, (str, Path)):
        return str(processing_class)
    if hasattr(processing_class, "image_processor") or not hasattr(processing_class, "save_pretrained"):
        raise ConfigError(
            f"processing_class: {type(processing_class).__name__} is not a tokenizer; grpo trains text models, so "
            "pass a tokenizer (or its name or folder)."
        )
    target = output_dir / "processing_class"
    output_dir.mkdir(parents=True, exist_ok=True)
    processing_class.save_pretrained(str(target))
    return str(target.resolve())


def train(
    config: str | Path | Mapping[str, Any] | GRPOConfig,
    *,
    reward_funcs: Sequence[str | Callable[..., Any]] | None = None,
    train_dataset: Any = None,
    eval_dataset: Any = None,
    peft_config: Any = None,
    processing_class: Any = None,
    rollout_func: str | Callable[..., Any] | None = None,
    environment_factory: str | type | Callable[..., Any] | Mapping[str, str | type | Callable[..., Any]] | None = None,
    tools: Sequence[str | Callable[..., Any]] | None = None,
    agent: str | Callable[..., Any] | None = None,
    **overrides: Any,
) -> TrainResult:
    """Train with GRPO; return where the model and metrics went.

    ``config``: a TOML or YAML file (Axolotl's layout included), a dict in the
    same layout, or a :class:`GRPOConfig`. ``overrides`` replace keys as
    ``grpo run --set`` does: ``max_steps=3``, ``trl={"beta": 0.04}`` (merged
    into the table), or ``**{"trl.beta": 0.04}``.
    ``reward_funcs``: callables (TRL's convention: completions and dataset
    columns in, one float per completion out) and/or names; they replace
    ``trl.reward_funcs``. ``train_dataset``: a ``datasets.Dataset`` with a
    ``prompt`` column; it replaces the config's ``datasets``.
    ``eval_dataset``: a ``datasets.Dataset`` of held-out prompts; it replaces
    ``test_datasets`` (evaluated every ``eval_steps``). ``peft_config``: a
    ``peft.LoraConfig``; it sets ``adapter = "lora"``, ``lora_r``,
    ``lora_alpha``, ``lora_dropout`` and the target modules (``None`` or
    ``"all-linear"``: every linear layer), and refuses by name an option grpo's
    LoRA does not build. ``processing_class``: a tokenizer, or its name or
    folder; it becomes ``tokenizer_config`` (a tokenizer object is saved
    into ``output_dir/processing_class`` first, chat template included).
    These are ``GRPOTrainer``'s arguments of the same names.
    ``rollout_func``, ``environment_factory`` (a class, or a dict of name -> class), ``tools`` (functions):
    TRL's arguments of the same names, as objects or import paths; they
    replace ``trl.rollout_func`` / ``trl.environment_factory`` / ``trl.tools``.
    An object defined in the script itself works here (the training process
    runs them), unlike a reward function under reward worker subprocesses.
    ``agent``: the function the ``agent`` environment calls once per sample
    (``run(row, *, base_url, api_key, model)``, sync or async); it sets
    ``[plugins.agent] function`` and, when ``[plugins] environment`` is
    unset, chooses the ``agent`` environment.

    Runs the checks ``grpo run`` runs and raises the same errors
    (:class:`~grpo_core.contract.errors.ConfigError` and friends) before anything heavy.
    Every failure is a :class:`~grpo_core.contract.errors.GrpoError` whose message
    is the line ``grpo run`` prints: one no rule foresaw is an
    :class:`~grpo_core.contract.errors.UnexpectedFailure` naming the phase, with
    the exception as its ``original`` and its traceback in ``output_dir/grpo-error.log``.
    """
    # the training stack loads when a run starts, so `import grpo` stays fast
    from grpo_core.runtime import failure

    try:
        return _train(
            config,
            reward_funcs,
            train_dataset,
            rollout_func,
            environment_factory,
            tools,
            overrides,
            eval_dataset=eval_dataset,
            peft_config=peft_config,
            processing_class=processing_class,
            agent=agent,
        )
    except Exception as exc:
        report = failure.unexpected(exc, None, "grpo.train")
        if report is exc:
            raise
        raise report from None


def _train(
    config: str | Path | Mapping[str, Any] | GRPOConfig,
    reward_funcs: Sequence[str | Callable[..., Any]] | None,
    train_dataset: Any,
    rollout_func: str | Callable[..., Any] | None,
    environment_factory: str | type | Callable[..., Any] | Mapping[str, str | type | Callable[..., Any]] | None,
    tools: Sequence[str | Callable[..., Any]] | None,
    overrides: dict[str, Any],
    *,
    eval_dataset: Any = None,
    peft_config: Any = None,
    processing_class: Any = None,
    agent: str | Callable[..., Any] | None = None,
) -> TrainResult:
    # the training stack loads when a run starts, so `import grpo` stays fast
    from grpo_core.config.loader import anchor_to_config_dir, validate
    from grpo_core.host.plugin_host import PluginHost
    from grpo_core.training.run import run_training

    raw, config_dir = _raw_config(config)
    for key, value in overrides.items():
        _merge(raw, key, value)
    in_memory: dict[str, Callable[..., Any]] = {}
    if reward_funcs is not None:
        specs, in_memory = _reward_specs(reward_funcs)
        raw.setdefault("trl", {})["reward_funcs"] = specs
    if rollout_func is not None:
        raw.setdefault("trl", {})["rollout_func"] = _code_spec(rollout_func, "rollout_func")
    if isinstance(environment_factory, Mapping):  # TRL's dict: several environments, rows name theirs
        raw.setdefault("trl", {})["environment_factory"] = {
            str(name): _code_spec(cls, f"environment_factory[{name!r}]") for name, cls in environment_factory.items()
        }
    elif environment_factory is not None:
        raw.setdefault("trl", {})["environment_factory"] = _code_spec(environment_factory, "environment_factory")
    if tools is not None:
        if isinstance(tools, str):
            raise ConfigError("tools: expected a list of functions or 'module.function' paths, got one string")
        raw.setdefault("trl", {})["tools"] = [_code_spec(tool, "tools") for tool in tools]
    output_dir = Path(str(raw.get("output_dir", GRPOConfig.model_fields["output_dir"].default)))
    if agent is not None:
        plugins = raw.setdefault("plugins", {})
        if not isinstance(plugins, dict):
            raise ConfigError("agent: the config's 'plugins' is not a table")
        plugins.setdefault("environment", "agent")
        settings = plugins.setdefault("agent", {})
        if not isinstance(settings, dict):
            raise ConfigError("agent: [plugins.agent] is not a table")
        settings["function"] = _code_spec(agent, "agent")
    if train_dataset is not None:
        raw["datasets"] = [{"path": _save_dataset(train_dataset, output_dir)}]
    if eval_dataset is not None:
        raw["test_datasets"] = [{"path": _save_dataset(eval_dataset, output_dir, "eval_dataset")}]
    if peft_config is not None:
        keys = _peft_keys(peft_config)
        if keys["lora_target_linear"]:
            raw.pop("lora_target_modules", None)  # the peft_config's choice replaces the config's
        raw.update(keys)
    if processing_class is not None:
        raw["tokenizer_config"] = _processing_class(processing_class, output_dir)
    cfg = validate(raw, str(config) if isinstance(config, (str, Path)) else "config")
    if config_dir is not None:
        cfg = anchor_to_config_dir(cfg, config_dir)

    host = PluginHost(allow=set(cfg.plugins.allow) if cfg.plugins.allow else None)
    if in_memory:
        if cfg.trl.reward_num_workers > 1 or cfg.trl.reward_timeout is not None:
            names = ", ".join(s.removeprefix(CALLABLE_PREFIX) for s in in_memory)
            raise ConfigError(
                f"reward functions {names} are defined in your script's __main__ (or are objects), which reward "
                "worker subprocesses (trl.reward_num_workers > 1 or trl.reward_timeout) cannot import: move them "
                "into a module and pass them from there, or drop those two options."
            )
        host.pm.register(_CallableRewards(in_memory), name="grpo.api.reward_funcs")
    config_path = str(Path(config).resolve()) if isinstance(config, (str, Path)) else None
    status = run_training(cfg, host, config_path=config_path)  # the path names the run in output_dir's lock
    output_dir = Path(cfg.output_dir)
    checkpoints = sorted(
        output_dir.glob("checkpoint-*"),
        key=lambda p: int(p.name.rpartition("-")[2]) if p.name.rpartition("-")[2].isdigit() else -1,
    )
    return TrainResult(
        status=status,
        output_dir=output_dir,
        metrics_path=output_dir / "metrics.jsonl",
        checkpoints=[p for p in checkpoints if p.is_dir()],
        config=cfg,
    )
