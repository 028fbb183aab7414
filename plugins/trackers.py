"""Built-in trackers (``grpo.tracker`` entry points): TensorBoard, Weights &
Biases, MLflow and trackio.

Each imports its library when built, not at module import, and raises
:class:`~grpo_core.observability.tracking.MissingTrackerLibrary` (one line naming the pip
package) when it is absent. Every one writes under ``output_dir`` by default
so a run works offline: W&B in offline mode unless ``WANDB_MODE`` says
otherwise, MLflow to a local file store unless ``MLFLOW_TRACKING_URI`` is
set. Tables accumulate: each step's completions are added, earlier ones stay.

A resumed run (``context.start_step`` > 0) continues its tracker's run as
far as the tracker allows: TensorBoard rewinds its event log to the step
(``purge_step``: what the killed run logged after it is hidden), W&B and
MLflow continue the same run, whose id a fresh start keeps in
``output_dir/<tracker>-run.json``; neither can drop what the killed run
logged after the step, and each says so when there is some.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
from pathlib import Path
from typing import Any

from grpo_core.plugin_api import MissingTrackerLibrary, RunContext


def _require(tracker: str, module: str, package: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingTrackerLibrary(tracker, package) from None


def _needs(tracker: str, module: str, package: str) -> Any:
    """The tracker class's own config check: its library is installed (found,
    not imported), so ``grpo config check`` refuses ``report_to`` naming a
    tracker that could not start."""

    def grpo_validate_config(config: Any) -> list[str]:
        if importlib.util.find_spec(module) is None:
            raise MissingTrackerLibrary(tracker, package)
        return []

    return staticmethod(grpo_validate_config)


def _run_name(context: RunContext) -> str:
    return Path(context.output_dir).resolve().name or "grpo"


class _RunRecord:
    """``output_dir/<tracker>-run.json``: the tracker's run id and the last
    step it logged, so a resumed run continues that run (and knows whether
    the killed run logged steps past the checkpoint)."""

    def __init__(self, context: RunContext, tracker: str) -> None:
        self.path = Path(context.output_dir) / f"{tracker}-run.json"
        self.start_step = int(getattr(context, "start_step", 0) or 0)
        self.log = context.log
        self.tracker = tracker
        self.id: str | None = None
        self.last_step = 0
        if self.start_step > 0:
            try:
                data = json.loads(self.path.read_text())
                self.id, self.last_step = str(data["id"]), int(data.get("last_step", 0))
            except (OSError, ValueError, KeyError, TypeError):
                pass

    def continued(self, run_id: str, overlap: str) -> None:
        """Say that ``run_id`` continues, and ``overlap``: what the tracker does
        with the steps the interrupted run logged after the start step."""
        self.log(f"{self.tracker}: continuing run {run_id} from step {self.start_step}")
        if self.last_step > self.start_step:
            steps = f"{self.start_step + 1}-{self.last_step}"
            self.log(
                f"{self.tracker}: run {run_id} holds what the interrupted run logged for steps {steps}: "
                f"{overlap.format(steps=steps)} metrics.jsonl holds the one history (its rows are in abandoned/)."
            )

    def save(self, run_id: str, step: int = 0) -> None:
        """Keep ``run_id`` and the highest step logged to it (written when either changes)."""
        if run_id == self.id and step <= self.last_step and self.path.is_file():
            return
        self.id, self.last_step = run_id, max(self.last_step, step)
        try:
            self.path.write_text(json.dumps({"id": run_id, "last_step": self.last_step}) + "\n")
        except OSError:  # a full disk: metrics.jsonl's write reports it
            pass


def _markdown_table(rows: list[dict[str, Any]]) -> str:
    columns = list(rows[0])

    def cell(value: Any) -> str:
        return str(value).replace("|", "\\|").replace("\n", " ")[:500]

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


class TensorBoardTracker:
    """``report_to = ["tensorboard"]``: event files in ``output_dir/runs``.
    A table is written as markdown text under its name, one entry per step."""

    grpo_validate_config = _needs("tensorboard", "tensorboard", "tensorboard")

    def __init__(self, context: RunContext) -> None:
        _require("tensorboard", "tensorboard", "tensorboard")
        # tensorboard is optional: imported only when the tracker is chosen
        from torch.utils.tensorboard import SummaryWriter

        own = not os.environ.get("TENSORBOARD_LOGGING_DIR")
        self.log_dir = Path(os.environ.get("TENSORBOARD_LOGGING_DIR") or Path(context.output_dir) / "runs")
        start = int(getattr(context, "start_step", 0) or 0)
        # TensorBoard's own rewind: events at or after purge_step logged earlier in this directory are hidden
        # (a resumed run's killed predecessor; on a fresh start in the run's own directory, an earlier run)
        earlier = own and self.log_dir.is_dir() and any(self.log_dir.iterdir())
        purge = start + 1 if start > 0 or earlier else None
        self.writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=purge)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def log_table(self, name: str, rows: list[dict[str, Any]], step: int) -> None:
        self.writer.add_text(name, _markdown_table(rows), global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """``report_to = ["wandb"]`` (or ``use_wandb = true``): offline by default,
    files in ``output_dir/wandb`` (``wandb sync`` uploads them later). Set
    ``WANDB_MODE=online`` and ``WANDB_PROJECT`` to log live. The completion
    table is one incremental table: each step appends its rows."""

    grpo_validate_config = _needs("wandb", "wandb", "wandb")

    def __init__(self, context: RunContext) -> None:
        self.wandb = _require("wandb", "wandb", "wandb")
        out = Path(context.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.record = _RunRecord(context, "wandb")
        resume: dict[str, Any] = {"id": self.record.id, "resume": "allow"} if self.record.id else {}
        self.run = self.wandb.init(
            project=os.environ.get("WANDB_PROJECT", "grpo"),
            name=os.environ.get("WANDB_NAME", _run_name(context)),
            dir=str(out),
            mode=os.environ.get("WANDB_MODE", "offline"),
            config=context.config.model_dump(mode="json"),
            reinit="create_new",
            **resume,
        )
        if resume:
            self.record.continued(
                self.run.id,
                "W&B keeps them, and its steps only increase: this run's values for steps {steps} do not replace them.",
            )
        self.record.save(self.run.id)
        self.tables: dict[str, Any] = {}

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)
        self.record.save(self.run.id, step)

    def log_table(self, name: str, rows: list[dict[str, Any]], step: int) -> None:
        table = self.tables.get(name)
        if table is None:
            table = self.tables[name] = self.wandb.Table(columns=list(rows[0]), log_mode="INCREMENTAL")
        for row in rows:
            table.add_data(*[row.get(c) for c in table.columns])
        self.run.log({name: table}, step=step)

    def close(self) -> None:
        self.run.finish()


_MLFLOW_EXPORTS = ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_ID", "MLFLOW_ALLOW_FILE_STORE")
"""What mlflow (or this tracker) puts in os.environ; put back as found at close."""
_MLFLOW_BAD = re.compile(r"[^A-Za-z0-9_\-. /:]")


class MlflowTracker:
    """``report_to = ["mlflow"]``: a local file store in ``output_dir/mlruns``
    unless ``MLFLOW_TRACKING_URI`` is set; experiment ``MLFLOW_EXPERIMENT_NAME``
    (default ``grpo``). A table is one JSON artifact per name that every
    step appends to (``mlflow.log_table``)."""

    grpo_validate_config = _needs("mlflow", "mlflow", "mlflow-skinny")

    def __init__(self, context: RunContext) -> None:
        self.mlflow = _require("mlflow", "mlflow", "mlflow-skinny")
        self.env_before = {key: os.environ.get(key) for key in _MLFLOW_EXPORTS}
        uri = self.env_before["MLFLOW_TRACKING_URI"]
        if not uri:
            uri = (Path(context.output_dir).resolve() / "mlruns").as_uri()
            # MLflow 3 refuses file stores unless asked; a local store is the
            # point here (no server, no database package: mlflow-skinny works).
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.mlflow.set_tracking_uri(uri)
        self.mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", "grpo"))
        self.record = _RunRecord(context, "mlflow")
        self.run = self._start(context)
        self.record.save(self.run.info.run_id)
        self.client = self.mlflow.tracking.MlflowClient(uri)
        self.tables: dict[str, list[dict[str, Any]]] = {}

    def _start(self, context: RunContext) -> Any:
        """The resumed run's MLflow run again, else a new one."""
        if self.record.id:
            try:
                run = self.mlflow.start_run(run_id=self.record.id)
            except Exception as exc:  # gone from this tracking store (another URI): a new run, said so
                context.log(f"mlflow: cannot continue run {self.record.id} ({exc}); starting a new run")
            else:
                self.record.continued(
                    run.info.run_id, "MLflow keeps them beside this run's values (logged values cannot be removed)."
                )
                return run
        return self.mlflow.start_run(run_name=_run_name(context))

    def log(self, metrics: dict[str, float], step: int) -> None:
        clean = {_MLFLOW_BAD.sub("_", k): v for k, v in metrics.items()}
        self.mlflow.log_metrics(clean, step=step, run_id=self.run.info.run_id)
        self.record.save(self.run.info.run_id, step)

    def log_table(self, name: str, rows: list[dict[str, Any]], step: int) -> None:
        # The whole table so far, rewritten: mlflow.log_table's append needs pandas.
        kept = self.tables.setdefault(name, [])
        kept.extend(rows)
        columns = list(dict.fromkeys(c for r in kept for c in r))
        table = {"columns": columns, "data": [[r.get(c) for c in columns] for r in kept]}
        self.client.log_dict(self.run.info.run_id, table, f"{name}.json")

    def close(self) -> None:
        self.mlflow.end_run()
        # mlflow exports the tracking URI and experiment to os.environ (for
        # subprocesses): left there, the next run in this process would log
        # into this run's output_dir instead of its own.
        if not self.env_before["MLFLOW_TRACKING_URI"]:  # the store was this run's own
            self.mlflow.set_tracking_uri(None)
        for key, value in self.env_before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class TrackioTracker:
    """``report_to = ["trackio"]``: trackio's local store (its own default
    directory, or ``TRACKIO_DIR``); project ``TRACKIO_PROJECT`` (default
    ``grpo``). A table is logged per step with every row so far."""

    grpo_validate_config = _needs("trackio", "trackio", "trackio")

    def __init__(self, context: RunContext) -> None:
        self.trackio = _require("trackio", "trackio", "trackio")
        self.run = self.trackio.init(
            project=os.environ.get("TRACKIO_PROJECT", "grpo"),
            name=_run_name(context),
            config=context.config.model_dump(mode="json"),
        )
        self.tables: dict[str, list[dict[str, Any]]] = {}

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.trackio.log(metrics, step=step)

    def log_table(self, name: str, rows: list[dict[str, Any]], step: int) -> None:
        kept = self.tables.setdefault(name, [])
        kept.extend(rows)
        columns = list(dict.fromkeys(c for r in kept for c in r))
        table = self.trackio.Table(columns=columns, data=[[r.get(c) for c in columns] for r in kept])
        self.trackio.log({name: table}, step=step)

    def close(self) -> None:
        self.trackio.finish()
