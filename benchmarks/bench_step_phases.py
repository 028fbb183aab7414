"""Where a grpo step's seconds go on this machine: the time-to-accuracy
benchmark's grpo setup (arithmetic example, colocated vLLM, 4 x 8 x 48
tokens) for a few steps, printing each step's ``time/*`` metrics.

    .venv/bin/python benchmarks/bench_step_phases.py --steps 6 --bf16 auto
    .venv/bin/python benchmarks/bench_step_phases.py --steps 6 --bf16 false --vllm-dtype float32

``--bf16 auto`` / ``--vllm-dtype auto`` are grpo's defaults (bf16 where the
CPU computes it natively, float32 elsewhere).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples" / "arithmetic"))

PHASES = ("forward_backward", "generation", "scoring", "weight_sync", "optimizer", "other")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--bf16", choices=["auto", "true", "false"], default="auto")
    parser.add_argument("--vllm-dtype", default="auto")
    args = parser.parse_args()

    import bench_time_to_accuracy as tta

    from grpo_core.config.loader import validate
    from grpo_core.host.plugin_host import PluginHost
    from grpo_core.modeling.model_files import DEFAULT_MODEL, resolve_model_dir
    from grpo_core.modeling.precision import cpu_flag_summary
    from grpo_core.training.run import run_training

    bf16 = {"auto": "auto", "true": True, "false": False}[args.bf16]
    output_dir = Path(tempfile.mkdtemp()) / "run"
    config = tta.grpo_config(resolve_model_dir(DEFAULT_MODEL), args.steps, args.steps + 1, output_dir, bf16)
    config["vllm"]["dtype"] = args.vllm_dtype
    began = time.perf_counter()
    run_training(validate(config), PluginHost())
    wall = time.perf_counter() - began
    print(f"CPU flags: {cpu_flag_summary()}; bf16 = {args.bf16}, [vllm] dtype = {args.vllm_dtype}; {wall:.0f} s in all")
    for line in (output_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        phases = "  ".join(f"{name} {record.get('time/' + name, 0.0):.2f}" for name in PHASES)
        print(f"  step {record.get('step')}: {record['step_time']:.2f} s  {phases}")


if __name__ == "__main__":
    main()
