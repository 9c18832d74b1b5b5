#!/usr/bin/env bash
# One device call (~10 min on an H100): capture/engine graph tests, MoE and linear kernel tests at
# real shapes, the fp32 drift table, the kernel table and the Flash x4 decode step; logs in $OUT.
set -uo pipefail
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1 DSV4_CACHE=/tmp/dsv4cache
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton_cache}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t() { local s=$1 f=$2; shift 2; echo "== $f"; timeout "$s" "$@" > "$OUT/$f" 2>&1; echo "rc=$?" >> "$OUT/$f"; tail -4 "$OUT/$f"; }
t 115 graphs.log python3 -m pytest -q -rf --tb=short -m gpu tests/test_cuda_graph_capture.py tests/test_cuda_graphs_engine.py
t 45 kernel_drift.txt python3 bench/kernel_drift.py --steps 30
t 140 kernel_tests.log python3 -m pytest -q -rf --tb=short -m gpu tests/test_triton_moe.py tests/test_triton_linear.py tests/test_triton_small.py
t 150 kernels.txt python3 bench/kernels.py --out "$OUT"
t 120 decode_bench.txt python3 bench/decode_bench.py --layers 4 --batch 1 8 32 --context 8192 --format bf16 fp8-mxfp4 \
  --ops kernels-eager kernels-graph --steps 10
