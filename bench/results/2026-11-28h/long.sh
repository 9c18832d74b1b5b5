# call 8: one prompt of 8192 / 32768 / 131072 tokens (8192-token steps): does a prompt's time grow linearly
bash bench/gpu_quick.sh tcache_load
export PYTHONPATH=/tmp/site:$PWD DSV4_CACHE=/tmp/dsv4cache TRITON_CACHE_DIR=/tmp/triton_cache OUT=${OUT:-/tmp/out}
timeout 330 python3 bench/prefill_bench.py --layers 4 --format fp8-mxfp4 --budget 8192 --lengths 8192 32768 131072 \
  --batch 0 --no-hf --repeats 1 --profile-len 2048 > $OUT/prefill_long.txt 2>&1; grep -v "it/s]" $OUT/prefill_long.txt | tail -20
