#!/usr/bin/env bash
# call 1: the MoE GPU tests (last session's 64-pair config, this session's W4A8 16-pair tiles), then the
# decode-size MoE: W4A8 tiles vs the bf16-dequantized ones vs the engine's GEMV (moe_decode_tune)
set -uo pipefail
bash bench/gpu_quick.sh tcache_load moe
export PYTHONPATH=/tmp/site:$PWD DSV4_CACHE=/tmp/dsv4cache TRITON_CACHE_DIR=/tmp/triton_cache OUT=${OUT:-/tmp/out} PYTHONUNBUFFERED=1
t() { local s=$1 f=$2; shift 2; echo "== $f ($(date +%T))"; timeout "$s" "$@" > "$OUT/$f" 2>&1; echo "rc=$?" >> "$OUT/$f"; tail -12 "$OUT/$f"; }
t 200 tune_w4a8.txt python3 bench/moe_decode_tune.py --path w4a8 --tokens 1 8 16 32
t 60 tune_grouped_main.txt python3 bench/moe_decode_tune.py --path grouped --configs 0 --tokens 1 8 16 32
t 60 tune_gemv_main.txt python3 bench/moe_decode_tune.py --path gemv --configs 0 --tokens 1 8
