"""Merged-weight sync to a real vLLM server: where the files go, and in
which dtype.

    .venv/bin/python benchmarks/bench_sync_io.py [--syncs 5]

Starts one managed server (SmolLM2-135M-Instruct, ``dtype`` float32, eager)
and syncs a LoRA-r16 policy (random B, so the weights really change) with
``full_filesystem`` in three ways, each ``--syncs`` times:

* ``output_dir``: files under ``output_dir/vllm-weights`` (what grpo did
  before: disk I/O, and the folder stayed behind);
* ``memory``: a private temporary folder in ``/dev/shm`` (the default now
  for a server on the same machine; removed when training ends);
* ``memory_bf16``: the same, cast to bfloat16 first, as for a server that
  serves bf16 (the reload is into this float32 server, so only the save and
  the bytes are comparable).

Prints the median seconds to save, to reload and in total, the bytes
written, the ratio against ``output_dir``, and the CPU's flags.

    .venv/bin/python benchmarks/bench_sync_io.py --colocated [--syncs 5]

times instead the in-memory sync into a colocated engine (``vllm_mode =
"colocate"``, ``vllm_in_memory``) by its two parts: computing the merged
weights of the adapted modules, and vLLM's in-place reload of them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--syncs", type=int, default=5)
    parser.add_argument("--colocated", action="store_true", help="time the in-memory sync into a colocated engine")
    args = parser.parse_args()
    if args.colocated:
        colocated(args.syncs)
        return

    from grpo_core.config.loader import validate
    from grpo_core.contract.context import RunContext
    from grpo_core.contract.types import WEIGHTS_FROM_PATH
    from grpo_core.modeling.model_files import DEFAULT_MODEL, resolve_model_dir
    from grpo_plugins.vllm.engine import VLLMServerEngine
    from grpo_plugins.weight_sync_files import FullFilesystemSync

    model_dir = resolve_model_dir(DEFAULT_MODEL)
    work = Path(tempfile.mkdtemp(prefix="bench-sync-"))
    cfg = validate(
        {
            "base_model": model_dir,
            "adapter": "lora",
            "output_dir": str(work),
            "sequence_len": 256,
            "vllm": {"port": 0, "dtype": "float32", "max_model_len": 256, "cpu_kvcache_space": 1},
            "trl": {"use_vllm": True, "vllm_managed": True},
        }
    )
    context = RunContext(
        config=cfg, output_dir=work, engine_requirements=frozenset({WEIGHTS_FROM_PATH}), log=lambda m: None
    )
    engine = VLLMServerEngine(context)
    model = lora_policy(model_dir)
    engine.ensure_ready()

    class Bf16View:
        """The engine as a bf16 server would present it to the sync."""

        def __getattr__(self, name: str):
            return "bfloat16" if name == "weight_dtype" else getattr(engine, name)

    results = {}
    try:
        for variant in ("output_dir", "memory", "memory_bf16"):
            sync = FullFilesystemSync(context)
            if variant == "output_dir":
                sync.root = work / "vllm-weights"
            target = Bf16View() if variant == "memory_bf16" else engine
            saves, loads, totals, sizes = [], [], [], []
            for version in range(1, args.syncs + 1):
                result = sync.grpo_sync_weights(model, version, target)
                detail = result.detail
                save = float(detail.split("save ")[1].split("s,")[0])
                load = float(detail.split("load ")[1].split("s ")[0])
                saves.append(save)
                loads.append(load)
                totals.append(result.seconds)
                sizes.append(sum(f.stat().st_size for f in (sync.root / f"v{version}").iterdir()))
            results[variant] = {
                "root": str(sync.root.parent),
                "save_s": statistics.median(saves),
                "load_s": statistics.median(loads),
                "total_s": statistics.median(totals),
                "bytes": sizes[-1],
            }
            sync.grpo_train_end()
    finally:
        engine.shutdown()
    base = results["output_dir"]["total_s"]
    for variant, r in results.items():
        r["speedup_vs_output_dir"] = base / r["total_s"]
        print(
            f"{variant:<12} save {r['save_s']:.3f}s  load {r['load_s']:.3f}s  total {r['total_s']:.3f}s  "
            f"{r['bytes'] / 2**20:.0f} MiB  {r['speedup_vs_output_dir']:.2f}x vs output_dir  ({r['root']})"
        )
    from grpo_core.modeling.precision import cpu_flag_summary

    print("cpu flags:", cpu_flag_summary())
    print("RESULT " + json.dumps({"cpu_flags": cpu_flag_summary(), "syncs": args.syncs, **results}))


def lora_policy(model_dir: str):
    """SmolLM2 + LoRA r16 with a random B, so the merged weights really change."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0),
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.02)
    return model


def colocated(syncs: int) -> None:
    """``--colocated``: the in-memory sync's two parts, median over ``syncs``."""
    import time

    from grpo_core.config.loader import validate
    from grpo_core.modeling.engine_weights import merged_weights
    from grpo_core.modeling.model_files import DEFAULT_MODEL, resolve_model_dir
    from grpo_core.modeling.precision import cpu_flag_summary
    from grpo_plugins.vllm.colocate import ColocatedEngine

    model_dir = resolve_model_dir(DEFAULT_MODEL)
    cfg = validate(
        {
            "base_model": model_dir,
            "adapter": "lora",
            "sequence_len": 256,
            "vllm": {"dtype": "float32", "max_model_len": 256, "cpu_kvcache_space": 1},
            "trl": {"use_vllm": True, "vllm_mode": "colocate"},
        }
    )
    model = lora_policy(model_dir)
    engine = ColocatedEngine(cfg, log=lambda m: None)
    engine.start()
    merges, loads = [], []
    try:
        for _ in range(syncs):
            began = time.perf_counter()
            weights = merged_weights(model, engine.fused_modules())
            merges.append(time.perf_counter() - began)
            began = time.perf_counter()
            engine.load_weights(weights)
            loads.append(time.perf_counter() - began)
    finally:
        engine.shutdown()
    result = {
        "cpu_flags": cpu_flag_summary(),
        "syncs": syncs,
        "tensors": len(weights),
        "merge_s": statistics.median(merges),
        "load_s": statistics.median(loads),
        "merge_runs_s": merges,
        "load_runs_s": loads,
    }
    print(
        f"colocated in-memory sync of {len(weights)} tensors: merged weights {result['merge_s']:.3f}s, "
        f"vLLM reload {result['load_s']:.3f}s (median of {syncs}); cpu flags: {result['cpu_flags']}"
    )
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
