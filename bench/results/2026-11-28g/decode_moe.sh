# call 10: the decode MoE at 1-32 tokens: the decode GEMV kernels (main) against the prefill's grouped
# tiles forced at those sizes (16 pairs a tile, tensor cores, the bf16 tile decode)
bash bench/gpu_quick.sh tcache_load
export PYTHONPATH=/tmp/site:$PWD DSV4_CACHE=/tmp/dsv4cache TRITON_CACHE_DIR=/tmp/triton_cache OUT=${OUT:-/tmp/out}
mkdir -p $OUT
(timeout 80 python3 bench/moe_decode_tune.py --tokens 1 8 16 32 --configs 0; timeout 200 python3 bench/moe_decode_tune.py --path grouped --tokens 1 8 16 32) 2>&1 | grep -v Warn > $OUT/moe_decode_paths.txt; cat $OUT/moe_decode_paths.txt
