"""Where the time to the first step goes with a managed vLLM server.

    .venv/bin/python benchmarks/bench_startup.py

Three measurements, each in fresh processes, on the arithmetic example
(SmolLM2-135M-Instruct + LoRA, managed server, merged-weight sync):

- ``server alone``: the server ``grpo run`` would start (same argv and
  environment), from spawn to ``/health`` answering, with nothing else running;
- ``trainer alone``: a process that loads the tokenizer and the policy with its
  LoRA adapter as ``grpo run`` does (``grpo_core.modeling.models``), spawn to loaded;
- ``grpo run``: the real command, one step, with every log line stamped as it
  arrives, so the timeline shows when the server was spawned, when it became
  ready (both as ``grpo run`` logs them) and when the first step ended.

If the two starts overlap well, the server's ready time inside ``grpo run``
is close to (spawn time + server alone), and the first step ends about one
step after the later of the two. ``--repeats`` runs the whole set again.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CONFIG = ROOT / "examples" / "arithmetic" / "config.toml"
PYTHON = sys.executable
EVENTS = {
    "server spawned": re.compile(r"vLLM: starting server"),
    "server ready": re.compile(r"vLLM: server ready"),
    "first step": re.compile(r"step_time="),
}


def _server_alone() -> float:
    """Spawn-to-healthy seconds of the server ``grpo run`` would start."""
    code = f"""
import time
started = time.monotonic()
from grpo_core.config.loader import load_config
from grpo_plugins.vllm.command_line import managed_spec
from grpo_plugins.vllm.server import ManagedServer
cfg = load_config({str(CONFIG)!r}, overrides=["trl.vllm_lora_sync=false"])
spec = managed_spec(cfg, lora=False)
with ManagedServer(spec, log=lambda _m: None) as server:
    spawn = time.monotonic()
    server.start()
    server.wait_ready(600)
    print("SECONDS", time.monotonic() - spawn, spawn - started)
"""
    out = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, check=True).stdout
    return float(out.split("SECONDS")[1].split()[0])


def _trainer_alone() -> float:
    """Spawn-to-loaded seconds of a process that loads the policy as ``grpo run`` does."""
    code = f"""
import time
from grpo_core.config.loader import load_config
from grpo_core.modeling.model_files import resolve_model_dir
from grpo_core.modeling.models import load_policy, load_tokenizer
cfg = load_config({str(CONFIG)!r})
model_dir = resolve_model_dir(cfg.base_model)
load_policy(cfg, model_dir, load_tokenizer(cfg, model_dir))
print("LOADED")
"""
    started = time.monotonic()
    subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, check=True)
    return time.monotonic() - started


def _grpo_run() -> dict[str, float]:
    """Seconds from spawn of ``grpo run`` to each event in :data:`EVENTS`."""
    with tempfile.TemporaryDirectory(prefix="grpo-startup-") as tmp:
        argv = [
            PYTHON,
            "-m",
            "grpo",
            "run",
            str(CONFIG),
            "--set",
            "max_steps=1",
            "--set",
            f'output_dir="{Path(tmp) / "out"}"',
        ]
        started = time.monotonic()
        seen: dict[str, float] = {}
        with subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}
        ) as proc:
            assert proc.stdout is not None
            buffer = ""
            while chunk := proc.stdout.read(1):  # the progress bar ends its lines with \r, not \n
                buffer += chunk
                if chunk not in "\r\n":
                    continue
                for name, pattern in EVENTS.items():
                    if name not in seen and pattern.search(buffer):
                        seen[name] = time.monotonic() - started
                buffer = ""
            if proc.wait() != 0:
                raise RuntimeError(f"grpo run failed ({proc.returncode})")
        seen["exit"] = time.monotonic() - started
        return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    from grpo_core.modeling.model_files import DEFAULT_MODEL, resolve_model_dir
    from grpo_core.modeling.precision import cpu_flag_summary

    resolve_model_dir(DEFAULT_MODEL)  # convert the GGUF once, outside every clock
    rows: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        rows.setdefault("server alone: spawn to healthy", []).append(_server_alone())
        rows.setdefault("trainer alone: spawn to policy loaded", []).append(_trainer_alone())
        for name, seconds in _grpo_run().items():
            rows.setdefault(f"grpo run: spawn to {name}", []).append(seconds)
    flags = cpu_flag_summary()
    print(f"\nCPU flags: {flags}; {os.cpu_count()} cores; load average before: {os.getloadavg()[0]:.1f}")
    print(f"{'measurement':<44}{'median s':>10}   runs")
    for name, values in rows.items():
        print(f"{name:<44}{statistics.median(values):>10.1f}   {', '.join(f'{v:.1f}' for v in values)}")
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "startup.json").write_text(json.dumps({"cpu_flags": flags, "runs": rows}, indent=2))


if __name__ == "__main__":
    main()
