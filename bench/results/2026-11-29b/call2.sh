# call 2: main's decode MoE with x and h rounded before the GEMVs (no rounding in their K loops): the GPU MoE
# tests, every GEMV tile config at 1-8 tokens, the GEMV past 8 tokens against the grouped tiles, the shared
# expert inside the decode kernels at 4 / 8 tokens
bash bench/gpu_quick.sh tcache_load
export PYTHONPATH=/tmp/site:$PWD DSV4_CACHE=/tmp/dsv4cache TRITON_CACHE_DIR=/tmp/triton_cache OUT=${OUT:-/tmp/out}
mkdir -p $OUT
for i in 0 1 2 3 4 5 6 7; do timeout 150 python3 bench/moe_decode_tune.py --compile-only --part $i/8 --tokens 1 2 4 8 > /dev/null 2>&1 & done
wait
timeout 170 python3 -m pytest -q -rf --tb=short --maxfail=4 -m gpu tests/test_triton_moe.py > $OUT/call2_moe_tests.log 2>&1; echo rc=$? >> $OUT/call2_moe_tests.log
tail -3 $OUT/call2_moe_tests.log
timeout 150 python3 bench/moe_decode_tune.py --tokens 1 2 4 8 > $OUT/call2_tune.txt 2>&1; cat $OUT/call2_tune.txt
(timeout 60 python3 bench/moe_decode_tune.py --tokens 12 16 --max-pairs 96 --configs 0 1 2>&1 | tail -3
 timeout 60 python3 bench/moe_decode_tune.py --tokens 8 12 16 --path grouped --configs 0 2>&1 | tail -2
 timeout 60 python3 bench/moe_decode_tune.py --tokens 2 4 8 --shared-fused-max 8 --configs 0 1 2>&1 | tail -3) > $OUT/call2_sizes.txt
cat $OUT/call2_sizes.txt
