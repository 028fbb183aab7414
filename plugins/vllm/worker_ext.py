"""Runs inside each vLLM worker (``--worker-extension-cls``): lets the
trainer's weight sync hand weights over the network, with no filesystem
shared between the two machines.

``/collective_rpc {"method": "grpo_load_weights_from_url", ...}`` makes
every worker fetch the safetensors bytes the trainer serves
(:mod:`grpo_plugins.vllm.http_sync`) and load them in place, exactly as
``reload_weights`` loads files: weights not in the payload keep their
values. Nothing is written to disk on the server's side. This module is
imported by the vLLM server process: it must stay free of grpo_core and of
anything heavy.
"""

from __future__ import annotations

import urllib.request
from typing import Any

FETCH_TIMEOUT_S = 600.0


def fetch(url: str, token: str, timeout: float = FETCH_TIMEOUT_S) -> bytes:
    """GET ``url`` with the sync's bearer token; no proxy from the
    environment (the trainer is reached directly)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with opener.open(request, timeout=timeout) as response:
        return response.read()


class GrpoWorkerExtension:
    """Mixed into vLLM's worker class by vLLM itself."""

    def grpo_load_weights_from_url(self, url: str, token: str) -> int:
        """Fetch and load the weights; returns how many tensors were loaded
        (the trainer checks it)."""
        from safetensors.torch import load

        tensors: dict[str, Any] = load(fetch(url, token))
        self.reload_weights(weights_iterator=iter(tensors.items()))  # type: ignore[attr-defined]
        return len(tensors)
