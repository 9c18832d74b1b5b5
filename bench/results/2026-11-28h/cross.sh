# call 5: the FP8 decode GEMV against the FP8 GEMM at 4-64 rows (where linear.SKINNY_MAX_M should sit)
bash bench/gpu_quick.sh tcache_load
export PYTHONPATH=/tmp/site:$PWD DSV4_CACHE=/tmp/dsv4cache TRITON_CACHE_DIR=/tmp/triton_cache OUT=${OUT:-/tmp/out}
timeout 300 python3 bench/tune_linear.py crossover > $OUT/crossover.txt 2>&1; cat $OUT/crossover.txt
