"""Experiment trackers (``report_to``) and the completion log.

``output_dir/metrics.jsonl`` is always written (by
:class:`grpo_core.observability.logging.MetricsLogger`); every other tracker is a
plugin in the ``grpo.tracker`` entry point group, built as
``factory(context)`` into an object satisfying
:class:`grpo_core.contract.types.Tracker`. ``report_to`` picks them by name (the HF
convention: a list, ``"none"``, or ``"all"`` for every installed one);
``use_wandb = true`` adds ``wandb``.

Trackers are built before the model loads, so a missing library costs
seconds: the factory raises :class:`MissingTrackerLibrary`, one line naming
the pip package.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo_core.contract.errors import ConfigError, PluginError, StorageError
from grpo_core.host.plugin_host import own_checks

if TYPE_CHECKING:
    from grpo_core.config.schema import GRPOConfig
    from grpo_core.contract.context import RunContext
    from grpo_core.contract.types import ScoredGroup, Tracker
    from grpo_core.host.plugin_host import PluginHost

TRACKER_GROUP = "grpo.tracker"
ALWAYS = "jsonl"  # metrics.jsonl: always written, accepted in report_to for clarity


class MissingTrackerLibrary(ConfigError):
    """A tracker named in ``report_to`` needs a package that is not installed."""

    def __init__(self, tracker: str, package: str) -> None:
        super().__init__(f"report_to = '{tracker}' needs the '{package}' package: pip install {package}")


def requested_trackers(cfg: GRPOConfig, available: list[str]) -> list[str]:
    """The tracker names a config asks for, in order, without duplicates."""
    names = list(cfg.report_to or [])
    if cfg.use_wandb and "wandb" not in names:
        names.append("wandb")
    if "all" in names:
        names = [n for n in names if n != "all"] + sorted(available)
    out: list[str] = []
    for name in names:
        if name != ALWAYS and name not in out:
            out.append(name)
    return out


def _tracker_problem(cfg: GRPOConfig, host: PluginHost, name: str) -> str | None:
    """Why tracker ``name`` could not start: not published, not allowed,
    ambiguous, or its own check (the library it needs is not installed)."""
    try:
        _info, factory = host.import_entry_point(TRACKER_GROUP, name, key="report_to")
        own_checks(factory, cfg)
    except (PluginError, ConfigError) as exc:
        return str(exc)
    return None


def installed_trackers(cfg: GRPOConfig, host: PluginHost) -> list[str]:
    """What ``report_to = "all"`` means: every published tracker that can start here."""
    return [name for name in host.published(TRACKER_GROUP) if _tracker_problem(cfg, host, name) is None]


def check_report_to(cfg: GRPOConfig, host: PluginHost) -> list[str]:
    """Config-check errors: every tracker ``report_to`` names is published,
    allowed, unambiguous, and passes its own check (its library installed:
    found, not imported)."""
    errors = []
    for name in requested_trackers(cfg, []):
        problem = _tracker_problem(cfg, host, name)
        if problem is not None:
            errors.append(
                f"{problem.rstrip('.')}. '{ALWAYS}' (metrics.jsonl) is always written; 'none' turns the others off."
            )
    return errors


def _finite(metrics: dict[str, Any]) -> dict[str, float]:
    out = {}
    for key, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if math.isfinite(float(value)):
            out[key] = float(value)
    return out


class TrackerSet:
    """Every tracker of a run; one failing tracker warns once and is dropped,
    never stopping training (metrics.jsonl still has every number)."""

    def __init__(self, trackers: dict[str, Tracker]) -> None:
        self.trackers = dict(trackers)

    @classmethod
    def build(cls, cfg: GRPOConfig, host: PluginHost, context: RunContext) -> TrackerSet:
        names = requested_trackers(cfg, installed_trackers(cfg, host) if "all" in (cfg.report_to or []) else [])
        built: dict[str, Tracker] = {}
        try:
            for name in names:
                _info, factory = host.import_entry_point(TRACKER_GROUP, name, key="report_to")
                try:
                    built[name] = factory(context)
                except (ConfigError, PluginError):
                    raise
                except Exception as exc:
                    raise PluginError(f"tracker '{name}' failed to start: {type(exc).__name__}: {exc}") from exc
        except BaseException:
            cls(built).close()
            raise
        return cls(built)

    def _each(self, action: str, call: Any) -> None:
        for name, tracker in list(self.trackers.items()):
            try:
                call(tracker)
            except Exception as exc:
                print(
                    f"warning: tracker '{name}' failed to {action} ({type(exc).__name__}: {exc}); "
                    "it is switched off for the rest of the run (metrics.jsonl has every number).",
                    file=sys.stderr,
                )
                self.trackers.pop(name, None)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        clean = _finite(metrics)
        self._each("log metrics", lambda t: t.log(clean, step))

    def log_table(self, name: str, rows: list[dict[str, Any]], step: int) -> None:
        if rows:
            self._each("log a table", lambda t: t.log_table(name, rows, step))

    def close(self) -> None:
        for name, tracker in list(self.trackers.items()):
            try:
                tracker.close()
            except Exception as exc:
                print(f"warning: tracker '{name}' failed to close: {type(exc).__name__}: {exc}", file=sys.stderr)
        self.trackers.clear()


def completion_rows(groups: list[ScoredGroup], reward_names: list[str], step: int) -> list[dict[str, Any]]:
    """One flat row per completion: step, prompt, its dataset index
    (``prompt_index``: which prompts a step trained, e.g. across a resume),
    completion, each reward, advantage."""
    rows = []
    for scored in groups:
        prompt = scored.group.prompt.prompt
        prompt_text = prompt[-1]["content"] if isinstance(prompt, list) and prompt else str(prompt)
        for completion, rewards, advantage in zip(scored.group.completions, scored.rewards, scored.advantages):
            row: dict[str, Any] = {
                "step": step,
                "prompt": prompt_text,
                "prompt_index": scored.group.prompt.index,
                "completion": completion.text,
            }
            for name, value in zip(reward_names, rewards):
                row[f"reward/{name}"] = None if value is None or not math.isfinite(value) else float(value)
            row["advantage"] = float(advantage)
            row["policy_version"] = scored.group.policy_version
            rows.append(row)
    return rows


class CompletionLog:
    """``trl.log_completions``: ``output_dir/completions.jsonl``, appended at
    every logged step, never rewritten."""

    def __init__(self, output_dir: Path) -> None:
        self.path = Path(output_dir) / "completions.jsonl"

    def append(self, rows: list[dict[str, Any]]) -> None:
        try:
            with open(self.path, "a", encoding="utf-8") as handle:
                for row in rows:
                    handle.write(json.dumps(row, ensure_ascii=False) + "\n")
        except OSError as exc:
            raise StorageError(f"could not append completions to {self.path}: {exc}. Make room in output_dir.") from exc
