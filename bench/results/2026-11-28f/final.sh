# call 5: prefill_bench with this session's kernels (median of 3 runs a length), then the warm-up tests (no compile after start-up)
bash bench/gpu_quick.sh tcache_load
export PYTHONPATH=/tmp/site:$PWD DSV4_CACHE=/tmp/dsv4cache TRITON_CACHE_DIR=/tmp/triton_cache OUT=${OUT:-/tmp/out}
mkdir -p $OUT
timeout 260 python3 bench/prefill_bench.py --layers 4 --format fp8-mxfp4 --budget 8192 --lengths 2048 8192 --no-hf > $OUT/prefill_bench.txt 2>&1
grep -E "peaks|one prompt|16 prompts|profile of|^ +[0-9.]+%" $OUT/prefill_bench.txt | head -16
timeout 200 python3 -m pytest -q -rf --tb=short -x -m gpu tests/test_gpu_warmup.py > $OUT/warmup.log 2>&1; tail -3 $OUT/warmup.log
