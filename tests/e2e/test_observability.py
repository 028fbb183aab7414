"""Observability on one real run: trackers, completion log, evaluation during
training, health alerts, the progress display, and the tools around a run
(``grpo report``, ``grpo rewards test``, ``grpo eval``, ``grpo merge``).

One tiny ``grpo run`` (real CLI subprocess, the tiny random model of
tests/tiny_model.py: what is checked is what the run writes, not what it
learns; transformers rollout, 2 steps) with every feature on is shared by the module; each test reads back
what it wrote with the real libraries (TensorBoard's event reader, MLflow's
client, W&B's offline run file, PIL for the plots).
"""

from __future__ import annotations

import glob
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import raw_config, write_toml

from grpo_core.interface.cli import main

REWARDS = """
import re

def last_digit_even(completions, **kwargs):
    out = []
    for c in completions:
        digits = re.findall(r"\\d", c[0]["content"])
        out.append(1.0 if digits and int(digits[-1]) % 2 == 0 else 0.0)
    return out

def even_tokens(completion_ids, **kwargs):
    # the fraction of even token ids: it varies within every group of the tiny model's random
    # completions (which never sample a digit or EOS in 8 tokens), so every step trains
    return [sum(t % 2 == 0 for t in ids) / max(1, len(ids)) for ids in completion_ids]

def broken(completions, **kwargs):
    raise ValueError("boom")
"""

STEPS = 2
PROMPTS_PER_STEP = 2
GENERATIONS = 4
VAL = 2


def write_config(root: Path, model_dir: str) -> Path:
    raw = raw_config(
        model_dir,
        root,
        adapter="lora",
        lora_r=8,
        lora_alpha=16,
        val_set_size=VAL,
        eval_steps=1,
        sequence_len=128,
        micro_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=STEPS,
        learning_rate=1e-3,
        lr_scheduler="constant",
        seed=8,  # even_tokens varies within every group: step 1 trains (entropy, the alert, the adapter moves)
        report_to=["tensorboard", "wandb", "mlflow"],
        # thresholds that make alerts fire deterministically on 2 steps
        alerts={
            "window": 1,
            "entropy_max": 1e-4,
            "grad_norm_max": 1e-9,
            "silence": ["grad_norm_high"],
            "reward_zero_steps": 1,
            "reward_zero_eps": 100.0,
        },
        trl={
            "num_generations": GENERATIONS,
            "max_completion_length": 8,
            "reward_funcs": ["tiny_rewards.last_digit_even", "tiny_rewards.even_tokens"],
            "reward_weights": [1.0, 0.5],
            "temperature": 1.0,
            "log_completions": True,
            "num_completions_to_print": 2,
        },
    )
    return write_toml(root / "config.toml", raw)


def env_for(root: Path) -> dict[str, str]:
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "PYTHONPATH": str(root),
        "COLUMNS": "200",
    }


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: str):
    root = tmp_path_factory.mktemp("observe")
    (root / "tiny_rewards.py").write_text(REWARDS)
    rows = [
        {"prompt": [{"role": "user", "content": f"What is {a} + {a + 1}?"}], "answer": str(2 * a + 1)}
        for a in range(1, 11)
    ]
    (root / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    config = write_config(root, tiny_model_dir)
    proc = subprocess.run(  # noqa: S603 - our own console script
        [sys.executable, "-m", "grpo", "run", str(config)],
        cwd=root,
        env=env_for(root),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return {
        "root": root,
        "out": root / "out",
        "config": config,
        "output": proc.stdout + proc.stderr,
        "model_dir": tiny_model_dir,
    }


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# --------------------------------------------------------------------------- metrics, eval, alerts


def test_evaluation_logs_eval_metrics_every_eval_step(run) -> None:
    records = jsonl(run["out"] / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        for key in (
            "eval/reward",
            "eval/rewards/last_digit_even/mean",
            "eval/rewards/even_tokens/mean",
            "eval/completions/mean_length",
            "eval/policy_version",
        ):
            assert record.get(key) is not None, (key, record)
        assert record["eval/num_samples"] == VAL  # one greedy completion per held-out prompt
        assert 0 < record["eval/completions/mean_length"] <= 8
        # the eval reward is the weighted sum of the per-function means
        expected = record["eval/rewards/last_digit_even/mean"] + 0.5 * record["eval/rewards/even_tokens/mean"]
        assert record["eval/reward"] == pytest.approx(expected, abs=1e-6)
    # pinned at the version the trainer had just synced: the one that
    # generated the step's batch, plus one if the step updated the weights
    for record in records:
        assert record["eval/policy_version"] == record["policy_version"] + (record["grad_norm"] > 0)


def test_validation_prompts_are_never_trained_on(run) -> None:
    trained = {r["prompt"] for r in jsonl(run["out"] / "completions.jsonl")}
    evaluated = {r["prompt"] for r in _wandb_table_rows(run["out"], "eval_completions")}
    assert len(evaluated) == VAL
    assert not trained & evaluated


def test_alerts_fire_once_are_recorded_and_can_be_silenced(run) -> None:
    records = jsonl(run["out"] / "metrics.jsonl")
    assert records[0].get("alerts/entropy_explosion") == 1.0
    assert "alerts/entropy_explosion" not in records[1]  # fires once
    assert records[0].get("alerts/reward_zero") == 1.0
    assert not any("alerts/grad_norm_high" in r for r in records)  # silenced
    output = run["output"]
    assert output.count("alert [entropy_explosion]") == 1
    assert "grpo rewards test" in output  # reward_zero's suggestion
    saved = jsonl(run["out"] / "alerts.jsonl")
    assert {a["name"] for a in saved} == {"entropy_explosion", "reward_zero"}


def test_progress_shows_phases_and_the_final_summary_line(run) -> None:
    output = run["output"]
    for phase in ("generating", "scoring", "training", "syncing", "evaluating"):
        assert f"grpo [{phase}]" in output, phase
    final = [line for line in output.splitlines() if line.startswith("training completed")]
    assert final, output[-2000:]
    assert "best eval/reward" in final[-1] and f"model saved to {run['out']}" in final[-1]
    assert "sample completions" in output  # num_completions_to_print still works


# --------------------------------------------------------------------------- completions and trackers


def test_completion_log_appends_every_logged_step(run) -> None:
    rows = jsonl(run["out"] / "completions.jsonl")
    per_step = PROMPTS_PER_STEP * GENERATIONS
    assert [r["step"] for r in rows] == [1] * per_step + [2] * per_step
    for row in rows:
        assert set(row) >= {"prompt", "completion", "reward/last_digit_even", "reward/even_tokens", "advantage"}
        assert row["reward/last_digit_even"] in (0.0, 1.0)
    # advantages are group-relative: they sum to ~0 within each prompt's group
    for start in range(0, len(rows), GENERATIONS):
        assert abs(sum(r["advantage"] for r in rows[start : start + GENERATIONS])) < 1e-4


def test_tensorboard_event_files_hold_the_metrics_and_tables(run) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run["out"] / "runs"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    reward = acc.Scalars("reward")
    logged = jsonl(run["out"] / "metrics.jsonl")
    assert [e.step for e in reward] == [1, 2]
    assert [e.value for e in reward] == pytest.approx([r["reward"] for r in logged], rel=1e-5)
    assert [e.step for e in acc.Scalars("eval/reward")] == [1, 2]
    texts = [t for t in acc.Tags()["tensors"] if t.startswith("completions")]
    assert texts and [e.step for e in acc.Tensors(texts[0])] == [1, 2]  # one table per step, none overwritten


def test_mlflow_file_store_holds_metrics_and_an_accumulated_table(run) -> None:
    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient((run["out"] / "mlruns").resolve().as_uri())
    experiment = client.get_experiment_by_name("grpo")
    (found,) = client.search_runs([experiment.experiment_id])
    history = client.get_metric_history(found.info.run_id, "reward")
    assert sorted(m.step for m in history) == [1, 2]
    assert len(client.get_metric_history(found.info.run_id, "eval/rewards/last_digit_even/mean")) == 2
    artifact = Path(client.download_artifacts(found.info.run_id, "completions.json", str(run["root"] / "mlflow-dl")))
    table = json.loads(artifact.read_text())
    steps = [row[table["columns"].index("step")] for row in table["data"]]
    assert steps.count(1) == steps.count(2) == PROMPTS_PER_STEP * GENERATIONS  # step 2 appended, step 1 kept


def _wandb_records(out: Path):
    """Records of W&B's offline run file (LevelDB log framing, protobuf records)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb"))
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # full record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(pending + chunk if kind == 4 else chunk)
            pending = b""
            yield record
        else:
            pending = chunk if kind == 2 else pending + chunk


def _wandb_history(out: Path) -> list[dict]:
    rows = []
    for record in _wandb_records(out):
        if record.WhichOneof("record_type") == "history":
            rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item})
    return rows


def _wandb_table_rows(out: Path, name: str) -> list[dict]:
    rows = []
    for path in sorted(
        glob.glob(str(out / "wandb" / "offline-run-*" / "files" / "media" / "table" / f"{name}_*.table.json"))
    ):
        table = json.loads(Path(path).read_text())
        rows += [dict(zip(table["columns"], row)) for row in table["data"]]
    return rows


def test_wandb_offline_run_holds_metrics_and_an_incremental_table(run) -> None:
    history = _wandb_history(run["out"])
    steps = [h for h in history if "reward" in h]
    assert [h["_step"] for h in steps] == [1, 2]
    assert all("eval/reward" in h for h in steps)
    increments = [h["completions/nrows"] for h in history if "completions/nrows" in h]
    per_step = PROMPTS_PER_STEP * GENERATIONS
    assert increments == [per_step, 2 * per_step]  # one table that grows: step 2 added to step 1's rows
    assert len(_wandb_table_rows(run["out"], "completions")) == 2 * PROMPTS_PER_STEP * GENERATIONS


# --------------------------------------------------------------------------- tools


def test_report_writes_nonblank_plots_and_a_summary(run, capsys: pytest.CaptureFixture) -> None:
    from PIL import Image

    assert main(["report", str(run["out"])]) == 0
    text = capsys.readouterr().out
    assert "reward" in text and "eval/reward" in text and "[entropy_explosion]" in text
    pngs = {p.stem: p for p in (run["out"] / "report").glob("*.png")}
    assert {"reward", "reward_std", "entropy", "grad_norm", "completion_length", "eval"} <= set(pngs)
    for path in pngs.values():
        with Image.open(path) as image:
            assert image.size == (800, 450)
            lo, hi = image.convert("L").getextrema()
            assert hi - lo > 100, f"{path.name} is blank"


def test_rewards_test_scores_a_column_and_reports_errors(run, capsys: pytest.CaptureFixture, monkeypatch) -> None:
    monkeypatch.chdir(run["root"])
    monkeypatch.syspath_prepend(str(run["root"]))
    assert main(["rewards", "test", str(run["config"]), "--samples", "3", "--from-column", "answer"]) == 0
    out = capsys.readouterr().out
    # every answer (2a + 1) is odd: the even-digit reward is 0 on all three
    assert "last_digit_even: 3 completions" in out and "values: 0 x3" in out
    assert "GRPO gets no learning signal" in out
    code = main(
        [
            "rewards",
            "test",
            str(run["config"]),
            "--samples",
            "2",
            "--from-column",
            "answer",
            "--set",
            'trl.reward_funcs=["tiny_rewards.broken"]',
            "--set",
            "trl.reward_weights=[1.0]",
        ]
    )
    out = capsys.readouterr().out
    assert code == 1 and "ERROR" in out and "boom" in out and "Sample 0" in out
    assert main(["rewards", "test", str(run["config"]), "--samples", "2", "--from-column", "nope"]) == 2
    assert "no such column" in capsys.readouterr().err


def test_rewards_test_generates_with_the_model(run, capsys: pytest.CaptureFixture, monkeypatch) -> None:
    monkeypatch.chdir(run["root"])
    monkeypatch.syspath_prepend(str(run["root"]))
    assert main(["rewards", "test", str(run["config"]), "--samples", "2", "--generations", "2"]) == 0
    out = capsys.readouterr().out
    assert "2 generated completion(s) per row" in out and "even_tokens: 4 completions" in out


def test_merge_gives_a_plain_model_equal_to_base_plus_adapter(run) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    assert main(["merge", str(run["out"])]) == 0
    merged_dir = run["out"] / "merged"
    assert (merged_dir / "model.safetensors").is_file() and (merged_dir / "tokenizer.json").is_file()
    assert not (merged_dir / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
    reference = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(run["model_dir"], dtype=torch.float32), str(run["out"])
    )
    ids = torch.tensor([[1, 504, 3458, 314, 216, 30, 1241]])
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, reference(ids).logits, rtol=1e-4, atol=1e-4)
        base = AutoModelForCausalLM.from_pretrained(run["model_dir"], dtype=torch.float32)
        assert not torch.allclose(merged(ids).logits, base(ids).logits, atol=1e-4)  # the adapter is in it


def test_eval_command_matches_the_last_in_training_evaluation(
    run, capsys: pytest.CaptureFixture, monkeypatch, tmp_path
) -> None:
    monkeypatch.chdir(run["root"])
    monkeypatch.syspath_prepend(str(run["root"]))
    out_file = tmp_path / "eval.json"
    assert main(["eval", str(run["config"]), "--adapter", str(run["out"]), "--output", str(out_file)]) == 0
    metrics = json.loads(out_file.read_text())
    last = jsonl(run["out"] / "metrics.jsonl")[-1]
    assert metrics["eval/num_samples"] == VAL
    # same held-out prompts, same greedy decoding, same weights (merged here)
    assert metrics["eval/reward"] == pytest.approx(last["eval/reward"], abs=1e-6)
    assert metrics["eval/completions/mean_length"] == pytest.approx(last["eval/completions/mean_length"])
