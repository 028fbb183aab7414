"""The policy behind one ``forward`` that returns completion log-probs.

:func:`grpo_core.optimization.logprobs.token_logprobs` runs the decoder body and the LM
head separately (chunked), never the model's own ``forward``. DDP, FSDP and
DeepSpeed hook into the forward of the module they wrap (DDP prepares its
gradient all-reduce there, FSDP gathers the root's shards there), so the
trainer hands them this module: its ``forward`` is the whole log-prob
computation, and the wrapper's hooks run around it. The policy itself stays
reachable as :attr:`policy` for saving and weight syncs.
"""

from __future__ import annotations

from typing import Any

import torch

from grpo_core.modeling.models import unwrap
from grpo_core.optimization.logprobs import token_logprobs


class PolicyLogprobs(torch.nn.Module):
    def __init__(self, policy: torch.nn.Module) -> None:
        super().__init__()
        self.policy = policy
        # FSDP's auto-wrap reads the layer classes to wrap from the root module
        base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
        self._no_split_modules = list(getattr(base, "_no_split_modules", None) or [])

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        num_completion_tokens: int,
        temperature: float = 1.0,
        with_entropy: bool = False,
        body: Any = None,
        share_prompts: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``body``: the policy's compiled decoder body (``torch_compile``), if any;
        ``share_prompts``: run each distinct prompt once (:func:`token_logprobs`)."""
        return token_logprobs(
            self.policy,
            input_ids,
            attention_mask,
            num_completion_tokens,
            temperature=temperature,
            with_entropy=with_entropy,
            body=body,
            share_prompts=share_prompts,
        )


def inner_policy(prepared: Any) -> torch.nn.Module:
    """The policy inside a prepared (possibly DDP/FSDP-wrapped) :class:`PolicyLogprobs`."""
    module = unwrap(prepared)
    while not isinstance(module, PolicyLogprobs) and hasattr(module, "module"):
        module = module.module
    return module.policy if isinstance(module, PolicyLogprobs) else module
