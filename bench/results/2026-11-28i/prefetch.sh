#!/usr/bin/env bash
# call 6 (branch w4a8-decode-moe at 363c906: scales loaded one K step ahead): W4A8 tiles vs main's bf16 tiles, one run
bash bench/gpu_quick.sh tcache_load >/dev/null; export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/triton_cache PYTHONUNBUFFERED=1
timeout 200 python3 bench/moe_decode_tune.py --path w4a8 --tokens 1 8 16 32 --configs 0 1 2 5 2>&1 | tail -6 | tee $OUT/tune_w4a8.txt
timeout 60 python3 bench/moe_decode_tune.py --path grouped --configs 0 --tokens 1 8 16 32 2>&1 | tail -2 | tee $OUT/tune_grouped_main.txt
