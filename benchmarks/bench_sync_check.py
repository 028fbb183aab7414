"""What checking a weight sync costs against the sync itself, and which gaps
the check sees, on a real vLLM server.

    .venv/bin/python benchmarks/bench_sync_check.py [--dtype float32|bfloat16] [--trainer-bf16] [--syncs 5]

Starts one managed server (SmolLM2-135M-Instruct, LoRA loading on, the
``dtype`` given) and syncs a LoRA-r16 policy (random B, so the weights really
differ from the base) ``--syncs`` times with each of grpo's two filesystem
syncs, ``lora_filesystem`` (adapter load) and ``full_filesystem`` (merged
reload), each followed by the check ``verify_weight_sync`` runs
(:class:`grpo_core.sync.verify.SyncVerifier`: the trainer's probe
forward plus the server's ``prompt_logprobs`` request). After each verified
sync the policy's B moves by one small random step without a sync, and the
same probe is scored again: the gap a sync that never arrived shows.

Prints, per sync kind, the median seconds of the sync and of the check, their
ratio, the same-weight gaps (mean and max per token) with the bound the check
held them to, the stale gaps, and the CPU's flags. ``--trainer-bf16`` runs the
trainer's probe forward under bf16 autocast (as ``bf16 = true`` does).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_sync_io import lora_policy  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--trainer-bf16", action="store_true")
    parser.add_argument("--syncs", type=int, default=5)
    parser.add_argument("--step", type=float, default=0.002, help="std of the random step B takes between syncs")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from grpo_core.config.loader import validate
    from grpo_core.contract.context import RunContext
    from grpo_core.contract.types import ADAPTER_FROM_PATH, WEIGHTS_FROM_PATH
    from grpo_core.modeling.model_files import DEFAULT_MODEL, resolve_model_dir
    from grpo_core.modeling.precision import Precision, cpu_flag_summary
    from grpo_core.sync.verify import SyncVerifier, compare, probe_ids, trainer_logprobs
    from grpo_plugins.vllm.engine import VLLMServerEngine
    from grpo_plugins.weight_sync_files import FullFilesystemSync, LoraFilesystemSync

    model_dir = resolve_model_dir(DEFAULT_MODEL)
    work = Path(tempfile.mkdtemp(prefix="bench-sync-check-"))
    cfg = validate(
        {
            "base_model": model_dir,
            "adapter": "lora",
            "lora_r": 16,
            "output_dir": str(work),
            "sequence_len": 256,
            "vllm": {"port": 0, "dtype": args.dtype, "max_model_len": 256, "cpu_kvcache_space": 1},
            "trl": {"use_vllm": True, "vllm_managed": True},
        }
    )
    needs = frozenset({ADAPTER_FROM_PATH, WEIGHTS_FROM_PATH})
    context = RunContext(config=cfg, output_dir=work, engine_requirements=needs, log=lambda m: None)
    engine = VLLMServerEngine(context)
    model = lora_policy(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    precision = Precision(torch.float32, torch.bfloat16 if args.trainer_bf16 else None, "bench")
    ids = probe_ids(tokenizer)
    engine.ensure_ready()
    results = {}
    generator = torch.Generator().manual_seed(1)
    try:
        for kind, sync in (
            ("lora_filesystem", LoraFilesystemSync(context)),
            ("full_filesystem", FullFilesystemSync(context)),
        ):
            verifier = SyncVerifier("every", engine, ids, precision, log=print)
            syncs, checks, gaps, worst, bounds, stale = [], [], [], [], [], []
            for version in range(1, args.syncs + 1):
                timed: list[float] = []
                verifier.sync(
                    lambda v=version: timed.append(sync.grpo_sync_weights(model, v, engine).seconds), model, version
                )
                check = verifier.take_metrics()
                syncs.append(timed[0])
                checks.append(check["sync/verify_seconds"])
                gaps.append(check["sync/logprob_gap"])
                worst.append(check["sync/logprob_gap_max"])
                bounds.append(check["sync/logprob_bound"])
                with torch.no_grad():  # one step the engine does not get
                    for name, param in model.named_parameters():
                        if "lora_B" in name:
                            param.add_(torch.randn(param.shape, generator=generator) * args.step)
                stale.append(compare(trainer_logprobs(model, ids, precision), engine.score_tokens(ids)[0])[0])
            alone_trainer, alone_engine = [], []
            for _ in range(3):  # the check's two halves, one after the other (before the files go: vLLM reads them)
                began = time.perf_counter()
                trainer_logprobs(model, ids, precision)
                alone_trainer.append(time.perf_counter() - began)
                began = time.perf_counter()
                engine.score_tokens(ids)
                alone_engine.append(time.perf_counter() - began)
            sync.grpo_train_end()
            results[kind] = {
                "trainer_probe_s": statistics.median(alone_trainer),
                "engine_probe_s": statistics.median(alone_engine),
                "sync_s": statistics.median(syncs),
                "check_s": statistics.median(checks),
                "check_over_sync": statistics.median(checks) / statistics.median(syncs),
                "gap_mean": gaps,
                "gap_max": worst,
                "bound": bounds,
                "stale_gap_mean": stale,
                "sync_runs_s": syncs,
                "check_runs_s": checks,
            }
    finally:
        engine.shutdown()
    trainer = "bf16 autocast" if args.trainer_bf16 else "float32"
    for kind, r in results.items():
        print(
            f"{kind:<16} sync {r['sync_s']:.3f}s  check {r['check_s']:.3f}s  ({100 * r['check_over_sync']:.0f}% of the "
            f"sync)  same-weight gap mean {max(r['gap_mean']):.2g} max {max(r['gap_max']):.2g} (bound "
            f"{min(r['bound']):.2g})  stale gap mean {min(r['stale_gap_mean']):.2g}-{max(r['stale_gap_mean']):.2g}; "
            f"alone: trainer probe {r['trainer_probe_s']:.3f}s, engine probe {r['engine_probe_s']:.3f}s"
        )
    print(
        f"server dtype {args.dtype}, trainer {trainer}, probe {len(ids)} tokens, step std {args.step}; cpu flags: "
        f"{cpu_flag_summary()}"
    )
    print(
        "RESULT "
        + json.dumps(
            {"cpu_flags": cpu_flag_summary(), "dtype": args.dtype, "trainer": trainer, "syncs": args.syncs, **results}
        )
    )


if __name__ == "__main__":
    main()
