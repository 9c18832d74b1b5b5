#!/usr/bin/env bash
# Install dsv4 (editable) into the active Python environment.
#   bash scripts/install.sh          # the engine
#   bash scripts/install.sh test     # the engine + test dependencies (pytest, transformers, and
#                                     # triton where torch has none: the kernel tests' interpreter)
#
# torch, first match wins:
#   1. an installed torch >= 2.11 is kept (e.g. a CUDA build on a GPU machine);
#   2. DSV4_TORCH_INDEX is set: torch>=2.11 from that wheel index
#      (e.g. https://download.pytorch.org/whl/cu128, or a local mirror);
#   3. an NVIDIA GPU is visible: a CUDA build of torch>=2.11 from the default index;
#   4. otherwise torch==2.13.0 from PyTorch's CPU wheel index (a ~200 MB download; on Linux the
#      default index serves the CUDA build, over 1.4 GiB with its nvidia packages). When that index
#      cannot be reached within 10 s, the default index is used instead, and the script says which
#      build it took and why.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  test) TARGET=".[test]" ;;
  "") TARGET="." ;;
  *) echo "usage: scripts/install.sh [test]" >&2; exit 2 ;;
esac
PY=${PYTHON:-python}
command -v "$PY" >/dev/null 2>&1 || PY=python3
CPU_INDEX=https://download.pytorch.org/whl/cpu
CPU_TORCH=torch==2.13.0

say() { echo "install: $*" >&2; }

have_torch() {
  "$PY" - <<'PYEOF' 2>/dev/null
import sys, torch
major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
sys.exit(0 if (major, minor) >= (2, 11) else 1)
PYEOF
}

torch_build() {  # e.g. "torch 2.13.0+cpu (CPU build)"
  "$PY" -c 'import torch; c = torch.version.cuda; print("torch", torch.__version__, f"(CUDA {c} build)" if c else "(CPU build)")' \
    2>/dev/null || echo "torch (version unknown)"
}

probe_index() {  # $1: a wheel index. Succeeds when its torch page answers within 10 s; else prints why not
  "$PY" - "$1" <<'PYEOF'
import sys, urllib.request
try:
    urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=10).close()
except Exception as e:  # DNS failure, refused or timed-out connection, HTTP error, proxy error
    print(getattr(e, "reason", None) or e)
    sys.exit(1)
PYEOF
}

install_cpu_torch() {
  local why
  if why=$(probe_index "$CPU_INDEX"); then
    say "no NVIDIA GPU: installing the CPU build $CPU_TORCH from $CPU_INDEX"
    if "$PY" -m pip install "$CPU_TORCH" --index-url "$CPU_INDEX"; then
      say "took $(torch_build) from $CPU_INDEX"
      return
    fi
    why="pip could not install $CPU_TORCH from it"
  fi
  say "no NVIDIA GPU, but PyTorch's CPU wheel index $CPU_INDEX cannot be used ($why);" \
      "installing $CPU_TORCH from the default index instead"
  "$PY" -m pip install "$CPU_TORCH"
  local build
  build=$(torch_build)
  say "took $build from the default index because $CPU_INDEX could not be used"
  case "$build" in
    *CUDA*) say "that is a CUDA build (a large download, unused without a GPU); to get the CPU build later:" \
                "pip uninstall torch, then rerun with DSV4_TORCH_INDEX=$CPU_INDEX" ;;
  esac
}

if have_torch; then
  say "keeping the installed $(torch_build)"
elif [ -n "${DSV4_TORCH_INDEX:-}" ]; then
  say "installing torch>=2.11 from DSV4_TORCH_INDEX=$DSV4_TORCH_INDEX"
  "$PY" -m pip install "torch>=2.11" --index-url "$DSV4_TORCH_INDEX"
  say "took $(torch_build) from $DSV4_TORCH_INDEX"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  say "NVIDIA GPU found: installing a CUDA build of torch>=2.11 from the default index"
  "$PY" -m pip install "torch>=2.11"
  say "took $(torch_build)"
else
  install_cpu_torch
fi

if [ "$TARGET" = ".[test]" ] && ! "$PY" -c "import triton" 2>/dev/null; then
  # the kernel tests run on CPU through Triton's interpreter; CUDA builds of torch bring their own
  # triton, so it is only added where torch came without one (the version of the GPU image)
  say "installing triton==3.6.0 for the kernel tests (Triton's interpreter runs them on CPU)"
  "$PY" -m pip install "triton==3.6.0"
fi

"$PY" -m pip install -e "$TARGET"
