"""The gap the same weights show between a vLLM server and the trainer, per
precision pair: what the sync check's bounds (grpo_core/sync/verify.py)
are set from.

    .venv/bin/python benchmarks/bench_probe_noise.py float32|bfloat16

Starts one server (SmolLM2-135M-Instruct, base weights, the dtype given) and
scores the first 48 ids of a fixed text with ``prompt_logprobs`` (four times:
the seconds of each request are printed), then compares with the transformers
model's log-probs of the same ids in float32, under bf16 autocast, and with
bf16 weights (mean and max |difference| per token). The text is the first
sentences of the sync check's probe.
"""

import json
import sys
import time
from pathlib import Path

import httpx
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_core.config.loader import validate
from grpo_core.modeling.model_files import DEFAULT_MODEL, resolve_model_dir
from grpo_plugins.vllm.command_line import server_spec
from grpo_plugins.vllm.server import ManagedServer

MODEL = resolve_model_dir(DEFAULT_MODEL)
dtype = sys.argv[1]
import tempfile

out = Path(tempfile.mkdtemp(prefix=f"bench-probe-noise-{dtype}-"))
cfg = validate(
    {
        "base_model": MODEL,
        "adapter": "lora",
        "lora_r": 8,
        "sequence_len": 512,
        "output_dir": str(out),
        "vllm": {
            "host": "127.0.0.1",
            "port": 0,
            "dtype": dtype,
            "max_model_len": 512,
            "cpu_kvcache_space": 1,
            "api_key": "k",
        },
        "trl": {"use_vllm": True, "vllm_lora_sync": True},
    }
)
spec = server_spec(cfg, lora=True)
server = ManagedServer(spec, out / "server.log")
server.start()
try:
    server.wait_ready(600)
    tok = AutoTokenizer.from_pretrained(MODEL)
    text = (
        "The quick brown fox jumps over the lazy dog. 17 + 25 = 42, and the capital of France is Paris. Water boils "
        "at 100 degrees Celsius at sea level; ice melts at zero."
    )
    ids = tok(text, add_special_tokens=False)["input_ids"][:48]
    print("n ids", len(ids))
    c = httpx.Client(headers={"Authorization": "Bearer k"})
    body = {"model": "base", "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0}
    for _i in range(4):
        t = time.perf_counter()
        r = c.post(spec.base_url + "/v1/completions", json=body, timeout=60)
        dt = time.perf_counter() - t
        print("probe seconds", round(dt, 4), r.status_code)
    d = r.json()
    pl = d["choices"][0]["prompt_logprobs"]
    print(json.dumps(pl[:3]))
    eng = [next(iter(p.values()))["logprob"] for p in pl[1:]]
    keys = [int(next(iter(p.keys()))) for p in pl[1:]]
    assert keys == ids[1:], (keys[:5], ids[1:6])
    m = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    x = torch.tensor([ids])
    for name, ctx in [("fp32", torch.no_grad()), ("bf16-autocast", torch.autocast("cpu", dtype=torch.bfloat16))]:
        with torch.no_grad(), ctx:
            t = time.perf_counter()
            logits = m(x).logits.float()
            dt = time.perf_counter() - t
        lp = torch.log_softmax(logits[0, :-1], -1).gather(-1, x[0, 1:, None])[:, 0]
        diff = (lp - torch.tensor(eng)).abs()
        print(f"engine {dtype} vs trainer {name}: mean {diff.mean():.3g} max {diff.max():.3g} trainer fwd {dt:.3f}s")
    mb = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.bfloat16).eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logits = mb(x).logits.float()
    lp = torch.log_softmax(logits[0, :-1], -1).gather(-1, x[0, 1:, None])[:, 0]
    diff = (lp - torch.tensor(eng)).abs()
    print(f"engine {dtype} vs trainer bf16-weights: mean {diff.mean():.3g} max {diff.max():.3g}")
    print("mean |logp|", torch.tensor(eng).abs().mean())
finally:
    server.stop()
