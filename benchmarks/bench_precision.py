"""One LoRA forward+backward of SmolLM2 on 16 x 80 tokens, in each way
``bf16 = true`` could be built, against float32, on this CPU.

    .venv/bin/python benchmarks/bench_precision.py --repeats 5

- ``float32``: grpo's choice where bf16 is emulated (``bf16 = "auto"`` there).
- ``autocast``: float32 weights, forward under ``torch.autocast(bfloat16)``.
- ``bf16-base``: the frozen base loaded in bf16, adapters float32, under
  autocast: what ``bf16 = true`` builds for a LoRA run (grpo_core/modeling/precision.py).
- ``bf16-base-no-autocast``: the frozen base in bf16, adapters float32, no
  autocast (peft casts the adapter input to its float32 weights).

Prints the median seconds of ``--repeats`` passes (one warm-up excluded), the
ratio to float32, and how far each mode's per-token log-probs are from
float32's on the same batch (mean absolute difference), with the CPU's flags.
The accuracy side (does a bf16 run learn as well) is
benchmarks/bench_time_to_accuracy.py's ``grpo-bf16`` runner.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
MODES = ("float32", "autocast", "bf16-base", "bf16-base-no-autocast")


def build(model_dir: str, mode: str) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if mode.startswith("bf16-base") else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)
    for name, param in model.named_parameters():
        if param.requires_grad:
            param.data = param.data.float()  # adapters train in float32 in every mode
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)  # a non-trivial adapter, identical in every mode (seeded)
    return model


def token_logps(model: torch.nn.Module, ids: torch.Tensor, mode: str) -> torch.Tensor:
    context = (
        torch.autocast("cpu", dtype=torch.bfloat16) if mode in ("autocast", "bf16-base") else contextlib.nullcontext()
    )
    with context:
        logits = model(input_ids=ids).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=80)
    args = parser.parse_args()

    from grpo_core.modeling.model_files import DEFAULT_MODEL, resolve_model_dir
    from grpo_core.modeling.precision import cpu_flag_summary, native_bf16

    model_dir = resolve_model_dir(DEFAULT_MODEL)
    ids = torch.randint(0, 49152, (args.batch, args.tokens), generator=torch.Generator().manual_seed(0))
    rows, reference = {}, None
    for mode in MODES:
        torch.manual_seed(0)
        model = build(model_dir, mode)
        times = []
        for _ in range(args.repeats + 1):
            model.zero_grad(set_to_none=True)
            began = time.perf_counter()
            logps = token_logps(model, ids, mode)
            logps.mean().backward()
            times.append(time.perf_counter() - began)
        with torch.no_grad():
            logps = token_logps(model, ids, mode)
        reference = logps if reference is None else reference
        rows[mode] = {
            "seconds": statistics.median(times[1:]),
            "logp_mad_vs_fp32": float((logps - reference).abs().mean()),
        }
        del model
    flags = cpu_flag_summary()
    print(
        f"CPU flags: {flags}; native bf16: {native_bf16('cpu')}; {torch.get_num_threads()} threads; "
        f"LoRA r16 forward+backward, {args.batch} x {args.tokens} tokens, median of {args.repeats}"
    )
    print(f"{'mode':<24}{'seconds':>10}{'vs float32':>12}{'|logp - fp32|':>16}")
    for mode, row in rows.items():
        row["speedup_vs_fp32"] = rows["float32"]["seconds"] / row["seconds"]
        print(f"{mode:<24}{row['seconds']:>10.2f}{row['speedup_vs_fp32']:>11.2f}x{row['logp_mad_vs_fp32']:>16.4f}")
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "precision.json").write_text(json.dumps({"cpu_flags": flags, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
