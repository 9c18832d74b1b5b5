# call 2: the decode-size grouped MoE with the gate/up GEMM transposed (BT 16) against main's tiles;
# the batch-1 decode step's whole kernel list; continuous batching vs waves after last session's decode change
bash bench/gpu_quick.sh tcache_load
export PYTHONPATH=/tmp/site:$PWD DSV4_CACHE=/tmp/dsv4cache TRITON_CACHE_DIR=/tmp/triton_cache OUT=${OUT:-/tmp/out}
for i in 0 1 2 3 4 5 6; do timeout 300 python3 bench/moe_decode_tune.py --path grouped --tokens 8 16 32 --configs 0 5 6 7 8 9 10 \
  --compile-only --part $i/7 > $OUT/tune_compile_$i.log 2>&1 & done; wait; tail -2 $OUT/tune_compile_*.log
timeout 200 python3 bench/moe_decode_tune.py --path grouped --tokens 8 16 32 --configs 0 5 6 7 8 9 10 > $OUT/moe_grouped_wt.txt 2>&1; tail -12 $OUT/moe_grouped_wt.txt
timeout 90 python3 bench/profile_decode.py --layers 4 --format fp8-mxfp4 --batch 1 --ops kernels --graph --top 60 > $OUT/profile4_b1.txt 2>&1; tail -45 $OUT/profile4_b1.txt
bash bench/gpu_quick.sh throughput
