"""CLI commands around a run: ``report``, ``rewards test``, ``eval``, ``merge``.

Registered on the app by :func:`register_tools` (called from
:func:`grpo_core.interface.cli.build_app`; the options they share are
:mod:`grpo_core.interface.cli_common`'s); the work lives in :mod:`grpo_core.observability.report`
and :mod:`grpo_core.interface.tools`, imported inside each command so ``grpo --help``
stays fast.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from grpo_core.interface.cli_common import (
    config_argument,
    load_and_check,
    set_option,
    stderr,
    warn,
)


def register_tools(app: typer.Typer) -> None:
    rewards_app = typer.Typer(help="Check reward functions before training.", no_args_is_help=True)
    app.add_typer(rewards_app, name="rewards")

    @app.command("report")
    def report_cmd(
        output_dir: Path = typer.Argument(..., help="A run's output_dir (it holds metrics.jsonl).", show_default=False),
        out: Path | None = typer.Option(None, "--out", help="Where to write the PNGs (default OUTPUT_DIR/report)."),
    ) -> None:
        """Plot a run (reward, per-function rewards, reward_std, entropy, KL,
        grad norm, completion length, staleness, IS ratios, eval) and print a
        one-screen summary with the alerts that fired."""
        # imported when the command runs, so `grpo --help` stays fast
        from grpo_core.observability.report import build_report

        text, pngs = build_report(output_dir, out)
        typer.echo(text)
        typer.echo(f"plots: {', '.join(str(p) for p in pngs)}")

    @rewards_app.command("test")
    def rewards_test_cmd(
        config: Path = config_argument(),
        samples: int = typer.Option(8, "--samples", "-n", min=1, help="Dataset rows to score."),
        from_column: str | None = typer.Option(
            None,
            "--from-column",
            help="Score this dataset column (e.g. the reference answer) instead of generated completions.",
        ),
        generations: int = typer.Option(
            2, "--generations", min=1, help="Completions generated per row (without --from-column)."
        ),
        set_: list[str] | None = set_option(),
    ) -> None:
        """Run each reward function standalone on N dataset rows (through the
        dataset transform) and print, per function, the distribution of its
        values, any error with the sample that caused it, and the time per
        call. Do this first when rewards stay at zero."""
        # imported when the command runs, so `grpo --help` stays fast
        from grpo_core.interface.tools import rewards_test

        cfg, host, notes = load_and_check(config, set_, trains=False)
        for note in notes:
            warn(note)
        reports, groups = rewards_test(cfg, host, samples, from_column, generations)
        source = f"column '{from_column}'" if from_column else f"{generations} generated completion(s) per row"
        typer.echo(f"{len(groups)} rows, {source}")
        for group in groups[:2]:
            prompt = group.prompt.prompt
            text = prompt[-1]["content"] if isinstance(prompt, list) else str(prompt)
            typer.echo(f"  sample: {text[-80:]!r} -> {group.completions[0].text[:80]!r}")
        for report in reports:
            for line in report.describe():
                typer.echo(line)
        if any(r.error for r in reports):
            raise typer.Exit(1)

    @app.command("eval")
    def eval_cmd(
        config: Path = config_argument(),
        adapter: Path | None = typer.Option(
            None,
            "--adapter",
            help="A trained LoRA adapter (a run's output_dir or a checkpoint); omit for the base model.",
        ),
        output: Path | None = typer.Option(None, "--output", "-o", help="Also write the metrics here as JSON."),
        set_: list[str] | None = set_option(),
    ) -> None:
        """Evaluate the base model or an adapter on the config's evaluation
        data (test_datasets, or the val_set_size split), exactly as training
        does: one completion per prompt at eval_temperature, scored by the
        configured reward functions (transformers generation)."""
        # imported when the command runs, so `grpo --help` stays fast
        from grpo_core.interface.tools import run_eval

        cfg, host, notes = load_and_check(config, set_, trains=False)
        for note in notes:
            warn(note)
        metrics = run_eval(cfg, host, str(adapter) if adapter else None)
        for key in sorted(metrics):
            typer.echo(f"{key:<34} {metrics[key]:.4g}")
        if output is not None:
            output.write_text(json.dumps(metrics, indent=2) + "\n", encoding="utf-8")
            stderr(f"wrote {output}")

    @app.command("merge")
    def merge_cmd(
        output_dir: Path = typer.Argument(
            ..., help="A LoRA run's output_dir (or a checkpoint directory).", show_default=False
        ),
        output: Path | None = typer.Option(
            None, "--output", "-o", help="Where to write the merged model (default OUTPUT_DIR/merged)."
        ),
        base: str | None = typer.Option(
            None, "--base", help="The base model, when adapter_config.json does not name a reachable one."
        ),
    ) -> None:
        """Merge a LoRA adapter into its base model: a plain Hugging Face model
        directory (safetensors + tokenizer) for transformers or `vllm serve`."""
        # imported when the command runs, so `grpo --help` stays fast
        from grpo_core.interface.tools import merge_adapter

        path = merge_adapter(output_dir, output, base)
        typer.echo(f"merged model written to {path}")
        typer.echo(f"serve it: vllm serve {path}")
