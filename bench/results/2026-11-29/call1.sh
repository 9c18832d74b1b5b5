# call 1: the decode MoE GEMV with its K step's loads reordered (moe_experts._gemm, BM 1): GPU MoE tests,
# the tile grid at 1/2/4/8 tokens, main's old kernels (.whl/old_moe_experts.py = HEAD's file) in the same
# run, then the decode step new vs old.
D=bench/results/2026-11-29
bash bench/gpu_quick.sh tcache_load
export PYTHONPATH=/tmp/site:$PWD DSV4_CACHE=/tmp/dsv4cache TRITON_CACHE_DIR=/tmp/triton_cache OUT=${OUT:-/tmp/out}
mkdir -p $OUT
for i in 0 1 2 3 4 5 6 7; do timeout 200 python3 bench/moe_decode_tune.py --compile-only --part $i/8 --tokens 1 2 4 8 > $OUT/compile_$i.log 2>&1 & done
timeout 200 python3 -m pytest -q -rf --tb=short --maxfail=4 -m gpu tests/test_triton_moe.py > $OUT/call1_moe_tests.log 2>&1; echo rc=$? >> $OUT/call1_moe_tests.log
wait
tail -3 $OUT/call1_moe_tests.log
timeout 120 python3 bench/moe_decode_tune.py --tokens 1 2 4 8 > $OUT/call1_tune_new.txt 2>&1; cat $OUT/call1_tune_new.txt
cp dsv4/ops/triton/moe_experts.py /tmp/new_moe_experts.py
cp .whl/old_moe_experts.py dsv4/ops/triton/moe_experts.py
timeout 60 python3 bench/moe_decode_tune.py --tokens 1 2 4 8 --configs 0 > $OUT/call1_tune_old.txt 2>&1; cat $OUT/call1_tune_old.txt
timeout 100 python3 bench/decode_bench.py --layers 4 --batch 1 4 8 --context 8192 --format fp8-mxfp4 --ops kernels-graph --steps 10 --no-hf > $OUT/call1_decode_old.txt 2>&1; tail -8 $OUT/call1_decode_old.txt
cp /tmp/new_moe_experts.py dsv4/ops/triton/moe_experts.py
timeout 130 python3 bench/decode_bench.py --layers 4 --batch 1 4 8 --context 8192 --format fp8-mxfp4 --ops kernels-graph --steps 10 --no-hf > $OUT/call1_decode_new.txt 2>&1; tail -8 $OUT/call1_decode_new.txt
