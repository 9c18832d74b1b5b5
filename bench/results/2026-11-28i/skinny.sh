#!/usr/bin/env bash
# call 8: bench/tune_skinny.py on the FP8 decode linears (batch 1); call 9: main's tiling rule vs three candidates
bash bench/gpu_quick.sh tcache_load >/dev/null; export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/triton_cache PYTHONUNBUFFERED=1
timeout 420 python3 bench/tune_skinny.py --geo flash --batch 1 --formats fp8 2>&1 | grep -v "^dsv4:" | tee $OUT/tune_skinny_fp8.txt   # call 8
timeout 270 python3 bench/results/2026-11-28i/skinny_rules.py 2>&1 | grep -v "^dsv4:" | tee $OUT/skinny_rules.txt                # call 9
