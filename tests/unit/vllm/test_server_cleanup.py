"""What a run clears from a server it starts on: adapters an earlier run left.

Two handles of one server (a pool naming it twice, or two training
processes) clean it at the same moment: both list the adapter, one unloads
it, and the other's unload answers 404. That adapter is gone, which is what
the cleanup wanted; before, the 404 ended the run (seen in the in-flight
pool test, which names the session's server under two URLs).
"""

from __future__ import annotations

import pytest

from grpo_plugins.vllm.client import EngineRequestError
from grpo_plugins.vllm.engine import VLLMServerEngine


class _Client:
    base_url = "http://127.0.0.1:1"

    def __init__(self, unload_status: int | None) -> None:
        self.owned_adapters: dict[str, str] = {}
        self.unload_status = unload_status
        self.unloaded: list[str] = []
        self.prefix_cache_reset = False

    def models(self):
        return [{"id": "base", "root": "/m", "parent": None}, {"id": "policy", "root": "/old", "parent": "base"}]

    def unload_lora_adapter(self, name: str) -> None:
        if self.unload_status is not None:
            raise EngineRequestError("refused", self.unload_status, "The lora adapter 'policy' cannot be found.")
        self.unloaded.append(name)

    def weight_version(self):
        return None

    def reset_prefix_cache(self) -> None:
        self.prefix_cache_reset = True


def _engine(client: _Client, logs: list[str]) -> VLLMServerEngine:
    engine = object.__new__(VLLMServerEngine)  # only what _clean_server reads: a managed server's client and log
    engine.client = client
    engine.server = object()
    engine.log = logs.append
    engine._label = None
    return engine


def test_an_adapter_left_by_an_earlier_run_is_unloaded() -> None:
    client, logs = _Client(None), []
    _engine(client, logs)._clean_server()
    assert client.unloaded == ["policy"] and client.prefix_cache_reset
    assert logs == ["vLLM: unloaded adapter 'policy' left on the server by an earlier run"]


def test_an_adapter_another_handle_unloaded_first_is_taken_as_gone() -> None:
    client, logs = _Client(404), []
    _engine(client, logs)._clean_server()
    assert client.prefix_cache_reset and logs == []


def test_another_refusal_still_stops_the_run() -> None:
    with pytest.raises(EngineRequestError):
        _engine(_Client(400), [])._clean_server()
