"""``torch_compile``: torch.compile of the policy's decoder body.

What is compiled, and why only that: a GRPO step never calls the model's
``forward`` (see :mod:`grpo_core.optimization.logprobs`); it runs the decoder body once
and applies the LM head chunk by chunk under activation checkpointing. The
body is where the time goes, so the body is compiled, for the training
forward/backward and the no-grad log-prob passes alike.

The compiled body is a separate handle the trainer keeps and passes to
:func:`~grpo_core.optimization.logprobs.token_logprobs`; the model itself is left as it
was (never replaced by an ``OptimizedModule``, whose state-dict keys would
gain an ``_orig_mod.`` prefix). So its parameter names, ``state_dict`` keys,
PEFT's adapter saving, the weight syncs and checkpoints are exactly those of
an uncompiled run (a checkpoint saved with compile loads into a run without
it, and the other way round), and generation by the ``transformers``
rollout, whose KV-cache steps would only recompile, stays eager. The
reference pass (LoRA: the same body with the adapter disabled) runs eager
too.

Micro-batches vary in length: shapes are marked dynamic after the first
recompile (torch's default), so a run compiles a couple of graphs, not one
per length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from grpo_core.contract.errors import ConfigError
from grpo_core.modeling.structure import decoder_and_head

if TYPE_CHECKING:
    from grpo_core.config.schema import GRPOConfig


def compiled_body(model: Any) -> Any:
    """The module :func:`compile_policy` compiles: the decoder body the
    log-prob path runs (``model.model`` for Llama-style models, through a
    PEFT wrapper)."""
    # Here, not at the top: config checks import this module, and models imports torch.
    from grpo_core.modeling.models import unwrap

    return decoder_and_head(unwrap(model))[0]


@dataclass(frozen=True)
class CompileOptions:
    """The three keys this module reads: ``torch_compile``, ``torch_compile_backend``, ``torch_compile_mode``."""

    enabled: bool
    backend: str = "inductor"
    mode: str | None = None

    @classmethod
    def of(cls, cfg: GRPOConfig) -> CompileOptions:
        return cls(cfg.torch_compile, cfg.torch_compile_backend or "inductor", cfg.torch_compile_mode)


def compile_problem(options: CompileOptions) -> str | None:
    """Why the compile options cannot run here (for ``grpo config check``), or ``None``."""
    # heavy (torch): loaded on first use, not with this module
    import torch

    if not options.enabled:
        return None
    backend = options.backend
    if backend not in torch._dynamo.list_backends(exclude_tags=()):
        return (
            f"torch_compile_backend = '{backend}' is not a torch.compile backend here: use one of "
            f"{', '.join(torch._dynamo.list_backends())} (default inductor)."
        )
    return None


def compile_policy(options: CompileOptions, model: Any) -> Any:
    """``model``'s decoder body compiled as ``options`` ask (an
    ``OptimizedModule`` sharing the body's parameters), or ``None`` when
    ``torch_compile`` is off. Compilation itself happens at the first call."""
    if not options.enabled:
        return None
    # heavy (torch): loaded on first use, not with this module
    import torch

    problem = compile_problem(options)
    if problem is not None:
        raise ConfigError(problem)
    mode, backend = options.mode, options.backend
    kwargs: dict[str, Any] = {"backend": backend}
    if mode is not None and mode != "default":
        kwargs["mode"] = mode
    return torch.compile(compiled_body(model), **kwargs)
