"""gloo all-reduce between two "hosts" (network namespaces on a veth pair) against two processes on one host.

The gradient all-reduce of a DDP step is this collective on the gradient bytes;
docs/multi-node.md's cost model uses the numbers. Run as root (namespaces):

    .venv/bin/python benchmarks/bench_netns_allreduce.py            # prints one JSON line per size and setup

Each setup starts two torchrun agents (``--nnodes 2 --nproc_per_node 1``, c10d
rendezvous), the same ones tests/e2e/test_multinode.py starts; each worker times
``all_reduce`` of float32 tensors of 1, 16 and 64 MiB (3 repeats after a
warm-up, the median reported). A veth pair is a kernel copy, not a wire: the
two-host numbers bound what loopback-like links give, not what a NIC gives.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

WORKER = r"""
import json, os, statistics, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
for mib in (1, 16, 64):
    t = torch.ones(mib * 2**20 // 4)
    dist.all_reduce(t)
    times = []
    for _ in range(3):
        dist.barrier(); start = time.perf_counter(); dist.all_reduce(t); times.append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        s = statistics.median(times)
        row = {"setup": os.environ["SETUP"], "mib": mib, "seconds": round(s, 4), "mib_per_s": round(mib / s, 1)}
        print(json.dumps(row), flush=True)
dist.destroy_process_group()
"""


def run_two(argv_for_rank, env_for_rank) -> None:
    """Start both ranks at once (they rendezvous with each other) and print rank 0's lines."""
    procs = [
        subprocess.Popen(argv_for_rank(r), env=env_for_rank(r), stdout=subprocess.PIPE, text=True) for r in range(2)
    ]
    out = [p.communicate(timeout=300)[0] for p in procs]
    print(out[0].strip(), flush=True)


def main() -> int:
    from netns import Hosts, namespaces_refused, torchrun_line

    refused = namespaces_refused()
    if refused:
        print(f"skipped: {refused}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        worker = Path(tmp) / "worker.py"
        worker.write_text(WORKER)
        base = {**os.environ, "OMP_NUM_THREADS": "1"}
        one = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(worker)],
            env={**base, "SETUP": "one host, 2 processes"},
            capture_output=True,
            text=True,
            timeout=300,
        )
        print(one.stdout.strip(), flush=True)
        with Hosts(count=2) as hosts:

            def argv(rank: int) -> list[str]:
                return hosts.command(rank, [*torchrun_line(rank, "bench"), str(worker)])

            def env(rank: int) -> dict[str, str]:
                return {
                    **base,
                    "SETUP": "two hosts (veth), 1 process each",
                    "GLOO_SOCKET_IFNAME": hosts.interface(rank),
                }

            run_two(argv, env)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
