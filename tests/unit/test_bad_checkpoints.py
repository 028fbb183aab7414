"""Every file of a checkpoint, cut short or changed by one byte: resuming it
refuses in one message naming that file (or, for a file a resume does not
read, skips it and says so), before any model loads, and nothing on disk
changes.

Real checkpoints are written with :func:`save_checkpoint` (a tiny randomly
initialised Llama, full and as a real PEFT LoRA adapter, a real AdamW after
one step), then damaged the ways a full disk or an interrupted copy damage
files: cut at the start, after a few bytes, in the middle, one byte short;
one byte flipped at the start, in the middle, at the end; and (hypothesis)
cut or flipped anywhere. The reader under test is
:func:`~grpo_core.checkpointing.checkpoint.read_checkpoint`, what ``grpo run``
calls before it loads the model (the end-to-end runs are in
``tests/e2e/reliability/test_input_faults.py``). Resuming with a config that
does not match how the checkpoint was made is checked here too
(:mod:`grpo_core.checkpointing.record`), with the record and, for a
checkpoint written before the record, from its own files.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_model import random_llama

from grpo_core.checkpointing import checkpoint as ckpt
from grpo_core.checkpointing.integrity import MANIFEST, needed_for_resume
from grpo_core.checkpointing.record import RECORD_KEY, check_resume, describe
from grpo_core.config.loader import validate
from grpo_core.contract.errors import ConfigError, GrpoError

KINDS = ("full", "lora")
CUTS = {
    "empty": lambda n: 0,
    "8_bytes": lambda n: min(8, n - 1),
    "half": lambda n: n // 2,
    "one_short": lambda n: n - 1,
}
FLIPS = {"first": lambda n: 0, "middle": lambda n: n // 2, "last": lambda n: n - 1}


def _tiny_llama() -> Any:
    return random_llama(vocab_size=32, max_position_embeddings=32)


def _config(kind: str, **changes: Any) -> Any:
    raw: dict[str, Any] = {"base_model": "tiny-llama", "datasets": [{"path": "d.jsonl"}], "micro_batch_size": 8}
    if kind == "lora":
        raw.update(adapter="lora", lora_r=2, lora_alpha=4, lora_target_modules=["q_proj", "v_proj"])
    raw.update(changes)
    return validate(raw)


def _write(root: Path, kind: str) -> Path:
    """A real checkpoint of ``kind`` under ``root/out``, with the run's record."""
    from transformers import get_scheduler

    model = _tiny_llama()
    if kind == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model(torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    optimizer.step()
    scheduler = get_scheduler("constant", optimizer)
    record = {**describe(_config(kind), root / "no-model-dir", 1), "vocab_size": 32}
    extra = {"replay": {"totals": {"replayed": 1}}, "pending_batch": None, RECORD_KEY: record}
    return ckpt.save_checkpoint(root / "out", 1, model, None, optimizer, scheduler, {"policy_version": 1}, extra)


@functools.cache
def pristine(kind: str) -> Path:
    """One checkpoint of each kind for the whole module (copied before each damage)."""
    return _write(Path(tempfile.mkdtemp(prefix=f"grpo-bad-ckpt-{kind}-")), kind)


def files_of(kind: str) -> list[str]:
    root = pristine(kind)
    return sorted(str(f.relative_to(root)) for f in root.rglob("*") if f.is_file())


def tree_digest(root: Path) -> dict[str, str]:
    return {
        str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest() for f in root.rglob("*") if f.is_file()
    }


def damaged_copy(tmp: Path, kind: str, relative: str, cut: int | None = None, flip: int | None = None) -> Path:
    """A copy of the pristine checkpoint with ``relative`` cut at ``cut`` or
    one byte flipped at ``flip`` (offsets taken modulo its size), beside an
    intact checkpoint-0 that must stay as it is."""
    out = tmp / "out"
    shutil.copytree(pristine(kind), out / "checkpoint-0")
    path = shutil.copytree(pristine(kind), out / "checkpoint-1")
    file = path / relative
    data = file.read_bytes()
    if cut is not None:
        file.write_bytes(data[: cut % max(1, len(data))])
    if flip is not None and data:
        buffer = bytearray(data)
        buffer[flip % len(data)] ^= 0xFF
        file.write_bytes(bytes(buffer))
    return path


def assert_named_or_skipped(path: Path, relative: str) -> None:
    """The contract: a file a resume reads is refused naming it; another is a
    note naming it (or, with no manifest to check it against, ignored); no
    file in output_dir changes while the checkpoint is read."""
    before = tree_digest(path.parent)
    named = str(path / relative)
    if needed_for_resume(relative) or relative == ckpt.STATE_FILE:
        with pytest.raises(GrpoError) as refused:
            ckpt.read_checkpoint(path)
        message = str(refused.value)
        assert named in message, message
        assert "Traceback" not in message and "\n" not in message.strip(), message
        assert "resume from" in message.lower() or "do not resume" in message, message  # the fix
    else:
        notes = ckpt.read_checkpoint(path).notes
        if (path / MANIFEST).is_file():
            assert any(named in note and "skipped" in note for note in notes), notes
    assert tree_digest(path.parent) == before


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("damage", [*(f"cut_{c}" for c in CUTS), *(f"flip_{f}" for f in FLIPS)])
def test_every_file_cut_or_flipped_is_named(tmp_path: Path, kind: str, damage: str) -> None:
    """Each file of the checkpoint, in turn (a damage is one file at a time,
    each checked on a fresh copy)."""
    for i, relative in enumerate(files_of(kind)):
        size = (pristine(kind) / relative).stat().st_size
        how, _, which = damage.partition("_")
        offset = (CUTS if how == "cut" else FLIPS)[which](size)
        tmp = tmp_path / str(i)
        path = damaged_copy(tmp, kind, relative, **({"cut": offset} if how == "cut" else {"flip": offset}))
        assert_named_or_skipped(path, relative)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    kind=st.sampled_from(KINDS),
    pick=st.integers(min_value=0),
    offset=st.integers(min_value=0, max_value=2**40),
    cut=st.booleans(),
)
def test_any_cut_or_flipped_byte_is_named(tmp_path_factory: pytest.TempPathFactory, kind, pick, offset, cut) -> None:
    files = files_of(kind)
    relative = files[pick % len(files)]
    size = (pristine(kind) / relative).stat().st_size
    if cut and offset % max(1, size) == 0 and size == 0:
        return
    tmp = tmp_path_factory.mktemp("any")
    path = damaged_copy(tmp, kind, relative, **({"cut": offset} if cut else {"flip": offset}))
    assert_named_or_skipped(path, relative)


@pytest.mark.parametrize("kind", KINDS)
def test_a_checkpoint_from_before_the_manifest_is_checked_by_what_its_files_say(tmp_path: Path, kind: str) -> None:
    """Without manifest.json (a checkpoint of an older grpo): it still reads;
    a cut weights file is refused by its own safetensors header, a cut state
    file by the safe loader, each named. (A flipped byte inside tensor data
    cannot be seen without the recorded checksum: the known gap.)"""
    intact = shutil.copytree(pristine(kind), tmp_path / "old" / "checkpoint-1")
    (intact / MANIFEST).unlink()
    assert ckpt.read_checkpoint(intact).notes == []
    weights = "model/adapter_model.safetensors" if kind == "lora" else "model/model.safetensors"
    for relative in (weights, "optimizer.pt", "extra_state.pt", ckpt.STATE_FILE):
        for fraction in (0.0, 0.5, 0.99):
            path = damaged_copy(tmp_path / f"{relative.replace('/', '_')}-{fraction}", kind, relative)
            (path / MANIFEST).unlink()
            data = (path / relative).read_bytes()
            (path / relative).write_bytes(data[: int(len(data) * fraction)])
            assert_named_or_skipped(path, relative)


# ------------------------------------------------------------------ how it was made


def test_resume_with_another_lora_shape_names_each_difference(tmp_path: Path) -> None:
    path = pristine("lora")
    assert check_resume(path, _config("lora"), tmp_path, None, 1) == []
    with pytest.raises(GrpoError) as refused:
        check_resume(path, _config("lora", lora_r=16, lora_alpha=8), tmp_path, None, 1)
    message = str(refused.value)
    assert "lora_r = 2, this config has 16. Set lora_r = 2" in message
    assert "lora_alpha = 4, this config has 8" in message
    with pytest.raises(GrpoError, match="target modules"):
        check_resume(path, _config("lora", lora_target_modules=["q_proj"]), tmp_path, None, 1)
    with pytest.raises(GrpoError, match="holds a LoRA adapter, this config trains the full model"):
        check_resume(path, _config("full"), tmp_path, None, 1)
    with pytest.raises(GrpoError, match="base_model: the checkpoint was trained from 'tiny-llama'"):
        check_resume(path, _config("lora", base_model="another-model"), tmp_path, None, 1)


def test_resume_with_another_vocabulary_or_process_count(tmp_path: Path) -> None:
    path = pristine("full")
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 32}))
    grown = ["x"] * 40  # a tokenizer with 8 special tokens added
    with pytest.raises(GrpoError, match="32 embedding rows, this config's tokenizer and base model give 40"):
        check_resume(path, _config("full"), model_dir, grown, 1)
    warnings = check_resume(path, _config("full"), model_dir, ["x"] * 32, 2)
    assert any("saved by 1 process(es), this run has 2" in w for w in warnings), warnings
    warnings = check_resume(path, _config("full", bf16=True), model_dir, None, 1)
    assert any(w.startswith("precision:") for w in warnings), warnings


def test_an_older_checkpoint_is_compared_by_its_adapter_config(tmp_path: Path) -> None:
    """No record: adapter_config.json still says LoRA, its rank and alpha."""
    old = shutil.copytree(pristine("lora"), tmp_path / "checkpoint-1")
    (old / MANIFEST).unlink()
    assert check_resume(old, _config("lora"), tmp_path, None, 1) == []
    with pytest.raises(GrpoError, match="lora_r = 2, this config has 8"):
        check_resume(old, _config("lora", lora_r=8), tmp_path, None, 1)
    with pytest.raises(GrpoError, match="lora_target_modules: the checkpoint's adapter targets"):
        check_resume(old, _config("lora", lora_target_modules=["k_proj"]), tmp_path, None, 1)


def test_weights_of_another_shape_are_one_line_not_a_state_dict_error(tmp_path: Path) -> None:
    """What the record cannot see (an older checkpoint whose config says
    all-linear) still fails in one line when the weights load."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_tiny_llama(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with pytest.raises(GrpoError) as refused:
        ckpt.load_model_weights(model, pristine("lora"))
    message = str(refused.value)
    assert "weights do not fit the model this config builds" in message and "size mismatch" in message
    assert "lora_r" in message  # the settings to restore


def test_every_byte_of_a_pickled_state_flipped_is_a_named_error_or_data(tmp_path: Path) -> None:
    """The safe loader itself, on every byte of the optimizer state's pickle
    stream flipped in turn: it reads data or refuses naming the file, never
    another exception (a flip there made torch's restricted unpickler raise
    KeyError, IndexError, AssertionError or TypeError; found by the hypothesis
    test above). What still reads is caught by the manifest's checksum."""
    import zipfile

    from grpo_core.checkpointing.safe_load import safe_load

    source = pristine("full") / "optimizer.pt"
    data = source.read_bytes()
    with zipfile.ZipFile(source) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("data.pkl"))
    start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
    target = tmp_path / "optimizer.pt"
    for offset in range(start, start + info.compress_size):
        buffer = bytearray(data)
        buffer[offset] ^= 0xFF
        target.write_bytes(bytes(buffer))
        try:
            safe_load(target)
        except GrpoError as exc:
            assert str(target) in str(exc), str(exc)


# ------------------------------------------------------------------ adapters and merged models


@pytest.mark.parametrize("kind", KINDS)
def test_a_model_or_adapter_folder_with_a_cut_or_damaged_weights_file_is_named(tmp_path: Path, kind: str) -> None:
    """What ``base_model`` (a merged model a run wrote), ``grpo eval --adapter``
    and ``grpo merge`` load: a weights file cut anywhere, or its header's
    bytes flipped, is a ConfigError naming the file and the setting, before
    transformers or PEFT read it. (A flip inside tensor data is read as it
    is: only a checkpoint's manifest can see it.)"""
    from grpo_core.interface.tools import merge_adapter
    from grpo_core.modeling.models import _load_causal_lm
    from grpo_core.modeling.weight_files import check_weight_folder

    source = pristine(kind) / "model"
    name = "adapter_model.safetensors" if kind == "lora" else "model.safetensors"
    data = (source / name).read_bytes()
    header_end = 8 + int.from_bytes(data[:8], "little")
    variants = {f"cut_{n}": data[:n] for n in (0, 7, header_end // 2, header_end + 1, len(data) - 1)}
    for at in (0, 3, 9, header_end // 2, header_end - 1):
        buffer = bytearray(data)
        buffer[at] ^= 0xFF
        variants[f"flip_{at}"] = bytes(buffer)
    variants["config_json_cut"] = None
    for label, content in variants.items():
        folder = shutil.copytree(source, tmp_path / label)
        if content is None:
            config = folder / ("adapter_config.json" if kind == "lora" else "config.json")
            config.write_bytes(config.read_bytes()[:20])
            named = config
        else:
            (folder / name).write_bytes(content)
            named = folder / name
        with pytest.raises(ConfigError) as refused:
            check_weight_folder(folder, "base_model")
        assert str(named) in str(refused.value) and "damaged" in str(refused.value), (label, refused.value)
        if kind == "lora":
            with pytest.raises(ConfigError, match=re.escape(str(named))):
                merge_adapter(folder, tmp_path / "merged", base="unused")
        else:
            with pytest.raises(ConfigError, match=re.escape(str(named))):
                _load_causal_lm(_config("full", base_model=str(folder)), str(folder))
