"""The example package's weight sync (``examples/grpo-plugin-example``,
``safetensors_dir``) against the real vLLM server: the files it writes from
a PEFT model (HF names, W + LoRA delta, tied ``lm_head`` written once) are
what vLLM reloads, and the server then samples the LoRA policy.

The package is pip-installed into a private folder, as in test_plugins.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from helpers import REPO
from pip_target import install_into_target
from test_vllm_server import chat_prompts, mean_abs_diff

from grpo_core.contract.types import SamplingSettings
from grpo_core.host import plugin_host
from grpo_core.host.plugin_host import PluginHost
from grpo_plugins.vllm.rollout import VLLMRollout

pytestmark = pytest.mark.vllm

EXAMPLE = REPO / "examples" / "grpo-plugin-example"


@pytest.fixture(scope="module")
def example_on_path(tmp_path_factory: pytest.TempPathFactory):
    site = install_into_target(EXAMPLE, tmp_path_factory.mktemp("example"))
    sys.path.insert(0, str(site))
    plugin_host.rescan()
    yield site
    sys.path.remove(str(site))
    for name in [n for n in sys.modules if n.split(".")[0] == "grpo_plugin_example"]:
        del sys.modules[name]
    plugin_host.rescan()


def test_example_sync_makes_vllm_sample_the_lora_policy(
    example_on_path, make_context, peft_model, smollm2_tokenizer
) -> None:
    prompts = chat_prompts(smollm2_tokenizer, ["What is 3 + 4?", "Name a colour."])
    ctx = make_context()
    rollout = VLLMRollout(ctx)
    sync = PluginHost().load_implementation("weight_sync", "safetensors_dir", ctx)
    result = sync.grpo_sync_weights(peft_model, 1, rollout.engine)
    assert result.detail.endswith("v000001/model.safetensors")
    groups = rollout.grpo_rollout_generate(prompts, 2, SamplingSettings(max_tokens=10, seed=2), 1)
    merged_err = mean_abs_diff(groups, peft_model)
    with peft_model.disable_adapter():
        base_err = mean_abs_diff(groups, peft_model)
    print(f"example sync: mean |logp diff| vs PEFT model: {merged_err:.4f}, vs base model: {base_err:.4f}")
    assert merged_err < 0.1 and base_err > 3 * merged_err  # the same bounds as grpo's own full_filesystem sync
    sync.grpo_train_end()
    assert not Path(result.detail.split(": ", 1)[1]).exists()  # grpo_train_end removed its files
    VLLMRollout(make_context()).grpo_train_start()  # the next test's run: hygiene restores the base weights
