"""The trainer's forward+backward with each distinct prompt run once
(``share_prompt_prefix = true``, the default) against every row run whole.

    .venv/bin/python benchmarks/bench_shared_prompts.py --repeats 5

The arithmetic example's micro-batch: SmolLM2-135M-Instruct + LoRA r16 on all
linear layers, 16 rows holding 4 distinct prompts of 34 tokens (the example's
chat-templated prompts are 33-35 tokens; 4 prompts x 8 completions sorted by
length spread each group over both micro-batches), completions of
``--completion-tokens`` (48: an early step's; the answers shorten to ~10
tokens as the policy learns). The two ways alternate, so a change in machine
load hits both; prints the median seconds, the ratio, the tokens each pushes
through the decoder, and the largest log-prob and (relative) gradient
differences between them.

``--compare head-checkpoint`` times, on the same micro-batch with shared
prompts, the LM head's chunks recomputed in backward (activation
checkpointing, ``checkpoint_above = 0``) against kept for backward (grpo's
default below 128 Mi logit elements, :mod:`grpo_core.optimization.logprobs`).

``--compare lora-forward`` times peft's LoRA forward against a candidate that
was tried for #13 and not adopted (RESULTS.md), kept here so that it can be
measured again on other hardware. peft computes ``base(x) +
lora_B(lora_A(dropout(x))) * scaling``: a multiply and an add over each
adapted layer's whole output in forward, and the multiply again in backward.
The candidate (:func:`fused_lora_forward`) adds ``scaling * h @ B^T`` into the
base output in place (``addmm_``), so the BLAS call does both and backward
scales only the thin ``[tokens, r]`` gradient; it covers only the plain case
this benchmark runs (one adapter, no dropout, not merged, one dtype).

``--compare head-selection`` times the LM head's log-softmax, target
selection and entropy as autograd composes them (``log_softmax``, ``gather``,
``-(p * log p).sum()``: grpo's path before #27) against
:class:`grpo_core.optimization.logprobs.SelectedLogSoftmax` (grpo's default),
prompts shared in both.

``--compare head-chunks`` times the LM head in chunks of 256 rows (grpo's
default) against 128: a 256-row float32 chunk of SmolLM2's 49k vocabulary is
48 MiB, above glibc's largest mmap threshold (32 MiB), so every out-of-place
pass over it faults in fresh pages; 128-row chunks (24 MiB) stay in the heap.
Tried for #27 and not adopted (RESULTS.md, "LM-head chunks under malloc's
mmap threshold").

``--precision bf16`` runs every way as grpo's ``bf16 = "auto"`` does on a CPU
with native bf16: the frozen base in bf16, float32 adapters, attention by
``sdpa_float32``, forward in grpo's compute region (bf16 autocast, the LoRA
layers' inputs left in bf16: :mod:`grpo_core.modeling.adapter_casts`).
``--compare adapter-casts`` (bf16 implied) times that region against plain
bf16 autocast, where peft casts each adapted layer's bf16 input to float32
and autocast casts it back.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent


def fused_lora_forward(layer, x: torch.Tensor) -> torch.Tensor:
    """``--compare lora-forward``'s candidate for a peft ``lora.Linear`` (module docstring)."""
    name = layer.active_adapters[0]
    rows = x.reshape(-1, x.shape[-1])  # 2-D: the in-place add is then on a fresh tensor, not a view
    result = layer.base_layer(rows)  # nothing saves this output for backward, so it may be added to in place
    down = layer.lora_A[name](rows)
    # in-place ops are outside autocast: B comes to the output's dtype by hand (bf16 there)
    result.addmm_(down.to(result.dtype), layer.lora_B[name].weight.t().to(result.dtype), alpha=layer.scaling[name])
    return result.view(*x.shape[:-1], result.shape[-1])


def composed_selection(logits: torch.Tensor, targets: torch.Tensor, with_entropy: bool):
    """``--compare head-selection``'s baseline: the head's selection as autograd composes it."""
    logps_all = F.log_softmax(logits, dim=-1)
    selected = logps_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return selected, (-(logps_all.exp() * logps_all).sum(-1)).detach() if with_entropy else None


def lora_model(dtype: torch.dtype = torch.float32, attn_implementation: str | None = None) -> torch.nn.Module:
    """SmolLM2-135M-Instruct with a fresh LoRA r16 on all linear layers, in training mode: the
    frozen base in ``dtype`` (bf16 as grpo loads it for bf16 compute), the adapters float32;
    ``attn_implementation`` as transformers takes it (None: its default, sdpa)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from grpo_core.modeling.model_files import DEFAULT_MODEL, resolve_model_dir

    extra = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    model = AutoModelForCausalLM.from_pretrained(resolve_model_dir(DEFAULT_MODEL), dtype=dtype, **extra)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"))
    model.train()
    return model


def trainer_model(precision: str) -> torch.nn.Module:
    """:func:`lora_model` as grpo loads the policy for a pass in ``precision``: for "bf16", the frozen
    base in bf16 with attention in float32 (``sdpa_float32``, grpo_core/modeling/attention.py)."""
    if precision != "bf16":
        return lora_model(torch.float32)
    from grpo_core.modeling.attention import register_sdpa_float32

    return lora_model(torch.bfloat16, register_sdpa_float32())


def micro_batch(
    generator: torch.Generator, prompts: int, rows: int, prompt_tokens: int, completion: int
) -> torch.Tensor:
    """``[rows, prompt_tokens + completion]`` random token ids: ``prompts`` distinct prompts, row i
    holding prompt i % prompts, each row its own completion (the arithmetic example's layout)."""
    prompt_ids = torch.randint(0, 49152, (prompts, prompt_tokens), generator=generator)
    return torch.cat(
        [prompt_ids[torch.arange(rows) % prompts], torch.randint(0, 49152, (rows, completion), generator=generator)],
        dim=1,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=34)
    parser.add_argument("--completion-tokens", type=int, nargs="+", default=[48, 12])
    parser.add_argument(
        "--precision",
        choices=["float32", "bf16"],
        default="float32",
        help="bf16: as grpo's bf16 = 'auto' computes on a native-bf16 CPU (module docstring)",
    )
    parser.add_argument(
        "--compare",
        choices=["shared-prompts", "head-checkpoint", "lora-forward", "head-selection", "adapter-casts", "head-chunks"],
        default="shared-prompts",
    )
    args = parser.parse_args()
    # (label, token_logprobs keyword arguments, LoRA layers' forward or None for peft's,
    # the head's selection or None for grpo's) of the two ways timed
    ways = {
        "shared-prompts": (
            ("whole", {"share_prompts": False}, None, None),
            ("shared", {"share_prompts": True}, None, None),
        ),
        "head-checkpoint": (
            ("recomputed", {"share_prompts": True, "checkpoint_above": 0}, None, None),
            ("kept", {"share_prompts": True}, None, None),
        ),
        "lora-forward": (
            ("peft", {"share_prompts": True}, None, None),
            ("fused", {"share_prompts": True}, fused_lora_forward, None),
        ),
        "head-selection": (
            ("composed", {"share_prompts": True}, None, composed_selection),
            ("fused", {"share_prompts": True}, None, None),
        ),
        "adapter-casts": (
            ("cast", {"share_prompts": True, "grpo_region": False}, None, None),
            ("uncast", {"share_prompts": True}, None, None),
        ),
        "head-chunks": (
            ("256-row", {"share_prompts": True, "chunk_size": 256}, None, None),
            ("128-row", {"share_prompts": True, "chunk_size": 128}, None, None),
        ),
    }[args.compare]
    if args.compare == "adapter-casts":
        args.precision = "bf16"

    from bench_ceiling import compute_context
    from peft.tuners.lora.layer import Linear as LoraLinear

    from grpo_core.modeling.precision import cpu_flag_summary, native_bf16
    from grpo_core.optimization import logprobs
    from grpo_core.optimization.logprobs import token_logprobs

    torch.manual_seed(0)
    if args.precision == "bf16" and not native_bf16("cpu"):
        raise SystemExit("--precision bf16: this CPU has no native bf16 (AVX512-BF16 or AMX)")
    model = trainer_model(args.precision)
    if args.compare in (
        "lora-forward",
        "adapter-casts",
    ):  # a fresh adapter is a no-op (B = 0): give it an effect, as after a few steps
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(std=0.02)
    peft_forward = LoraLinear.forward
    grpo_selection = logprobs.SelectedLogSoftmax.apply
    generator = torch.Generator().manual_seed(0)
    results = []
    for completion in args.completion_tokens:
        ids = micro_batch(generator, args.prompts, args.rows, args.prompt_tokens, completion)
        mask = torch.ones_like(ids)
        times: dict[str, list[float]] = {label: [] for label, *_ in ways}
        logps: dict[str, torch.Tensor] = {}
        grads: dict[str, list[torch.Tensor]] = {}
        for _ in range(args.repeats + 1):
            for label, kwargs, lora_forward, selection in ways:
                LoraLinear.forward = lora_forward or peft_forward
                logprobs.SelectedLogSoftmax.apply = selection or grpo_selection
                model.zero_grad(set_to_none=True)
                kwargs = dict(kwargs)  # a way runs in grpo's compute region unless it says grpo_region = False
                compute = compute_context(args.precision, model if kwargs.pop("grpo_region", True) else None)
                began = time.perf_counter()
                with compute():
                    lp, _ = token_logprobs(model, ids, mask, completion, with_entropy=True, **kwargs)
                lp.float().mean().backward()
                times[label].append(time.perf_counter() - began)
                logps[label] = lp.detach()
                grads[label] = [p.grad for p in model.parameters() if p.requires_grad]
        LoraLinear.forward = peft_forward
        logprobs.SelectedLogSoftmax.apply = grpo_selection
        (a, *_), (b, *_) = ways
        row = {
            "completion_tokens": completion,
            "max_abs_logp_difference": float((logps[a] - logps[b]).abs().max()),
            "max_relative_grad_difference": max(
                float((x - y).abs().max() / y.abs().max().clamp_min(1e-30)) for x, y in zip(grads[a], grads[b])
            ),
            **{f"{label}_seconds": statistics.median(times[label][1:]) for label, *_ in ways},
        }  # the first pass is warm-up
        row["speedup"] = row[f"{a}_seconds"] / row[f"{b}_seconds"]
        if args.compare == "shared-prompts":
            row["tokens"] = (
                f"{args.rows * (args.prompt_tokens + completion)} -> "
                f"{args.prompts * args.prompt_tokens + args.rows * completion}"
            )
        results.append(row)
    flags = cpu_flag_summary()
    print(
        f"CPU flags: {flags}; {torch.get_num_threads()} threads; {args.precision}; LoRA r16 forward+backward of "
        f"{args.rows} rows, {args.prompts} distinct prompts of {args.prompt_tokens} tokens, median of {args.repeats}"
    )
    print(
        f"{'completion tokens':>18}{a + ' s':>14}{b + ' s':>14}{'speed-up':>10}{'tokens':>16}{'max |dlogp|':>13}"
        f"{'max rel dgrad':>15}"
    )
    for r in results:
        print(
            f"{r['completion_tokens']:>18}{r[a + '_seconds']:>14.2f}{r[b + '_seconds']:>14.2f}{r['speedup']:>9.2f}x"
            f"{r.get('tokens', '-'):>16}{r['max_abs_logp_difference']:>13.1e}{r['max_relative_grad_difference']:>15.1e}"
        )
    (HERE / "results").mkdir(exist_ok=True)
    name = args.compare.replace("-", "_")
    (HERE / "results" / f"{name}.json").write_text(
        json.dumps(
            {"cpu_flags": flags, "compare": args.compare, "precision": args.precision, "rows": results}, indent=2
        )
    )


if __name__ == "__main__":
    main()
