# call 5: prefill with the new 256-pair MoE tiles; the 128-pair tiles' down GEMM; the MoE GPU tests
bash bench/gpu_quick.sh tcache_load
export PYTHONPATH=/tmp/site:$PWD DSV4_CACHE=/tmp/dsv4cache TRITON_CACHE_DIR=/tmp/triton_cache OUT=${OUT:-/tmp/out}
mkdir -p $OUT
timeout 260 python3 bench/prefill_bench.py --layers 4 --format fp8-mxfp4 --budget 8192 --lengths 2048 8192 --no-hf > $OUT/prefill_bench.txt 2>&1
grep -E "peaks|one prompt|16 prompts|profile of|^ +[0-9.]+%" $OUT/prefill_bench.txt | head -20
(timeout 100 python3 bench/moe_prefill_tune.py --tokens 4096 --cases 26 38 39; timeout 60 python3 bench/moe_prefill_tune.py --tokens 8192 --cases 36 40) 2>&1 | grep -v Warn > $OUT/moe_tune.txt; cat $OUT/moe_tune.txt
timeout 150 python3 -m pytest -q -x -m gpu tests/test_triton_moe.py -k "weight_rows or (real_shapes and mxfp4) or repeat" > $OUT/moe_tests.log 2>&1; tail -2 $OUT/moe_tests.log
