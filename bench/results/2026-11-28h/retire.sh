# call 3: the transposed gate/up GEMM retiring each K step through an empty register move instead
# of a multiply by 1.0 (moe_grouped._retired): tile timings both ways, the MoE GPU tests, the prefill bench
bash bench/gpu_quick.sh tcache_load
export PYTHONPATH=/tmp/site:$PWD DSV4_CACHE=/tmp/dsv4cache TRITON_CACHE_DIR=/tmp/triton_cache OUT=${OUT:-/tmp/out}
timeout 150 python3 -m pytest -q -rf --tb=short -m gpu tests/test_triton_moe.py -k "weight_rows or repeat_bit or real_shapes or graph" > $OUT/moe_tests.log 2>&1; tail -3 $OUT/moe_tests.log
timeout 200 python3 bench/moe_prefill_tune.py --tokens 8192 --cases 36 26 32 33 --retire both > $OUT/moe_8192.txt 2>&1; cat $OUT/moe_8192.txt
timeout 100 python3 bench/moe_prefill_tune.py --tokens 4096 --cases 26 32 33 --retire both > $OUT/moe_4096.txt 2>&1; cat $OUT/moe_4096.txt
timeout 150 python3 bench/prefill_bench.py --layers 4 --format fp8-mxfp4 --budget 8192 --lengths 2048 8192 --no-hf > $OUT/prefill_bench.txt 2>&1; grep -v "it/s]" $OUT/prefill_bench.txt | tail -25
