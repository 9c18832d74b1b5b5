#!/usr/bin/env bash
# call 4: the weight-layout probe (layout_probe.py; run from the w4a8-decode-moe branch's tree, which has moe_w4a8's decoder)
bash bench/gpu_quick.sh tcache_load >/dev/null; export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/triton_cache
timeout 300 python3 bench/results/2026-11-28i/layout_probe.py 2>&1 | tail -30 | tee $OUT/layout_probe.txt
