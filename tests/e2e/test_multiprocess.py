"""Several training processes (accelerate / torchrun, gloo on CPU).

Real processes, real launchers, the tiny model (tests/tiny_model.py: the
properties here are the loop's arithmetic and its collectives, not the
model's size) and the transformers rollout (every rank samples its share of
each generation call). NCCL and GPUs cannot run here; gloo runs the same collectives.

* 2 processes x (micro_batch_size 2, gradient_accumulation_steps 1) train
  on the same global batch as 1 process x (2, 2): the losses, gradient
  norms and weights after 2 steps match (float32 tolerances below; the
  summation order differs, nothing else).
* Every rank trains on its own share of each batch, of whole groups: the
  prompts each rank saw are disjoint and together cover the batch.
* With async prefetch on (the producer thread issues no collectives) the
  run finishes, and a run resumed from a mid-run checkpoint with 2
  processes repeats the straight run exactly; onto 1 process, up to
  summation order (DDP 2 -> 1).
* FSDP: the same steps as 1 process; exact resume on 2 processes; and
  FSDP 2 -> 1, 1 -> FSDP 2, 1 -> DDP 2 up to summation order.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import GRPO, REPO, TESTS, metrics, no_traceback, raw_config, run_group, run_workdir, weights, write_toml

REWARDS = "def parity(completion_ids, **kwargs):\n    return [float(sum(ids) % 2) for ids in completion_ids]\n"
TIMEOUT = 240


def write_config(tmp: Path, name: str, model: str, **top) -> Path:
    trl = {
        "num_generations": 2,
        "max_completion_length": 4,
        "reward_funcs": ["mp_rewards.parity"],
        "temperature": 1.0,
        "skip_zero_advantage_batches": False,
        **top.pop("trl", {}),
    }
    keys = {
        "adapter": None,
        "sequence_len": 64,
        "micro_batch_size": 2,
        "gradient_accumulation_steps": 1,
        "max_steps": 2,
        "learning_rate": 5e-3,
        "lr_scheduler": "constant",
        "seed": 7,
        "save_steps": 100,
        **top,
        "trl": trl,
    }
    return write_toml(tmp / f"{name}.toml", raw_config(model, tmp, out=name, **keys))


def run_grpo(tmp: Path, args: list[str], launcher: list[str] | None = None, shares: Path | None = None) -> None:
    """``grpo <args>`` in its own process(es) (``launcher``: e.g. torchrun),
    from ``tmp`` so the reward module imports."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp), str(TESTS), str(REPO)]), "OMP_NUM_THREADS": "1"}
    if shares is not None:
        shares.mkdir(exist_ok=True)
        env["GRPO_TEST_SHARES"] = str(shares)
    entry = ["-m", "multiproc_entry"] if shares is not None else ["-m", "grpo"]
    cmd = [*(launcher or [sys.executable]), *entry, *args]
    done = run_group(cmd, cwd=tmp, env=env, timeout=TIMEOUT)
    assert done.returncode == 0, f"{cmd} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"


@pytest.fixture
def workdir(tiny_model_dir: str, tmp_path: Path) -> tuple[Path, str]:
    run_workdir(tmp_path, [{"prompt": f"Item {i}:"} for i in range(12)], {"mp_rewards": REWARDS})
    return tmp_path, tiny_model_dir


@pytest.mark.extended  # DDP against one process also runs in
# test_ranks_train_disjoint_shares_with_async_prefetch_and_resume_exactly and test_multinode
def test_two_processes_match_one_on_the_same_global_batch(workdir: tuple[Path, str]) -> None:
    tmp, model = workdir
    one = write_config(tmp, "one", model, gradient_accumulation_steps=2)  # 1 x 2 x 2 = 4 completions per step
    two = write_config(tmp, "two", model)  # 2 processes x 2 x 1 = 4
    run_grpo(tmp, ["run", str(one)])
    run_grpo(tmp, ["run", str(two), "--num-processes", "2"])

    a, b = metrics(tmp / "one"), metrics(tmp / "two")
    assert [r["step"] for r in b] == [1, 2], "rank 0 alone writes metrics.jsonl: one line per step"
    assert [r["world_size"] for r in a] == [1, 1] and [r["world_size"] for r in b] == [2, 2]
    for ra, rb in zip(a, b, strict=True):
        assert rb["reward"] == ra["reward"], "the ranks sample, and rank 0 scores, the same batch"
        assert rb["num_tokens"] == ra["num_tokens"], "tokens summed over ranks"
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-4, abs=1e-6)
        assert rb["grad_norm"] == pytest.approx(ra["grad_norm"], rel=1e-4)
        assert ra["grad_norm"] > 0
    wa, wb = weights(tmp / "one"), weights(tmp / "two")
    moved = 0.0
    for key in wa:
        torch.testing.assert_close(wb[key], wa[key], rtol=1e-4, atol=1e-6)
        moved = max(moved, float((wa[key] - weights_at_start(model)[key]).abs().max()))
    assert moved > 1e-4, "the weights did not move: the comparison proves nothing"


_START: dict[str, dict[str, torch.Tensor]] = {}


def weights_at_start(model: str) -> dict[str, torch.Tensor]:
    if model not in _START:
        from safetensors.torch import load_file

        _START[model] = load_file(str(Path(model) / "model.safetensors"))
    return _START[model]


# A deterministic rollout (no model): resumed and straight runs sample alike
# whatever the async schedule. Prompts "Item i" with an even i get a
# constant reward (a group without learning signal), so ranks regularly
# disagree on whether their micro-batch has signal: a rank that skipped its
# backward alone would leave the other waiting in the all-reduce (a hang).
ROLLOUT = """
def rollout(prompts, trainer):
    tok = trainer.processing_class
    out = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
    for p in prompts:
        ids = tok.encode(p, add_special_tokens=False)
        i = int(p.split()[1].rstrip(":"))
        for k in range(trainer.num_generations):
            out["prompt_ids"].append(list(ids))
            out["completion_ids"].append([100 + (i * 31 + k * 17 + j * 7) % 900 for j in range(3)] + [tok.eos_token_id])
            out["logprobs"].append(None)
    return out
"""
ENV = (
    ROLLOUT
    + """
def gated(completion_ids, prompts, **kwargs):
    return [
        float(sum(ids) % 2) if int(p.split()[1].rstrip(":")) % 2 else 1.0 for ids, p in zip(completion_ids, prompts)
    ]
"""
)


def shares_by_step(shares: Path) -> dict[int, dict[int, list[str]]]:
    out: dict[int, dict[int, list[str]]] = {}
    for file in sorted(shares.glob("rank*.jsonl")):
        for line in file.read_text().splitlines():
            record = json.loads(line)
            assert record["world"] == 2
            out.setdefault(record["step"], {})[record["rank"]] = record["prompts"]
    return out


@pytest.mark.extended  # ~65 s; test_multinode's two-host DDP run (matches two processes, resumes on one) and
# test_loss_mask's two-process episodes run in the default tier
def test_ranks_train_disjoint_shares_with_async_prefetch_and_resume_exactly(workdir: tuple[Path, str]) -> None:
    tmp, model = workdir
    (tmp / "mp_env.py").write_text(ENV)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    settings = {
        "adapter": "lora",
        "lora_r": 4,
        "lora_alpha": 8,
        "max_steps": 4,
        "save_steps": 2,
        "trl": {
            "rollout_func": "mp_env.rollout",
            "reward_funcs": ["mp_env.gated"],
            "async_prefetch": True,
            "skip_zero_advantage_batches": True,
        },
    }
    straight = write_config(tmp, "straight", model, **json.loads(json.dumps(settings)))
    run_grpo(tmp, ["run", str(straight)], launcher=torchrun, shares=tmp / "shares")

    by_step = shares_by_step(tmp / "shares")
    assert sorted(by_step) == [0, 1, 2, 3]
    seen: list[str] = []
    for step, ranks in sorted(by_step.items()):
        assert sorted(ranks) == [0, 1] and all(len(p) == 1 for p in ranks.values()), ranks  # one whole group each
        assert not set(ranks[0]) & set(ranks[1]), f"step {step}: both ranks trained on {ranks}"
        seen += ranks[0] + ranks[1]
    assert len(set(seen)) == 8, "the 4 batches of 2 prompts were covered, each prompt once"
    a = metrics(tmp / "straight")
    assert [r["world_size"] for r in a] == [2.0] * 4
    assert any(0 < r["frac_reward_zero_std"] < 1 for r in a), "no step mixed signal and no-signal groups: proves less"

    def math(record: dict) -> dict:  # everything but wall-clock timings
        return {k: v for k, v in record.items() if k != "step_time" and not k.startswith("time/")}

    # Same process count: exact.
    resumed = write_config(
        tmp,
        "resumed",
        model,
        **json.loads(json.dumps(settings)),
        resume_from_checkpoint=str(tmp / "straight" / "checkpoint-2"),
    )
    run_grpo(tmp, ["run", str(resumed)], launcher=torchrun)
    b = metrics(tmp / "resumed")
    assert [r["step"] for r in b] == [3, 4]
    for ra, rb in zip(a[2:], b, strict=True):
        assert math(rb) == math(ra)
    wa = weights_of(tmp / "straight")
    wb = weights_of(tmp / "resumed")
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key

    # Onto 1 process (gradient_accumulation_steps 2 keeps the global batch): a checkpoint at a batch
    # boundary resumes onto another process count; the sums run in another order, hence a tolerance.
    single = write_config(
        tmp,
        "single",
        model,
        **json.loads(json.dumps(settings)),
        gradient_accumulation_steps=2,
        resume_from_checkpoint=str(tmp / "straight" / "checkpoint-2"),
    )
    run_grpo(tmp, ["run", str(single)])
    c = metrics(tmp / "single")
    assert [r["step"] for r in c] == [3, 4] and [r["world_size"] for r in c] == [1.0, 1.0]
    for ra, rc in zip(a[2:], c, strict=True):
        # (num_tokens counts trained tokens: one process skips its no-signal micro-batch, two processes
        # train it when the other rank's has signal; a zero-advantage micro-batch adds no gradient)
        assert rc["reward"] == ra["reward"]
        assert rc["loss"] == pytest.approx(ra["loss"], rel=1e-4, abs=1e-6)
        assert rc["grad_norm"] == pytest.approx(ra["grad_norm"], rel=1e-4, abs=1e-7)
    wc = weights_of(tmp / "single")
    for key in wa:
        torch.testing.assert_close(wc[key], wa[key], rtol=1e-4, atol=1e-6)


def weights_of(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    file = out / "adapter_model.safetensors"
    return load_file(str(file if file.is_file() else out / "model.safetensors"))


@pytest.mark.extended  # five FSDP runs (~75 s); the FSDP run of the sharded transformers rollout test is the default
# tier's
def test_fsdp_two_processes_match_one_and_resume_exactly_or_onto_another_count(workdir: tuple[Path, str]) -> None:
    """FSDP2 (full_shard + auto_wrap of the decoder layers) through accelerate, full fine-tuning: the
    same steps as 1 process on the same global batch, full weights in checkpoints, exact resume on 2
    processes, and resumes across process counts (FSDP 2 -> 1, 1 -> FSDP 2, 1 -> DDP 2)."""
    tmp, model = workdir
    (tmp / "mp_env.py").write_text(ENV)
    # Both sides share prompts (the default; each FSDP unit then runs twice per forward, prompts and
    # completions). One side running every row whole moved the weights past the tolerance: float
    # rounding, which Adam magnifies on near-zero gradients.
    common = {
        "max_steps": 4,
        "save_steps": 2,
        "trl": {"rollout_func": "mp_env.rollout", "reward_funcs": ["mp_env.gated"]},
    }
    fsdp = {
        "fsdp": ["full_shard", "auto_wrap"],
        "fsdp_config": {"fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer"},
    }
    sharded = write_config(tmp, "fsdp", model, **json.loads(json.dumps(common)), **fsdp)
    single = write_config(tmp, "single", model, **json.loads(json.dumps(common)), gradient_accumulation_steps=2)
    run_grpo(tmp, ["run", str(sharded), "--num-processes", "2"])
    run_grpo(tmp, ["run", str(single)])
    a, c = metrics(tmp / "fsdp"), metrics(tmp / "single")
    assert [r["world_size"] for r in a] == [2.0] * 4
    for ra, rc in zip(a, c, strict=True):
        assert ra["reward"] == rc["reward"] and ra["num_tokens"] == rc["num_tokens"]
        assert ra["loss"] == pytest.approx(rc["loss"], rel=1e-4, abs=1e-6)
        assert ra["grad_norm"] == pytest.approx(rc["grad_norm"], rel=1e-4, abs=1e-7)
    wa, wc = weights_of(tmp / "fsdp"), weights_of(tmp / "single")
    assert wa.keys() == wc.keys()
    for key in wa:
        torch.testing.assert_close(wa[key], wc[key], rtol=1e-4, atol=1e-6)

    resumed = write_config(
        tmp,
        "fsdp_resumed",
        model,
        **json.loads(json.dumps(common)),
        **fsdp,
        resume_from_checkpoint=str(tmp / "fsdp" / "checkpoint-2"),
    )
    run_grpo(tmp, ["run", str(resumed), "--num-processes", "2"])
    b = metrics(tmp / "fsdp_resumed")
    assert [r["step"] for r in b] == [3, 4]

    def math(record: dict) -> dict:  # but timings, and alerts (a health alert fires once per run, resumed or not)
        return {k: v for k, v in record.items() if k != "step_time" and not k.startswith(("time/", "alerts/"))}

    for ra, rb in zip(a[2:], b, strict=True):
        assert math(rb) == math(ra)
    wb = weights_of(tmp / "fsdp_resumed")
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key

    # Onto another process count, from the same checkpoints at a batch boundary (the global batch of 4
    # kept: 2 processes x 1 micro-batch, or 1 process x gradient_accumulation_steps 2), Adam state included:
    # FSDP 2 -> 1 process (the same config, fsdp still set: one process runs unsharded), 1 process -> FSDP 2
    # and 1 process -> DDP 2. Each repeats steps 3-4 up to summation order (the tolerances of FSDP vs one
    # process above); had the optimizer state not come across, step 3 would move every weight by about lr.
    def onto(name: str, checkpoint: Path, processes: int, **top) -> None:
        path = write_config(
            tmp, name, model, **json.loads(json.dumps(common)), **top, resume_from_checkpoint=str(checkpoint)
        )
        run_grpo(tmp, ["run", str(path)] + (["--num-processes", str(processes)] if processes > 1 else []))
        resumed = metrics(tmp / name)
        assert [(r["step"], r["world_size"]) for r in resumed] == [(3, processes), (4, processes)], name
        for ra, rn in zip(a[2:], resumed, strict=True):
            assert rn["reward"] == ra["reward"] and rn["num_tokens"] == ra["num_tokens"], name
            assert rn["loss"] == pytest.approx(ra["loss"], rel=1e-4, abs=1e-6), name
            assert rn["grad_norm"] == pytest.approx(ra["grad_norm"], rel=1e-4, abs=1e-7), name
        wn = weights_of(tmp / name)
        assert wn.keys() == wa.keys(), name
        for key in wa:
            torch.testing.assert_close(
                wn[key], wa[key], rtol=1e-4, atol=1e-6, msg=lambda m, n=name, k=key: f"{n} {k}: {m}"
            )

    onto("fsdp_onto_one", tmp / "fsdp" / "checkpoint-2", 1, **fsdp, gradient_accumulation_steps=2)
    onto("single_onto_fsdp", tmp / "single" / "checkpoint-2", 2, **fsdp)
    onto("single_onto_ddp", tmp / "single" / "checkpoint-2", 2)


ZERO3_JSON = {
    "zero_optimization": {"stage": 3},
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
}


@pytest.mark.parametrize(
    "sharding", ["fsdp", pytest.param("zero3", marks=pytest.mark.extended)]
)  # ZeRO-3 runs in test_deepspeed too
def test_the_transformers_rollout_samples_a_sharded_policy_and_matches_one_process(
    workdir: tuple[Path, str], sharding: str
) -> None:
    """FSDP and ZeRO-3 shard the weights: every rank samples its share of each generation call
    with the policy made whole for the call (unsharded / gathered), and both ranks sample (the
    per-rank counts). The 2-process run samples, scores and trains the same batches as 1 process
    (the transformers rollout, seeded per completion by its place in the call, so the split
    changes no sample), and on every step the sampler's log-probs equal the trainer's: a policy
    left at the start's weights would sample steps 2-3 from a stale policy (a log-prob gap)."""
    tmp, model = workdir
    if sharding == "zero3":
        if importlib.util.find_spec("deepspeed") is None:
            pytest.skip("deepspeed is not installed")
        (tmp / "zero3.json").write_text(json.dumps(ZERO3_JSON))
        shard: dict = {"deepspeed": str(tmp / "zero3.json")}
    else:
        shard = {
            "fsdp": ["full_shard", "auto_wrap"],
            "fsdp_config": {"fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer"},
        }
    sharded = write_config(tmp, sharding, model, max_steps=3, learning_rate=2e-2, **shard)
    single = write_config(tmp, "single", model, max_steps=3, learning_rate=2e-2, gradient_accumulation_steps=2)
    run_grpo(tmp, ["run", str(sharded), "--num-processes", "2"])
    run_grpo(tmp, ["run", str(single)])
    a, c = metrics(tmp / sharding), metrics(tmp / "single")
    assert [r["world_size"] for r in a] == [2.0] * 3
    for ra in a:  # each step's 2 prompts x 2 generations: one prompt's group sampled on each process
        assert (ra["completions/sampled_on_rank_0"], ra["completions/sampled_on_rank_1"]) == (2.0, 2.0), ra
    assert not any(key.startswith("completions/sampled_on_rank") for key in c[0]), "one process spreads nothing"
    for ra, rc in zip(a, c, strict=True):
        assert ra["reward"] == rc["reward"] and ra["num_tokens"] == rc["num_tokens"], "the same samples"
        assert ra["grad_norm"] == pytest.approx(rc["grad_norm"], rel=1e-4, abs=1e-7)
        for record in (ra, rc):  # sampled from the policy being trained, not an older one
            assert record["is/sampling_logp_difference/max"] < 1e-3, record
    wa, wc = weights_of(tmp / sharding), weights_of(tmp / "single")
    for key in wc:  # float32 sums in another order: one element of 1.5M was 1.45e-6 apart on AVX2 kernels
        torch.testing.assert_close(wa[key], wc[key], rtol=1e-4, atol=5e-6)
    moved = max(float((wc[k] - weights_at_start(model)[k]).abs().max()) for k in wc)
    assert moved > 1e-3, "the weights barely moved: a stale sampler would go unseen"


# ----------------------------------------------------------------------------- light: shapes and checks


@pytest.mark.extended  # FSDP runs in the default tier through the sharded transformers rollout test; async prefetch on
# 2 processes through the DDP disjoint-shares test
def test_fsdp_with_async_prefetch_does_not_deadlock_and_matches_one_process(workdir: tuple[Path, str]) -> None:
    """The reference's documented deadlock (a background thread issuing FSDP collectives): grpo's producer
    thread issues none, so an FSDP run with async_prefetch finishes (a hang fails at TIMEOUT) and trains the
    same steps as 1 process (the rollout here ignores the policy, so prefetching changes no sample)."""
    tmp, model = workdir
    (tmp / "mp_env.py").write_text(ENV)
    trl = {"rollout_func": "mp_env.rollout", "reward_funcs": ["mp_env.gated"]}
    fsdp = {
        "fsdp": ["full_shard", "auto_wrap"],
        "fsdp_config": {"fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer"},
    }
    sharded = write_config(tmp, "fsdp_async", model, max_steps=3, trl={**trl, "async_prefetch": True}, **fsdp)
    single = write_config(tmp, "single_sync", model, max_steps=3, trl=dict(trl), gradient_accumulation_steps=2)
    run_grpo(tmp, ["run", str(sharded), "--num-processes", "2"])
    run_grpo(tmp, ["run", str(single)])
    a, c = metrics(tmp / "fsdp_async"), metrics(tmp / "single_sync")
    assert [r["step"] for r in a] == [1, 2, 3]
    for ra, rc in zip(a, c, strict=True):
        assert ra["reward"] == rc["reward"] and ra["num_tokens"] == rc["num_tokens"]
        assert ra["grad_norm"] == pytest.approx(rc["grad_norm"], rel=1e-4, abs=1e-7)


def grpo_launch(tmp: Path, args: list[str]) -> tuple[subprocess.CompletedProcess[str], int]:
    """``grpo <args>`` as a user types it (the console script), from ``tmp``;
    also returns that process's pid."""
    env = {**os.environ, "PYTHONPATH": str(tmp), "OMP_NUM_THREADS": "1"}
    done = run_group([GRPO, *args], cwd=tmp, env=env, timeout=TIMEOUT)
    return done, done.pid


def assert_no_launcher_dump(stderr: str) -> None:
    no_traceback(stderr)
    assert "ChildFailedError" not in stderr and "torch/distributed" not in stderr, stderr


def test_num_processes_checks_a_bad_config_once_before_starting_processes(tmp_path: Path) -> None:
    (tmp_path / "mp_rewards.py").write_text(REWARDS)
    # every Python process started from here records its pid (site imports sitecustomize from PYTHONPATH)
    (tmp_path / "sitecustomize.py").write_text(
        f"import os\nwith open({str(tmp_path / 'pids')!r}, 'a') as f:\n    f.write(f'{{os.getpid()}}\\n')\n"
    )
    # 4 completions per generation over 2 processes: 2 each, half a group of 4; only a check for 2 processes sees it
    path = write_config(tmp_path, "bad", "some/model", trl={"num_generations": 4, "generation_batch_size": 4})
    done, parent = grpo_launch(tmp_path, ["run", str(path), "--num-processes", "2"])
    assert (tmp_path / "pids").read_text().split() == [str(parent)], "a process was started"
    assert done.returncode == 2, done.stderr
    assert_no_launcher_dump(done.stderr)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--num-processes" not in errors[0], done.stderr  # once: from the parent, no child
    assert "groups stay whole on a process" in done.stderr
    assert not (tmp_path / "bad").exists()


def test_a_child_failing_at_run_time_prints_its_one_line_error(tmp_path: Path) -> None:
    run_workdir(tmp_path, [{"prompt": f"Item {i}:"} for i in range(4)], {"mp_rewards": REWARDS})
    # passes the check (a model directory with a config.json, with one warning); fails loading its tokenizer
    model = tmp_path / "no-tokenizer-model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    path = write_config(tmp_path, "out", str(model), trl={"prefetch_depth": 2})
    done, _ = grpo_launch(tmp_path, ["run", str(path), "--num-processes", "2"])
    assert done.returncode == 2, done.stderr  # the child's own exit code (ConfigError), not the launcher's 1
    assert_no_launcher_dump(done.stderr)
    warned = [line for line in done.stderr.splitlines() if line.startswith("warning:")]
    assert len(warned) == 1 and "trl.prefetch_depth = 2 has no effect" in warned[0], done.stderr  # the parent's, once
    lines = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith("warning:")]
    # each child that got as far as failing prints the same line (elastic stops the other with SIGTERM)
    assert 1 <= len(lines) <= 2 and len(set(lines)) == 1, done.stderr
    assert lines[0].startswith(f"error: base_model: cannot load a tokenizer from '{model}'"), done.stderr


REFUSING_SYNC = """
from grpo_core.plugin_api import hookimpl
from grpo_core.contract.errors import WeightSyncUnverified
from grpo_plugins.weight_sync_in_process import InProcessSync


class RefusesVersion2(InProcessSync):
    \"\"\"Rank 0's sync of policy version 2 fails its check.\"\"\"

    @hookimpl
    def grpo_sync_weights(self, model, version, engine):
        if version == 2:
            raise WeightSyncUnverified("test: the engine never received policy version 2")
        return super().grpo_sync_weights(model, version, engine)
"""


def test_a_sync_that_fails_on_rank_0_stops_every_rank_with_one_checkpoint(workdir: tuple[Path, str]) -> None:
    """Only rank 0 syncs; its failed sync after step 2 must stop rank 1 too,
    at the same point: both checkpoint step 2 together and exit 3. (Before,
    rank 1 went on to step 3's collectives while rank 0 checkpointed, and
    the run hung.)"""
    from plugin_set import write_distribution

    tmp, model = workdir
    write_distribution(
        tmp,
        "grpo_refusing_sync",
        REFUSING_SYNC,
        "grpo-refusing-sync",
        "[grpo.weight_sync]\nrefuses_v2 = grpo_refusing_sync:RefusesVersion2\n",
    )
    path = write_config(tmp, "out", model, max_steps=4, plugins={"weight_sync": "refuses_v2"})
    done, _ = grpo_launch(tmp, ["run", str(path), "--num-processes", "2"])  # a hang fails at TIMEOUT
    assert done.returncode == 3, done.stderr[-4000:]
    assert_no_launcher_dump(done.stderr)
    said = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert 1 <= len(said) <= 2 and set(said) == {"error: test: the engine never received policy version 2"}, done.stderr
    assert "Training stopped at step 2; checkpoint saved to" in done.stderr
    out = tmp / "out"
    assert [r["step"] for r in metrics(out)] == [1, 2]  # step 2 trained and was recorded before its sync failed
    assert (out / "checkpoint-2" / "trainer_state.json").is_file() and not (out / "checkpoint-3").exists()
