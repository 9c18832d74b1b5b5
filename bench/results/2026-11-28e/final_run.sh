export OUT=${OUT:-/tmp/out}
bash bench/gpu_quick.sh tcache_load >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD DSV4_CACHE=/tmp/dsv4cache TRITON_CACHE_DIR=/tmp/triton_cache DSV4_REPORT_AT_ONCE=1
timeout 150 python3 -m pytest -q -rf --tb=short -m gpu tests/test_triton_moe.py -k "weight_rows_on_the_mma_m_side_real or bf16_decode or (real_shapes_bf16 and mxfp4)" > $OUT/final_moe_tests.log 2>&1; tail -2 $OUT/final_moe_tests.log
timeout 150 python3 bench/prefill_bench.py --layers 4 --format fp8-mxfp4 --budget 8192 --lengths 2048 8192 --no-hf > $OUT/prefill_bench.txt 2>&1; grep -E "peaks|one prompt|16 prompts|profile of|%.*ms" $OUT/prefill_bench.txt | head -12
