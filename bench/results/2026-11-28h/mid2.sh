# call 10: the new grouped_mxfp4_mid config (64-pair tiles, gate/up transposed) against the few config at 1024 / 2048 tokens; its GPU tests
bash bench/gpu_quick.sh tcache_load
export PYTHONPATH=/tmp/site:$PWD DSV4_CACHE=/tmp/dsv4cache TRITON_CACHE_DIR=/tmp/triton_cache OUT=${OUT:-/tmp/out}
for t in 2048 1024; do timeout 80 python3 bench/moe_prefill_tune.py --tokens $t --cases 7 41 --bm 64 > $OUT/moe_mid_$t.txt 2>&1; cat $OUT/moe_mid_$t.txt | grep -v Warn; done
timeout 150 python3 -m pytest -q -rf --tb=short -m gpu tests/test_triton_moe.py -k "mid or (real_shapes and 300-64)" > $OUT/moe_mid_tests.log 2>&1; tail -4 $OUT/moe_mid_tests.log
