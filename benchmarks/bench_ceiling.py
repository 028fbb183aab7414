"""Where the trainer's and the generator's seconds go: achieved rates against
this CPU's ceilings, all measured in one run (issue #27).

    nice -n 10 .venv/bin/python benchmarks/bench_ceiling.py --repeats 5
    nice -n 10 .venv/bin/python benchmarks/bench_ceiling.py --vllm            # + a float32 vLLM server of its own
    .venv/bin/python benchmarks/bench_ceiling.py --base-url http://127.0.0.1:PORT --api-key KEY  # reuse one
    nice -n 10 .venv/bin/python benchmarks/bench_ceiling.py --precision bf16  # the trainer as bf16 runs it
    # both as 'auto' runs them on AMX:
    .venv/bin/python benchmarks/bench_ceiling.py --precision bf16 --vllm --vllm-dtype bfloat16

The process keeps freed memory for reuse, as a grpo run on a CPU does
(``reuse_freed_memory``, :mod:`grpo_core.runtime.heap`). Prints, in order:

1. The ceilings: float32 ``torch.mm`` GFLOP/s for the shapes of #27 (median of
   ``--repeats`` samples after warm-up, at torch's thread count, which is the
   trainer's), bf16 ones too where the CPU has native bf16 (labelled so), and
   memory bandwidth (a tensor's sum: read; a copy: read + write).
2. The trainer's forward+backward of the arithmetic micro-batch (what
   ``bench_shared_prompts.py`` builds: SmolLM2-135M-Instruct float32 + LoRA r16
   on all linear layers, 16 rows = 4 distinct 34-token prompts x 48 completion
   tokens) three ways, interleaved, median: grpo's log-prob path with shared
   prompts (the default) and with every row whole, and a plain transformers +
   peft loop (full forward, log-softmax over the vocabulary at every position,
   gather, backward). Each way's useful flops (:func:`micro_batch_flops`) give
   its GFLOP/s and its share of the ceiling: the seconds the matching ``mm``
   shapes would take for those flops over the seconds taken.
3. ``torch.profiler`` top ops by self CPU time for grpo's path and the plain loop.
4. With ``--vllm`` or ``--base-url``: one generation of the arithmetic batch
   (4 chat-templated prompts from examples/arithmetic x 8 samples x 48 tokens,
   ``ignore_eos``): ms per decode step, ``(t(48 tokens) - t(1 token)) / 47``,
   against the bandwidth bound (weight bytes in the server's dtype, ``--vllm-dtype``,
   / read bandwidth) and the flop bound (2 x 32 x matmul weights / the decode-like
   ``mm`` rate in that dtype).

Useful flops (:func:`micro_batch_flops`), a multiply-add counted as 2: every
frozen linear layer's product forward and its input gradient backward (no
weight gradient: frozen), so 4 x tokens x in x out; each LoRA pair forward,
input gradient and weight gradients, 6 x tokens x r x (in + out); attention's
two products (scores, weighted values) over the causal triangle only (each
query against the keys at or before it), forward and twice that backward;
the LM head (tied embeddings, frozen) 4 x positions x hidden x vocab, on the
completion positions for grpo and on every position for the plain loop.
Elementwise work (norms, activations, softmax, LoRA's scaling) is not counted.

``--precision bf16`` runs the trainer's ways as grpo's ``bf16`` does (the
frozen base loaded in bf16, the adapters float32, forward under bf16
autocast, attention in float32 by ``sdpa_float32``; what ``bf16 = "auto"``
picks on a CPU with AVX512-BF16 or AMX) and rates them against the bf16
``mm`` ceilings.

The CPU flags, torch version, threads and the load average at start and end
are printed with the numbers; on a loaded machine read them as such.
Writes benchmarks/results/ceiling.json (``ceiling_bf16.json`` with ``--precision bf16``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

MM_SHAPES = {  # label: (m, k, n) of [m x k] x [k x n]
    "2048x2048x2048": (2048, 2048, 2048),
    "MLP [1700x576]x[576x1536]": (1700, 576, 1536),
    "attention projection [1700x576]x[576x576]": (1700, 576, 576),
    "LM head [768x576]x[576x49152]": (768, 576, 49152),
    "decode-like [32x576]x[576x1536]": (32, 576, 1536),
}
CEILING_OF = {  # flop class -> the mm shape whose rate is its ceiling
    "MLP": "MLP [1700x576]x[576x1536]",
    "attention projections": "attention projection [1700x576]x[576x576]",
    "LoRA": "attention projection [1700x576]x[576x576]",  # thin products: an optimistic ceiling
    "attention scores": "attention projection [1700x576]x[576x576]",
    "LM head": "LM head [768x576]x[576x49152]",
}
PROMPTS, ROWS, PROMPT_TOKENS, COMPLETION_TOKENS, SAMPLES = 4, 16, 34, 48, 8


# ---------------------------------------------------------------- ceilings


def median_seconds(fn: Callable[[], object], repeats: int, min_sample_s: float = 0.02) -> float:
    """Median seconds of one ``fn()`` call: after a warm-up call, ``repeats``
    samples, each looping ``fn`` enough times to last ``min_sample_s``."""
    began = time.perf_counter()
    fn()
    inner = max(1, math.ceil(min_sample_s / max(time.perf_counter() - began, 1e-9)))
    samples = []
    for _ in range(repeats):
        began = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - began) / inner)
    return statistics.median(samples)


def mm_gflops(m: int, k: int, n: int, dtype: torch.dtype, repeats: int) -> float:
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    out = torch.empty(m, n, dtype=dtype)
    return 2 * m * k * n / median_seconds(lambda: torch.mm(a, b, out=out), repeats) / 1e9


def bandwidth_gbs(repeats: int, mib: int = 512) -> dict[str, float]:
    """GB/s reading a ``mib``-MiB float32 tensor (``sum``) and copying it (read + write)."""
    x = torch.rand(mib * 2**20 // 4)
    y = torch.empty_like(x)
    nbytes = x.numel() * 4
    return {
        "read (sum)": nbytes / median_seconds(x.sum, repeats) / 1e9,
        "copy (read + write)": 2 * nbytes / median_seconds(lambda: y.copy_(x), repeats) / 1e9,
    }


def ceilings(repeats: int, bf16: bool) -> dict[str, dict[str, float]]:
    rates = {"float32": {label: mm_gflops(*shape, torch.float32, repeats) for label, shape in MM_SHAPES.items()}}
    if bf16:
        rates["bf16 (native)"] = {
            label: mm_gflops(*shape, torch.bfloat16, repeats) for label, shape in MM_SHAPES.items()
        }
    return rates


# ---------------------------------------------------------------- flops


@dataclass(frozen=True)
class Dims:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    lora_r: int

    @classmethod
    def of(cls, config, lora_r: int) -> Dims:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(
            config.hidden_size,
            config.intermediate_size,
            config.num_hidden_layers,
            config.num_attention_heads,
            config.num_key_value_heads,
            head_dim,
            config.vocab_size,
            lora_r,
        )

    def linears(self) -> dict[str, list[tuple[int, int]]]:
        """(in, out) of one decoder layer's linear layers, by flop class."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {
            "attention projections": [(self.hidden, q), (self.hidden, kv), (self.hidden, kv), (q, self.hidden)],
            "MLP": [(self.hidden, self.intermediate)] * 2 + [(self.intermediate, self.hidden)],
        }


def causal_keys_whole(rows: int, length: int) -> int:
    """(query, key) pairs of ``rows`` rows of ``length`` tokens, each query against the keys up to itself."""
    return rows * length * (length + 1) // 2


def causal_keys_shared(prompts: int, prompt_tokens: int, rows: int, completion: int) -> int:
    """The same with each distinct prompt run once and every row's completion attending to its prompt."""
    p, c = prompt_tokens, completion
    return prompts * p * (p + 1) // 2 + rows * (c * p + c * (c + 1) // 2)


def decoder_flops(d: Dims, tokens: int, key_pairs: int) -> dict[str, float]:
    """Useful forward + backward flops of the decoder body (module docstring)."""
    flops = {cls: 4.0 * tokens * d.layers * sum(i * o for i, o in shapes) for cls, shapes in d.linears().items()}
    every = [shape for shapes in d.linears().values() for shape in shapes]
    flops["LoRA"] = 6.0 * tokens * d.layers * d.lora_r * sum(i + o for i, o in every)
    flops["attention scores"] = 3 * 4.0 * key_pairs * d.heads * d.head_dim * d.layers
    return flops


def micro_batch_flops(
    d: Dims, way: str, prompts: int, rows: int, prompt_tokens: int, completion: int
) -> dict[str, float]:
    """Useful flops by class of one forward+backward of the micro-batch: ``way`` is "shared"
    (each prompt once, head on the completions), "whole" (every row whole, head on the
    completions) or "plain" (every row whole, head on every position)."""
    length = prompt_tokens + completion
    if way == "shared":
        flops = decoder_flops(
            d, prompts * prompt_tokens + rows * completion, causal_keys_shared(prompts, prompt_tokens, rows, completion)
        )
    else:
        flops = decoder_flops(d, rows * length, causal_keys_whole(rows, length))
    head_positions = rows * (length if way == "plain" else completion)
    flops["LM head"] = 4.0 * head_positions * d.hidden * d.vocab
    return flops


def ceiling_seconds(flops: dict[str, float], rates: dict[str, float]) -> float:
    """Seconds the flops would take at their matching mm shapes' rates (GFLOP/s)."""
    return sum(f / (rates[CEILING_OF[cls]] * 1e9) for cls, f in flops.items())


# ---------------------------------------------------------------- the trainer's forward/backward


def compute_context(precision: str, model=None) -> Callable[[], contextlib.AbstractContextManager]:
    """The forward's context: none in float32; for bf16, grpo's compute region for ``model``
    (autocast, the LoRA layers' inputs left in bf16) as the trainer enters it, or plain bf16
    autocast without a model (what a plain peft loop runs)."""
    if precision != "bf16":
        return contextlib.nullcontext
    if model is None:
        return lambda: torch.autocast("cpu", dtype=torch.bfloat16)
    from grpo_core.modeling.precision import Precision

    region = Precision(torch.bfloat16, torch.bfloat16, "bf16 compute")
    return lambda: region.autocast("cpu", model)


def grpo_pass(model, ids: torch.Tensor, completion: int, share: bool, compute=contextlib.nullcontext) -> torch.Tensor:
    """grpo's log-prob path as the trainer calls it (entropy on), then backward."""
    from grpo_core.optimization.logprobs import token_logprobs

    with compute():
        logps, _ = token_logprobs(model, ids, torch.ones_like(ids), completion, with_entropy=True, share_prompts=share)
    logps.mean().backward()
    return logps.detach()


def plain_pass(model, ids: torch.Tensor, completion: int, compute=contextlib.nullcontext) -> torch.Tensor:
    """A plain transformers + peft loop: logits at every position, log-softmax over the vocabulary, backward."""
    with compute():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[:, :-1]
        logps = F.log_softmax(logits.float(), dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)[:, -completion:]
    logps.mean().backward()
    return logps.detach()


def trainer_ways(
    model, ids: torch.Tensor, completion: int, precision: str = "float32"
) -> dict[str, Callable[[], torch.Tensor]]:
    grpo_compute, plain_compute = compute_context(precision, model), compute_context(precision)
    return {
        "shared": lambda: grpo_pass(model, ids, completion, share=True, compute=grpo_compute),
        "whole": lambda: grpo_pass(model, ids, completion, share=False, compute=grpo_compute),
        "plain": lambda: plain_pass(model, ids, completion, compute=plain_compute),
    }


def time_interleaved(model, ways: dict[str, Callable[[], torch.Tensor]], repeats: int):
    """Seconds of each way per round, the ways alternating (the first round, warm-up, not kept), and each one's
    log-probs."""
    times: dict[str, list[float]] = {name: [] for name in ways}
    logps: dict[str, torch.Tensor] = {}
    for round_ in range(repeats + 1):
        for name, fn in ways.items():
            model.zero_grad(set_to_none=True)
            began = time.perf_counter()
            logps[name] = fn()
            if round_:
                times[name].append(time.perf_counter() - began)
            print(f"  round {round_} {name}: {time.perf_counter() - began:.2f} s", file=sys.stderr, flush=True)
    return times, logps


def top_ops(fn: Callable[[], object], model, top: int) -> list[dict]:
    """One call of ``fn`` under torch.profiler: the ``top`` ops by self CPU time, with their share."""
    from torch.profiler import ProfilerActivity, profile

    model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events)
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    return [
        {"op": e.key, "self_ms": e.self_cpu_time_total / 1e3, "share": e.self_cpu_time_total / total, "calls": e.count}
        for e in events[:top]
    ] + [{"op": "(all ops)", "self_ms": total / 1e3, "share": 1.0, "calls": 0}]


# ---------------------------------------------------------------- generation


def arithmetic_prompts(tokenizer, count: int) -> list[list[int]]:
    """The first ``count`` prompts of the arithmetic example, chat-templated, as token ids."""
    lines = (HERE.parent / "examples" / "arithmetic" / "data" / "train.jsonl").read_text().splitlines()[:count]
    return [
        list(
            tokenizer.apply_chat_template(
                json.loads(line)["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        for line in lines
    ]


def generation_seconds(
    base_url: str, api_key: str | None, model: str, prompts: list[list[int]], max_tokens: int
) -> float:
    import requests

    body = {
        "model": model,
        "prompt": prompts,
        "n": SAMPLES,
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "ignore_eos": True,
        "logprobs": 0,
    }
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    began = time.perf_counter()
    response = requests.post(f"{base_url}/v1/completions", json=body, headers=headers, timeout=900)
    response.raise_for_status()
    return time.perf_counter() - began


def decode_step_ms(
    base_url: str, api_key: str | None, model: str, prompts: list[list[int]], repeats: int
) -> dict[str, float]:
    """ms per decode step of ``len(prompts) x SAMPLES`` sequences: 48-token minus 1-token requests, alternating."""
    one, full = [], []
    generation_seconds(base_url, api_key, model, prompts, COMPLETION_TOKENS)  # warm-up
    for _ in range(repeats):
        one.append(generation_seconds(base_url, api_key, model, prompts, 1))
        full.append(generation_seconds(base_url, api_key, model, prompts, COMPLETION_TOKENS))
    t1, t48 = statistics.median(one), statistics.median(full)
    return {
        "request_1_token_s": t1,
        "request_48_tokens_s": t48,
        "ms_per_decode_step": (t48 - t1) / (COMPLETION_TOKENS - 1) * 1e3,
    }


def decode_bounds(
    model, read_gbs: float, decode_gflops: float, sequences: int, bytes_per_weight: int = 4
) -> dict[str, float]:
    """A decode step's lower bounds: reading every weight once (``bytes_per_weight``: 4 for a float32
    server, 2 for bf16), and its matmul flops at the decode-like rate of the server's dtype."""
    params = {n: p for n, p in model.named_parameters() if "lora_" not in n}  # the server runs merged weights, no LoRA
    weight_bytes = sum(p.numel() * bytes_per_weight for p in params.values())  # tied embeddings counted once
    embedding = model.get_input_embeddings().weight.numel()
    matmul_weights = (
        sum(p.numel() for n, p in params.items() if p.dim() == 2 and "embed" not in n) + embedding
    )  # + the tied head
    flops = 2.0 * sequences * matmul_weights
    return {
        "weight_MB": weight_bytes / 1e6,
        "bandwidth_bound_ms": weight_bytes / (read_gbs * 1e9) * 1e3,
        "flops_per_step_G": flops / 1e9,
        "flop_bound_ms": flops / (decode_gflops * 1e9) * 1e3,
    }


def start_server(extra: tuple[str, ...] = (), dtype: str = "float32"):
    """A vLLM server in ``dtype`` on all cores without LoRA layers (grpo's managed default on CPU),
    via bench_vllm_cpu; ``extra`` goes on its command line."""
    from bench_vllm_cpu import serve

    from grpo_core.modeling.model_files import DEFAULT_MODEL, resolve_model_dir
    from grpo_plugins.vllm.addresses import free_port

    port = free_port()
    return serve(
        resolve_model_dir(DEFAULT_MODEL), port, dtype, all_cores=True, lora=False, extra=extra
    ), f"http://127.0.0.1:{port}"


# ---------------------------------------------------------------- report


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def print_ceilings(rates: dict[str, dict[str, float]], bandwidth: dict[str, float]) -> None:
    print("\n== ceilings: torch.mm GFLOP/s, median after warm-up ==")
    print(f"{'shape':<45}" + "".join(f"{dtype:>16}" for dtype in rates))
    for label in MM_SHAPES:
        print(f"{label:<45}" + "".join(f"{rates[dtype][label]:>16.0f}" for dtype in rates))
    print("memory bandwidth: " + ", ".join(f"{k} {v:.1f} GB/s" for k, v in bandwidth.items()))


def print_trainer(rows: list[dict], precision: str) -> None:
    print(f"\n== the trainer's forward+backward, {precision}, interleaved, median ==")
    print(f"{'way':<48}{'s':>7}{'GFLOP':>8}{'GFLOP/s':>9}{'% ceiling':>11}")
    for r in rows:
        print(
            f"{r['label']:<48}{r['seconds']:>7.2f}{r['gflop']:>8.0f}{r['gflops']:>9.0f}"
            f"{r['ceiling_share'] * 100:>10.0f}%"
        )


def print_profile(name: str, ops: list[dict]) -> None:
    print(f"\n== top ops by self CPU time: {name} ==")
    for op in ops:
        print(f"  {op['op']:<44}{op['self_ms']:>9.0f} ms{op['share'] * 100:>6.1f}%{op['calls']:>7}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--top", type=int, default=12, help="ops shown per profile")
    parser.add_argument("--vllm", action="store_true", help="start a vLLM server (~60-100 s) and time a generation")
    parser.add_argument(
        "--vllm-dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="the server's dtype with --vllm (bfloat16: what [vllm] dtype = 'auto' serves on a native-bf16 CPU)",
    )
    parser.add_argument("--base-url", help="time a generation on this running vLLM server instead")
    parser.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY"))
    parser.add_argument("--served-model", default="base")
    parser.add_argument(
        "--precision",
        choices=["float32", "bf16"],
        default="float32",
        help="the trainer's compute: bf16 as grpo's `bf16 = true` runs it (module docstring)",
    )
    args = parser.parse_args()

    from bench_shared_prompts import micro_batch, trainer_model

    from grpo_core.modeling.precision import cpu_flag_summary, native_bf16

    out: dict = {
        "cpu_flags": cpu_flag_summary(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "load_average_start": load_average(),
        "precision": args.precision,
    }
    if args.vllm_dtype == "bfloat16" and not native_bf16("cpu"):
        raise SystemExit(
            "--vllm-dtype bfloat16: this CPU has no native bf16 (AVX512-BF16 or AMX); grpo serves float32 here"
        )
    if args.precision == "bf16" and not native_bf16("cpu"):
        raise SystemExit("--precision bf16: this CPU has no native bf16 (AVX512-BF16 or AMX); grpo stays float32 here")
    print(
        f"CPU flags: {out['cpu_flags']}; torch {out['torch']}; {out['threads']} threads; "
        f"load average (1, 5, 15 min) at start: {out['load_average_start']}",
        flush=True,
    )
    out["mm_gflops"] = ceilings(args.repeats, native_bf16("cpu"))
    out["bandwidth_gbs"] = bandwidth_gbs(args.repeats)
    print_ceilings(out["mm_gflops"], out["bandwidth_gbs"])
    trainer_rates = out["mm_gflops"]["bf16 (native)" if args.precision == "bf16" else "float32"]

    torch.manual_seed(0)
    model = trainer_model(args.precision)
    dims = Dims.of(model.config, lora_r=16)
    ids = micro_batch(torch.Generator().manual_seed(0), PROMPTS, ROWS, PROMPT_TOKENS, COMPLETION_TOKENS)
    ways = trainer_ways(model, ids, COMPLETION_TOKENS, args.precision)
    samples, logps = time_interleaved(model, ways, args.repeats)
    seconds = {name: statistics.median(t) for name, t in samples.items()}
    labels = {
        "shared": "grpo, shared prompts (default)",
        "whole": "grpo, every row whole",
        "plain": "plain transformers + peft loop",
    }
    out["trainer"] = []
    for name, s in seconds.items():
        flops = micro_batch_flops(dims, name, PROMPTS, ROWS, PROMPT_TOKENS, COMPLETION_TOKENS)
        out["trainer"].append(
            {
                "way": name,
                "label": labels[name],
                "seconds": s,
                "samples_s": samples[name],
                "gflop": sum(flops.values()) / 1e9,
                "gflops": sum(flops.values()) / s / 1e9,
                "ceiling_share": ceiling_seconds(flops, trainer_rates) / s,
                "flops_by_class_G": {k: v / 1e9 for k, v in flops.items()},
            }
        )
    out["max_abs_logp_difference_vs_plain"] = {
        n: float((logps[n] - logps["plain"]).abs().max()) for n in ("shared", "whole")
    }
    print_trainer(out["trainer"], args.precision)
    gflop = {r["way"]: r["gflop"] for r in out["trainer"]}
    for name in ("shared", "whole"):  # the same round's ratio: the machine's load changes less within a round
        per_round = [
            gflop[name] / samples[name][i] / (gflop["plain"] / samples["plain"][i]) for i in range(args.repeats)
        ]
        print(f"GFLOP/s of {labels[name]} over the plain loop's, per round: {', '.join(f'{r:.2f}' for r in per_round)}")
    print(
        "useful GFLOP by class (shared): "
        + ", ".join(f"{k} {v:.1f}" for k, v in out["trainer"][0]["flops_by_class_G"].items())
    )
    print(f"max |log-prob difference| against the plain loop: {out['max_abs_logp_difference_vs_plain']}", flush=True)

    out["profile"] = {name: top_ops(ways[name], model, args.top) for name in ("shared", "plain")}
    for name, ops in out["profile"].items():
        print_profile(labels[name], ops)

    if args.vllm or args.base_url:
        from transformers import AutoTokenizer

        from grpo_core.modeling.model_files import DEFAULT_MODEL, resolve_model_dir

        prompts = arithmetic_prompts(AutoTokenizer.from_pretrained(resolve_model_dir(DEFAULT_MODEL)), PROMPTS)
        bf16_server = args.vllm and not args.base_url and args.vllm_dtype == "bfloat16"
        decode_rate = out["mm_gflops"]["bf16 (native)" if bf16_server else "float32"]["decode-like [32x576]x[576x1536]"]
        bounds = decode_bounds(
            model,
            out["bandwidth_gbs"]["read (sum)"],
            decode_rate,
            PROMPTS * SAMPLES,
            bytes_per_weight=2 if bf16_server else 4,
        )
        del model, ways
        proc, base_url = (
            start_server(dtype=args.vllm_dtype) if args.vllm and not args.base_url else (None, args.base_url)
        )
        try:
            out["generation"] = {
                "server": base_url if proc is None else f"own: {args.vllm_dtype}, all cores, no LoRA",
                **decode_step_ms(base_url, args.api_key, args.served_model, prompts, max(2, args.repeats // 2)),
            }
        finally:
            if proc is not None:
                os.killpg(proc.pid, 15)
                proc.wait(60)
        out["generation"].update(bounds)
        g = out["generation"]
        print(
            f"\n== one generation: {PROMPTS} prompts x {SAMPLES} x {COMPLETION_TOKENS} tokens, vLLM ({g['server']}) =="
        )
        print(
            f"requests: 1 token {g['request_1_token_s']:.2f} s, {COMPLETION_TOKENS} tokens "
            f"{g['request_48_tokens_s']:.2f} s; {g['ms_per_decode_step']:.0f} ms per decode step of "
            f"{PROMPTS * SAMPLES} sequences"
        )
        print(
            f"bounds: reading {g['weight_MB']:.0f} MB of weights {g['bandwidth_bound_ms']:.0f} ms; "
            f"{g['flops_per_step_G']:.1f} GFLOP at the decode-like rate {g['flop_bound_ms']:.0f} ms"
        )

    out["load_average_end"] = load_average()
    print(f"\nload average (1, 5, 15 min) at end: {out['load_average_end']}")
    (HERE / "results").mkdir(exist_ok=True)
    name = "ceiling.json" if args.precision == "float32" else f"ceiling_{args.precision}.json"
    (HERE / "results" / name).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    from grpo_core.runtime.heap import RetainedHeap

    with RetainedHeap(not torch.cuda.is_available()):  # freed memory kept, as a grpo run on a CPU keeps it
        main()
