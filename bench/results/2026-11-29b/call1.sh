# call 1: the decode MoE with x (and h) rounded by a launch before the GEMVs instead of in their K loops
# (moe_decode.PREQUANT 0 / 1 / 2, branch prequant-exp): one MoE layer call at 1-8 tokens, then the decode step
bash bench/gpu_quick.sh tcache_load
export PYTHONPATH=/tmp/site:$PWD DSV4_CACHE=/tmp/dsv4cache TRITON_CACHE_DIR=/tmp/triton_cache OUT=${OUT:-/tmp/out}
mkdir -p $OUT
R=bench/results/2026-11-29b
for pq in 1 2; do timeout 120 python3 $R/pq.py $pq bench/moe_decode_tune.py --compile-only --configs 0 1 --tokens 1 2 4 8 > /dev/null 2>&1 & done
wait
for pq in 0 1 2 0 2; do echo "PREQUANT $pq"; timeout 60 python3 $R/pq.py $pq bench/moe_decode_tune.py --tokens 1 2 4 8 --configs 0 1 2>&1 | tail -2; done > $OUT/call1_tune.txt; cat $OUT/call1_tune.txt
for pq in 2 0; do echo "PREQUANT $pq"; timeout 150 python3 $R/pq.py $pq bench/decode_bench.py --layers 4 --batch 1 8 --context 8192 --format fp8-mxfp4 --ops kernels-graph --steps 10 --no-hf 2>&1 | tail -4; done > $OUT/call1_decode.txt; cat $OUT/call1_decode.txt
