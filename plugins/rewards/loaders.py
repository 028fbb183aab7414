"""Resolving ``trl.reward_funcs`` entries that are not registered names.

An always-on plugin (``grpo.plugins: reward_loaders``). It understands:

* ``module.function``: an import path, with the working directory on
  ``sys.path`` (``rewards.accuracy_reward`` for ./rewards.py; nested
  packages such as ``my_rewards.scoring.accuracy_reward`` too);
* a reward-model directory (``config.json`` with a
  ``*ForSequenceClassification`` architecture) or a hub id of one: its first
  logit of prompt + completion is the reward.

Anything else gets ``None`` so another plugin may claim it.
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Any

from grpo_core.plugin_api import PluginError, RunContext, hookimpl, import_from_cwd

DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")
SEQ_CLS_SUFFIX = "ForSequenceClassification"


class RewardLoaders:
    """Loads reward functions by import path and reward models by folder or hub id (stateless)."""

    @hookimpl
    def grpo_load_reward(self, spec: str, context: RunContext) -> Any:
        path = Path(spec).expanduser()
        if path.is_dir():
            return reward_model_from_dir(spec, path, context)
        if "://" in spec:
            return None  # URLs belong to other plugins
        if DOTTED.fullmatch(spec):
            return import_reward_function(spec)
        if spec.count("/") == 1 and not spec.startswith((".", "/", "~")):
            return reward_model_from_hub(spec, context)
        return None


def import_reward_function(spec: str) -> Any:
    """``module.function`` -> the function; ``None`` when the module itself
    does not exist (so the host can say what else the spec could be)."""
    module_name = spec.rpartition(".")[0]
    try:
        func = import_from_cwd(spec)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            return None
        raise PluginError(
            f"reward function '{spec}': importing '{module_name}' failed: {type(exc).__name__}: {exc}"
        ) from exc
    except ImportError as exc:
        raise PluginError(f"reward function '{spec}': {exc}. Check the function name.") from exc
    except Exception as exc:  # a bug in the user's module at import time
        raise PluginError(
            f"reward function '{spec}': importing '{module_name}' raised {type(exc).__name__}: {exc}"
        ) from exc
    if not callable(func):
        raise PluginError(f"reward function '{spec}' is a {type(func).__name__}, not a function.")
    return func


def _architectures(config: dict[str, Any]) -> list[str]:
    return [a for a in config.get("architectures") or [] if isinstance(a, str)]


def reward_model_from_dir(spec: str, path: Path, context: RunContext) -> Any:
    config_file = path / "config.json"
    if not config_file.is_file():
        return None
    archs = _architectures(json.loads(config_file.read_text()))
    if not any(a.endswith(SEQ_CLS_SUFFIX) for a in archs):
        raise PluginError(
            f"reward function '{spec}' is a model directory but not a sequence-classification (reward) model "
            f"(architectures: {archs or 'none'}); reward models need a *{SEQ_CLS_SUFFIX} architecture."
        )
    return RewardModelFunction(str(path), path.name, context)


def reward_model_from_hub(spec: str, context: RunContext) -> Any:
    # heavy (transformers): loaded on first use, not with this module
    from transformers import AutoConfig

    trust = bool(context.config.trust_remote_code)
    try:
        config = AutoConfig.from_pretrained(spec, trust_remote_code=trust)
    except Exception as exc:
        if "trust_remote_code" in str(exc):
            raise PluginError(
                f"reward function '{spec}' ships its own Python code, which grpo does not run unless the config says "
                "`trust_remote_code = true`. Read that code first: it runs with your permissions."
            ) from None
        raise PluginError(
            f"reward function '{spec}' looks like a hub id of a reward model but could not be fetched "
            f"({type(exc).__name__}: {' '.join(str(exc).split())[:160]}). Download it where a hub is reachable and "
            "give its local directory."
        ) from exc
    archs = list(getattr(config, "architectures", None) or [])
    if not any(a.endswith(SEQ_CLS_SUFFIX) for a in archs):
        raise PluginError(
            f"reward function '{spec}' is not a sequence-classification (reward) model (architectures: {archs})."
        )
    return RewardModelFunction(spec, spec.rsplit("/", 1)[-1], context)


class RewardModelFunction:
    """A sequence-classification model as a TRL-style reward function.

    Weights load on the first call, so resolving the spec (which the main
    process and every reward worker do) stays cheap where the function is
    never called.
    """

    batch_size = 8

    def __init__(self, source: str, name: str, context: RunContext) -> None:
        self.source = source
        self.__name__ = name
        cfg = context.config
        self.chat_template_kwargs = dict(cfg.trl.chat_template_kwargs or {})
        self.use_bf16 = cfg.bf16 is True
        self.trust_remote_code = bool(cfg.trust_remote_code)  # the base model's rule applies to reward models too
        self._lock = threading.Lock()
        self._model: Any = None
        self._tokenizer: Any = None

    def _load(self) -> None:
        # heavy (torch, transformers): loaded on first use, not with this module
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(self.source, trust_remote_code=self.trust_remote_code)
            if tokenizer.pad_token is None:
                tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
            device = "cuda" if torch.cuda.is_available() else "cpu"
            dtype = torch.bfloat16 if self.use_bf16 else torch.float32
            model = AutoModelForSequenceClassification.from_pretrained(
                self.source, dtype=dtype, trust_remote_code=self.trust_remote_code
            )
        except ValueError as exc:
            if "trust_remote_code" not in str(exc):
                raise
            raise PluginError(
                f"reward model '{self.__name__}' ({self.source}) ships its own Python code, which grpo does not run "
                "unless the config says `trust_remote_code = true`. Read that code first: it runs with your "
                "permissions."
            ) from None
        model = model.to(device).eval()
        if model.config.pad_token_id is None:
            model.config.pad_token_id = tokenizer.pad_token_id
        self._tokenizer, self._model = tokenizer, model

    def _text(self, prompt: Any, completion: Any) -> str:
        if isinstance(prompt, list):
            messages = list(prompt) + (
                list(completion)
                if isinstance(completion, list)
                else [{"role": "assistant", "content": str(completion)}]
            )
            if self._tokenizer.chat_template is not None:
                return self._tokenizer.apply_chat_template(messages, tokenize=False, **self.chat_template_kwargs)
            return "\n".join(f"{m.get('role')}: {m.get('content')}" for m in messages)
        return str(prompt) + (completion if isinstance(completion, str) else str(completion))

    def __call__(self, prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
        # heavy (torch): loaded on first use, not with this module
        import torch

        with self._lock:
            if self._model is None:
                self._load()
        texts = [self._text(p, c) for p, c in zip(prompts, completions, strict=True)]
        scores: list[float] = []
        device = next(self._model.parameters()).device
        for start in range(0, len(texts), self.batch_size):
            enc = self._tokenizer(
                texts[start : start + self.batch_size],
                return_tensors="pt",
                padding=True,
                padding_side="right",
                truncation=True,
                add_special_tokens=False,
            ).to(device)
            with torch.no_grad():
                logits = self._model(**enc).logits
            scores.extend(logits[:, 0].float().tolist())
        return scores
