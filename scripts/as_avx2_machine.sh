#!/usr/bin/env bash
# Run a command as it would run on an AVX2-only machine of this project's kind (no AVX-512, no
# native bf16, no AMX), on a CPU that has them: for timing the test tier on the slow class when
# no such machine is at hand. Needs root (a private mount namespace).
#   /proc/cpuinfo  loses its avx512*/amx* flags (grpo and vLLM pick precision and kernels from it)
#   torch          ATEN_CPU_CAPABILITY=avx2, oneDNN ONEDNN_MAX_CPU_ISA=AVX2, and torch.cpu._is_*
#                  answering as AVX2 (avx2_machine/sitecustomize.py; vLLM's kernel choice reads them)
# What it cannot change: the clock, caches and memory of this CPU. Read its times as an estimate.
# Usage: bash scripts/as_avx2_machine.sh .venv/bin/python -m pytest tests
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
fake=/tmp/grpo-cpuinfo-avx2
sed -E '/^flags/ s/ (avx512[a-z0-9_]*|amx[a-z0-9_]*)//g' /proc/cpuinfo >"$fake"
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
# Compiled-code caches of their own: inductor's cache key leaves out the vector ISA, so a kernel it
# built for this CPU's AVX-512 would be reused by AVX2 code (garbage numbers, seen in test_torch_compile).
export TORCHINDUCTOR_CACHE_DIR=/tmp/grpo-avx2-inductor TORCH_EXTENSIONS_DIR=/tmp/grpo-avx2-torch-extensions
export PYTHONPATH="$here/avx2_machine${PYTHONPATH:+:$PYTHONPATH}"
exec unshare --mount --propagation private sh -c 'mount --bind "$0" /proc/cpuinfo && exec "$@"' "$fake" "$@"
