# call 3: main with the GEMV tiles chosen by pairs (moe.CONFIGS gemv / gemv_wide): GPU MoE tests, both configs
# at 1-8 tokens, the decode step (batch 1 / 4 / 8 / 32), the verify step's cost at batch 1
bash bench/gpu_quick.sh tcache_load
export PYTHONPATH=/tmp/site:$PWD DSV4_CACHE=/tmp/dsv4cache TRITON_CACHE_DIR=/tmp/triton_cache OUT=${OUT:-/tmp/out}
mkdir -p $OUT
timeout 60 python3 bench/moe_decode_tune.py --compile-only --configs 0 1 --tokens 1 2 4 8 > /dev/null 2>&1 &
timeout 170 python3 -m pytest -q -rf --tb=short --maxfail=4 -m gpu tests/test_triton_moe.py > $OUT/call3_moe_tests.log 2>&1; echo rc=$? >> $OUT/call3_moe_tests.log
wait
tail -3 $OUT/call3_moe_tests.log
timeout 60 python3 bench/moe_decode_tune.py --tokens 1 2 4 8 --configs 0 1 > $OUT/call3_tune.txt 2>&1; cat $OUT/call3_tune.txt
timeout 170 python3 bench/decode_bench.py --layers 4 --batch 1 4 8 32 --context 8192 --format fp8-mxfp4 --ops kernels-graph --steps 10 --no-hf > $OUT/call3_decode.txt 2>&1; tail -5 $OUT/call3_decode.txt
timeout 150 python3 bench/spec_bench.py --layers 4 --batch 1 --k 3 --tables cost --steps 20 > $OUT/call3_spec_cost.txt 2>&1; tail -8 $OUT/call3_spec_cost.txt
