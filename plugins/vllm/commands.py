"""``grpo vllm-serve CONFIG``: run the vLLM server a config describes, in the
foreground, until Ctrl-C or SIGTERM.

Registered through the ``grpo.plugins`` entry point ``vllm_commands``. This
module imports neither vLLM nor torch: the server is a subprocess, and
``grpo --help`` must stay fast where vLLM is not even installed.
"""

from pathlib import Path
from typing import Any

from grpo_core.plugin_api import hookimpl


def serve_foreground(
    config: Path, overrides: list[str], host: str | None, port: int | None, uds: Path | None = None
) -> int:
    """Start the server, say when it is ready, stop it on a signal.

    ``uds``: serve on that Unix socket only (its directory must be private);
    otherwise TCP, with ``[vllm] api_key`` / ``VLLM_API_KEY`` or a key made
    up here and printed once, required on every path but ``/health``. Over
    TCP the key is also left for a later ``grpo run`` of this user
    (:mod:`grpo_plugins.vllm.key_handoff`) until the server stops."""
    # imported when `grpo vllm-serve` runs: this always-on plugin loads with every `grpo` command
    import signal
    import threading

    import typer

    from grpo_core.plugin_api import EngineUnavailable, PluginHost, load_config
    from grpo_plugins.vllm.addresses import check_socket_path
    from grpo_plugins.vllm.command_line import engine_flags, server_spec
    from grpo_plugins.vllm.key_handoff import leave_key, withdraw_key
    from grpo_plugins.vllm.server import ManagedServer

    cfg = load_config(config, overrides)
    # LoRA layers only when the config's weight sync loads adapters (they slow CPU generation).
    needs = PluginHost(allow=set(cfg.plugins.allow) if cfg.plugins.allow else None).engine_requirements(cfg)
    flags = engine_flags(needs)
    if uds is not None:
        uds = uds.absolute()
        check_socket_path(uds)
        spec = server_spec(cfg, **flags, uds=uds)
    else:
        spec = server_spec(cfg, host=host, port=port, **flags, generate_key=True)
    for warning in spec.warnings:
        typer.echo(f"warning: {warning}", err=True)
    stop = threading.Event()
    received: list[int] = []

    def on_signal(signum: int, _frame: Any) -> None:
        received.append(signum)
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    server = ManagedServer(spec, log_path=None, log=lambda m: typer.echo(m, err=True))
    try:
        server.start()
        timeout = float(cfg.trl.vllm_server_timeout or 240)
        server.wait_ready(max(timeout, 300.0), cancel=stop)
        if not stop.is_set():
            key = " (API key required)" if spec.api_key else ""
            typer.echo(f"vLLM server ready at {spec.base_url}, model 'base'{key}. Ctrl-C to stop.", err=True)
            if spec.uds:
                typer.echo(
                    f'Point the trainer at it: trl.vllm_server_base_url = "{spec.base_url}", trl.vllm_managed = false.',
                    err=True,
                )
            left, why_not = leave_key(spec.base_url, spec.api_key) if spec.api_key and not spec.uds else (None, None)
            if why_not:
                typer.echo(f"warning: the API key is not left for `grpo run`: {why_not}", err=True)
            if spec.key_generated:
                typer.echo(
                    f"API key for this server (made up now; none was configured): {spec.api_key}\n"
                    "Give it to the trainer as VLLM_API_KEY in its environment or [vllm] api_key"
                    + (
                        "; a `grpo run` of this user on this machine needs neither: it reads the file below."
                        if left
                        else "."
                    ),
                    err=True,
                )
            if left:
                typer.echo(
                    f"API key left for `grpo run` of this user in {left} (mode 600; removed when the server stops).",
                    err=True,
                )
        while not stop.is_set() and server.alive():
            stop.wait(0.5)
        if not stop.is_set():
            raise EngineUnavailable(
                f"vLLM server at {spec.base_url} exited on its own with code "
                f"{server.process.returncode if server.process else '?'}"
            )
    finally:
        if spec.api_key and not spec.uds:
            withdraw_key(spec.base_url, spec.api_key)
        server.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    typer.echo("vLLM server stopped.", err=True)
    return 0


class VLLMCommands:
    """Adds the ``grpo vllm-serve`` command.

    ``grpo.plugins:vllm_commands``."""

    @hookimpl
    def grpo_register_commands(self, app: Any) -> None:
        # imported when `grpo vllm-serve` runs: this always-on plugin loads with every `grpo` command
        import typer

        @app.command("vllm-serve")
        def vllm_serve(
            config: Path = typer.Argument(..., help="Config file; its vllm table describes the server."),
            set_: list[str] | None = typer.Option(
                None, "--set", "-s", metavar="KEY=VALUE", help="Override a config key (repeatable)."
            ),
            host: str | None = typer.Option(None, help="Bind address (default: vllm.host in the config, 127.0.0.1)."),
            port: int | None = typer.Option(None, help="Port (default: vllm.port in the config; 0 picks a free one)."),
            uds: Path | None = typer.Option(
                None,
                "--uds",
                help="Serve on this Unix socket only, no TCP port; its directory must be yours and mode 700.",
            ),
        ) -> None:
            """Serve the config's base model with vLLM for `grpo run` (LoRA loading and weight reload enabled).

            The server loads adapters and weights from its own filesystem when
            asked to, so who can reach it matters (docs/security.md):

            --uds PATH: a Unix socket in a private directory; only you can
            connect. Point the trainer at it with
            trl.vllm_server_base_url = "unix:PATH".

            TCP (default): binds 127.0.0.1 unless the config says otherwise.
            Every request but /health needs the API key: vllm.api_key or
            VLLM_API_KEY, else one is made up and printed at start. The key is
            left, readable by you alone, for a later `grpo run CONFIG` of
            yours on this machine, which then uses this server without
            being given the key; it is removed when the server stops. A
            non-loopback host serves the dev endpoints (full-weight reload)
            only with vllm.expose_dev_endpoints = true.
            """
            serve_foreground(config, set_ or [], host, port, uds)
