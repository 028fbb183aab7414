"""Pieces of observability that need no model: report_to parsing and checks,
tracker loading (real libraries, and a missing one), the health monitor on
metric sequences, the validation split, and the report on written metrics."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import minimal_config

from grpo_core.config.loader import validate
from grpo_core.config.schema import AlertSettings
from grpo_core.contract.context import RunContext
from grpo_core.contract.errors import ConfigError, DataError
from grpo_core.contract.types import Prompt, Tracker
from grpo_core.generation.evaluation import split_validation
from grpo_core.host.plugin_host import PluginHost
from grpo_core.observability.alerts import HealthMonitor
from grpo_core.observability.tracking import TrackerSet, requested_trackers
from grpo_core.validation.run_check import check_run_config

minimal = minimal_config


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("value", "expected"),
    [("none", []), ("tensorboard", ["tensorboard"]), (["TensorBoard", "mlflow"], ["tensorboard", "mlflow"]), ([], [])],
)
def test_report_to_follows_the_hf_convention(value: Any, expected: list[str]) -> None:
    assert validate(minimal(report_to=value)).report_to == expected


def test_use_wandb_adds_wandb_and_all_means_every_installed_tracker() -> None:
    assert requested_trackers(validate(minimal(use_wandb=True)), []) == ["wandb"]
    assert requested_trackers(validate(minimal(report_to=["jsonl", "wandb"], use_wandb=True)), []) == ["wandb"]
    assert requested_trackers(validate(minimal(report_to="all")), ["mlflow", "tensorboard"]) == [
        "mlflow",
        "tensorboard",
    ]


def test_formerly_refused_options_now_pass_the_checks() -> None:
    check_run_config(
        validate(
            minimal(
                use_wandb=True,
                val_set_size=0.1,
                trl={"num_generations": 4, "reward_funcs": ["last_number_match"], "log_completions": True},
            )
        )
    )


def test_config_check_names_an_unknown_tracker_and_what_exists() -> None:
    with pytest.raises(ConfigError) as info:
        check_run_config(validate(minimal(report_to=["tensorbored"])), PluginHost())
    assert "report_to = 'tensorbored'" in str(info.value) and "tensorboard" in str(info.value)


def test_eval_strategy_without_data_and_unknown_alert_names_are_refused() -> None:
    with pytest.raises(ConfigError, match="val_set_size"):
        check_run_config(validate(minimal(eval_strategy="steps")))
    with pytest.raises(ConfigError, match="alerts.silence"):
        check_run_config(validate(minimal(alerts={"silence": ["entropy"]})))
    with pytest.raises(ConfigError, match="whole number"):
        check_run_config(validate(minimal(val_set_size=2.5)))


# --------------------------------------------------------------------------- trackers


def _context(tmp_path: Path, **top: Any) -> tuple[Any, RunContext]:
    cfg = validate(minimal(output_dir=str(tmp_path / "out"), **top))
    return cfg, RunContext(config=cfg, output_dir=tmp_path / "out")


def test_missing_tracker_library_is_one_line_naming_the_pip_package(tmp_path: Path, monkeypatch) -> None:
    # Simulate an environment without the libraries (they are installed here).
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.setitem(sys.modules, "mlflow", None)
    for name, package in (("tensorboard", "tensorboard"), ("mlflow", "mlflow-skinny")):
        cfg, ctx = _context(tmp_path, report_to=[name])
        with pytest.raises(ConfigError) as info:
            TrackerSet.build(cfg, PluginHost(), ctx)
        assert str(info.value) == f"report_to = '{name}' needs the '{package}' package: pip install {package}"


def test_builtin_trackers_satisfy_the_protocol(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg, ctx = _context(tmp_path, report_to=["tensorboard", "wandb", "mlflow"])
    trackers = TrackerSet.build(cfg, PluginHost(), ctx)
    try:
        assert set(trackers.trackers) == {"tensorboard", "wandb", "mlflow"}
        assert all(isinstance(t, Tracker) for t in trackers.trackers.values())
    finally:
        trackers.close()


def test_a_second_mlflow_run_in_one_process_logs_to_its_own_output_dir(tmp_path: Path, monkeypatch) -> None:
    """mlflow exports the tracking URI to os.environ; a run that chose its own
    store takes it back when it closes (the Python API may train twice)."""
    from mlflow.tracking import MlflowClient

    for key in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_ID"):  # restored after the test, whatever mlflow set
        monkeypatch.delenv(key, raising=False)
    stores = []
    for name in ("first", "second"):
        cfg, ctx = _context(tmp_path / name, report_to=["mlflow"])
        trackers = TrackerSet.build(cfg, PluginHost(), ctx)
        trackers.trackers["mlflow"].log({"reward": 1.0}, step=1)
        trackers.close()
        assert not {"MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_ID"} & set(os.environ)
        stores.append(tmp_path / name / "out" / "mlruns")
    for store in stores:
        client = MlflowClient(store.resolve().as_uri())
        (found,) = client.search_runs([client.get_experiment_by_name("grpo").experiment_id])
        assert [m.value for m in client.get_metric_history(found.info.run_id, "reward")] == [1.0]


class _Broken:
    def __init__(self) -> None:
        self.closed = False

    def log(self, metrics: dict[str, float], step: int) -> None:
        raise RuntimeError("network down")

    def log_table(self, name: str, rows: list, step: int) -> None:
        pass

    def close(self) -> None:
        self.closed = True


class _Keep:
    def __init__(self) -> None:
        self.logged: list[tuple[dict, int]] = []

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.logged.append((metrics, step))

    def log_table(self, name: str, rows: list, step: int) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_failing_tracker_is_dropped_with_a_warning_and_others_keep_logging(capsys) -> None:
    broken, keep = _Broken(), _Keep()
    trackers = TrackerSet({"broken": broken, "keep": keep})
    trackers.log({"reward": 1.0, "bad": float("nan"), "text": "x"}, 1)
    trackers.log({"reward": 2.0}, 2)
    assert keep.logged == [({"reward": 1.0}, 1), ({"reward": 2.0}, 2)]  # non-finite and non-numbers dropped
    assert "tracker 'broken' failed to log metrics" in capsys.readouterr().err
    assert "broken" not in trackers.trackers


# --------------------------------------------------------------------------- alerts


def feed(monitor: HealthMonitor, steps: list[dict[str, float]]) -> list[tuple[int, str]]:
    fired = []
    for step, metrics in enumerate(steps, start=1):
        fired += [(a.step, a.name) for a in monitor.update(step, metrics)]
    return fired


def healthy(**changes: float) -> dict[str, float]:
    return {
        "reward": 0.5,
        "reward_std": 0.3,
        "entropy": 0.3,
        "grad_norm": 0.2,
        "loss": 0.1,
        "skipped_zero_adv_batches": 0.0,
        **changes,
    }


def test_healthy_run_fires_nothing(tmp_path: Path) -> None:
    monitor = HealthMonitor(AlertSettings(), tmp_path, echo=lambda _l: None)
    assert feed(monitor, [healthy() for _ in range(30)]) == []
    assert not (tmp_path / "alerts.jsonl").exists()


def test_reward_zero_fires_once_after_the_configured_steps(tmp_path: Path) -> None:
    lines: list[str] = []
    monitor = HealthMonitor(AlertSettings(reward_zero_steps=20), tmp_path, echo=lines.append)
    assert feed(monitor, [healthy(reward=0.0) for _ in range(25)]) == [(20, "reward_zero")]
    assert len(lines) == 1 and "grpo rewards test" in lines[0]
    assert json.loads((tmp_path / "alerts.jsonl").read_text())["name"] == "reward_zero"


def test_no_signal_entropy_grad_and_is_alerts(tmp_path: Path) -> None:
    settings = AlertSettings(window=4)
    cases = {
        "no_signal": [healthy(reward_std=0.0)] * 3 + [healthy()] * 1 + [healthy(reward_std=0.0)] * 4,
        "entropy_collapse": [healthy(entropy=0.001)] * 4,
        "entropy_explosion": [healthy(entropy=8.0)] * 4,
        "grad_norm_high": [healthy(grad_norm=50.0)] * 4,
        "is_ratio": [healthy(**{"is/sampling_logp_difference/mean": 1.5})] * 4,
    }
    for name, steps in cases.items():
        fired = feed(HealthMonitor(settings, None, echo=lambda _l: None), steps)
        assert [n for _s, n in fired] == [name], (name, fired)


def test_grad_norm_zero_only_on_steps_that_trained() -> None:
    monitor = HealthMonitor(AlertSettings(), None, echo=lambda _l: None)
    skipped = [healthy(grad_norm=0.0, skipped_zero_adv_batches=float(i + 1)) for i in range(3)]
    assert feed(monitor, skipped) == []  # the zero-advantage skip explains a zero norm
    # a batch with no samples at all (partial rollouts' first batch, every sample still open) trained nothing
    assert monitor.update(4, healthy(grad_norm=0.0, skipped_zero_adv_batches=3.0, num_tokens=0.0)) == []
    assert monitor.update(5, healthy(grad_norm=0.0, skipped_zero_adv_batches=3.0))[0].name == "grad_norm_zero"


def test_alerts_can_be_silenced_or_switched_off() -> None:
    steps = [healthy(entropy=0.0)] * 12
    assert feed(HealthMonitor(AlertSettings(silence=["entropy_collapse"]), None, echo=lambda _l: None), steps) == []
    assert feed(HealthMonitor(AlertSettings(enabled=False), None, echo=lambda _l: None), steps) == []


# --------------------------------------------------------------------------- validation split


def prompts(n: int) -> list[Prompt]:
    return [Prompt(prompt=f"q{i}", prompt_ids=[i], index=i) for i in range(n)]


def test_validation_split_is_seeded_disjoint_and_sized() -> None:
    train, val = split_validation(prompts(20), 0.25, seed=3)
    assert len(val) == 5 and len(train) == 15
    assert not {p.prompt for p in train} & {p.prompt for p in val}
    assert [p.index for p in train] == list(range(15))
    again = split_validation(prompts(20), 0.25, seed=3)[1]
    assert [p.prompt for p in again] == [p.prompt for p in val]
    assert [p.prompt for p in split_validation(prompts(20), 0.25, seed=4)[1]] != [p.prompt for p in val]
    assert len(split_validation(prompts(20), 3, seed=3)[1]) == 3
    with pytest.raises(DataError, match="leaving none to train on"):
        split_validation(prompts(4), 4, seed=0)


# --------------------------------------------------------------------------- report


def test_report_summary_lists_first_last_best_and_alerts(tmp_path: Path) -> None:
    from grpo_core.observability.report import build_report

    rows = [
        {
            "step": s,
            "reward": r,
            "reward_std": 0.2,
            "entropy": 0.4,
            "grad_norm": 0.1,
            "rewards/acc/mean": r,
            "eval/reward": e,
        }
        for s, r, e in ((1, 0.1, 0.2), (2, 0.6, 0.5), (3, 0.4, 0.3))
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + '\n{"step": 4, "rew')  # torn tail
    (tmp_path / "alerts.jsonl").write_text(json.dumps({"step": 2, "name": "no_signal", "message": "m"}) + "\n")
    text, pngs = build_report(tmp_path)
    reward_line = next(line for line in text.splitlines() if line.startswith("reward "))
    assert reward_line.split()[1:] == ["0.1", "0.4", "0.6", "@", "2"]
    assert "eval/reward" in text and "[no_signal]" in text
    assert {p.stem for p in pngs} == {"reward", "reward_std", "entropy", "grad_norm", "eval"}
    with pytest.raises(DataError, match="metrics.jsonl"):
        build_report(tmp_path / "nothing")


# --------------------------------------------------------------------------- a third-party tracker


THIRD_PARTY = """
import json
from pathlib import Path


class LinesTracker:
    def __init__(self, context):
        self.path = Path(context.output_dir) / "lines.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def log(self, metrics, step):
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\\n")

    def log_table(self, name, rows, step):
        with open(self.path, "a") as f:
            f.write(json.dumps({"table": name, "rows": len(rows), "step": step}) + "\\n")

    def close(self):
        with open(self.path, "a") as f:
            f.write(json.dumps({"closed": True}) + "\\n")
"""


def test_a_third_party_tracker_package_is_chosen_by_its_entry_point_name(tmp_path: Path, monkeypatch) -> None:
    from grpo_core.host import plugin_host

    site = tmp_path / "site"
    site.mkdir()
    (site / "grpo_lines_tracker.py").write_text(THIRD_PARTY)
    info = site / "grpo_lines_tracker-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: grpo-lines-tracker\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[grpo.tracker]\nlines = grpo_lines_tracker:LinesTracker\n")
    monkeypatch.syspath_prepend(str(site))
    plugin_host.rescan()
    try:
        cfg, ctx = _context(tmp_path, report_to=["lines"])
        check_run_config(cfg, PluginHost())  # known by name to the config check
        trackers = TrackerSet.build(cfg, PluginHost(), ctx)
        trackers.log({"reward": 0.25}, 3)
        trackers.log_table("completions", [{"step": 3, "completion": "x"}], 3)
        trackers.close()
        lines = [json.loads(line) for line in (tmp_path / "out" / "lines.jsonl").read_text().splitlines()]
        assert lines == [{"step": 3, "reward": 0.25}, {"table": "completions", "rows": 1, "step": 3}, {"closed": True}]
        # the plugin allowlist applies to trackers as to every other plugin
        from grpo_core.contract.errors import PluginError

        with pytest.raises(PluginError, match="not allowed"):
            TrackerSet.build(cfg, PluginHost(allow={"someone-else"}), ctx)
    finally:
        sys.modules.pop("grpo_lines_tracker", None)
        monkeypatch.undo()
        plugin_host.rescan()


def test_metrics_logger_writes_forced_steps_between_logging_steps(tmp_path: Path) -> None:
    from grpo_core.observability.logging import MetricsLogger

    logger = MetricsLogger(tmp_path, max_steps=6, initial_step=0, logging_steps=3)
    for step in range(1, 7):
        logger.log(step, {"reward": float(step)}, force=step == 2)  # step 2 evaluated (or raised an alert)
    logger.phase("evaluating")
    logger.close()
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [2, 3, 6]
