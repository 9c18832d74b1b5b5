# call 6: main's final kernels: the GPU MoE tests, then the simulated-acceptance table at batch 1 (k = 3, the
# verify cost in the same run)
bash bench/gpu_quick.sh tcache_load
export PYTHONPATH=/tmp/site:$PWD DSV4_CACHE=/tmp/dsv4cache TRITON_CACHE_DIR=/tmp/triton_cache OUT=${OUT:-/tmp/out}
mkdir -p $OUT
timeout 130 python3 bench/spec_bench.py --layers 4 --batch 1 --k 3 --tables cost --steps 2 > /dev/null 2>&1 &
timeout 140 python3 -m pytest -q -rf --tb=short --maxfail=4 -m gpu tests/test_triton_moe.py > $OUT/call6_moe_tests.log 2>&1; echo rc=$? >> $OUT/call6_moe_tests.log
wait
tail -3 $OUT/call6_moe_tests.log
timeout 120 python3 bench/spec_bench.py --layers 4 --batch 1 --k 3 --tables cost simulated --tokens 96 > $OUT/call6_spec.txt 2>&1; grep -v Warn $OUT/call6_spec.txt
