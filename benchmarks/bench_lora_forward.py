"""A candidate LoRA forward that fuses peft's scaling and add into the
matmul, against peft's own, in the trainer's forward+backward. Tried for #13
and not adopted (RESULTS.md): this script keeps the candidate so that it can
be measured again on other hardware.

    .venv/bin/python benchmarks/bench_lora_forward.py --repeats 15

peft computes ``base(x) + lora_B(lora_A(dropout(x))) * scaling``: besides the
two thin matmuls, a multiply and an add over the layer's whole output in
forward, and the multiply again in backward, for each of the 210 adapted
layers. The candidate adds ``scaling * h @ B^T`` into the base output in place
(``addmm_``), so the BLAS call does both and backward scales only the thin
``[tokens, r]`` gradient. It covers only the plain case this benchmark runs
(one adapter, no dropout, not merged, one dtype).

The time-to-accuracy task's micro-batch, as ``bench_shared_prompts.py`` builds
it: SmolLM2-135M-Instruct + LoRA r16 on all linear layers (loaded by grpo's
``load_policy``), 16 rows holding 4 distinct prompts of 34 tokens, prompts
shared, completions of ``--completion-tokens``. The two forwards alternate
pass by pass, so a change in machine load hits both; prints the median
seconds, the ratio, and the largest log-prob and relative gradient
differences between them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def fused_lora_forward(layer, x: torch.Tensor) -> torch.Tensor:
    """The candidate forward for a peft ``lora.Linear`` (see the docstring)."""
    name = layer.active_adapters[0]
    rows = x.reshape(-1, x.shape[-1])  # 2-D: the in-place add is then on a fresh tensor, not a view
    result = layer.base_layer(rows)  # nothing saves this output for backward, so it may be added to in place
    result.addmm_(layer.lora_A[name](rows), layer.lora_B[name].weight.t(), alpha=layer.scaling[name])
    return result.view(*x.shape[:-1], result.shape[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=34)
    parser.add_argument("--completion-tokens", type=int, nargs="+", default=[48, 12])
    args = parser.parse_args()

    from peft.tuners.lora.layer import Linear as LoraLinear

    from grpo_core.config.loader import validate
    from grpo_core.logprobs import token_logprobs
    from grpo_core.model_files import DEFAULT_MODEL, resolve_model_dir
    from grpo_core.models import load_policy, load_tokenizer
    from grpo_core.precision import cpu_flag_summary

    torch.manual_seed(0)
    model_dir = resolve_model_dir(DEFAULT_MODEL)
    cfg = validate({"base_model": model_dir, "adapter": "lora", "lora_r": 16, "lora_alpha": 32,
                    "lora_target_linear": True})  # fmt: skip
    model = load_policy(cfg, model_dir, load_tokenizer(cfg, model_dir))
    with torch.no_grad():  # a fresh adapter is a no-op (B = 0): give it an effect, as after a few steps
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.02)
    peft_forward = LoraLinear.forward
    layers = sum(1 for m in model.modules() if isinstance(m, LoraLinear))

    def use(fused: bool) -> None:
        LoraLinear.forward = fused_lora_forward if fused else peft_forward

    generator = torch.Generator().manual_seed(0)
    results = []
    for completion in args.completion_tokens:
        prompts = torch.randint(0, 49152, (args.prompts, args.prompt_tokens), generator=generator)
        ids = torch.cat([prompts[torch.arange(args.rows) % args.prompts],
                         torch.randint(0, 49152, (args.rows, completion), generator=generator)], dim=1)  # fmt: skip
        mask = torch.ones_like(ids)
        times: dict[str, list[float]] = {"peft": [], "fused": []}
        outputs: dict[str, tuple[torch.Tensor, list[torch.Tensor]]] = {}
        for _ in range(args.repeats + 1):
            for label in times:
                use(label == "fused")
                model.zero_grad(set_to_none=True)
                began = time.perf_counter()
                lp, _ = token_logprobs(model, ids, mask, completion, with_entropy=True, share_prompts=True)
                lp.mean().backward()
                times[label].append(time.perf_counter() - began)
                outputs[label] = (lp.detach(), [p.grad for p in model.parameters() if p.requires_grad])
        use(False)
        grad_difference = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
                              for a, b in zip(outputs["fused"][1], outputs["peft"][1]))  # fmt: skip
        row = {"completion_tokens": completion,
               "peft_seconds": statistics.median(times["peft"][1:]),  # the first pass is warm-up
               "fused_seconds": statistics.median(times["fused"][1:]),
               "max_abs_logp_difference": float((outputs["fused"][0] - outputs["peft"][0]).abs().max()),
               "max_relative_grad_difference": grad_difference}  # fmt: skip
        row["speedup"] = row["peft_seconds"] / row["fused_seconds"]
        results.append(row)
    flags = cpu_flag_summary()
    print(f"CPU flags: {flags}; {torch.get_num_threads()} threads; LoRA r16 ({layers} adapted layers) forward+backward "
          f"of {args.rows} rows, {args.prompts} shared prompts of {args.prompt_tokens} tokens, median of {args.repeats}")
    print(f"{'completion tokens':>18}{'peft s':>10}{'fused s':>10}{'speed-up':>10}{'max |dlogp|':>13}{'max rel dgrad':>15}")
    for r in results:
        print(f"{r['completion_tokens']:>18}{r['peft_seconds']:>10.2f}{r['fused_seconds']:>10.2f}{r['speedup']:>9.2f}x"
              f"{r['max_abs_logp_difference']:>13.1e}{r['max_relative_grad_difference']:>15.1e}")
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "lora_forward.json").write_text(json.dumps({"cpu_flags": flags, "rows": results}, indent=2))


if __name__ == "__main__":
    main()
