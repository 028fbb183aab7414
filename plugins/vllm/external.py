"""What grpo reads from a vLLM server it did not start: a ``trl vllm-serve``,
a stock ``vllm serve``, or a ``grpo vllm-serve`` of another terminal.

A server grpo starts is known from the config. One started by hand may
serve its model under another name (``vllm serve DIR`` serves ``DIR``, not
grpo's ``base``), return other log-probs, keep another dtype or lack LoRA
layers; reading it from the server's own answers (``/v1/models``, and in
dev mode ``/server_info``) is what lets the two-terminal workflow of TRL,
``trl vllm-serve --model DIR`` then train, point grpo at it unchanged.

TRL 1.16's ``trl vllm-serve`` *is* vLLM's OpenAI server (it execs
``vllm serve`` with dev mode, ``--logprobs-mode processed_logprobs`` and
``--weight-transfer-config '{"backend": "nccl"}'``), so the ``vllm``
rollout speaks its protocol as it is. TRL 1.10 and earlier (and ``axolotl
vllm-serve``, which runs the installed TRL's script) served a FastAPI app of its own
(``/generate/``, ``/init_communicator/``, ``/update_named_param/``);
:func:`old_trl_protocol` recognises it so the run stops with one line
naming the fix instead of failing on a missing route.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

from grpo_core.plugin_api import GrpoError
from grpo_plugins.vllm.client import VLLMClient

MATCHING_LOGPROBS_MODE = "processed_logprobs"
"""The mode whose sampled log-probs the trainer reproduces: vLLM's log-probs
after the temperature, as grpo's trainer divides its logits by it (grpo's
managed servers and ``trl vllm-serve`` both pass it)."""

OLD_TRL_PROTOCOL = (
    "{url} speaks the older TRL server protocol (/generate/, /init_communicator/: `trl vllm-serve` of TRL 1.10 or "
    "earlier, or `axolotl vllm-serve` on such a TRL), which grpo does not talk; start the server with a newer TRL's "
    "`trl vllm-serve --model DIR` (TRL 1.16's runs vLLM's own server), `vllm serve DIR` or `grpo vllm-serve CONFIG` "
    "instead (docs/servers.md)."
)


@dataclass(frozen=True)
class ServerFacts:
    """What one server says about itself. ``None``: it did not say (a
    server without dev mode has no ``/server_info``)."""

    base_model: str | None = None
    """The name ``/v1/models`` serves the base model under."""
    logprobs_mode: str | None = None
    dtype: str | None = None
    """``"float32"``, ``"bfloat16"``...: what its weights are kept in."""
    lora: bool | None = None
    """Started with ``--enable-lora``."""
    max_lora_rank: int | None = None
    weight_transfer: str | None = None
    """The ``--weight-transfer-config`` backend (``"nccl"``), ``""`` if none."""
    dev_mode: bool = False


def base_model_name(models: list[dict[str, Any]]) -> str | None:
    """The id of the first served model that is not an adapter."""
    return next((str(m["id"]) for m in models if m.get("parent") is None and m.get("id")), None)


def server_config(client: VLLMClient) -> dict[str, Any] | None:
    """The server's resolved ``VllmConfig`` (``GET /server_info``, dev mode
    only), or ``None`` when it has no such route or answers otherwise."""
    try:
        info = client.request(
            "GET", "/server_info", params={"config_format": "json"}, parse=lambda r: r.json(), retry=False
        )
    except GrpoError:
        return None
    config = info.get("vllm_config") if isinstance(info, dict) else None
    return config if isinstance(config, dict) else None


def read_facts(client: VLLMClient, models: list[dict[str, Any]]) -> ServerFacts:
    """:class:`ServerFacts` of the server behind ``client`` (``models``: its
    ``/v1/models`` answer, already read)."""
    base = base_model_name(models)
    config = server_config(client)
    if config is None:
        return ServerFacts(base_model=base)
    model = config.get("model_config") or {}
    lora = config.get("lora_config")
    transfer = config.get("weight_transfer_config")
    dtype = str(model.get("dtype") or "").removeprefix("torch.") or None
    return ServerFacts(
        base_model=base,
        logprobs_mode=model.get("logprobs_mode"),
        dtype=dtype,
        lora=lora is not None,
        max_lora_rank=(lora or {}).get("max_lora_rank"),
        weight_transfer=str((transfer or {}).get("backend") or ""),
        dev_mode=True,
    )


def logprobs_problem(mode: str | None, temperature: float, where: str) -> str | None:
    """Why the sampler log-probs of a server in ``mode`` do not match what the
    trainer computes at ``temperature`` (importance-sampling correction and
    the ``is/*`` metrics compare the two), or ``None``."""
    if mode is None or mode == MATCHING_LOGPROBS_MODE:
        return None
    if mode == "raw_logprobs" and temperature == 1.0:
        return None  # nothing processes the logits at temperature 1 but top-k/top-p, which the trainer ignores too
    return (
        f"{where} returns log-probs in --logprobs-mode {mode}, but grpo's trainer computes them after the temperature "
        f"({temperature:g}), so the importance-sampling ratio would compare different distributions. Restart the "
        f"server with --logprobs-mode {MATCHING_LOGPROBS_MODE} (`trl vllm-serve` and `grpo vllm-serve` pass it)."
    )


def old_trl_protocol(base_url: str, timeout: float = 5.0) -> bool:
    """The server at ``base_url`` (TCP) answers the older TRL protocol: its
    ``/get_world_size/`` (trailing slash) gives a world size and it has no
    ``/v1/models``."""
    if base_url.startswith("unix:"):
        return False
    try:
        with httpx.Client(timeout=timeout) as http:
            if http.get(base_url + "/v1/models").status_code != 404:
                return False
            answer = http.get(base_url + "/get_world_size/")
            return answer.status_code == 200 and "world_size" in answer.json()
    except (httpx.HTTPError, ValueError):
        return False
