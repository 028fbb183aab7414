"""``grpo report OUTPUT_DIR``: plots and a one-screen summary of a run,
from what it wrote (``metrics.jsonl``, ``alerts.jsonl``), so it works on a
finished run, a running one or one that died. It reads the run's one
history: one row per step (in a log from before grpo set a killed run's
rows aside, the resumed run's row of a step logged twice), and lists what
was set aside under ``abandoned/``.

Plots (PNG, matplotlib's Agg backend, in ``OUTPUT_DIR/report/``): one per
panel of :data:`PANELS` that has data. The summary gives the first, last
and best value of the key metrics and every alert that fired.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from grpo_core.contract.errors import ConfigError, DataError
from grpo_core.observability.history import abandoned_summary, surviving_rows

# panel file name -> (title, which metric keys it draws)
PANELS: dict[str, tuple[str, Callable[[str], bool]]] = {
    "reward": (
        "reward (total and per function)",
        lambda k: k == "reward" or (k.startswith("rewards/") and k.endswith("/mean")),
    ),
    "reward_std": ("reward_std and groups without signal", lambda k: k in ("reward_std", "frac_reward_zero_std")),
    "entropy": ("entropy", lambda k: k == "entropy"),
    "kl": ("KL to the reference", lambda k: k == "kl"),
    "grad_norm": ("grad norm", lambda k: k == "grad_norm"),
    "completion_length": (
        "completion length (tokens)",
        lambda k: k in ("completions/mean_length", "completions/max_length"),
    ),
    "staleness": ("staleness (policy versions)", lambda k: k == "staleness"),
    "is_ratio": ("sampler vs trainer (importance sampling)", lambda k: k.startswith("is/")),
    "eval": ("evaluation", lambda k: k.startswith("eval/") and k not in ("eval/num_samples", "eval/policy_version")),
}
# summary rows: key, whether higher is better (None: no "best")
SUMMARY_KEYS: tuple[tuple[str, bool | None], ...] = (
    ("reward", True),
    ("reward_std", None),
    ("eval/reward", True),
    ("entropy", None),
    ("kl", None),
    ("grad_norm", None),
    ("completions/mean_length", None),
    ("loss", None),
    ("step_time", False),
)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by a crash mid-write
    return out


def series(records: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    return [
        (int(r["step"]), float(r[key]))
        for r in records
        if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool) and math.isfinite(r[key])
    ]


def plot(records: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """One PNG per panel with data; returns the files written."""
    try:
        # matplotlib is optional: imported only where used, so grpo runs without it
        import matplotlib
    except ImportError:
        raise ConfigError("grpo report draws its plots with matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg", force=True)
    # matplotlib is optional: imported only where used, so grpo runs without it
    import matplotlib.pyplot as plt

    keys = sorted({k for r in records for k in r if k != "step"})
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, (title, wanted) in PANELS.items():
        lines = {k: series(records, k) for k in keys if wanted(k)}
        lines = {k: v for k, v in lines.items() if v}
        if not lines:
            continue
        fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
        for key, points in lines.items():
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o" if len(points) < 30 else None, label=key)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written


def _fmt(value: float) -> str:
    return f"{value:.4g}"


def summary(records: list[dict[str, Any]], alerts: list[dict[str, Any]], output_dir: Path) -> str:
    """The one-screen text summary."""
    last = records[-1]["step"] if records else 0
    lines = [f"run {output_dir}: {len(records)} logged steps, last step {last}"]
    lines.append(f"{'metric':<26}{'first':>10}{'last':>10}{'best':>18}")
    for key, higher in SUMMARY_KEYS:
        points = series(records, key)
        if not points:
            continue
        best = ""
        if higher is not None:
            step, value = (max if higher else min)(points, key=lambda p: p[1])
            best = f"{_fmt(value)} @ {step}"
        lines.append(f"{key:<26}{_fmt(points[0][1]):>10}{_fmt(points[-1][1]):>10}{best:>18}")
    rewards = sorted({k for r in records for k in r if k.startswith("rewards/") and k.endswith("/mean")})
    for key in rewards:
        points = series(records, key)
        if points:
            lines.append(f"{key:<26}{_fmt(points[0][1]):>10}{_fmt(points[-1][1]):>10}")
    if alerts:
        lines.append(f"alerts fired ({len(alerts)}):")
        lines += [f"  step {a.get('step')}: [{a.get('name')}] {a.get('message')}" for a in alerts]
    else:
        lines.append("alerts fired: none")
    return "\n".join(lines)


def history_notes(output_dir: Path, dropped: int) -> list[str]:
    """What the report leaves out: rows an interrupted run wrote after the
    checkpoint a later run resumed from (:mod:`grpo_core.observability.history`)."""
    lines = []
    if dropped:
        lines.append(
            f"left out: {dropped} metrics row(s) superseded by a resumed run (a step logged again: the later row is "
            "the surviving run's)"
        )
    abandoned = abandoned_summary(output_dir)
    if abandoned:
        lines.append("abandoned by resumed runs (not plotted):")
        lines += abandoned
    return lines


def build_report(output_dir: Path, out_dir: Path | None = None) -> tuple[str, list[Path]]:
    """Write the plots of the run's one history; return ``(summary text, PNG paths)``."""
    output_dir = Path(output_dir)
    records, dropped = surviving_rows(read_jsonl(output_dir / "metrics.jsonl"))
    if not records:
        raise DataError(f"{output_dir / 'metrics.jsonl'} is missing or empty: point grpo report at a run's output_dir.")
    alerts = read_jsonl(output_dir / "alerts.jsonl")
    pngs = plot(records, out_dir or output_dir / "report")
    text = "\n".join([summary(records, alerts, output_dir), *history_notes(output_dir, dropped)])
    (pngs[0].parent if pngs else output_dir).joinpath("summary.txt").write_text(text + "\n", encoding="utf-8")
    return text, pngs
