#!/usr/bin/env bash
# call 10 (main): the batch-1/8 MoE GEMV with its K loop pipelined (PIPE 2, 3) against main's (PIPE 1), H200
bash bench/gpu_quick.sh tcache_load >/dev/null; export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/triton_cache PYTHONUNBUFFERED=1
timeout 330 python3 bench/moe_decode_tune.py --path gemv --tokens 1 8 --configs 0 1 2 4 5 13 14 2>&1 | grep -v "^dsv4:" | tee $OUT/gemv_pipe.txt
