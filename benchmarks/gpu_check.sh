#!/usr/bin/env bash
# The GPU paths in one run, made for the GPU machine this project can be lent
# (one H200; Python 3.12 with PyTorch 2.11 for CUDA 13, transformers, peft,
# accelerate; no vLLM, no network). Budget: under 8 minutes (timeout below).
#
# Here, first: scripts/gpu_wheels.sh   (fills .whl/ with what that machine lacks)
# There, with .whl carried:            PY=python3 benchmarks/gpu_check.sh [--only liger,bf16]
#
# Installs .whl/*.whl (--no-index --no-deps) and grpo itself into $GPU_SITE
# (/tmp/site), puts it on PYTHONPATH, and runs benchmarks/gpu_check.py, which
# writes $OUT/gpu_check.json (else benchmarks/results/gpu_check.json).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
WHEELS=${GPU_WHEELS_DIR:-.whl}
SITE=${GPU_SITE:-/tmp/site}
DEST=${OUT:-benchmarks/results}
mkdir -p "$DEST"

if ! compgen -G "$WHEELS/*.whl" >/dev/null; then
  echo "gpu_check: no wheels in $WHEELS: run scripts/gpu_wheels.sh on a machine with PyPI and carry $WHEELS" >&2
  exit 2
fi
PIP=("$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE")
"${PIP[@]}" "$WHEELS"/*.whl
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
# grpo itself, so its entry points (the built-in plugins) are registered; setuptools came with the wheels.
"${PIP[@]}" --no-build-isolation .
"$PY" -c "import torch; print('torch', torch.__version__, 'CUDA', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
PYTHONUNBUFFERED=1 timeout 470 "$PY" benchmarks/gpu_check.py --out "$DEST/gpu_check.json" --shape "$WHEELS/smollm2-shape" "$@"
