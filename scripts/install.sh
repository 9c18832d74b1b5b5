#!/usr/bin/env bash
# Install dsv4 (editable) into the active Python environment.
#   bash scripts/install.sh          # the engine
#   bash scripts/install.sh test     # the engine + test dependencies (pytest, transformers)
# torch: kept if a torch >= 2.11 is already installed (e.g. a CUDA build on a GPU machine).
# Otherwise, on a machine without an NVIDIA GPU we install the CPU build torch==2.13.0 (a plain
# `torch` requirement would pull a multi-GB CUDA build); set DSV4_TORCH_INDEX to a wheel index
# (e.g. the PyTorch CPU index) where PyPI's default build is not the one you want.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
command -v "$PY" >/dev/null 2>&1 || PY=python3

have_torch() {
  "$PY" - <<'PYEOF' 2>/dev/null
import sys, torch
major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
sys.exit(0 if (major, minor) >= (2, 11) else 1)
PYEOF
}

if ! have_torch; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "install: NVIDIA GPU found, installing a CUDA build of torch" >&2
    "$PY" -m pip install "torch>=2.11"
  elif [ -n "${DSV4_TORCH_INDEX:-}" ]; then
    "$PY" -m pip install "torch>=2.11" --index-url "$DSV4_TORCH_INDEX"
  else
    echo "install: no GPU, installing the CPU build torch==2.13.0" >&2
    "$PY" -m pip install "torch==2.13.0"
  fi
fi

case "${1:-}" in
  test) "$PY" -m pip install -e ".[test]" ;;
  "") "$PY" -m pip install -e . ;;
  *) echo "usage: scripts/install.sh [test]" >&2; exit 2 ;;
esac
