#!/usr/bin/env bash
# The GPU paths in one run (< 8 minutes on one H100/H200-class GPU): liger parity on CUDA, an fp8
# step, NCCL weight sync to a managed CUDA vLLM server, bf16 step time. Needs a CUDA machine with
# `pip install -e '.[vllm,gpu,test]' torchao`. Writes benchmarks/results/gpu_check.json (or $OUT/...).
# Not yet run: see benchmarks/RESULTS.md, "GPU paths".
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DEST=${OUT:-benchmarks/results}
mkdir -p "$DEST"
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))"
timeout 450 "$PY" benchmarks/gpu_check.py --out "$DEST/gpu_check.json" "$@"
