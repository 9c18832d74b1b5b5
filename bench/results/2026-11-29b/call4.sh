# call 4: the decode step at batch 16 with the GEMV up to 16 tokens (main now) against the grouped tiles from 9
# tokens (before); the GPU tests of what the change touches (warm-up, graphs, speculation); the verify step's cost
bash bench/gpu_quick.sh tcache_load
export PYTHONPATH=/tmp/site:$PWD DSV4_CACHE=/tmp/dsv4cache TRITON_CACHE_DIR=/tmp/triton_cache OUT=${OUT:-/tmp/out}
mkdir -p $OUT
R=bench/results/2026-11-29b
D="bench/decode_bench.py --layers 4 --batch 16 --context 8192 --format fp8-mxfp4 --ops kernels-graph --no-hf"
timeout 150 python3 $D --steps 2 > /dev/null 2>&1 &
timeout 150 python3 $R/with.py MXFP4_DECODE_MAX_PAIRS=48 $D --steps 2 > /dev/null 2>&1 &
wait
(for i in 1 2; do timeout 100 python3 $D --steps 10 2>&1 | tail -1; timeout 100 python3 $R/with.py MXFP4_DECODE_MAX_PAIRS=48 $D --steps 10 2>&1 | tail -1; done) > $OUT/call4_decode16.txt
cat $OUT/call4_decode16.txt
bash bench/gpu_quick.sh warmup graphs spec_tests
for f in warmup.log graphs.log spec_tests.log; do tail -n 2 $OUT/$f; done
timeout 150 python3 bench/spec_bench.py --layers 4 --batch 1 32 --k 3 --tables cost --steps 20 > $OUT/call4_spec_cost.txt 2>&1; tail -4 $OUT/call4_spec_cost.txt
