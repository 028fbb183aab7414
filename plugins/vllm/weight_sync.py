"""Weight syncs to a vLLM server through the filesystem.

* ``lora_filesystem``: save the PEFT adapter, ``POST /v1/load_lora_adapter``
  (in place, under the name ``'policy'``); requests then name ``'policy'``.
* ``full_filesystem``: save all weights (safetensors; a LoRA is merged
  first), ``POST /collective_rpc reload_weights`` and reset the prefix cache
  (the server needs ``VLLM_SERVER_DEV_MODE=1``).

Each version goes to a fresh directory (written under a temporary name and
renamed, so the server never reads half a file; a new path also keeps vLLM
from reusing prefix-cache blocks computed with the old weights). Older
versions are deleted; the newest is kept so a restarted server can be given
it again (``context.services['vllm.resync']``).

Both need the ``vllm`` rollout, which publishes the client. NCCL transfer
to GPU servers is refused with these alternatives (:class:`NcclSync`).
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo_core import hookimpl
from grpo_core.errors import ConfigError, EngineUnavailable, NotImplementedYet
from grpo_core.types import SyncResult

if TYPE_CHECKING:
    from grpo_core.context import RunContext
    from grpo_plugins.vllm.client import VLLMClient

POLICY_NAME = "policy"


class NcclSync:
    """``grpo.weight_sync:nccl``: refused with the alternatives.

    NCCL transfer into vLLM (its weight-transfer API) needs CUDA GPUs on
    both sides, and grpo has not been run on GPUs yet; the name exists so a
    config asking for it gets this explanation instead of "unknown name".
    """

    def __init__(self, context: RunContext) -> None:
        raise self.refusal()

    @staticmethod
    def refusal() -> NotImplementedYet:
        return NotImplementedYet(
            "weight sync 'nccl' (NCCL transfer to vLLM)",
            "it needs CUDA GPUs on both sides and has not been built and tested here. Use 'lora_filesystem' "
            "(trl.vllm_lora_sync = true, adapter = 'lora') or 'full_filesystem' with a vLLM server on a shared "
            "filesystem, or 'vllm_in_memory' (trl.vllm_mode = 'colocate'), which hands tensors over in memory",
        )

    @hookimpl
    def grpo_sync_weights(self, model: Any, version: int) -> SyncResult:  # the contract's shape; never reached
        raise self.refusal()


def _is_peft(model: Any) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


class _FilesystemSync:
    """What both syncs share: versioned directories, the client, re-sync."""

    subdir = ""
    kind = ""

    def __init__(self, context: RunContext) -> None:
        self.context = context
        self.root = Path(context.output_dir) / self.subdir
        self.run_id = uuid.uuid4().hex[:8]
        self._lock = threading.Lock()
        self._last: tuple[Path, int] | None = None
        context.services["vllm.resync"] = self.resync

    def _client(self) -> VLLMClient:
        client = self.context.services.get("vllm.client")
        if client is None:
            raise ConfigError(
                f"weight sync '{self.kind}' sends weights to the vLLM server of the 'vllm' rollout, which is not "
                "loaded: set trl.use_vllm = true (or plugins.rollout = 'vllm')."
            )
        prepare = self.context.services.get("vllm.prepare")
        if prepare is not None:
            prepare()
        return client

    def _tag(self, version: int) -> str:
        return f"grpo-{self.kind.split('_')[0]}-{self.run_id}-v{version}"

    def _save(self, model: Any, out: Path) -> None:
        raise NotImplementedError

    def _apply(self, client: VLLMClient, path: Path, version: int) -> None:
        raise NotImplementedError

    def _write_version(self, model: Any, version: int) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        target = self.root / f"v{version}"
        tmp = Path(tempfile.mkdtemp(prefix=f".v{version}.tmp-", dir=self.root))
        try:
            self._save(model, tmp)
            if target.exists():
                shutil.rmtree(target)
            tmp.rename(target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return target

    def _prune(self, keep: Path) -> None:
        for old in self.root.glob("v*"):
            if old.is_dir() and old != keep:
                shutil.rmtree(old, ignore_errors=True)

    @hookimpl
    def grpo_sync_weights(self, model: Any, version: int) -> SyncResult:
        client = self._client()
        with self._lock:
            start = time.perf_counter()
            path = self._write_version(model, version)
            saved = time.perf_counter()
            try:
                self._apply(client, path.resolve(), version)
            except EngineUnavailable:
                # A managed server that died is restarted (with base weights): give it ours.
                restart = self.context.services.get("vllm.restart")
                if restart is None or not restart():
                    raise
                self.context.log("vLLM: re-applying this weight sync to the restarted server")
                self._apply(client, path.resolve(), version)
            self._last = (path, version)
            self._prune(path)
            end = time.perf_counter()
        return SyncResult(version, end - start, f"{self.kind}: save {saved - start:.2f}s, load {end - saved:.2f}s ({path})")

    def resync(self) -> None:
        """Give a restarted server the newest weights again."""
        with self._lock:
            if self._last is None:
                return
            path, version = self._last
            client = self.context.services["vllm.client"]
            self._apply(client, path.resolve(), version)

    def _label(self, client: VLLMClient, version: int) -> None:
        tag = self._tag(version)
        if client.set_weight_version(tag):
            self.context.services["vllm.weight_tag"] = tag


class LoraFilesystemSync(_FilesystemSync):
    """``grpo.weight_sync:lora_filesystem``."""

    subdir = "vllm-adapters"
    kind = "lora_filesystem"

    def _save(self, model: Any, out: Path) -> None:
        if not _is_peft(model):
            raise ConfigError(
                "weight sync 'lora_filesystem' (trl.vllm_lora_sync = true) needs a LoRA adapter: set "
                "adapter = 'lora', or use plugins.weight_sync = 'full_filesystem' for full fine-tuning."
            )
        name = getattr(model, "active_adapter", "default")
        model.save_pretrained(str(out), selected_adapters=[name])
        if name != "default":  # PEFT writes non-default adapters into a subfolder
            for item in (out / name).iterdir():
                item.rename(out / item.name)
            (out / name).rmdir()

    def _apply(self, client: VLLMClient, path: Path, version: int) -> None:
        client.load_lora_adapter(POLICY_NAME, str(path), inplace=True)
        self.context.services["vllm.model"] = POLICY_NAME
        self._label(client, version)


# vLLM fuses these projections into one weight (qkv_proj, gate_up_proj); an
# in-place reload of one member without the others would leave the rest of
# the fused weight unset, so a partial update carries the whole group.
PACKED_GROUPS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _lora_modules(base: Any) -> dict[str, Any]:
    return {name: m for name, m in base.named_modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")}


def _modules_to_send(base: Any, lora: dict[str, Any], packed_groups: tuple[tuple[str, ...], ...]) -> set[str] | None:
    """Names of the modules whose weights training changes (LoRA-wrapped
    ones, plus their fused siblings); ``None`` when other weights train too
    (everything is sent then)."""
    if any(p.requires_grad and "lora_" not in n for n, p in base.named_parameters()):
        return None
    names = set(lora)
    for name in lora:
        parent, _, leaf = name.rpartition(".")
        for group in packed_groups:
            if leaf in group:
                names.update(f"{parent}.{member}" if parent else member for member in group)
    return names


def merged_weights(model: Any, packed_groups: tuple[tuple[str, ...], ...] = PACKED_GROUPS) -> dict[str, Any]:
    """The HF-named weights the inference engine needs to sample from
    ``model``: every weight for full fine-tuning; for a LoRA, only the
    adapted modules (and their fused siblings), as ``W + delta``.

    The delta is computed beside the weights, never merged into them, so the
    trainer's frozen base stays bit-exact however many syncs run (a merge
    followed by an unmerge does not round-trip in floating point), and the
    ~25% of the model a LoRA never touches (embeddings, norms) is neither
    copied nor sent. vLLM's in-place reload keeps weights it is not given.
    """
    import torch

    if not _is_peft(model):
        return {k: v.detach() for k, v in model.state_dict().items()}
    base = model.get_base_model()
    lora = _lora_modules(base)
    send = _modules_to_send(base, lora, packed_groups)
    state: dict[str, Any] = {}
    with torch.no_grad():
        for key, value in base.state_dict().items():
            if "lora_" in key:
                continue
            name = key.replace(".base_layer.", ".")
            module_name, _, param = name.rpartition(".")
            if send is not None and module_name not in send:
                continue
            module = lora.get(module_name)
            if module is not None and param == "weight" and not module.merged:
                for adapter in module.active_adapters:
                    if adapter in module.lora_A:
                        value = value + module.get_delta_weight(adapter)
            state[name] = value.detach()
    return state


class FullFilesystemSync(_FilesystemSync):
    """``grpo.weight_sync:full_filesystem``."""

    subdir = "vllm-weights"
    kind = "full_filesystem"

    def _save(self, model: Any, out: Path) -> None:
        from safetensors.torch import save_file

        state = merged_weights(model)
        seen: dict[int, str] = {}
        unique = {}
        for key, tensor in state.items():  # tied weights (lm_head = embed_tokens) are stored once
            ptr = tensor.data_ptr()
            if ptr in seen:
                continue
            seen[ptr] = key
            unique[key] = tensor.contiguous()
        save_file(unique, str(out / "model.safetensors"), metadata={"format": "pt"})

    def _apply(self, client: VLLMClient, path: Path, version: int) -> None:
        client.collective_rpc("reload_weights", {"weights_path": str(path)})
        client.reset_prefix_cache()
        self.context.services["vllm.model"] = "base"
        self._label(client, version)
