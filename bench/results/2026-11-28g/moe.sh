# call 2: the MoE's down GEMM transposed (moe_grouped._w2_wt_kernel, each K step retired) against the
# untransposed one, the gate/up GEMM at 16 warps, and the tile sizes at 4096 / 6144 tokens
bash bench/gpu_quick.sh tcache_load
export PYTHONPATH=/tmp/site:$PWD DSV4_CACHE=/tmp/dsv4cache TRITON_CACHE_DIR=/tmp/triton_cache OUT=${OUT:-/tmp/out}
mkdir -p $OUT
tune() { timeout "$1" python3 bench/moe_prefill_tune.py "${@:2}" 2>&1 | grep -v Warn; }
tune 260 --tokens 8192 --cases 23 29 30 31 32 27 > $OUT/moe_8192.txt; cat $OUT/moe_8192.txt
tune 120 --tokens 4096 --cases 26 33 34 23 29 > $OUT/moe_4096.txt; cat $OUT/moe_4096.txt
tune 100 --tokens 6144 --cases 26 33 23 29 > $OUT/moe_6144.txt; cat $OUT/moe_6144.txt
