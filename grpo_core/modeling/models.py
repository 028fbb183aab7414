"""Loading the tokenizer, the policy and the reference model; saving the result.

``model_dir`` is what :func:`grpo_core.modeling.model_files.resolve_model_dir` returned
for ``base_model`` (a local HF directory or a hub id). Everything the config
says about the model (dtype, attention kernel, LoRA, gradient checkpointing,
chat template, special tokens) is applied here, so the trainer receives a
ready ``nn.Module`` and never reads those keys itself.

The reference model (for the KL term when ``trl.beta > 0``) is exposed as a
:class:`ReferenceModel` with one method the trainer needs::

    ref = reference_model(cfg, model_dir, policy)      # None when beta == 0
    with ref.active() as m:                            # no_grad inside
        ref_logits = m(input_ids=..., attention_mask=...).logits

For LoRA it is the policy itself with the adapter switched off (no second
copy in memory); for full fine-tuning it is a frozen copy of the base weights.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from grpo_core.config.zero_stage import zero_stage
from grpo_core.contract.errors import ConfigError, NotImplementedYet
from grpo_core.modeling.attention import SDPA_FLOAT32, register_sdpa_float32
from grpo_core.modeling.precision import resolve_precision
from grpo_core.modeling.quantization import quantization_config
from grpo_core.modeling.tokenizer_files import damaged_file, template_problem
from grpo_core.modeling.weight_files import check_weight_folder
from grpo_core.runtime.failure import one_line

if TYPE_CHECKING:
    from grpo_core.config.schema import GRPOConfig

# Templates grpo knows by name, for models whose tokenizer has none (or the
# wrong one). A tokenizer's own named templates (a dict chat_template) are
# accepted by name as well.
NAMED_CHAT_TEMPLATES: dict[str, str] = {
    "chatml": (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
    # Meta's Llama 3 chat format (Axolotl's `chat_template: llama3`), written from its model card.
    "llama3": (
        "{{ bos_token }}{% for message in messages %}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
        " + '<|eot_id|>' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
    ),
}
TOKENIZER_DEFAULT = "tokenizer_default"


# ----------------------------------------------------------------------------- tokenizer


def _looks_like_jinja(text: str) -> bool:
    return "{{" in text or "{%" in text


def _resolve_chat_template(tokenizer: Any, choice: str | None) -> str | None:
    """The template string to install, or ``None`` to keep the tokenizer's."""
    if choice is None or choice == TOKENIZER_DEFAULT:
        return None
    if _looks_like_jinja(choice):
        return choice
    own = tokenizer.chat_template if isinstance(tokenizer.chat_template, dict) else {}
    if choice in own:
        return own[choice]
    if choice in NAMED_CHAT_TEMPLATES:
        return NAMED_CHAT_TEMPLATES[choice]
    path = Path(choice).expanduser()
    if path.suffix == ".jinja" and path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(
                f"chat_template '{choice}': the file is not UTF-8 text (byte {exc.start}). Save it as UTF-8."
            ) from None
    known = sorted({TOKENIZER_DEFAULT, *own, *NAMED_CHAT_TEMPLATES})
    raise ConfigError(
        f"chat_template '{choice}' is not a known template name ({', '.join(known)}), a .jinja file, "
        "or an inline Jinja template (text containing '{{' or '{%')."
    )


def remote_code_error(key: str, source: str, exc: Exception) -> ConfigError | None:
    """The refusal to give when ``source`` needs its own Python code and the
    config does not trust it (transformers says so in a ValueError)."""
    if "trust_remote_code" not in str(exc):
        return None
    return ConfigError(
        f"{key}: '{source}' ships its own Python code (modelling or tokenizer files), which grpo does not run "
        "unless the config says `trust_remote_code = true`. Read that code first: it runs with your permissions."
    )


def load_tokenizer(cfg: GRPOConfig, model_dir: str) -> Any:
    """The tokenizer with the config's chat template and special tokens,
    a pad token, and left padding (prompts are left-padded in batches)."""
    # heavy (transformers): loaded on first use, not with this module
    from transformers import AutoTokenizer

    source = cfg.tokenizer_config or model_dir
    key = "tokenizer_config" if cfg.tokenizer_config else "base_model"
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=cfg.trust_remote_code)
    except Exception as exc:  # OSError, ValueError, UnicodeDecodeError, the tokenizers library's own Exception
        refused = remote_code_error(key, source, exc) if isinstance(exc, (OSError, ValueError)) else None
        damaged = damaged_file(source)
        if refused is None and damaged is not None:
            refused = ConfigError(
                f"{key}: cannot load a tokenizer from '{source}': {damaged}. Restore that file (copy it again from "
                "where the model came from)."
            )
        raise refused or ConfigError(
            f"{key}: cannot load a tokenizer from '{source}': {type(exc).__name__}: {one_line(exc, 300)}"
        ) from exc

    template = _resolve_chat_template(tokenizer, cfg.chat_template)
    if template is not None:
        tokenizer.chat_template = template
    _check_template(tokenizer, cfg, source)

    if cfg.special_tokens:
        for key, token in cfg.special_tokens.items():
            if key not in {"pad_token", "eos_token", "bos_token", "unk_token", "sep_token", "cls_token", "mask_token"}:
                # Anything else is an extra special token to add to the vocabulary.
                tokenizer.add_special_tokens({"additional_special_tokens": [token]}, replace_extra_special_tokens=False)
                continue
            tokenizer.add_special_tokens({key: token})

    if tokenizer.pad_token is None:
        fallback = tokenizer.eos_token or tokenizer.unk_token
        if fallback is None:
            raise ConfigError(
                f"the tokenizer of '{source}' has no pad, eos or unk token; set special_tokens.pad_token in the config."
            )
        tokenizer.pad_token = fallback
    tokenizer.padding_side = "left"
    return tokenizer


def _check_template(tokenizer: Any, cfg: GRPOConfig, source: str) -> None:
    """Refuse a chat template that does not compile, naming where it came
    from, before any prompt is rendered with it."""
    own = tokenizer.chat_template
    templates = own if isinstance(own, dict) else {"": own} if isinstance(own, str) else {}
    for name, text in templates.items():
        problem = template_problem(text) if isinstance(text, str) else None
        if problem is None:
            continue
        if cfg.chat_template and cfg.chat_template != TOKENIZER_DEFAULT:
            where = f"chat_template '{cfg.chat_template}'" if len(cfg.chat_template) < 200 else "chat_template"
        else:
            where = f"the chat template of the tokenizer in '{source}'" + (f" ('{name}')" if name else "")
        raise ConfigError(
            f"{where} is not a valid Jinja template: {problem}. Fix the template, or set `chat_template`."
        )


# ----------------------------------------------------------------------------- policy


def resolve_dtype(cfg: GRPOConfig) -> torch.dtype:
    """Dtype the policy's weights load in (:mod:`grpo_core.modeling.precision`): bf16
    or fp16 only for a LoRA's frozen base; trained weights stay float32."""
    return resolve_precision(cfg).load_dtype


_FLASH_AVAILABLE = {"flash_attention_2": "is_flash_attn_2_available", "flash_attention_3": "is_flash_attn_3_available"}


def _flash_or_sdpa(kernel: str, key: str) -> str:
    """A flash kernel where it can run; otherwise sdpa, saying so."""
    # heavy (transformers): loaded on first use, not with this module
    import transformers.utils as tu

    probe = getattr(tu, _FLASH_AVAILABLE[kernel], None)
    if torch.cuda.is_available() and probe is not None and probe():
        return kernel
    why = "no CUDA device" if not torch.cuda.is_available() else "the flash-attn package is not installed"
    warnings.warn(
        f"{key}: {kernel} is unavailable ({why}); using 'sdpa' (PyTorch scaled-dot-product attention) instead.",
        stacklevel=4,
    )
    return "sdpa"


def resolve_attn_implementation(
    cfg: GRPOConfig, device_type: str | None = None, flags: set[str] | None = None
) -> str | None:
    """``attn_implementation`` (Axolotl's and transformers' key) or the older
    ``flash_attention`` / ``sdp_attention`` flags -> what from_pretrained gets.
    Flash kernels need CUDA: elsewhere say what runs instead rather than fail.
    Unset, a bf16 pass on a CPU gets ``sdpa_float32`` (grpo_core/modeling/attention.py:
    PyTorch's CPU flash-attention backward is several times slower in bf16);
    ``device_type`` and ``flags`` default to this machine's, tests pass others."""
    if cfg.attn_implementation is not None:
        if cfg.attn_implementation in _FLASH_AVAILABLE:
            return _flash_or_sdpa(cfg.attn_implementation, f"attn_implementation = '{cfg.attn_implementation}'")
        if cfg.attn_implementation == SDPA_FLOAT32:
            return register_sdpa_float32()
        return cfg.attn_implementation
    if cfg.flash_attention:
        return _flash_or_sdpa("flash_attention_2", "flash_attention")
    if cfg.sdp_attention is True:
        return "sdpa"
    if cfg.sdp_attention is False:
        return "eager"
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type == "cpu" and resolve_precision(cfg, device_type, flags).compute_dtype == torch.bfloat16:
        return register_sdpa_float32()
    return None  # transformers' default


def _load_causal_lm(cfg: GRPOConfig, model_dir: str) -> nn.Module:
    # heavy (transformers): loaded on first use, not with this module
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": resolve_dtype(cfg), "trust_remote_code": cfg.trust_remote_code}
    attn = resolve_attn_implementation(cfg)
    if attn is not None:
        kwargs["attn_implementation"] = attn
    quantization = quantization_config(
        kwargs["dtype"],
        load_in_4bit=cfg.load_in_4bit,
        load_in_8bit=cfg.load_in_8bit,
        bnb_config_kwargs=cfg.bnb_config_kwargs,
    )
    if quantization is not None:
        kwargs["quantization_config"] = quantization
    check_weight_folder(model_dir, "base_model")  # a cut weights file named, not a SafetensorError
    try:
        return AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    except OSError as exc:
        raise ConfigError(f"base_model: cannot load a causal LM from '{model_dir}': {exc}") from exc
    except ValueError as exc:
        refused = remote_code_error("base_model", model_dir, exc)
        if refused is None:
            raise
        raise refused from None


def linear_module_names(model: nn.Module) -> set[str]:
    """Leaf names of the model's linear layers, output head excluded (what
    peft's 'all-linear' targets)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return {
        name.rsplit(".", 1)[-1] for name, mod in model.named_modules() if isinstance(mod, nn.Linear) and mod is not head
    }


def _lora_targets(cfg: GRPOConfig, model: nn.Module) -> str | list[str]:
    if cfg.lora_target_linear and cfg.lora_target_modules:
        return sorted(linear_module_names(model) | set(cfg.lora_target_modules))
    if cfg.lora_target_linear:
        return "all-linear"
    if cfg.lora_target_modules:
        return list(cfg.lora_target_modules)
    raise ConfigError("adapter = 'lora' needs lora_target_linear = true or a lora_target_modules list.")


def load_policy(cfg: GRPOConfig, model_dir: str, tokenizer: Any) -> nn.Module:
    """The model to train: a PEFT model when ``adapter = 'lora'``, else the
    full causal LM with every parameter trainable."""
    model = _load_causal_lm(cfg, model_dir)
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tokenizer))
        if cfg.adapter == "lora":
            warnings.warn(
                f"special_tokens added {len(tokenizer) - model.config.vocab_size} token(s) beyond the base vocabulary; "
                "with LoRA their embeddings stay at their initial value (mean of the others) and are saved with "
                "the adapter.",
                stacklevel=2,
            )
    model.config.pad_token_id = tokenizer.pad_token_id

    if cfg.gradient_checkpointing:
        kwargs = gradient_checkpointing_kwargs(cfg)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        model.config.use_cache = False
        if cfg.adapter == "lora":
            # Frozen embeddings give inputs without grad; reentrant checkpointing
            # would then drop the LoRA gradients of every checkpointed block.
            model.enable_input_require_grads()

    if cfg.adapter == "lora":
        # heavy (peft): loaded on first use, not with this module
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(
            r=cfg.lora_r,
            lora_alpha=cfg.lora_alpha,
            lora_dropout=cfg.lora_dropout,
            target_modules=_lora_targets(cfg, model),
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, lora)
    return model


def trainable_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts, for logs."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return trainable, total


def is_peft_model(model: Any) -> bool:
    try:
        # heavy (peft): loaded on first use, not with this module
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a dependency
        return False
    return isinstance(model, PeftModel)


# ----------------------------------------------------------------------------- reference


class ReferenceModel:
    """Computes reference log-probs for the KL term.

    Use ``with ref.active() as m: logits = m(...).logits``; gradients are off
    inside. Do not keep ``m`` beyond the ``with`` block: for LoRA it is the
    policy, whose adapter is switched back on when the block ends.
    """

    def active(self) -> contextlib.AbstractContextManager[nn.Module]:
        raise NotImplementedError

    def sync(self, policy: nn.Module, alpha: float) -> None:
        """``trl.sync_ref_model``: ref <- alpha * policy + (1 - alpha) * ref."""
        raise NotImplementedError


class DisabledAdapterReference(ReferenceModel):
    """LoRA: the base model is the policy with its adapter disabled."""

    def __init__(self, policy: nn.Module) -> None:
        self.policy = policy

    @contextlib.contextmanager
    def active(self) -> Iterator[nn.Module]:
        with torch.no_grad(), self.policy.disable_adapter():
            yield self.policy

    def sync(self, policy: nn.Module, alpha: float) -> None:
        raise NotImplementedYet(
            "trl.sync_ref_model", "with adapter = 'lora' the reference is the base model with the adapter disabled"
        )


class FrozenCopyReference(ReferenceModel):
    """Full fine-tuning: a separate, frozen copy of the initial weights."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model.eval()
        for param in self.model.parameters():
            param.requires_grad_(False)

    @contextlib.contextmanager
    def active(self) -> Iterator[nn.Module]:
        with torch.no_grad():
            yield self.model

    @torch.no_grad()
    def sync(self, policy: nn.Module, alpha: float) -> None:
        mine = dict(self.model.named_parameters())
        for name, param in policy.named_parameters():
            target = mine.get(name)
            if target is not None:
                target.mul_(1.0 - alpha).add_(param.detach().to(target.dtype), alpha=alpha)


def reference_model(cfg: GRPOConfig, model_dir: str, policy: nn.Module) -> ReferenceModel | None:
    """The reference for the KL term, or ``None`` when ``trl.beta == 0`` (no
    KL term: nothing is loaded)."""
    if not cfg.trl.beta:
        return None
    if is_peft_model(policy):
        if cfg.trl.sync_ref_model:
            raise NotImplementedYet(
                "trl.sync_ref_model", "with adapter = 'lora' the reference is the base model with the adapter disabled"
            )
        return DisabledAdapterReference(policy)
    frozen = _load_causal_lm(cfg, model_dir)
    vocab = policy.get_input_embeddings().num_embeddings
    if frozen.get_input_embeddings().num_embeddings != vocab:
        # Tokens added by special_tokens: same rows as the policy's (whose new
        # rows were initialised randomly-around-the-mean when it was resized).
        old = frozen.get_input_embeddings().num_embeddings
        frozen.resize_token_embeddings(vocab, mean_resizing=False)
        with torch.no_grad():
            frozen.get_input_embeddings().weight[old:] = policy.get_input_embeddings().weight[old:]
            out_ref, out_pol = frozen.get_output_embeddings(), policy.get_output_embeddings()
            if (
                out_ref is not None
                and out_pol is not None
                and out_ref.weight is not frozen.get_input_embeddings().weight
            ):
                out_ref.weight[old:] = out_pol.weight[old:]
    frozen.config.pad_token_id = policy.config.pad_token_id
    device = next(policy.parameters()).device
    return FrozenCopyReference(frozen.to(device))


# ----------------------------------------------------------------------------- saving


def unwrap(model: Any) -> Any:
    """The plain model under torch.compile / DDP wrappers."""
    while True:
        inner = getattr(model, "_orig_mod", None) or (
            getattr(model, "module", None) if hasattr(model, "no_sync") else None
        )
        if inner is None:
            return model
        model = inner


def save_final(model: nn.Module, tokenizer: Any, output_dir: str | Path, safetensors: bool = True) -> Path:
    """Save in the standard format: a PEFT adapter directory
    (``adapter_config.json`` + ``adapter_model.safetensors``, loadable by
    ``PeftModel.from_pretrained`` and by vLLM as a LoRA module) or a full HF
    model directory (safetensors), plus the tokenizer."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = unwrap(model)
    model.save_pretrained(out, safe_serialization=safetensors)  # save_safetensors = false: .bin files
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


def gradient_checkpointing_kwargs(cfg: GRPOConfig) -> dict[str, Any]:
    """``gradient_checkpointing_kwargs`` with ``use_reentrant`` defaulted:
    false (non-reentrant, what FSDP needs), but true under DeepSpeed ZeRO-3,
    whose partitioned parameters fail non-reentrant recomputation's
    metadata check (an explicit false there is refused by the config checks)."""
    kwargs = dict(cfg.gradient_checkpointing_kwargs or {})
    if "use_reentrant" not in kwargs:
        kwargs["use_reentrant"] = bool(cfg.deepspeed) and zero_stage(cfg) == 3
    return kwargs
