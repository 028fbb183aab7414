#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with what the lent GPU machine lacks, for
# benchmarks/gpu_check.sh there: that machine has Python 3.12, PyTorch 2.11
# (CUDA 13), transformers, peft, accelerate, pytest, typer, pluggy, ... but no
# network and no vLLM (its package list: /work/.library/device/KINDS.md).
# Everything grpo imports that the list lacks travels as a wheel, --no-deps,
# one pinned version each (two versions of one package stop the install
# there); the run carries at most 64 MiB, so the total is printed and checked.
#
# Also written: .whl/smollm2-shape/, SmolLM2-135M-Instruct's config and
# tokenizer without weights. The model's 93 MB GGUF wheel does not fit in
# 64 MiB, so the check there trains a randomly initialised model of the same
# shape (benchmarks/gpu_check.py).
#
#   scripts/gpu_wheels.sh            # needs PyPI; re-running skips what is already there
#
# tests/e2e/test_gpu_check.py reads GPU_WHEELS below and checks it against
# grpo's imports: keep one `name==version` per line.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DEST=${GPU_WHEELS_DIR:-.whl}
LIMIT_MIB=64

GPU_WHEELS=(
  # grpo's own imports the GPU machine lacks
  pydantic==2.14.4
  datasets==5.2.0
  tomli-w==1.2.0
  liger-kernel==0.8.5
  torchao==0.17.0       # fp8 = true: accelerate's torchao backend (grpo_core/modeling/fp8.py)
  trl==1.16.0           # a declared dependency; the parity tests import it
  # what those need that the machine lacks
  pydantic-core==2.50.5
  annotated-types==0.8.0
  typing-inspection==0.4.5
  dill==0.4.1
  multiprocess==0.70.19
  # builds grpo itself there (pip install --no-build-isolation --target): its build-system needs setuptools>=77
  setuptools==78.1.1
)

mkdir -p "$DEST"
for spec in "${GPU_WHEELS[@]}"; do
  name=${spec%%==*}
  version=${spec##*==}
  stem=$(echo "$name" | tr '-' '_')
  if compgen -G "$DEST/${stem}-${version}-*.whl" >/dev/null; then
    continue
  fi
  "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
    -d "$DEST" "$spec"
done

# One version per package: a stale wheel from an older pin would stop the install there.
"$PY" - "$DEST" "${GPU_WHEELS[@]}" <<'EOF'
import re, sys
from pathlib import Path

dest, specs = Path(sys.argv[1]), sys.argv[2:]
wanted = {re.sub(r"[-_.]+", "_", s.split("==")[0]).lower(): s.split("==")[1] for s in specs}
for wheel in sorted(dest.glob("*.whl")):
    name, version = wheel.name.split("-")[:2]
    key = re.sub(r"[-_.]+", "_", name).lower()
    if wanted.get(key) != version:
        print(f"removing {wheel.name}: not in GPU_WHEELS (scripts/gpu_wheels.sh)")
        wheel.unlink()
EOF

# SmolLM2's shape and tokenizer (no weights), from the locally converted model.
"$PY" - "$DEST/smollm2-shape" <<'EOF'
import json, sys
from pathlib import Path

from grpo_core.modeling.model_files import DEFAULT_MODEL, resolve_model_dir

out = Path(sys.argv[1])
src = Path(resolve_model_dir(DEFAULT_MODEL))
out.mkdir(parents=True, exist_ok=True)
for f in src.iterdir():
    if f.is_file() and not f.name.endswith((".safetensors", ".bin")) and f.name != "model.safetensors.index.json":
        (out / f.name).write_bytes(f.read_bytes())
cfg = json.loads((out / "config.json").read_text())
print(f"smollm2-shape: {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, vocab {cfg['vocab_size']} (no weights)")
EOF

bytes=$(du -sb "$DEST" | cut -f1)
mib=$(awk -v b="$bytes" 'BEGIN { printf "%.1f", b / 1048576 }')
echo "$DEST: $(ls "$DEST"/*.whl | wc -l) wheels + smollm2-shape/, ${mib} MiB in total (limit ${LIMIT_MIB} MiB)"
if [ "$bytes" -gt $((LIMIT_MIB * 1048576)) ]; then
  echo "error: $DEST is over ${LIMIT_MIB} MiB, more than one device run carries; drop a wheel from GPU_WHEELS" >&2
  exit 1
fi
