# call 2: the decode MoE GEMV's tiles after the load reordering, gate/up and down chosen apart, with and
# without a 64-register cap (bench/moe_decode_tune.py's grid, 36 configs), 1 / 4 / 8 tokens
bash bench/gpu_quick.sh tcache_load
export PYTHONPATH=/tmp/site:$PWD DSV4_CACHE=/tmp/dsv4cache TRITON_CACHE_DIR=/tmp/triton_cache OUT=${OUT:-/tmp/out}
mkdir -p $OUT
for i in 0 1 2 3 4 5 6 7; do timeout 300 python3 bench/moe_decode_tune.py --compile-only --part $i/8 --tokens 1 4 8 > $OUT/compile_$i.log 2>&1 & done
wait
tail -2 $OUT/compile_*.log
timeout 280 python3 bench/moe_decode_tune.py --tokens 1 4 8 > $OUT/call2_tune.txt 2>&1; cat $OUT/call2_tune.txt
rm -f $OUT/compile_*.log
