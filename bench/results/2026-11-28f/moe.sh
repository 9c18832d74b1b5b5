# call 4: the gate/up GEMM with gate and up rows stacked into one MMA, against the two-product kernel before it; tests; prefill_bench
bash bench/gpu_quick.sh tcache_load
export PYTHONPATH=/tmp/site:$PWD DSV4_CACHE=/tmp/dsv4cache TRITON_CACHE_DIR=/tmp/triton_cache OUT=${OUT:-/tmp/out}
mkdir -p $OUT /tmp/old && cp -r dsv4 bench /tmp/old/ && git show HEAD:dsv4/ops/triton/moe.py > /tmp/old/dsv4/ops/triton/moe.py 2>/dev/null; git show 81617e5:dsv4/ops/triton/moe_grouped.py > /tmp/old/dsv4/ops/triton/moe_grouped.py   # this call ran from a copy of that file
grep -n '"grouped_mxfp4' /tmp/old/dsv4/ops/triton/moe.py | head -3
(cd /tmp/old && for T in 8192 4096; do PYTHONPATH=/tmp/site:/tmp/old timeout 100 python3 bench/moe_prefill_tune.py --tokens $T --cases 11 20; done) > $OUT/moe_before.txt 2>&1; grep -v Warn $OUT/moe_before.txt
(timeout 200 python3 bench/moe_prefill_tune.py --tokens 8192 --cases 21 22 23 24 25; timeout 100 python3 bench/moe_prefill_tune.py --tokens 4096 --cases 25 26) > $OUT/moe_after.txt 2>&1; grep -v Warn $OUT/moe_after.txt
timeout 150 python3 -m pytest -q -x -m gpu tests/test_triton_moe.py -k "weight_rows or (real_shapes and mxfp4) or repeat" > $OUT/moe_tests.log 2>&1; tail -2 $OUT/moe_tests.log
timeout 120 python3 -m pytest -q -x -m gpu tests/test_triton_attention.py -k "prefill or graph" > $OUT/attn_tests.log 2>&1; tail -2 $OUT/attn_tests.log
