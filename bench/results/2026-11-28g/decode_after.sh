# call 11: decode with MXFP4 MoE batches above 8 tokens on the grouped tiles (MXFP4_DECODE_MAX_PAIRS); the
# warm-up test (no compile after start-up) and the batched-step GPU test
bash bench/gpu_quick.sh tcache_load
export PYTHONPATH=/tmp/site:$PWD DSV4_CACHE=/tmp/dsv4cache TRITON_CACHE_DIR=/tmp/triton_cache OUT=${OUT:-/tmp/out}
mkdir -p $OUT
timeout 110 python3 bench/decode_bench.py --layers 4 --batch 1 8 16 32 --context 8192 --format fp8-mxfp4 --ops kernels-graph --no-hf > $OUT/decode_bench.txt 2>&1; grep -E "floor" $OUT/decode_bench.txt
timeout 50 python3 -m pytest -q -rf --tb=short -x -m gpu tests/test_gpu_warmup.py > $OUT/warmup.log 2>&1; tail -2 $OUT/warmup.log
timeout 75 python3 -m pytest -q -rf --tb=short -x -m gpu tests/test_gpu_batched_step.py > $OUT/gpu_batched.log 2>&1; tail -2 $OUT/gpu_batched.log
