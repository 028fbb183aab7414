"""``fp8``: accepted only on hardware with FP8 matmuls, refused elsewhere with
what is needed. The device is faked (CUDA absent, an A100's 8.0, an H100's
9.0) so the test does not depend on this machine; the FP8 step itself runs
in benchmarks/gpu_check.sh, on a GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from grpo_core.modeling.fp8 import fp8_problem


def test_fp8_needs_compute_capability_8_9_and_torchao() -> None:
    assert "no CUDA device" in fp8_problem(capability=None, torchao=True)
    a100 = fp8_problem(capability=(8, 0), torchao=True)
    assert "compute capability 8.0" in a100 and ">= 8.9" in a100 and "H100" in a100
    assert "torchao" in fp8_problem(capability=(9, 0), torchao=False)
    assert fp8_problem(capability=(8, 9), torchao=True) is None  # L4 / RTX 4090
    assert fp8_problem(capability=(9, 0), torchao=True) is None  # H100 / H200


def _cfg(tmp_path: Path):
    from grpo_core.config.loader import validate

    (tmp_path / "train.jsonl").write_text('{"prompt": "hi"}\n')
    (tmp_path / "config.json").write_text("{}")  # a model folder `config check` finds (nothing loads it)
    return validate(
        {
            "base_model": str(tmp_path),
            "datasets": [{"path": str(tmp_path / "train.jsonl")}],
            "micro_batch_size": 4,
            "fp8": True,
            "bf16": True,
            "trl": {"num_generations": 4, "reward_funcs": ["last_number_match"]},
        }
    )


def test_config_check_refuses_fp8_without_cuda(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from grpo_core.contract.errors import ConfigError
    from grpo_core.validation.run_check import check_run_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"fp8 = true needs an NVIDIA GPU of compute capability >= 8.9.*no CUDA"):
        check_run_config(_cfg(tmp_path))


def test_config_check_fp8_on_faked_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import grpo_core.modeling.fp8 as fp8
    from grpo_core.contract.errors import ConfigError
    from grpo_core.validation.run_check import check_run_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ConfigError, match="compute capability 8.0"):
        check_run_config(_cfg(tmp_path))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(fp8, "_torchao_available", lambda: True)
    check_run_config(_cfg(tmp_path))  # accepted: an H100 with torchao


def test_fp8_reaches_the_accelerators_arguments(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``fp8 = true`` makes the run's ``make_accelerator`` build accelerate's
    Accelerator with ``mixed_precision="fp8"`` and a torchao recipe handler.

    Mocked, because neither can run here: accelerate's ``AORecipeKwargs``
    imports torchao (not installed) and the FP8 matmuls need a GPU of
    compute capability >= 8.9. So ``Accelerator`` and ``AORecipeKwargs`` are
    replaced by recorders, and the recorded arguments are checked against
    the real ``Accelerator``'s signature and accelerate's precision names."""
    import inspect

    import accelerate
    import accelerate.utils
    from accelerate.utils import PrecisionType

    from grpo_core.training.run import make_accelerator

    real_signature = inspect.signature(accelerate.Accelerator.__init__)
    made: list[dict] = []

    class RecordedAccelerator:
        distributed_type = accelerate.utils.DistributedType.NO

        def __init__(self, **kwargs):
            made.append(kwargs)

    class RecordedRecipe:  # the torchao recipe accelerate would build
        pass

    monkeypatch.setattr(accelerate, "Accelerator", RecordedAccelerator)
    monkeypatch.setattr(accelerate.utils, "AORecipeKwargs", RecordedRecipe)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = _cfg(tmp_path)

    make_accelerator(cfg)
    kwargs = made.pop()
    real_signature.bind(None, **kwargs)  # every argument is one the real Accelerator takes
    assert kwargs["mixed_precision"] == "fp8" and "fp8" in {p.value for p in PrecisionType}
    assert [type(h) for h in kwargs["kwargs_handlers"]] == [RecordedRecipe]

    cfg.fp8 = False
    make_accelerator(cfg)
    plain = made.pop()
    assert "mixed_precision" not in plain and "kwargs_handlers" not in plain  # without fp8, accelerate's defaults
