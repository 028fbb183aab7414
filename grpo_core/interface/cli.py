"""The ``grpo`` command line.

Commands: ``run`` (train), ``plugins`` (what is installed), ``config check |
schema | convert``. Always-on plugins may add commands through
:func:`~grpo_core.contract.hookspecs.grpo_register_commands` (the vLLM plugin adds
``vllm-serve``); a plugin that fails to load or to add its commands is
reported on stderr and skipped, never fatal to the other commands.

Every :class:`~grpo_core.contract.errors.GrpoError` ends the program with its message
on stderr and its ``exit_code``, without a traceback; Ctrl-C exits with 130.
Anything else (a bug) ends the same way: one line naming the command and the
exception, its traceback written to a file whose path is printed, an exit code
per class of failure (:data:`~grpo_core.contract.errors.EXIT_CODES`,
:mod:`grpo_core.runtime.failure`).
"""

from __future__ import annotations

import inspect
import json
import os
import sys
import threading
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

import grpo_core
from grpo_core import __version__
from grpo_core.contract.errors import ConfigError, GrpoError
from grpo_core.interface.cli_common import (
    config_argument,
    host_for,
    import_from_cwd,
    load_always_on,
    load_and_check,
    set_option,
    stderr,
    warn,
)
from grpo_core.interface.cli_tools import register_tools

if TYPE_CHECKING:
    from grpo_core.config.schema import GRPOConfig
    from grpo_core.host.plugin_host import PluginHost

HELP = """GRPO training for language models, with a plugin for every step.

A run is described by one config file (TOML, or the reference guide's YAML
layout): `grpo config check CONFIG` validates it, `grpo run CONFIG` trains.
"""

_CORE_DIR = Path(grpo_core.__file__).resolve().parent  # the package, wherever this module sits in it
_library_formatwarning = warnings.formatwarning  # Python's, as imported


def _format_warning(
    message: Warning | str, category: type[Warning], filename: str, lineno: int, line: str | None = None
) -> str:
    """grpo's own run-time warnings (a dropped prompt, a reward scored None)
    read like its start-up ones: ``warning: ...``, without a file name and a
    source line the user did not write. Other libraries' keep their format."""
    try:
        ours = Path(filename).resolve().is_relative_to(_CORE_DIR)
    except (OSError, ValueError):
        ours = False
    if ours:
        return f"warning: {message}\n"
    return _library_formatwarning(message, category, filename, lineno, line)


# ---------------------------------------------------------------------- app


def build_app(host: PluginHost | None = None) -> typer.Typer:
    """The Typer app with the core commands and every plugin's commands.

    ``host`` holds the always-on plugins whose commands are added; it is
    built with the allowlist of the config named on the command line, so a
    distribution outside that list is never imported."""
    app = typer.Typer(
        name="grpo",
        help=HELP,
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
        context_settings={"help_option_names": ["-h", "--help"]},
    )
    config_app = typer.Typer(
        help="Validate a config, print its JSON schema, or convert a YAML config (the reference's, Axolotl's or "
        "TRL's CLI file) to TOML.",
        no_args_is_help=True,
    )
    app.add_typer(config_app, name="config")
    _add_root_options(app)
    _add_run_command(app)
    _add_plugins_command(app)
    _add_config_commands(config_app)
    register_tools(app)  # report, rewards test, eval, merge
    _add_plugin_commands(app, host)
    _plain_help(app)
    return app


def _plain_help(app: typer.Typer) -> None:
    """Help texts are plain text: typer renders them as rich markup, which
    would swallow ``[trl]``, ``[[datasets]]`` and ``[vllm]`` as style tags.
    Every command's docstring and every option's help is escaped once, the
    plugins' commands included."""
    # rich comes with typer; imported when the app is built, so `import grpo_core` stays light
    from rich.markup import escape

    def plain(text: Any) -> Any:
        return escape(inspect.cleandoc(text)) if isinstance(text, str) else text

    for command in app.registered_commands:
        command.help = plain(command.help if isinstance(command.help, str) else inspect.getdoc(command.callback))
        for parameter in inspect.signature(command.callback).parameters.values() if command.callback else []:
            info = parameter.default
            if isinstance(getattr(info, "help", None), str):
                info.help = plain(info.help)
    for group in app.registered_groups:
        if group.typer_instance is not None:
            info = group.typer_instance.info
            if isinstance(info.help, str):
                info.help = plain(info.help)
            if isinstance(group.help, str):
                group.help = plain(group.help)
            _plain_help(group.typer_instance)


def _add_root_options(app: typer.Typer) -> None:
    def _print_version(value: bool) -> None:
        if value:
            typer.echo(f"grpo {__version__}")
            raise typer.Exit(0)

    @app.callback()
    def _root(
        version: bool = typer.Option(
            False, "--version", help="Print grpo's version and exit.", is_eager=True, callback=_print_version
        ),
    ) -> None:
        """GRPO training for language models."""


def _add_run_command(app: typer.Typer) -> None:
    @app.command("run")
    def run_cmd(
        config: Path = config_argument(),
        set_: list[str] | None = set_option(),
        num_processes: int = typer.Option(
            1,
            "--num-processes",
            min=1,
            help="Training processes (one per GPU; on CPU they share the cores), started "
            "with accelerate's launcher. Several machines: see docs/multi-gpu.md.",
        ),
        resume: str | None = typer.Option(
            None,
            "--resume",
            metavar="[PATH]",
            help="Resume: alone, from the newest checkpoint in output_dir; with PATH, from that checkpoint "
            '(resume_from_checkpoint = "latest" or PATH, for this launch).',
            show_default=False,
        ),
        start_over: bool = typer.Option(
            False,
            "--start-over",
            help="Start from step 0 in an output_dir that holds checkpoints: they and the logs move to "
            "output_dir/abandoned/ first, nothing is deleted (start_over = true, for this launch).",
        ),
    ) -> None:
        """Train: load and check CONFIG, then run GRPO for max_steps optimizer steps.

        Checkpoints go to output_dir (every save_steps, at the end, and when
        interrupted: Ctrl-C saves and exits with code 130). An output_dir
        belongs to one live run; a start from step 0 over its checkpoints is
        refused unless --start-over (or --resume to continue them).
        """
        set_ = [*(set_ or []), *launch_overrides(resume, start_over)]
        # imported when the command runs, so `grpo --help` stays fast
        from grpo_core.config.loader import load_config
        from grpo_core.interface.launch import CHECKED_ENV
        from grpo_core.runtime.processes import launched_by_launcher

        if num_processes > 1:
            # imported when the command runs, so `grpo --help` stays fast
            from grpo_core.interface.launch import launch

            if not launched_by_launcher():  # check once, here, before any process starts
                for note in load_and_check(config, set_, num_processes)[2]:
                    warn(note)
            code = launch(num_processes, ["run", str(config), *[a for o in set_ or [] for a in ("--set", o)]])
            if code >= 0:  # the launched processes trained; else this is one of them
                raise typer.Exit(code)
        note = warn if os.environ.get(CHECKED_ENV) != "1" else (lambda _note: None)  # the parent printed them
        import_from_cwd()
        cfg = load_config(config, set_ or [])
        host = host_for(cfg)
        for message in load_always_on(host):
            note(message)
        from grpo_core.runtime.distributed import process_group_left_on_exit
        from grpo_core.training.run import run_training  # heavy: torch, transformers

        with process_group_left_on_exit():  # this process ends with the run
            run_training(cfg, host, warn=note, config_path=str(config.resolve()))  # the checks of `grpo config check`


RESUME_LATEST = "latest"


def launch_overrides(resume: str | None, start_over: bool) -> list[str]:
    """``--resume [PATH]`` and ``--start-over`` as the config overrides they
    stand for (so launched processes get them through ``--set``)."""
    out = []
    if resume is not None:
        out.append(f"resume_from_checkpoint={json.dumps(resume)}")
    if start_over:
        out.append("start_over=true")
    return out


def bare_resume_as_latest(argv: list[str]) -> list[str]:
    """``grpo run CONFIG --resume`` (no value) means the newest checkpoint:
    a ``--resume`` followed by nothing, by another option, or by a config
    file (.toml/.yaml/.yml) gets the value ``latest``. Only for ``run``."""
    if "run" not in argv[:1]:
        return argv
    out: list[str] = []
    for i, arg in enumerate(argv):
        out.append(arg)
        if arg == "--resume":
            following = argv[i + 1] if i + 1 < len(argv) else None
            if following is None or following.startswith("-") or Path(following).suffix in {".toml", ".yaml", ".yml"}:
                out.append(RESUME_LATEST)
    return out


def _add_plugins_command(app: typer.Typer) -> None:
    @app.command("plugins")
    def plugins_cmd(
        as_json: bool = typer.Option(False, "--json", help="Print machine-readable JSON instead of a table."),
    ) -> None:
        """List every installed implementation of every extension point.

        Shows each implementation's name, the distribution that publishes it,
        its entry point target and, below, what it does (the first sentence
        of its docstring); one that cannot load, breaks the hook
        contract, is ambiguous (published by two distributions) or is not in
        the allowlist (GRPO_PLUGINS_ALLOW) is listed with the reason instead
        of failing the command.
        """
        # imported when the command runs, so `grpo --help` stays fast
        from grpo_core.host.plugin_host import AMBIGUOUS

        listing = list_plugins()
        if as_json:
            typer.echo(json.dumps(listing, indent=2))
            return
        for point, entry in listing.items():
            typer.echo(f"{point} ({entry['group']})")
            if not entry["implementations"]:
                typer.echo("  (none installed)")
            for impl in entry["implementations"]:
                detail = str(impl["error"] or "").removeprefix(AMBIGUOUS).strip()
                status = f"  {impl['status']}: {detail}" if impl["error"] else ""
                typer.echo(f"  {impl['name']:<24} {impl['distribution']:<24} {impl['target']}{status}")
                if impl["summary"]:
                    typer.echo(f"      {impl['summary']}")


def _add_config_commands(config_app: typer.Typer) -> None:
    @config_app.command("check")
    def check_cmd(
        config: Path = config_argument(),
        set_: list[str] | None = set_option(),
        full: bool = typer.Option(
            False, "--full", help="Print the whole effective config (TOML) instead of a summary."
        ),
        num_processes: int | None = typer.Option(
            None,
            "--num-processes",
            min=1,
            help="Check for this many training processes (default: the launcher's, else 1).",
        ),
        gpus: int | None = typer.Option(
            None,
            "--gpus",
            min=1,
            help="Check for a machine with this many GPUs per node (another machine than this one; default: the GPUs "
            "this machine shows).",
        ),
        import_code: bool = typer.Option(
            False,
            "--import",
            help="Also import every module the config names and look its function up (this runs their top-level "
            "code: only for a config you trust).",
        ),
    ) -> None:
        """Validate CONFIG and print the effective settings and any warnings.

        Checked without running any of your code: every key and value; the
        combinations a run refuses; each chosen implementation, imported and
        checked against the plugin contract, its settings table and the other
        choices; the paths (a local base_model, datasets, resume_from_checkpoint,
        the DeepSpeed JSON) exist; each module the config names by import path
        (reward functions, tools, rollout_func, environment_factory, dataset
        transforms) is found and its source defines the name (read, not run;
        listed with its file, so you can read it before `grpo run` runs it);
        the trackers in report_to are installed; [vllm] GPU placement fits
        --num-processes training processes and the GPUs this machine shows, or
        --gpus N for another machine (without GPUs: a warning that the indices
        were not checked), and so do the training processes, one per GPU;
        datasets' data_files match files; a hub dataset not in the local cache
        is a warning (it is fetched when the run starts), or an error with
        HF_HUB_OFFLINE=1; what output_dir already holds (a run in progress,
        checkpoints a fresh start would overwrite). Not checked: whether a hub
        id exists on the hub, what your code does when it runs (--import runs
        its imports), and whether the model fits in memory.

        The last line is `OK`, `OK with N warnings` (exit code 0: the run can
        start), or the errors, each naming the key and the fix (exit code 2).
        """
        # imported when the command runs, so `grpo --help` stays fast
        from grpo_core.runtime.gpus import assume_gpus

        with assume_gpus(gpus):
            cfg, host, notes = load_and_check(config, set_, num_processes)
        # imported when the command runs, so `grpo --help` stays fast
        from grpo_core.contract.extension_points import REWARD_GROUP
        from grpo_core.host.user_code import user_code, user_code_text

        code = user_code(cfg, host.published(REWARD_GROUP))
        if import_code:
            # imported when the command runs, so `grpo --help` stays fast
            from grpo_core.validation.references import import_problems

            problems = import_problems(code)
            if problems:
                raise ConfigError(
                    problems[0]
                    if len(problems) == 1
                    else f"{len(problems)} problems importing the config's code:\n"
                    + "\n".join(f"  - {p}" for p in problems)
                )
        if full:
            # imported when the command runs, so `grpo --help` stays fast
            from grpo_core.config.convert import to_toml_text

            typer.echo(to_toml_text(cfg.model_dump(mode="json")), nl=False)
        else:
            typer.echo(summary(cfg, num_processes, host))
            imported = " (each imported: --import)" if import_code and code else ""
            typer.echo(user_code_text(code) + imported)
        for note in notes:
            warn(note)
        count = len(notes)
        typer.echo(f"{config}: OK" + (f" with {count} warning{'s' if count > 1 else ''}" if count else ""))

    @config_app.command("schema")
    def schema_cmd() -> None:
        """Print the JSON schema of the config (every key, type and default)."""
        # imported when the command runs, so `grpo --help` stays fast
        from grpo_core.config.schema import config_model

        typer.echo(json.dumps(config_model().model_json_schema(), indent=2))  # with the plugins' tables ([vllm])

    @config_app.command("convert")
    def convert_cmd(
        config: Path = typer.Argument(
            ..., help="A YAML config: the reference's layout, Axolotl's, or TRL's CLI file.", show_default=False
        ),
        output: Path | None = typer.Option(None, "--output", "-o", help="Write the TOML here instead of printing it."),
    ) -> None:
        """Convert a YAML config to grpo's TOML.

        The reference's (and Axolotl's) layout maps one to one: `trl:` becomes
        [trl], `vllm:` [vllm], the `datasets:` list [[datasets]]. null values are
        left out (TOML has no null; they mean the default) and listed in a
        comment. Keys of Axolotl's layout get a comment saying what grpo does
        with them; refused ones are written commented out, with the reason.

        A `trl grpo --config` file (flat: model_name_or_path, dataset_name,
        per_device_train_batch_size, ...) is recognised by model_name_or_path
        or dataset_name without base_model: each key becomes its grpo name
        (GRPOConfig's own fields under [trl]), what grpo does not have is
        written commented out with the reason, and TRL's defaults that grpo
        sets otherwise are written out so the run trains as TRL's would.
        The TOML is validated: what still stops it is printed as a warning.
        """
        # imported when the command runs, so `grpo --help` stays fast
        from grpo_core.config.convert import to_toml_text
        from grpo_core.config.loader import read_raw, validate
        from grpo_core.config.trl_cli import from_trl_cli, looks_like_trl_cli

        if config.suffix not in {".yaml", ".yml"}:
            raise ConfigError(f"{config}: expected a .yaml or .yml file to convert (grpo configs are TOML already).")
        data = read_raw(config)
        if looks_like_trl_cli(data):
            converted = from_trl_cli(data)
            data = converted.data
            text = to_toml_text(data, trl=converted)
        else:
            text = to_toml_text(data, explain=True)
        try:
            validate(json.loads(json.dumps(data, default=str)), str(config))
        except ConfigError as exc:
            warn(f"converted, but the config does not validate yet:\n{exc}")
        if output is None:
            typer.echo(text, nl=False)
        else:
            output.write_text(text, encoding="utf-8")
            stderr(f"wrote {output}")


def _add_plugin_commands(app: typer.Typer, host: PluginHost | None) -> None:
    """Let always-on plugins add commands; any failure only warns."""
    # imported when the command runs, so `grpo --help` stays fast
    from grpo_core.host.plugin_host import PluginHost

    try:
        host = host or PluginHost()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            host.load_always_on(strict=False)
    except GrpoError as exc:  # e.g. a malformed allowlist: commands still work
        warn(f"plugins not loaded: {exc}")
        return
    for w in caught:
        warn(str(w.message))
    for impl in host.pm.hook.grpo_register_commands.get_hookimpls():
        try:
            impl.function(*[{"app": app}[name] for name in impl.argnames])
        except Exception as exc:  # a plugin bug must not break `grpo --help`
            warn(f"plugin '{impl.plugin_name}' could not add its commands: {type(exc).__name__}: {exc}")


def allowlist_of_command_line(argv: list[str]) -> set[str] | None:
    """``plugins.allow`` of the config file a command names, read before any
    plugin loads (so the allowlist also covers the plugins' commands).
    ``--set plugins.allow=[...]`` wins over the file."""
    # imported when the command runs, so `grpo --help` stays fast
    from grpo_core.config.loader import parse_override, read_raw

    allow: Any = None
    for i, arg in enumerate(argv):
        if arg in ("--set", "-s") and i + 1 < len(argv):
            keys, value = parse_override(argv[i + 1])
            if keys == ["plugins", "allow"]:
                return set(value) if isinstance(value, list) else None
        elif allow is None and Path(arg).suffix in {".toml", ".yaml", ".yml"} and Path(arg).is_file():
            try:
                plugins = read_raw(arg).get("plugins")
            except GrpoError:
                continue
            if isinstance(plugins, dict) and isinstance(plugins.get("allow"), list):
                allow = set(plugins["allow"])
    return allow


# ---------------------------------------------------------------------- views


def list_plugins() -> dict[str, dict[str, Any]]:
    """Extension point (and the reward and always-on groups) -> its entry
    point group and implementations."""
    # imported when the command runs, so `grpo --help` stays fast
    from grpo_core.contract.extension_points import (
        ALWAYS_ON_GROUP,
        EXTENSION_POINTS,
        REWARD_GROUP,
    )
    from grpo_core.host.plugin_host import PluginHost

    host = PluginHost()
    # imported when the command runs, so `grpo --help` stays fast
    from grpo_core.config.plugin_tables import TABLE_GROUP
    from grpo_core.observability.tracking import TRACKER_GROUP

    groups = {point.name: point.group for point in EXTENSION_POINTS} | {
        "reward": REWARD_GROUP,
        "plugins": ALWAYS_ON_GROUP,
        "tracker": TRACKER_GROUP,
        "settings": TABLE_GROUP,  # the top-level config tables plugins own ([vllm])
    }
    out: dict[str, dict[str, Any]] = {}
    for point, group in groups.items():
        impls = [
            {
                "name": i.name,
                "target": i.target,
                "distribution": i.distribution,
                "summary": i.summary,
                "error": i.error,
                "status": i.status,
            }
            for i in host.list_group(group)
        ]
        out[point] = {"group": group, "implementations": impls}
    return out


def summary(cfg: GRPOConfig, num_processes: int | None = None, host: Any = None) -> str:
    """The settings that decide what a run does, after defaults (with the
    checked config's plugin ``host``, also where generation runs)."""
    # imported when the command runs, so `grpo --help` stays fast
    from grpo_core.runtime.processes import world_size

    world = num_processes or world_size()
    # imported when the command runs, so `grpo --help` stays fast
    from grpo_core.modeling.precision import resolve_precision
    from grpo_core.validation.checks import implementation_names
    from grpo_core.validation.output_dir import start_line

    trl = cfg.trl
    # imported when the command runs, so `grpo --help` stays fast
    from grpo_core.config.batch_shape import generation_batch_size, steps_per_generation
    from grpo_core.config.trl_names import default_differences

    batch = generation_batch_size(cfg, world)
    per_generation = steps_per_generation(cfg, world)
    funcs = trl.reward_funcs or []
    weights = trl.reward_weights or [1.0] * len(funcs)
    lines = [
        f"model:        {cfg.base_model}"
        + (f" + LoRA r={cfg.lora_r} alpha={cfg.lora_alpha}" if cfg.adapter else " (full fine-tune)"),
        "datasets:     " + (", ".join(f"{d.path}[{d.split}]" for d in cfg.datasets) or "none"),
        (
            "steps:        "
            + (
                f"num_epochs {cfg.num_epochs:g} (max_steps counted from the dataset at start)"
                if cfg.num_epochs is not None and "max_steps" not in cfg.model_fields_set
                else str(cfg.max_steps)
            )
        )
        + f" x {batch} completions "
        f"({batch // max(1, int(trl.num_generations or 1))} prompts x {trl.num_generations} generations), "
        f"micro_batch_size {cfg.micro_batch_size}, gradient_accumulation_steps {cfg.gradient_accumulation_steps}"
        + (f", {per_generation} optimizer steps per generation" if per_generation > 1 else ""),
        _processes_line(cfg, world, batch),
        *([_generation_line(cfg, host, world)] if host is not None and world > 1 else []),
        f"optimizer:    {cfg.optimizer}, lr {cfg.learning_rate:g}, {cfg.lr_scheduler}, warmup {cfg.warmup_steps}",
        f"generation:   max_completion_length {trl.max_completion_length}, max_prompt_length {trl.max_prompt_length}, "
        f"temperature {trl.temperature}, top_p {trl.top_p}",
        f"loss:         {cfg.rl}: {trl.loss_type}, beta {trl.beta}, epsilon {trl.epsilon}/{trl.epsilon_high}, "
        f"num_iterations {trl.num_iterations}, scale_rewards {trl.scale_rewards}",
        "rewards:      " + (", ".join(f"{f} x{w:g}" for f, w in zip(funcs, weights)) or "none"),
        f"async:        async_prefetch {trl.async_prefetch}, sync every {trl.vllm_sync_interval} step(s)",
        f"precision:    {resolve_precision(cfg).reason}",
        "plugins:      " + ", ".join(f"{p}={n}" for p, n in implementation_names(cfg).items()),
        f"output_dir:   {cfg.output_dir}; "
        + (
            f"a checkpoint every {cfg.save_steps} steps (save_steps)"
            + (f", the newest {cfg.save_total_limit} kept" if cfg.save_total_limit else ", all kept")
            if cfg.save_steps
            else "checkpoints only at the end and on interruption (save_steps = 0)"
        ),
        start_line(cfg),
        _observe_summary(cfg),
    ]
    differences = default_differences(cfg)
    if differences:
        lines.append("vs TRL:       " + "; ".join(differences) + " (defaults left unset here; docs/from-trl.md)")
    if cfg.trust_remote_code:
        lines.append(
            "trust:        trust_remote_code = true: Python code shipped with the model, tokenizer and reward "
            "models runs"
        )
    return "\n".join(lines)


def _processes_line(cfg: GRPOConfig, world: int, batch: int) -> str:
    """Per-process and global batch shapes (TRL's definitions: micro_batch_size is per process)."""
    # imported when the command runs, so `grpo --help` stays fast
    from grpo_core.config.batch_shape import global_step_batch
    from grpo_core.parallel import backend_for

    n = max(1, int(cfg.trl.num_generations or 1))
    per_step = cfg.micro_batch_size * cfg.gradient_accumulation_steps
    return (
        f"processes:    {world} ({backend_for(cfg, world).describe(cfg, world)}); per process: {cfg.micro_batch_size} "
        f"x {cfg.gradient_accumulation_steps} = {per_step} completions per optimizer step, {batch // world} "
        f"({batch // world // n} groups) per generation; global: {global_step_batch(cfg, world)} per optimizer step, "
        f"{batch} ({batch // n} prompts) per generation"
    )


def _generation_line(cfg: GRPOConfig, host: Any, world: int) -> str:
    """Which processes generate (several processes only)."""
    # imported when the command runs, so `grpo --help` stays fast
    from grpo_core.parallel.generation_placement import where_generation_runs

    return f"generates on: {where_generation_runs(cfg, host, world)}"


def _observe_summary(cfg: GRPOConfig) -> str:
    # imported when the command runs, so `grpo --help` stays fast
    from grpo_core.config.eval_schedule import eval_every
    from grpo_core.observability.tracking import requested_trackers

    trackers = ", ".join(["metrics.jsonl", *requested_trackers(cfg, ["all installed"])])
    data = (
        "test_datasets" if cfg.test_datasets else (f"val_set_size {cfg.val_set_size:g}" if cfg.val_set_size > 0 else "")
    )
    evaluation = f"every {eval_every(cfg)} step(s) on {data}" if data and cfg.eval_strategy != "no" else "off"
    alerts = "on" if cfg.alerts.enabled else "off"
    return f"reporting:    {trackers}; eval {evaluation}; alerts {alerts}" + (
        ", log_completions" if cfg.trl.log_completions else ""
    )


# ---------------------------------------------------------------------- entry


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point (``sys.exit(main())``): run the CLI and
    turn user errors into a message and an exit code."""
    # imported when the command runs, so `grpo --help` stays fast
    from grpo_core.runtime.failure import install_thread_hook

    library_format, warnings.formatwarning = warnings.formatwarning, _format_warning
    thread_hook = install_thread_hook(lambda line: stderr(f"warning: {line}"))  # a dying thread: one line too
    try:
        return _main(argv)
    finally:
        warnings.formatwarning = library_format
        threading.excepthook = thread_hook


def _main(argv: list[str] | None) -> int:
    # imported when the command runs, so `grpo --help` stays fast
    from grpo_core.host.plugin_host import PluginHost

    # imported when the command runs, so `grpo --help` stays fast
    from grpo_core.runtime import failure

    args = list(sys.argv[1:] if argv is None else argv)
    try:
        args = bare_resume_as_latest(args)
        allow = allowlist_of_command_line(args)
        command = typer.main.get_command(build_app(PluginHost(allow=allow)))
        command.main(args=args, prog_name="grpo", standalone_mode=True)
    except GrpoError as exc:
        exc = failure.annotate(exc, None, f"running `{_command_line(args)}`")
        stderr(f"error: {exc}")
        return exc.exit_code
    except KeyboardInterrupt:
        stderr("interrupted")
        return 130
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        stderr(str(exc.code))
        return 1
    except Exception as exc:  # what no rule foresaw: one line, the traceback in a file
        report = failure.unexpected(exc, None, f"running `{_command_line(args)}`")
        stderr(f"error: {report}")
        return report.exit_code
    return 0


def _command_line(args: list[str]) -> str:
    """``grpo`` and its subcommand words (not their arguments), for messages."""
    words = ["grpo"]
    for arg in args:
        if arg.startswith("-") or "/" in arg or "." in arg:
            break
        words.append(arg)
    return " ".join(words[:3])


if __name__ == "__main__":
    raise SystemExit(main())
