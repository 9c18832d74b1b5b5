# call 7: more 16-pair tile configs for the decode-size grouped MoE (batches 16-32)
bash bench/gpu_quick.sh tcache_load
export PYTHONPATH=/tmp/site:$PWD DSV4_CACHE=/tmp/dsv4cache TRITON_CACHE_DIR=/tmp/triton_cache OUT=${OUT:-/tmp/out}
C="0 11 12 13 14 15 16 17 18"
for i in 0 1 2 3 4 5 6 7; do timeout 200 python3 bench/moe_decode_tune.py --path grouped --tokens 16 32 --configs $C \
  --compile-only --part $i/8 > $OUT/tune_compile_$i.log 2>&1 & done; wait
timeout 200 python3 bench/moe_decode_tune.py --path grouped --tokens 16 32 --configs $C > $OUT/moe_grouped_few.txt 2>&1; cat $OUT/moe_grouped_few.txt
