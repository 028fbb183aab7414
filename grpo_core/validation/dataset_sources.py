"""Where each ``[[datasets]]`` entry's rows will come from, judged before a run.

``datasets`` reads an entry one of three ways, and each has its own check:

* a local file or folder (``path`` exists): a folder's ``data_files`` are
  relative to the folder, and each must match a file (a file ``path`` reads
  that file; its ``data_files`` would be ignored, so that is a warning);
* a packaged builder (``path = "json"``, ``"csv"``, ...): ``data_files`` are
  the files to read, relative to the working directory (or beside the
  config, anchored by the loader), and must match something;
* a hub id (``org/name``): fetched at run time unless the local cache has it.
  Not cached is a warning, or an error when ``HF_HUB_OFFLINE`` /
  ``HF_DATASETS_OFFLINE`` says nothing may be fetched. Its ``data_files``
  are files inside the hub repository, which cannot be checked here.

A missing local ``path`` is :func:`grpo_core.validation.references.path_problems`'
to report. Nothing here downloads or opens a dataset.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

from grpo_core.config.schema import DatasetSpec, GRPOConfig

TRUE_VALUES = {"1", "ON", "YES", "TRUE"}


def offline() -> bool:
    """Whether nothing may be fetched from the hub (datasets' own rule:
    ``HF_DATASETS_OFFLINE`` when set, else ``HF_HUB_OFFLINE``), read now so
    the environment of this command decides."""
    flag = os.environ.get("HF_DATASETS_OFFLINE")
    if flag is None:
        flag = os.environ.get("HF_HUB_OFFLINE", "")
    return flag.strip().upper() in TRUE_VALUES


def _hf_home() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")) / "huggingface"
    return Path(os.environ.get("HF_HOME", str(default))).expanduser()


def cache_folders(hub_id: str) -> list[Path]:
    """Where a hub dataset would be found once fetched: the hub's download
    cache (``datasets--org--name``) and ``datasets``' prepared cache
    (``org___name``, its name snake-cased by ``datasets``), with the
    environment variables both libraries read."""
    hub = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE") or str(_hf_home() / "hub")
    prepared = Path(os.environ.get("HF_DATASETS_CACHE", str(_hf_home() / "datasets"))).expanduser()
    namespace, _, name = hub_id.rpartition("/")
    out = [Path(hub).expanduser() / f"datasets--{hub_id.replace('/', '--')}"]
    for variant in dict.fromkeys((name, name.lower(), name.lower().replace("-", "_"))):
        out.append(prepared / (f"{namespace}___{variant}" if namespace else variant))
    return out


def is_cached(hub_id: str) -> bool:
    return any(folder.is_dir() for folder in cache_folders(hub_id))


def packaged_builders() -> frozenset[str]:
    """``datasets``' packaged builder names (``json``, ``csv``, ...): a
    ``path`` that names one reads ``data_files`` from the local disk."""
    # imported when a config names a path that is neither here nor 'org/name': `datasets` is slow to import
    from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES

    return frozenset(_PACKAGED_DATASETS_MODULES)


def _files(spec: DatasetSpec) -> list[str]:
    if spec.data_files is None:
        return []
    return [spec.data_files] if isinstance(spec.data_files, str) else list(spec.data_files)


def _matches(base: Path, pattern: str) -> bool:
    """Whether ``pattern`` (a path or a glob, as ``data_files`` takes) names
    at least one file from ``base``."""
    full = Path(pattern).expanduser()
    full = full if full.is_absolute() else base / full
    return full.exists() or bool(glob.glob(str(full), recursive=True))


def dataset_source_problems(cfg: GRPOConfig) -> tuple[list[str], list[str]]:
    """(errors, warnings) for every dataset entry's ``data_files`` and hub id."""
    errors: list[str] = []
    warnings: list[str] = []
    builders: frozenset[str] | None = None
    for label, specs in (("datasets", cfg.datasets), ("test_datasets", cfg.test_datasets)):
        for i, spec in enumerate(specs):
            key = f"{label}[{i}]"
            files = [f for f in _files(spec) if "://" not in f]  # a URL is fetched at run time, like a hub id
            path = Path(spec.path).expanduser()
            if path.is_file():
                if files:
                    warnings.append(
                        f"{key}.data_files has no effect: path '{spec.path}' is a file, and that file is what is "
                        "read. Remove data_files, or set path to the folder they are in."
                    )
                continue
            if path.is_dir():
                missing = [f for f in files if not _matches(path, f)]
                if missing:
                    errors.append(
                        f"{key}.data_files: {', '.join(repr(f) for f in missing)} match no file in {path} (data_files "
                        "of a folder are relative to the folder). Fix the names, or remove data_files to read every "
                        "data file in it."
                    )
                continue
            if spec.path.startswith((".", "/", "~")):
                continue  # a missing local path: path_problems reports it
            if "/" not in spec.path:
                builders = packaged_builders() if builders is None else builders
                if spec.path in builders:
                    if not files:
                        errors.append(
                            f"{key}.path = '{spec.path}' reads data_files, and none are given: set "
                            f'data_files = "data/train.{spec.path}" (or set path to the file itself).'
                        )
                    missing = [f for f in files if not _matches(Path.cwd(), f)]
                    if missing:
                        errors.append(
                            f"{key}.data_files: {', '.join(repr(f) for f in missing)} match no file (relative to "
                            f"{Path.cwd()}, or beside the config). Fix the paths."
                        )
                    continue
            if is_cached(spec.path):
                continue
            if offline():
                errors.append(
                    f"{key}.path = '{spec.path}' is a hub dataset that is not in the local cache, and "
                    "HF_HUB_OFFLINE / HF_DATASETS_OFFLINE forbid fetching it. Fetch it where the hub is reachable "
                    "(or unset the variable), or point path at a local copy."
                )
            else:
                warnings.append(
                    f"{key}.path = '{spec.path}' is not a local file or folder nor in the hub cache: it will be "
                    "fetched from the Hugging Face hub when the run starts (a misspelt name fails only then)."
                )
    return errors, warnings
