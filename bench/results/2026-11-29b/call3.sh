# call 3: the decode GEMV past 8 tokens (16-48) against the grouped tiles (moe.MXFP4_DECODE_MAX_PAIRS), then the
# decode step at batch 1 / 4 / 8 / 32 as main runs it, and at 16 / 32 with the GEMV up to 32 tokens
bash bench/gpu_quick.sh tcache_load
export PYTHONPATH=/tmp/site:$PWD DSV4_CACHE=/tmp/dsv4cache TRITON_CACHE_DIR=/tmp/triton_cache OUT=${OUT:-/tmp/out}
mkdir -p $OUT
R=bench/results/2026-11-29b
timeout 150 python3 bench/moe_decode_tune.py --compile-only --configs 0 --tokens 16 24 32 48 --max-pairs 288 > /dev/null 2>&1 &
timeout 150 python3 bench/moe_decode_tune.py --compile-only --configs 0 --tokens 16 24 32 48 --path grouped > /dev/null 2>&1 &
timeout 200 python3 $R/with.py MXFP4_DECODE_MAX_PAIRS=192 bench/decode_bench.py --layers 4 --batch 16 --context 8192 --format fp8-mxfp4 --ops kernels-graph --steps 2 --no-hf > /dev/null 2>&1 &
wait
(timeout 60 python3 bench/moe_decode_tune.py --tokens 16 24 32 48 --max-pairs 288 --configs 0 2>&1 | tail -2
 timeout 60 python3 bench/moe_decode_tune.py --tokens 16 24 32 48 --path grouped --configs 0 2>&1 | tail -2) > $OUT/call3_sizes.txt
cat $OUT/call3_sizes.txt
timeout 170 python3 bench/decode_bench.py --layers 4 --batch 1 4 8 32 --context 8192 --format fp8-mxfp4 --ops kernels-graph --steps 10 --no-hf > $OUT/call3_decode.txt 2>&1; tail -5 $OUT/call3_decode.txt
timeout 120 python3 $R/with.py MXFP4_DECODE_MAX_PAIRS=192 bench/decode_bench.py --layers 4 --batch 16 32 --context 8192 --format fp8-mxfp4 --ops kernels-graph --steps 10 --no-hf > $OUT/call3_decode_gemv32.txt 2>&1; tail -3 $OUT/call3_decode_gemv32.txt
