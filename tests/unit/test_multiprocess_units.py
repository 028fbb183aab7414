"""The parts of a several-process run that need no processes: what ``grpo
config check --num-processes`` prints, the ``accelerate launch`` command line,
the exit code of a child killed by a signal, and the optimizer state rekeyed
between sharded and unsharded runs. The real two-process runs are
tests/e2e/test_multiprocess.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import write_toml


def test_config_check_prints_per_process_and_global_batches(tmp_path: Path, capsys) -> None:
    from grpo_core.interface.cli import main

    path = write_toml(
        tmp_path / "c.toml",
        {
            "base_model": "some/model",
            "micro_batch_size": 2,
            "gradient_accumulation_steps": 2,
            "datasets": [{"path": "my-org/arith"}],
            "trl": {"num_generations": 2, "reward_funcs": ["last_number_match"]},
        },
    )
    assert main(["config", "check", str(path), "--num-processes", "2"]) == 0
    out = capsys.readouterr().out
    assert (
        "processes:    2 (DDP: a full replica per process); per process: 2 x 2 = 4 completions per optimizer "
        "step, 4 (2 groups) per generation; global: 8 per optimizer step, 8 (4 prompts) per generation"
    ) in out
    assert "generates on: every process, each its share of each call's prompts" in out  # the transformers rollout
    assert main(["config", "check", str(path), "--num-processes", "2", "--set", "trl.use_vllm=true"]) == 0
    assert "generates on: rank 0 alone (the rollout samples for every process)" in capsys.readouterr().out
    # 8 completions over 4 processes: 2 each, not a whole group of 4
    assert (
        main(
            [
                "config",
                "check",
                str(path),
                "--num-processes",
                "4",
                "--set",
                "trl.generation_batch_size=8",
                "--set",
                "trl.num_generations=4",
                "--set",
                "gradient_accumulation_steps=1",
            ]
        )
        == 2
    )
    assert "groups stay whole on a process" in capsys.readouterr().err


def test_num_processes_runs_accelerate_launch_on_the_same_command() -> None:
    from grpo_core.interface.launch import launcher_command

    cmd = launcher_command(2, ["run", "c.toml", "--set", "max_steps=3"], cuda=False)
    assert cmd[1:3] == ["-m", "grpo_core.interface.launch"] and cmd[cmd.index("--num_processes") + 1] == "2"
    assert cmd[-6:] == ["-m", "grpo", "run", "c.toml", "--set", "max_steps=3"]


def test_a_child_killed_by_a_signal_gets_one_line_and_a_shell_exit_code(capsys: pytest.CaptureFixture[str]) -> None:
    """Real elastic failure records; a child killed by SIGKILL printed nothing itself."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from grpo_core.interface.launch import failure_exit_code

    own = ChildFailedError("grpo", {0: ProcessFailure(0, 11, -15, "<N/A>"), 1: ProcessFailure(1, 12, 3, "<N/A>")})
    assert failure_exit_code(own) == 3 and capsys.readouterr().err == ""
    killed = ChildFailedError("grpo", {1: ProcessFailure(1, 12, -9, "<N/A>")})
    assert failure_exit_code(killed) == 137
    assert capsys.readouterr().err == "error: training process 1 was killed by signal SIGKILL\n"


def test_optimizer_state_is_rekeyed_between_sharded_and_unsharded_runs() -> None:
    """An unsharded checkpoint keys Adam's state by position, FSDP's by
    parameter name (torch's distributed state dict): each is rekeyed for the
    other kind of run, matched by name (DDP's ``module.`` prefix dropped),
    and a state from another model is refused by name, not mis-assigned."""
    from grpo_core.contract.errors import GrpoError
    from grpo_core.parallel.sharding import optimizer_state_by_index, optimizer_state_by_name

    class Wrapper(torch.nn.Module):  # the policy inside a DDP-like wrapper: names start with "module."
        def __init__(self) -> None:
            super().__init__()
            self.module = torch.nn.Module()
            self.module.policy = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))

    torch.manual_seed(0)
    forward = Wrapper()
    optimizer = torch.optim.Adam(forward.parameters(), lr=0.1)
    forward.module.policy(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    by_index = optimizer.state_dict()
    by_name = optimizer_state_by_name(forward, optimizer, by_index)
    assert by_name["param_groups"][0]["params"] == [
        "policy.0.weight",
        "policy.0.bias",
        "policy.1.weight",
        "policy.1.bias",
    ]
    assert torch.equal(by_name["state"]["policy.1.weight"]["exp_avg"], by_index["state"][2]["exp_avg"])
    assert optimizer_state_by_name(forward, optimizer, by_name) is by_name  # already by name

    # Back by name, in the order this optimizer holds its parameters (here: reversed).
    reordered = torch.optim.Adam(list(forward.parameters())[::-1], lr=0.1)
    back = optimizer_state_by_index(forward, reordered, by_name)
    assert back["param_groups"][0]["params"] == [0, 1, 2, 3]  # load_state_dict pairs by position
    assert torch.equal(back["state"][1]["exp_avg"], by_index["state"][2]["exp_avg"])
    reordered.load_state_dict(back)
    assert torch.equal(reordered.state[forward.module.policy[1].weight]["exp_avg"], by_index["state"][2]["exp_avg"])

    other = {
        "state": {},
        "param_groups": [{**by_name["param_groups"][0], "params": ["policy.0.weight", "head.weight"]}],
    }
    with pytest.raises(GrpoError, match="another model or adapter"):
        optimizer_state_by_index(forward, optimizer, other)
    with pytest.raises(GrpoError, match=r"parameters per group: \[3\] saved, \[4\] here"):
        optimizer_state_by_name(forward, optimizer, {"state": {}, "param_groups": [{"params": [0, 1, 2]}]})
