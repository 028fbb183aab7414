"""Two hosts on one machine: trainers that rendezvous over a network, launched as clusters launch them.

Each "host" is a network namespace (tests/netns.py) with its own address on
one veth pair; host 0 is ``host0`` (10.213.x.1), host 1 ``host1``. One
training process per host, started exactly as on two machines: by torchrun
(``--nnodes 2 --node_rank R --nproc_per_node 1 --rdzv-backend c10d
--rdzv-endpoint host0:29500``, DDP) and by ``accelerate launch --num_machines 2
--machine_rank R --main_process_ip host0`` (FSDP2); the rendezvous store and
gloo's collectives go over the veth link (``GLOO_SOCKET_IFNAME`` names each
host's end). Each run is compared with the same config as 2 processes on one
host, at tests/e2e/test_multiprocess.py's tolerances. Real processes, real
launchers, the tiny model of tests/tiny_model.py; docs/multi-node.md quotes
the launch lines.

What is isolated: the network (each namespace sees its loopback and its veth
end only; a port opened in one is not reachable in the other but through the
link) and each host's files by convention: every host gets a private folder
holding its own copy of the config, data, reward code and model, and its own
``output_dir``, so a file one host writes is never read by the other. Not
isolated: the filesystem itself (no mount namespace), the process table, the
CPU. Checked afterwards: host 0 alone wrote ``metrics.jsonl``, checkpoints and
the final model; host 1's ``output_dir`` holds nothing (rank 1 creates it, empty).

Which host is rank 0: with ``--rdzv-backend c10d`` torchrun ignores
``--node_rank`` and numbers the nodes by their sorted addresses
(``--local-addr``; here host0 < host1), so the node that writes checkpoints is
the one with the smallest address, not necessarily the rendezvous host.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import REPO, TESTS, metrics, run_workdir, weights
from netns import Hosts, namespaces_refused, opened_hosts, torchrun_line
from test_multiprocess import ENV, REWARDS, run_grpo, weights_of, write_config

PORT = 29500  # free in a fresh namespace: nothing else listens there
TIMEOUT = 180


@pytest.fixture(scope="module")
def hosts():
    yield from opened_hosts(2)


def host_folder(root: Path, name: str, model_src: Path) -> Path:
    """A host's private folder: its own copy of the model, data and reward module."""
    folder = root / name
    folder.mkdir()
    run_workdir(folder, [{"prompt": f"Item {i}:"} for i in range(12)], {"mp_rewards": REWARDS, "mp_env": ENV})
    shutil.copytree(model_src, folder / "tiny")
    return folder


def torchrun(rank: int, run: str) -> list[str]:
    """Host ``rank``'s launcher line, as on a cluster node (docs/multi-node.md quotes it)."""
    return torchrun_line(rank, run, PORT)


def accelerate(rank: int, run: str) -> list[str]:
    """Host ``rank``'s ``accelerate launch`` line (2 machines x 1 process; static rendezvous at host0)."""
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_machines",
        "2",
        "--machine_rank",
        str(rank),
        "--main_process_ip",
        "host0",
        "--main_process_port",
        str(PORT),
        "--num_processes",
        "2",
        "--num_cpu_threads_per_process",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
    ]


def launch_two_hosts(hosts: Hosts, folders: list[Path], config_name: str, launcher=torchrun) -> list[str]:
    """``<launcher line> -m grpo run CONFIG`` on both hosts at once, each in its own
    folder; returns each host's output (both must exit 0)."""
    import os

    procs = []
    for rank, folder in enumerate(folders):
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(folder), str(TESTS), str(REPO)]),
            "OMP_NUM_THREADS": "1",
            "GLOO_SOCKET_IFNAME": hosts.interface(rank),
        }
        cmd = [
            *launcher(rank, config_name),
            "-m",
            "grpo",
            "run",
            str(folder / f"{config_name}.toml"),
        ]
        log = open(folder / f"{config_name}.log", "w")
        procs.append((hosts.start(rank, cmd, cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    deadline = time.monotonic() + TIMEOUT
    for proc, _ in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    outputs = []
    for (_proc, log), folder in zip(procs, folders, strict=True):
        log.close()
        outputs.append((folder / f"{config_name}.log").read_text())
    for rank, (proc, _) in enumerate(procs):
        assert proc.returncode == 0, f"host{rank} exit {proc.returncode}:\n" + "\n---\n".join(
            o[-4000:] for o in outputs
        )
    return outputs


def only_host0_wrote(folders: list[Path], run: str) -> None:
    """Host 0 (rank 0) wrote the run's files; host 1's output_dir holds nothing at all."""
    out0 = sorted(p.name for p in (folders[0] / run).iterdir())
    assert {"metrics.jsonl", "checkpoint-2", "checkpoint-4", "model.safetensors"} <= set(out0), out0
    out1 = folders[1] / run
    assert not out1.exists() or not any(out1.iterdir()), f"host1 wrote {sorted(p.name for p in out1.rglob('*'))}"


def close_match(a: list[dict], b: list[dict]) -> None:
    """The tolerances of tests/e2e/test_multiprocess.py (summation order differs, nothing else)."""
    for ra, rb in zip(a, b, strict=True):
        assert rb["reward"] == ra["reward"] and rb["num_tokens"] == ra["num_tokens"]
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-4, abs=1e-6)
        assert rb["grad_norm"] == pytest.approx(ra["grad_norm"], rel=1e-4, abs=1e-7)


def test_two_hosts_torchrun_ddp_matches_two_processes_on_one_host_and_resumes_on_one(
    hosts: Hosts, tiny_model_dir: str, tmp_path: Path
) -> None:
    model_src = Path(tiny_model_dir)
    folders = [host_folder(tmp_path, f"host{rank}", model_src) for rank in range(2)]
    for folder in folders:  # the same config on each host, at its own paths
        write_config(folder, "ddp", str(folder / "tiny"), max_steps=4, save_steps=2)
    launch_two_hosts(hosts, folders, "ddp")
    only_host0_wrote(folders, "ddp")

    # The reference: the same config as 2 processes on one host (torchrun --standalone), no namespace.
    local = host_folder(tmp_path, "local", model_src)
    write_config(local, "ddp", str(local / "tiny"), max_steps=4, save_steps=2)
    run_grpo(
        local,
        ["run", str(local / "ddp.toml")],
        launcher=[sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"],
    )

    two_hosts, one_host = metrics(folders[0] / "ddp"), metrics(local / "ddp")
    assert [(r["step"], r["world_size"]) for r in two_hosts] == [(1, 2), (2, 2), (3, 2), (4, 2)]
    # the transformers rollout generates on both hosts, each its share of the prompts (and still matches)
    assert all(r["completions/sampled_on_rank_0"] == r["completions/sampled_on_rank_1"] == 2.0 for r in two_hosts), (
        two_hosts
    )
    close_match(one_host, two_hosts)
    wa, wb = weights(local / "ddp"), weights(folders[0] / "ddp")
    assert wa.keys() == wb.keys()
    for key in wa:
        torch.testing.assert_close(wb[key], wa[key], rtol=1e-4, atol=1e-6)
    start = weights(model_src)
    assert max(float((wb[k] - start[k]).abs().max()) for k in wb) > 1e-4, (
        "the weights did not move: the match proves nothing"
    )

    # Resume on one host (docs/multi-gpu.md's table: "DDP 2 -> 1 process, the same up to summation order"),
    # host 0's checkpoint-2, 1 process with gradient_accumulation_steps 2 (the same global batch of 4).
    write_config(
        folders[0],
        "resumed",
        str(folders[0] / "tiny"),
        max_steps=4,
        save_steps=2,
        gradient_accumulation_steps=2,
        resume_from_checkpoint=str(folders[0] / "ddp" / "checkpoint-2"),
    )
    run_grpo(folders[0], ["run", str(folders[0] / "resumed.toml")])
    resumed = metrics(folders[0] / "resumed")
    assert [(r["step"], r["world_size"]) for r in resumed] == [(3, 1), (4, 1)]
    close_match(two_hosts[2:], resumed)
    wr = weights(folders[0] / "resumed")
    for key in wb:
        torch.testing.assert_close(wr[key], wb[key], rtol=1e-4, atol=1e-6)


@pytest.mark.extended  # the two-host DDP run (torchrun) is the default tier's; this FSDP one adds ~30 s
def test_two_hosts_accelerate_fsdp_matches_fsdp_on_one_host(hosts: Hosts, tiny_model_dir: str, tmp_path: Path) -> None:
    """FSDP2 (full_shard + auto_wrap), full fine-tuning, started by ``accelerate launch --num_machines 2
    --machine_rank R --main_process_ip host0``: the same steps and weights as ``grpo run --num-processes 2``
    (accelerate, one host). The rollout is tests/e2e/test_multiprocess.py's deterministic one, so that
    both layouts train the same completions (sampling would differ with the process layout)."""
    model_src = Path(tiny_model_dir)
    fsdp = {
        "fsdp": ["full_shard", "auto_wrap"],
        "fsdp_config": {"fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer"},
    }

    def config(folder: Path) -> None:
        write_config(
            folder,
            "fsdp",
            str(folder / "tiny"),
            max_steps=4,
            save_steps=2,
            **json.loads(json.dumps(fsdp)),
            trl={"rollout_func": "mp_env.rollout", "reward_funcs": ["mp_env.gated"]},
        )

    folders = [host_folder(tmp_path, f"host{rank}", model_src) for rank in range(2)]
    for folder in folders:
        config(folder)
    launch_two_hosts(hosts, folders, "fsdp", launcher=accelerate)
    only_host0_wrote(folders, "fsdp")

    local = host_folder(tmp_path, "local", model_src)
    config(local)
    run_grpo(local, ["run", str(local / "fsdp.toml"), "--num-processes", "2"])
    two_hosts, one_host = metrics(folders[0] / "fsdp"), metrics(local / "fsdp")
    assert [(r["step"], r["world_size"]) for r in two_hosts] == [(1, 2), (2, 2), (3, 2), (4, 2)]
    assert any(0 < r["frac_reward_zero_std"] < 1 for r in two_hosts)
    close_match(one_host, two_hosts)
    wa, wb = weights_of(local / "fsdp"), weights_of(folders[0] / "fsdp")
    assert wa.keys() == wb.keys()
    for key in wa:
        torch.testing.assert_close(wb[key], wa[key], rtol=1e-4, atol=1e-6)


def test_hosts_are_network_isolated_and_leave_nothing_behind() -> None:
    """The helper itself: each host sees its own loopback, reaches the other only over the veth
    link by name, and close() ends even a process that left its session (as launchers' workers do)."""
    refused = namespaces_refused()
    if refused:
        pytest.skip(refused)
    serve = "import socket,time;s=socket.socket();s.bind(('0.0.0.0',%d));s.listen();time.sleep(600)" % PORT
    probe = (
        "import socket,sys\ntry:\n    socket.create_connection((sys.argv[1], %d), timeout=3)\n"
        "    print('open')\nexcept OSError as e:\n    print(type(e).__name__)"
    ) % PORT
    with Hosts(count=2) as made:
        made.start(0, [sys.executable, "-c", serve])
        # a grandchild in its own session: not in the Popen's process group
        made.start(1, ["setsid", "-f", "sleep", "600"])
        time.sleep(1.0)

        def reach(host: int, target: str) -> str:
            done = subprocess.run(
                made.command(host, [sys.executable, "-c", probe, target]), capture_output=True, text=True, timeout=30
            )
            return done.stdout.strip()

        assert reach(1, "host0") == "open", "host1 reaches host0's port over the link"
        assert reach(1, "127.0.0.1") == "ConnectionRefusedError", "host1's loopback is its own"
        assert reach(0, "127.0.0.1") == "open"
        assert len(made.pids(1)) >= 1
    assert made.leftovers() == []


def test_skip_reasons_name_what_the_machine_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    """The two-host tests are skipped only where namespaces cannot be made, with the reason."""
    import netns

    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    assert "need root" in (netns.namespaces_refused() or "")
    monkeypatch.setattr(netns.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns, "IP", "/bin/false")  # an `ip netns add` that fails, as a kernel without netns does
    assert "refuses network namespaces" in (netns.namespaces_refused() or "")
