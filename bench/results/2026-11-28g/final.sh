# call 7: where a prefill's wall time outside kernels goes; prefill_bench again (a second machine for the
# new MoE tiles); decode (no slower); the warm-up test (no compile after start-up with the new tiles)
bash bench/gpu_quick.sh tcache_load
export PYTHONPATH=/tmp/site:$PWD DSV4_CACHE=/tmp/dsv4cache TRITON_CACHE_DIR=/tmp/triton_cache OUT=${OUT:-/tmp/out}
mkdir -p $OUT
timeout 120 python3 bench/profile_prefill.py --layers 4 --format fp8-mxfp4 --lengths 2048 8192 --reps 3 --cprofile > $OUT/profile_prefill.txt 2>&1
grep -E "prefill +[0-9]+ tokens|GPU:|syncs at" $OUT/profile_prefill.txt
timeout 200 python3 bench/prefill_bench.py --layers 4 --format fp8-mxfp4 --budget 8192 --lengths 2048 8192 --no-hf > $OUT/prefill_bench.txt 2>&1
grep -E "peaks|one prompt|16 prompts|profile of|^ +[0-9.]+%" $OUT/prefill_bench.txt | head -8
timeout 100 python3 bench/decode_bench.py --layers 4 --batch 1 8 32 --context 8192 --format fp8-mxfp4 --ops kernels-graph --no-hf > $OUT/decode_bench.txt 2>&1; tail -6 $OUT/decode_bench.txt
timeout 150 python3 -m pytest -q -rf --tb=short -x -m gpu tests/test_gpu_warmup.py > $OUT/warmup.log 2>&1; tail -3 $OUT/warmup.log
