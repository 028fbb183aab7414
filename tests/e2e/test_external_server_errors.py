"""A server started by hand that grpo cannot use: one line naming the fix.

The servers here are stand-ins (``http.server`` answering the routes, and
the 404 bodies, each kind of server answers), because what they imitate
cannot run on this machine or is not installed: the older TRL protocol is
what TRL 1.10 and earlier (and ``axolotl vllm-serve`` on such a TRL) serve; the others
are a stock ``vllm serve`` without dev mode and one in another
``--logprobs-mode``. A real ``trl vllm-serve`` is tested in
tests/e2e/vllm/test_trl_vllm_serve.py.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from helpers import REPO, grpo, no_traceback

from grpo_core.config.loader import validate
from grpo_core.contract.context import RunContext

ROOT = REPO
NOT_FOUND = (404, {"detail": "Not Found"})  # FastAPI's answer to an unknown route


@contextmanager
def serving(routes: dict[tuple[str, str], tuple[int, Any]]) -> Iterator[str]:
    """A server answering ``(method, path) -> (status, json)``; anything else 404s like FastAPI."""

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, method: str) -> None:
            if method == "POST":
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
            status, body = routes.get((method, self.path.split("?")[0]), NOT_FOUND)
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            self._answer("GET")

        def do_POST(self) -> None:  # noqa: N802
            self._answer("POST")

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


# TRL < 1.x's FastAPI server: routes with a trailing slash (FastAPI redirects the bare path).
OLD_TRL = {
    ("GET", "/health/"): (200, {"status": "ok"}),
    ("GET", "/health"): (307, {}),
    ("GET", "/get_world_size/"): (200, {"world_size": 1}),
    ("POST", "/generate/"): (200, {"completion_ids": []}),
}


def stock_vllm(dev_mode: bool, logprobs_mode: str = "processed_logprobs") -> dict[tuple[str, str], tuple[int, Any]]:
    """A stock ``vllm serve DIR``'s answers (the parts grpo asks for)."""
    routes: dict[tuple[str, str], tuple[int, Any]] = {
        ("GET", "/health"): (200, {}),
        ("GET", "/v1/models"): (200, {"data": [{"id": "/models/smol", "root": "/models/smol", "parent": None}]}),
    }
    if dev_mode:
        config = {
            "model_config": {"logprobs_mode": logprobs_mode, "dtype": "torch.bfloat16"},
            "lora_config": None,
            "weight_transfer_config": None,
        }
        routes.update(
            {
                ("GET", "/server_info"): (200, {"vllm_config": config}),
                ("POST", "/reset_prefix_cache"): (200, {}),
                ("GET", "/weight_info"): (200, {"weight_version": "default"}),
                ("GET", "/get_world_size"): (200, {"world_size": 1}),
            }
        )
    return routes


def context(tmp_path: Path, base_url: str, **trl: Any) -> RunContext:
    logs: list[str] = []
    cfg = validate(
        {
            "base_model": str(tmp_path),
            "datasets": [{"path": "x.jsonl"}],
            "micro_batch_size": 4,
            "output_dir": str(tmp_path),
            "trl": {
                "use_vllm": True,
                "vllm_managed": False,
                "vllm_server_base_url": base_url,
                "num_generations": 4,
                "reward_funcs": ["last_number_match"],
                "vllm_server_timeout": 3,
                **trl,
            },
        }
    )
    ctx = RunContext(config=cfg, output_dir=tmp_path, log=logs.append)
    ctx.logs = logs  # type: ignore[attr-defined]
    return ctx


def test_grpo_run_against_an_old_protocol_trl_server_says_so_in_one_line(tmp_path: Path, tiny_model_dir: str) -> None:
    """``grpo run`` (the real CLI) pointed at a server of TRL's older protocol:
    one line naming the servers grpo does talk to, no traceback."""
    (tmp_path / "train.jsonl").write_text('{"prompt": "What is 1 + 1?", "answer": "2"}\n' * 8)
    with serving(OLD_TRL) as url:
        (tmp_path / "config.yaml").write_text(
            json.dumps(
                {  # JSON is YAML
                    "base_model": tiny_model_dir,
                    "datasets": [{"path": str(tmp_path / "train.jsonl")}],
                    "micro_batch_size": 4,
                    "max_steps": 1,
                    "output_dir": str(tmp_path / "out"),
                    "trl": {
                        "use_vllm": True,
                        "vllm_managed": False,
                        "vllm_server_base_url": url,
                        "num_generations": 4,
                        "reward_funcs": ["last_number_match"],
                        "vllm_server_timeout": 3,
                    },
                }
            )
        )
        done = grpo("run", str(tmp_path / "config.yaml"), timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    no_traceback(output)
    lines = [line for line in output.splitlines() if "older TRL server protocol" in line]
    assert len(lines) == 1 and "trl vllm-serve --model DIR" in lines[0] and url in lines[0], output


def test_an_old_protocol_server_is_named_when_it_answers_health(tmp_path: Path) -> None:
    """Even where its ``/health`` answers (a proxy that follows the redirect),
    the missing ``/v1/models`` is explained, not reported as a bare 404."""
    from grpo_plugins.vllm.client import EngineRequestError
    from grpo_plugins.vllm.engine import VLLMServerEngine

    routes = {**OLD_TRL, ("GET", "/health"): (200, {})}
    with serving(routes) as url:
        engine = VLLMServerEngine(context(tmp_path, url))
        with pytest.raises(EngineRequestError, match=r"older TRL server protocol.*trl vllm-serve --model DIR"):
            engine.ensure_ready()


def test_a_server_without_dev_mode_generates_but_refuses_weight_syncs_naming_dev_mode(tmp_path: Path) -> None:
    from grpo_core.contract.errors import ConfigError
    from grpo_plugins.vllm.client import EngineRequestError
    from grpo_plugins.vllm.engine import VLLMServerEngine
    from grpo_plugins.vllm.nccl_sync import _reported_world_size

    with serving(stock_vllm(dev_mode=False)) as url:
        ctx = context(tmp_path, url)
        engine = VLLMServerEngine(ctx)
        engine.ensure_ready()
        assert engine.served_model == "/models/smol"  # its own name for the model, not grpo's "base"
        assert any("dev mode off" in line for line in ctx.logs)  # type: ignore[attr-defined]
        with pytest.raises(
            EngineRequestError, match=r"no /collective_rpc: start the server with VLLM_SERVER_DEV_MODE=1"
        ):
            engine.load_weights_from_path(tmp_path)
        with pytest.raises(ConfigError, match=r"weight sync 'nccl'.*no weight-transfer routes.*VLLM_SERVER_DEV_MODE=1"):
            _reported_world_size(engine.control_endpoints()[0])


def test_a_server_in_another_logprobs_mode_is_refused_when_the_temperature_differs(tmp_path: Path) -> None:
    from grpo_core.contract.errors import ConfigError
    from grpo_plugins.vllm.engine import VLLMServerEngine

    with serving(stock_vllm(dev_mode=True, logprobs_mode="raw_logprobs")) as url:
        with pytest.raises(
            ConfigError, match=r"--logprobs-mode raw_logprobs.*temperature \(0.7\).*--logprobs-mode processed_logprobs"
        ):
            VLLMServerEngine(context(tmp_path, url, temperature=0.7)).ensure_ready()
        engine = VLLMServerEngine(context(tmp_path, url))  # temperature 1: raw log-probs are the trainer's
        engine.ensure_ready()
        assert engine.weight_dtype == "bfloat16"  # read from the server: the sync sends that


def test_nccl_sync_refuses_a_server_without_a_weight_transfer_engine(tmp_path: Path) -> None:
    from grpo_core.contract.errors import ConfigError
    from grpo_plugins.vllm.engine import VLLMServerEngine
    from grpo_plugins.vllm.nccl_sync import _check_weight_transfer

    with serving(stock_vllm(dev_mode=True)) as url:
        engine = VLLMServerEngine(context(tmp_path, url))
        with pytest.raises(ConfigError, match=r"no NCCL weight-transfer engine.*--weight-transfer-config"):
            _check_weight_transfer(engine.control_endpoints()[0])
